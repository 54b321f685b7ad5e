"""What a stored validation run's collectives spend their time on, from its instruction tables
(issue 12, sixth session): waiting for the partner, or moving data once both are there; and how
much the ranks' compute drifts apart before they meet, against what the profile's spreads predict
(sim.meeting). Reads stored runs only: no timing is taken.

    python scripts/suite_meetings.py runs/suite-embedding-6 [runs/netns-embedding-6 ...]

A suite folder (``plans/<plan>/``: ``run/record``, ``prediction``, ``profile``, ``report.json``) or a
shaped-network folder of ``scripts/netns_embedding.sh`` (``<rate>/<method>/{run,report}``, one
profile in ``base/profile``). Per plan run (attempts included, in the order they ran):

- **compute**: one rank's forwards and backwards of an iteration, run (median over ranks and
  iterations) and profile (the prediction's), and their ratio;
- **drift apart**: per iteration, the latest rank's compute minus the ranks' mean (median and mean
  over iterations), against the profile's expected lateness of the latest of dp ranks
  (``sim.meeting.lateness_s`` of the iteration's compute variance from the profile's spreads);
- per collective (its tag without the iteration's numbers): the rank that arrived first waited
  for the other (``wait``: the later launch minus the earlier), then the exchange took ``after``
  (the earlier end minus the later launch); medians over iterations, beside the predicted duration.

Launch-to-end on each rank is what the instruction table calls the collective's duration; a
synchronous exchange (EmbRace's ``ids``) is also the compute thread's wait.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from sim.bundle_costs import BundleCostModel
from sim.meeting import instruction_variance, lateness_s
from sim.program import Kind

COMPUTE = ("FWD", "BWD")
COLLECTIVES = ("ALLREDUCE", "ALLTOALL")


def runs(folder: Path) -> list[dict]:
    """Every plan run of a suite or shaped-network folder: its tables, profile and report."""
    found = []
    if (folder / "base" / "profile").is_dir():
        for report in sorted(folder.glob("*/*/report/report.json")):
            found.append({"name": f"{report.parts[-4]} {report.parts[-3]}", "record": report.parents[1] / "run",
                          "prediction": report.parent / "prediction", "profile": folder / "base" / "profile",
                          "report": report})
    else:
        for plan in (folder / "plans").iterdir():
            if (plan / "report.json").is_file() and (plan / "profile").is_dir():
                found.append({"name": plan.name, "record": plan / "run", "prediction": plan / "prediction",
                              "profile": plan / "profile", "report": plan / "report.json"})
    for run in found:
        manifest = json.loads((run["profile"] / "manifest.json").read_text())
        run["profiled_utc"] = manifest.get("created_utc", "")
    return sorted(found, key=lambda r: (r["profiled_utc"], r["name"]))


def profile_lateness_s(profile: Path, micro_batch: int, microbatches: int, dp: int) -> float:
    """sim.meeting's expected lateness of the latest of ``dp`` ranks after one iteration's forwards
    and backwards (the meeting of a dense plan's buckets), from the profile's spreads."""
    costs = BundleCostModel.load(profile)
    layers = [costs.layer_costs(layer, micro_batch, 1) for layer in range(costs.num_layers)]
    variance = microbatches * (instruction_variance(Kind.FWD, layers) + instruction_variance(Kind.BWD, layers))
    return lateness_s(variance, dp)


def compute_parts(measured: pd.DataFrame, predicted: pd.DataFrame) -> dict[str, float]:
    run = measured[measured["kind"].isin(COMPUTE)]
    per_rank = (run["end_s"] - run["start_s"]).groupby([run["iteration"], run["rank"]]).sum().unstack()
    drift = per_rank.max(axis=1) - per_rank.mean(axis=1)
    first = predicted[predicted["kind"].isin(COMPUTE) & (predicted["rank"] == predicted["rank"].min())]
    profile = float((first["end_s"] - first["start_s"]).sum())
    return {"run_ms": float(per_rank.stack().median()) * 1e3, "profile_ms": profile * 1e3,
            "ratio": float(per_rank.stack().median()) / profile if profile else float("nan"),
            "drift_median_ms": float(drift.median()) * 1e3, "drift_mean_ms": float(drift.mean()) * 1e3}


def meetings(measured: pd.DataFrame, predicted: pd.DataFrame) -> pd.DataFrame:
    """Per collective tag: the first arrival's wait, the exchange once both are there, the prediction."""
    rows = []
    coll = measured[measured["kind"].isin(COLLECTIVES)]
    for (_, index), group in coll.groupby(["iteration", "index"]):
        starts, ends = group["start_s"].to_numpy(), group["end_s"].to_numpy()
        if len(group) < 2:
            continue
        rows.append({"collective": group["name"].iloc[0].split()[-1], "index": index,
                     "wait_ms": (starts.max() - starts.min()) * 1e3, "after_ms": (ends.min() - starts.max()) * 1e3})
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    out = table.groupby(["index", "collective"])[["wait_ms", "after_ms"]].median().reset_index()
    pred = predicted[predicted["kind"].isin(COLLECTIVES) & (predicted["rank"] == predicted["rank"].min())]
    durations = dict(zip(pred["index"], (pred["end_s"] - pred["start_s"]) * 1e3, strict=True))
    out["predicted_ms"] = out["index"].map(durations)
    return out


def main(folders: list[str]) -> None:
    for folder in map(Path, folders):
        print(f"\n## {folder.name}\n")
        print("| run (in the order profiled) | profiled (UTC) | error | compute run / profile (ms) | ratio | "
              "ranks drift apart: median / mean (ms) | profile's expected lateness (ms) |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        details = []
        for run in runs(folder):
            report = json.loads(run["report"].read_text())
            settings = report["settings"]["profile_settings"]
            measured = pd.read_parquet(run["record"] / "record" / "instructions.parquet")
            measured = measured[measured["parent"] == -1]
            predicted = pd.read_parquet(run["prediction"] / "instructions.parquet")
            predicted = predicted[predicted["parent"] == -1]
            parts = compute_parts(measured, predicted)
            dp = int(measured["rank"].nunique())
            microbatches = int(measured[measured["kind"] == "FWD"]["microbatch"].nunique())
            expected = profile_lateness_s(run["profile"], int(settings["micro_batch"]), microbatches, dp)
            print(f"| {run['name']} | {run['profiled_utc'][11:19]} | {report['iteration']['error']:+.1%} | "
                  f"{parts['run_ms']:.1f} / {parts['profile_ms']:.1f} | {parts['ratio']:.2f} | "
                  f"{parts['drift_median_ms']:.1f} / {parts['drift_mean_ms']:.1f} | {expected * 1e3:.1f} |")
            details.append((run["name"], meetings(measured, predicted)))
        print("\nper collective, medians over iterations (ms): the first arrival's wait for the other rank, "
              "the exchange once both are there, predicted\n")
        print("| run | collective | wait | after both | predicted |\n| --- | --- | ---: | ---: | ---: |")
        for name, table in details:
            for _, r in table.iterrows():
                print(f"| {name} | {r['collective']} | {r['wait_ms']:.2f} | {r['after_ms']:.2f} | "
                      f"{r['predicted_ms']:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["runs/suite-embedding-6"])
