"""Assembling the per-rank results of a run into a run record (rank 0 at the end of a run; the
launcher after a failure, from what the ranks had written)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pandas as pd

from sim.plan import Plan
from traces.chrome import instruction_table_to_chrome
from traces.runrecord import RunRecord, write_run_record
from traces.schema import INSTRUCTION_TABLE
from traces.tables import conform


def read_rank_results(out_dir: Path) -> list[dict]:
    results = []
    for path in sorted((Path(out_dir) / "ranks").glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                with contextlib.suppress(json.JSONDecodeError):  # a line cut by a crash
                    results.append(json.loads(line))
    return results


def summarise(plan: Plan, results: list[dict]) -> dict:
    """Per-rank iteration times and peak memory, and the loss of every iteration.

    The loss of an iteration is the mean over data-parallel replicas (TP rank 0 of the last
    pipeline stage) of the mean over micro-batches: the global-batch mean loss."""
    measured = [r for r in results if not r.get("warmup")]
    ranks = sorted({r["rank"] for r in results})
    iteration_s = {rank: [r["iteration_s"] for r in measured if r["rank"] == rank] for rank in ranks}
    peak = {rank: max([r["peak_memory"] for r in measured if r["rank"] == rank], default=0) for rank in ranks}
    # What the activation slots held at most (stage inputs and saved tensors on the device, each
    # storage once): the part of memory a memory policy changes, comparable with the ledger's.
    activations = {rank: max([r.get("activation_peak", 0) for r in measured if r["rank"] == rank], default=0)
                   for rank in ranks}
    by_iteration: dict[int, list[float]] = {}
    for r in results:
        if r["losses"]:
            by_iteration.setdefault(r["iteration"], []).append(sum(r["losses"]) / len(r["losses"]))
    losses = {it: sum(v) / len(v) for it, v in sorted(by_iteration.items())}
    return {
        "iteration_s": {str(k): v for k, v in iteration_s.items()},
        "peak_memory": {str(k): v for k, v in peak.items()},
        "activation_peak": {str(k): v for k, v in activations.items()},
        "losses": [losses[it] for it in sorted(losses)],
        "loss_iterations": sorted(losses),
        "warmup": sum(1 for r in results if r.get("warmup") and r["rank"] == ranks[0]) if ranks else 0,
    }


def results_table(results: list[dict]) -> pd.DataFrame:
    """The measured rows; on one host, on one clock.

    Every rank's times are offsets from its own start of the iteration, taken right after a
    barrier; ranks leave a barrier up to a few milliseconds apart on a busy machine. When all ranks
    share a host, their ``perf_counter`` is one system-wide monotonic clock, so each rank's rows are
    shifted onto the first rank's origin exactly."""
    measured = [r for r in results if not r.get("warmup")]
    one_host = len({r.get("host") for r in measured}) == 1 and all("t0_mono" in r for r in measured)
    origin: dict[int, float] = {}
    for r in sorted(measured, key=lambda r: r["rank"]):
        origin.setdefault(r["iteration"], r.get("t0_mono", 0.0))
    rows = []
    for r in measured:
        shift = r["t0_mono"] - origin[r["iteration"]] if one_host else 0.0
        rows += [{**row, "start_s": row["start_s"] + shift, "end_s": row["end_s"] + shift}
                 for row in r["rows"]]
    if not rows:
        table = pd.DataFrame({c: pd.Series(dtype=d) for c, d in INSTRUCTION_TABLE.columns.items()})
        table["iteration"] = pd.Series(dtype="int64")
        return table
    table = conform(pd.DataFrame(rows), INSTRUCTION_TABLE, "runtime")
    return table.sort_values(["iteration", "rank", "start_s", "index"], kind="stable").reset_index(drop=True)


def write_record(out_dir: Path, plan: Plan, results: list[dict], meta: dict, status: str = "ok",
                 error: str = "") -> Path:
    """Write ``<out>/record`` (INSTRUCTION_TABLE + summary) and ``<out>/trace.json`` from per-rank results.

    Table times are seconds from the start of each row's iteration (the simulator's convention
    for its one iteration; the ``iteration`` column says which); the Chrome trace lays the
    measured iterations one after another on the wall clock."""
    table = results_table(results)
    summary = {"plan": plan.model_dump(), "status": status, "error": error, **meta,
               **summarise(plan, results)}
    record_dir = Path(out_dir) / "record"
    write_run_record(RunRecord(table, summary), record_dir, chrome=False)
    if len(table):
        first_rank = min(x["rank"] for x in results)
        starts = {r["iteration"]: r["t0_wall"] for r in results if r["rank"] == first_rank}
        first = min(starts[it] for it in table["iteration"].unique())
        shifted = table.copy()
        offset = shifted["iteration"].map(lambda it: starts.get(it, first) - first)
        shifted["start_s"] += offset
        shifted["end_s"] += offset
        instruction_table_to_chrome(shifted, Path(out_dir) / "trace.json")
    return record_dir
