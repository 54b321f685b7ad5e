"""How fast each rank computed, instruction by instruction, in a stored validation run (issue 12,
seventh session). Reads stored runs only: no timing is taken.

    python scripts/suite_rank_speed.py runs/suite-embedding-7 [runs/netns-embedding-7 ...]

Folders as ``scripts/suite_meetings.py`` reads them (a suite, or a shaped-network folder). Per plan
run, from its instruction tables (``run/record/instructions.parquet``, ``prediction``):

- **per instruction**: each forward, backward and optimizer step's run time over its predicted
  (profile) time, medians over iterations and ranks;
- **the ranks apart**: per iteration, rank 0's forwards + backwards minus rank 1's (median of the
  absolute difference), and in how many iterations rank 0 is the slower: the same work, at the
  same time, on two cores;
- **beside what**: a compute instruction's run / profile by what the other rank did meanwhile (its
  own forwards and backwards cover under 25% of the instruction: ``other waits``; over 75%:
  ``other computes``), medians, with counts. Read with care: the slower rank is the one computing
  while the other waits, so a slow instruction lands in ``other waits`` because it is slow.

Each rank's times are relative to its own iteration start (after the iteration's barrier), so the
two ranks are aligned to the barrier's release (well under a millisecond on loopback).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/suite_meetings.py, beside this one
from suite_meetings import runs  # noqa: E402

COMPUTE = ("FWD", "BWD")


def _overlap(start: float, end: float, intervals: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, e) - max(start, s)) for s, e in intervals)


def per_instruction(measured: pd.DataFrame, predicted: pd.DataFrame) -> str:
    """``FWD0 16.8/13.9`` ...: each compute instruction's median run ms over its predicted ms."""
    durations = dict(zip(predicted["index"], predicted["end_s"] - predicted["start_s"], strict=True))
    rows = measured[measured["kind"].isin((*COMPUTE, "OPTIMIZER_STEP"))]
    medians = (rows["end_s"] - rows["start_s"]).groupby([rows["index"], rows["kind"], rows["microbatch"]]).median()
    return " ".join(f"{kind[:3]}{mb if mb >= 0 else ''} {ms * 1e3:.1f}/{durations[index] * 1e3:.1f}"
                    for (index, kind, mb), ms in medians.items())


def ranks_apart(measured: pd.DataFrame) -> tuple[float, float]:
    """(median |rank 0 - rank 1| of an iteration's forwards + backwards in ms, share of iterations
    where rank 0 is the slower)."""
    rows = measured[measured["kind"].isin(COMPUTE)]
    sums = (rows["end_s"] - rows["start_s"]).groupby([rows["iteration"], rows["rank"]]).sum().unstack()
    if sums.shape[1] < 2:
        return float("nan"), float("nan")
    difference = sums.iloc[:, 0] - sums.iloc[:, 1]
    return float(difference.abs().median()) * 1e3, float((difference > 0).mean())


def beside(measured: pd.DataFrame, predicted: pd.DataFrame) -> dict[str, tuple[float, int]]:
    """Compute run / profile by what the other rank did meanwhile: (median, count) per state."""
    durations = dict(zip(predicted["index"], predicted["end_s"] - predicted["start_s"], strict=True))
    found: dict[str, list[float]] = {"other waits": [], "partly": [], "other computes": []}
    for _, group in measured.groupby("iteration"):
        for rank in group["rank"].unique():
            mine, other = group[group["rank"] == rank], group[group["rank"] != rank]
            busy = list(zip(other[other["kind"].isin(COMPUTE)]["start_s"], other[other["kind"].isin(COMPUTE)]["end_s"],
                            strict=True))
            for row in mine[mine["kind"].isin(COMPUTE)].itertuples():
                took = row.end_s - row.start_s
                share = _overlap(row.start_s, row.end_s, busy) / took if took > 0 else 0.0
                state = "other waits" if share < 0.25 else "other computes" if share > 0.75 else "partly"
                found[state].append(took / durations[row.index])
    return {k: (float(np.median(v)) if v else float("nan"), len(v)) for k, v in found.items()}


def main(folders: list[str]) -> None:
    for folder in map(Path, folders):
        print(f"\n## {folder.name}\n")
        print("| run | per instruction: run / profile ms (median) | ranks apart: median ms, rank 0 slower | "
              "run / profile beside the other rank: waits / partly / computes (n) |")
        print("| --- | --- | --- | --- |")
        for run in runs(folder):
            measured = pd.read_parquet(run["record"] / "record" / "instructions.parquet")
            measured = measured[measured["parent"] == -1]
            predicted = pd.read_parquet(run["prediction"] / "instructions.parquet")
            predicted = predicted[(predicted["parent"] == -1) & (predicted["rank"] == predicted["rank"].min())]
            apart, slower = ranks_apart(measured)
            states = beside(measured, predicted)
            print(f"| {run['name']} | {per_instruction(measured, predicted)} | {apart:.1f}, {slower:.0%} | "
                  + " / ".join(f"{m:.2f} ({n})" for m, n in states.values()) + " |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["runs/suite-embedding-7"])
