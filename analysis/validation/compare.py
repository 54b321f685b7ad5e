"""Comparison of a prediction with a measurement: pure functions of the two instruction tables
(iteration times, per-kind durations, peak memory like with like), and ``MeasuredRun``, what they
need of a real run."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sim.compile import ResolvedPlan
from sim.program import Kind
from sim.result import SimResult


@dataclass
class MeasuredRun:
    """What the comparison needs of a real run (``exec.launcher.RunResult`` or a run record)."""

    table: pd.DataFrame  # INSTRUCTION_TABLE + "iteration", times from each iteration's start
    iteration_times: list[float]  # per measured iteration, the slowest rank's seconds
    peak_memory: dict[int, int]
    warmup: int = 0  # iterations run before the measured ones
    trace: Path | None = None
    directory: Path | None = None

    @classmethod
    def from_record(cls, run_dir: Path) -> MeasuredRun:
        """A run written by ``python -m exec.runtime`` (torchrun, SLURM, netns): ``run_dir/record``."""
        from traces.runrecord import read_run_record

        record = read_run_record(Path(run_dir) / "record")
        per_rank = [record.summary["iteration_s"][k] for k in sorted(record.summary["iteration_s"], key=int)]
        times = [max(values) for values in zip(*per_rank, strict=True)]
        peak = {int(k): int(v) for k, v in record.summary["peak_memory"].items()}
        trace = Path(run_dir) / "trace.json"
        return cls(record.instructions, times, peak, int(record.summary.get("warmup", 0)),
                   trace if trace.exists() else None, Path(run_dir))


def iteration_stats(times: list[float]) -> dict[str, Any]:
    values = np.asarray(times, dtype=float)
    median = float(np.median(values))
    p10, p90 = (float(v) for v in np.percentile(values, [10, 90]))
    return {"median_s": median, "p10_s": p10, "p90_s": p90, "min_s": float(values.min()),
            "max_s": float(values.max()), "spread": (p90 - p10) / median if median > 0 else float("nan"),
            "n": int(values.size), "times_s": [float(v) for v in values]}


def kind_comparison(predicted: pd.DataFrame, measured: pd.DataFrame) -> pd.DataFrame:
    """Median duration of every instruction kind (top-level rows), predicted vs measured."""
    def medians(table: pd.DataFrame) -> pd.DataFrame:
        top = table[table["parent"] == -1]
        durations = (top["end_s"] - top["start_s"]).groupby(top["kind"])
        return pd.DataFrame({"median_s": durations.median(), "n": durations.size()})

    pred, meas = medians(predicted), medians(measured)
    kinds = [k.value for k in Kind if k.value in set(pred.index) | set(meas.index)]
    rows = []
    for kind in kinds:
        p = float(pred["median_s"].get(kind, float("nan")))
        m = float(meas["median_s"].get(kind, float("nan")))
        rows.append({"kind": kind, "predicted_median_s": p, "measured_median_s": m,
                     "error": p / m - 1.0 if m > 0 else float("nan"),
                     "n_predicted": int(pred["n"].get(kind, 0)), "n_measured": int(meas["n"].get(kind, 0))})
    return pd.DataFrame(rows, columns=["kind", "predicted_median_s", "measured_median_s", "error",
                                       "n_predicted", "n_measured"])


def memory_comparison(sim: SimResult, measured: pd.DataFrame, measured_peak: dict[int, int],
                      resolved: ResolvedPlan, stage_ranks: dict[int, tuple[int, ...]],
                      unheld_param_bytes: dict[int, int] | None = None) -> pd.DataFrame:
    """Per rank: the ledger's peak and the runtime's tracked peak as each side reports them, and
    both made comparable (see MEMORY_NOTE): the ledger sampled at instruction ends without the
    flattened data-parallel buckets in flight, the runtime with gradients counted from the start
    (of the parameters the rank holds: ``unheld_param_bytes``, the Program's, leaves out the other
    ranks' shards of a sharded embedding table)."""
    plan = resolved.plan
    unheld = unheld_param_bytes or {}

    def held_grad_bytes(layer: int) -> float:
        c = resolved.costs.layer_costs(layer, plan.micro_batch, plan.tp)
        return c.grad_bytes * (1.0 - unheld.get(layer, 0) / c.param_bytes) if c.param_bytes else c.grad_bytes

    grad_bytes = {s: sum(held_grad_bytes(layer) for layer in layers) for s, layers in enumerate(resolved.stage_layers)}
    rows = []
    for rank in sorted(sim.memory):
        mine = measured[(measured["rank"] == rank) & (measured["parent"] == -1)]
        comparable = 0
        for _, it in mine.groupby("iteration"):
            samples = it["mem_after"].to_numpy(dtype=float).copy()
            ends = it["end_s"].to_numpy(dtype=float)
            for stage in stage_ranks.get(rank, ()):
                writers = it[(it["stage"] == stage) & it["kind"].isin([Kind.BWD.value, Kind.BWD_W.value])]
                first = float(writers["end_s"].min()) if len(writers) else math.inf
                samples[ends < first] += grad_bytes[stage]
            comparable = max(comparable, int(samples.max()) if samples.size else 0)
        predicted = _predicted_at_ends(sim.table[(sim.table["rank"] == rank) & (sim.table["parent"] == -1)])
        rows.append({"rank": rank, "predicted_peak": int(sim.memory[rank].peak_bytes),
                     "predicted_comparable": predicted, "measured_peak": int(measured_peak.get(rank, 0)),
                     "measured_comparable": comparable,
                     "error": predicted / comparable - 1.0 if comparable > 0 else float("nan")})
    return pd.DataFrame(rows, columns=["rank", "predicted_peak", "predicted_comparable", "measured_peak",
                                       "measured_comparable", "error"])


def _predicted_at_ends(top: pd.DataFrame) -> int:
    """The ledger at instruction ends, less the flattened gradient buckets being all-reduced then
    (the simulator holds one per bucket in flight; the runtime's CPU count has none)."""
    buckets = top[top["kind"] == Kind.ALLREDUCE.value]
    best = 0
    for end, mem in zip(top["end_s"], top["mem_after"], strict=True):
        in_flight = buckets[(buckets["start_s"] <= end) & (buckets["end_s"] > end)]["bytes"].sum()
        best = max(best, int(mem - in_flight))
    return best


def representative_iteration(measured: pd.DataFrame, times: list[float]) -> int:
    """The measured iteration whose time (slowest rank) is closest to the median."""
    iterations = sorted(measured["iteration"].unique())
    median = float(np.median(times))
    best = min(range(len(times)), key=lambda k: abs(times[k] - median))
    return int(iterations[best]) if best < len(iterations) else int(iterations[-1])

