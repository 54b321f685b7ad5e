"""Where a validation suite's prediction errors come from, from the instruction tables it kept
(issue 16: separate the candidate causes with measurements, not a fitted scale).

    python scripts/suite_decompose.py runs/suite-1 [runs/suite-2 ...]

For every plan of every suite folder it reads the measured table (``plans/<plan>/run/record/
instructions.parquet``, one row per instruction and iteration) and the predicted one
(``plans/<plan>/prediction/instructions.parquet``) and splits, on the rank whose compute ends last,
the measured minus predicted iteration time into:

- **compute**: the summed durations of its forward/backward/recompute instructions (the profile's
  figures against what the same kernels took inside the run: co-location with the other rank,
  cache and memory-bandwidth sharing, show up here);
- **optimizer**: its OPTIMIZER_STEP;
- **dispatch**: the gaps between consecutive compute instructions that no wait explains, i.e. the
  next compute instruction started later than both the previous one's end and the end of every
  receive or collective of the rank that finished in between (the runtime's own per-instruction
  cost: Python dispatch, hooks, posting sends and receives);
- **waits**: the rest of the idle time on that rank (waiting for the peer: the other rank's
  compute and dispatch, and the transfers), which is what the pipeline propagates;
- **first micro-batch**: the first forward of a stage over the median of its other forwards
  (reported, it is inside "compute");
- **collectives** (reported, they overlap the parts above): the time at least one all-reduce or
  all-to-all of that rank is in flight, and the sum of their durations. The runtime launches a
  plan's buckets together and they share the link, so each lasts about as long as all of them;
  the engine runs them one after the other: compare the time in flight, not instruction by
  instruction.

Medians over the measured iterations. Measured minus predicted, in milliseconds and as a share of
the measured iteration; the parts add up to the total.

It also times every point-to-point message (from the later of the send's start and the receive's
post to the receive's end) in the run and in the prediction, and, with ``--p2p-what-if``, re-simulates
each pipeline plan with every message lengthened by the in-run mean minus the predicted mean (every
message at its in-run mean where, as in the suite, they are all one size):
a diagnostic that says how much of the error the message times carry. It uses the run's own
measurements, so its errors are not predictions and must not be reported as accuracy.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from analysis.validation.runtime_costs import dispatch_gaps, message_times

COMPUTE = {"FWD", "BWD", "BWD_I", "BWD_W", "RECOMPUTE"}
COLLECTIVES = {"ALLREDUCE", "ALLTOALL"}


def busy_s(intervals: pd.DataFrame) -> float:
    """Seconds during which at least one of the [start_s, end_s) intervals is in flight. Collectives
    launched together (the runtime's buckets) share the link and CPU and each lasts about as long as
    all of them; the simulator's collective stream runs them one after the other. Their union is what
    both mean alike (docs/embrace.md, "Concurrent all-reduces")."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(zip(intervals["start_s"], intervals["end_s"], strict=True)):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def rank_parts(rows: pd.DataFrame) -> dict[str, float]:
    """One rank, one iteration: its span and how it was spent."""
    rows = rows[rows["parent"] == -1].sort_values("start_s")
    start, end = rows["start_s"].min(), rows["end_s"].max()
    compute = rows[rows["kind"].isin(COMPUTE)]
    optimizer = rows[rows["kind"] == "OPTIMIZER_STEP"]
    dispatch = sum(dispatch_gaps(rows))
    forwards = compute[compute["kind"] == "FWD"]
    first = forwards[forwards["microbatch"] == 0]["end_s"] - forwards[forwards["microbatch"] == 0]["start_s"]
    rest = forwards[forwards["microbatch"] > 0]
    rest_median = (rest["end_s"] - rest["start_s"]).median() if len(rest) else float("nan")
    busy = float((compute["end_s"] - compute["start_s"]).sum())
    opt = float((optimizer["end_s"] - optimizer["start_s"]).sum())
    span = float(end - start)
    collectives = rows[rows["kind"].isin(COLLECTIVES)]
    return {"span": span, "compute": busy, "optimizer": opt, "dispatch": dispatch,
            "collectives": busy_s(collectives),
            "collective_sum": float((collectives["end_s"] - collectives["start_s"]).sum()),
            "waits": span - busy - opt - dispatch,
            "first_fwd_ratio": float(first.median() / rest_median) if len(first) and rest_median else float("nan")}


def iteration_parts(rows: pd.DataFrame) -> dict[str, float]:
    """The iteration's span and the parts of the rank whose compute ends last."""
    per_rank = {rank: rank_parts(group) for rank, group in rows.groupby("rank")}
    last = max(per_rank, key=lambda r: rows[(rows["rank"] == r) & (rows["parent"] == -1)]["end_s"].max())
    parts = dict(per_rank[last])
    parts["iteration"] = float(rows["end_s"].max() - rows["start_s"].min())
    # the span of the last rank may start after the iteration does (it waits for its first input)
    parts["waits"] += parts["iteration"] - parts["span"]
    parts.pop("span")
    parts["rank"] = last
    return parts


def plan_parts(folder: Path) -> dict[str, float] | None:
    measured_path = folder / "run" / "record" / "instructions.parquet"
    predicted_path = folder / "prediction" / "instructions.parquet"
    if not (measured_path.is_file() and predicted_path.is_file()):
        return None
    measured = pd.read_parquet(measured_path)
    per_iteration = pd.DataFrame([iteration_parts(group) for _, group in measured.groupby("iteration")])
    m = per_iteration.median(numeric_only=True)
    p = iteration_parts(pd.read_parquet(predicted_path))
    out = {"plan": folder.name, "measured_ms": m["iteration"] * 1e3, "predicted_ms": p["iteration"] * 1e3}
    for part in ("compute", "optimizer", "dispatch", "waits"):
        out[f"d_{part}_ms"] = (m[part] - p[part]) * 1e3
    out["first_fwd_ratio"] = m["first_fwd_ratio"]
    for part in ("collectives", "collective_sum"):  # not parts of the sum: they overlap the others
        out[f"{part}_ms"], out[f"{part}_pred_ms"] = m[part] * 1e3, p[part] * 1e3
    out["compute_ratio"] = m["compute"] / p["compute"] if p["compute"] else float("nan")
    return out


def p2p_what_if(plan_dir: Path) -> tuple[float, float, float, float] | None:
    """(in-run mean message ms, predicted message ms, error as validated, error with every message
    lengthened by the in-run mean minus the predicted mean)."""
    import json
    from dataclasses import fields, replace

    from analysis.validation.calibration import ValidationCalibration, with_calibration
    from sim.compile import resolve_plan
    from sim.engine import EngineOptions
    from sim.plan import Plan
    from sim.simulate import simulate

    measured = pd.read_parquet(plan_dir / "run" / "record" / "instructions.parquet")
    predicted = message_times(pd.read_parquet(plan_dir / "prediction" / "instructions.parquet"))
    in_run = message_times(measured)
    if not len(in_run):
        return None
    report = json.loads((plan_dir / "report.json").read_text())
    plan = Plan.load(plan_dir / "plan.yaml")
    known = {f.name for f in fields(ValidationCalibration)}
    calibration = ValidationCalibration(**{k: v for k, v in report["settings"]["calibration"].items() if k in known})
    calibration = replace(calibration, p2p_overhead_s=calibration.p2p_overhead_s + in_run.mean() - predicted.mean())
    again = simulate(plan, full=True, options=calibration.engine_options(EngineOptions(layer_rows=False)),
                     resolved=with_calibration(resolve_plan(plan), calibration)).iteration_s
    measured_s = report["iteration"]["measured"]["median_s"]
    return in_run.mean() * 1e3, predicted.mean() * 1e3, report["iteration"]["error"], again / measured_s - 1


def main(folders: list[str]) -> None:
    if "--p2p-what-if" in folders:
        folders = [f for f in folders if f != "--p2p-what-if"]
        print("| suite | plan | message in run (mean ms) | predicted (ms) | error as validated | "
              "error with in-run messages (diagnostic) |")
        print("| --- | --- | ---: | ---: | ---: | ---: |")
        for folder in folders:
            for plan_dir in sorted((Path(folder) / "plans").iterdir()):
                if not (plan_dir / "report.json").is_file():
                    continue
                found = p2p_what_if(plan_dir)
                if found:
                    mean_ms, predicted_ms, before, after = found
                    print(f"| {Path(folder).name} | {plan_dir.name} | {mean_ms:.2f} | {predicted_ms:.2f} | "
                          f"{before:+.1%} | {after:+.1%} |")
        return
    tables = []
    for folder in folders:
        rows = [r for r in (plan_parts(p) for p in sorted((Path(folder) / "plans").iterdir())) if r]
        table = pd.DataFrame(rows)
        table.insert(0, "suite", Path(folder).name)
        tables.append(table)
    table = pd.concat(tables, ignore_index=True)
    parts = ["d_compute_ms", "d_optimizer_ms", "d_dispatch_ms", "d_waits_ms"]
    # The median iteration and the median of each part need not add up; the residual says by how much.
    table["residual_ms"] = table["measured_ms"] - table["predicted_ms"] - table[parts].sum(axis=1)
    print("measured - predicted per part, ms (the rank whose compute ends last; medians over iterations)\n")
    print("| suite | plan | measured | predicted | compute | optimizer | dispatch | waits | residual | "
          "compute meas/pred | 1st fwd / others |")
    print("| --- | --- |" + " ---: |" * 9)
    for _, r in table.iterrows():
        print(f"| {r['suite']} | {r['plan']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | "
              f"{r['d_compute_ms']:+.1f} | {r['d_optimizer_ms']:+.1f} | {r['d_dispatch_ms']:+.1f} | "
              f"{r['d_waits_ms']:+.1f} | {r['residual_ms']:+.1f} | {r['compute_ratio']:.3f} | "
              f"{r['first_fwd_ratio']:.2f} |")
    print("\ncollectives of that rank, ms: in flight (union of their intervals) and the sum of their "
          "durations, measured / predicted (medians)\n")
    print("| suite | plan | in flight | predicted | summed durations | predicted |")
    print("| --- | --- |" + " ---: |" * 4)
    for _, r in table.iterrows():
        print(f"| {r['suite']} | {r['plan']} | {r['collectives_ms']:.1f} | {r['collectives_pred_ms']:.1f} | "
              f"{r['collective_sum_ms']:.1f} | {r['collective_sum_pred_ms']:.1f} |")
    share = table[parts].div(table["measured_ms"], axis=0)
    print("\nmedian over every plan and suite, as a share of the measured iteration:")
    for part in parts:
        print(f"  {part[2:-3]:10s} {share[part].median():+.1%} (range {share[part].min():+.1%} .. "
              f"{share[part].max():+.1%})")
    print(f"  compute measured / predicted: median {table['compute_ratio'].median():.3f}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["runs/suite-1"])
