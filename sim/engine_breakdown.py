"""The engine's time breakdown of one iteration, the kinds docs/search.md defines ("The breakdown"), read
from a simulation's instruction table for the critical rank (``sim.critical_rank``), as the estimate
(``sim.estimate.Estimator._finish``) reports the same rank's."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from sim.critical_rank import critical_rank
from sim.embedding import EXCHANGE_TAG, LOOKUP_PHASES, exchange_phase


@dataclass(frozen=True, slots=True)
class Breakdown:
    rank: int
    compute_s: float  # FWD, BWD, BWD_I, BWD_W (their TP communication inside)
    recompute_s: float  # RECOMPUTE
    bubble_s: float  # the rest of the iteration
    exposed_comm_s: float  # the compute stream waiting for gradient sync between the last backward and the step
    optimizer_s: float  # the steps and what the rank still does after the last one


def _is_lookup(label: str) -> bool:
    tag = label.rsplit(" ", 1)[-1]
    return tag.startswith(EXCHANGE_TAG) and exchange_phase(tag) in LOOKUP_PHASES


def engine_breakdown(table: pd.DataFrame, iteration_s: float) -> Breakdown:
    """The critical rank's breakdown. Its gradient sync is the time its compute stream is idle between its
    last forward or backward and its last optimizer step, up to the end of the last gradient exchange
    (buckets, the tied embedding's all-reduce, a sharded embedding's gradient exchange or push) before that
    step: EmbRace 2D's own table step beside the buckets is not waiting, and its prefetched lookups, which
    the dense step waits for after the buckets, are bubble, as a sharded embedding's lookups before the
    forwards are. Until session 16 (issue-9v) it was the gap before the first step, so the table step cut
    it short and the buckets' wait after it went to the bubble (1.03 ms on gpt2-small dp2, two A100s)."""
    top = table[table["parent"] == -1]
    rank = critical_rank(top.groupby("rank")["end_s"].max().to_dict())
    mine = top[top["rank"] == rank]
    compute_rows = mine[mine["stream"] == "compute"]
    seconds = (compute_rows["end_s"] - compute_rows["start_s"]).groupby(compute_rows["kind"]).sum()

    def total(*kinds: str) -> float:
        return float(sum(seconds.get(k, 0.0) for k in kinds))

    steps = compute_rows[compute_rows["kind"] == "OPTIMIZER_STEP"]
    exposed = optimizer = 0.0
    if len(steps):
        # the step and what the rank still does after it (the distributed optimizer's parameter all-gather)
        optimizer = total("OPTIMIZER_STEP") + max(0.0, float(mine["end_s"].max() - steps["end_s"].max()))
        work = compute_rows[compute_rows["kind"] != "OPTIMIZER_STEP"]
        last_work = float(work["end_s"].max()) if len(work) else 0.0
        last_step = float(steps["start_s"].max())
        syncs = mine[(mine["stream"] != "compute") & (mine["end_s"] <= last_step)
                     & mine["kind"].isin(("ALLREDUCE", "ALLTOALL")) & ~mine["name"].map(_is_lookup)]
        until = min(last_step, max(last_work, float(syncs["end_s"].max()) if len(syncs) else last_work))
        busy = sum(max(0.0, min(end, until) - max(start, last_work))
                   for start, end in zip(steps["start_s"], steps["end_s"], strict=True))
        exposed = max(0.0, until - last_work - busy)
    compute, recompute = total("FWD", "BWD", "BWD_I", "BWD_W"), total("RECOMPUTE")
    bubble = max(0.0, iteration_s - compute - recompute - optimizer - exposed)
    return Breakdown(rank, compute, recompute, bubble, exposed, optimizer)
