"""The fast estimate runs a pipeline's graph at a capped micro-batch count and extends its steady
state to the plan's (``sim.estimate_pipeline.pipeline_time``). The extension is exact only where the
steady state's period is the slowest rank's compute per micro-batch; where a micro-batch's round trip
through the hops is longer (a communication-bound pipeline) the graph is run at the plan's own count
(ninth session, issue 12g). Before: gpt-tiny, pp 4, 32 micro-batches, 1 ms + 1 GB/s hops, 1F1B was
-10.7% against the engine; 26 of the 48 plans below were under it (-0.7 to -13.3% with the slow hops:
1F1B, interleaved, ZB-H1, DualPipeV, Merak's three; -0.06 to -0.16% with the fast ones)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from sim.estimate_pipeline import StageTime, action_graph, pipeline_time, steady_count, weighted_run
from sim.plan import Plan
from sim.schedules import SCHEDULES, Op

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_estimate_cpu import engine_s, estimate_s  # noqa: E402
from test_overlap_cpu import measured_comm  # noqa: E402

# (latency, bandwidth) of every hop: communication-bound (the 1 ms + 1 GB/s: a round trip
# through the pipeline's hops outlasts a rank's 3-6 ms of compute per micro-batch) and fast hops
# (10 us + 100 GB/s: the slowest rank's compute sets the period, the capped run is extended).
HOPS = {"comm-bound": (1e-3, 1e9), "compute-bound": (1e-5, 1e11)}


def cases() -> list[tuple[str, int, int]]:
    """Every registered schedule at pp 2-4 (pp 2-3 with two chunks: the test costs' 6 layers)."""
    out = []
    for name, info in SCHEDULES.items():
        chunks = 2 if info.chunks in ("2", ">= 2") else 1
        out += [(name, chunks, pp) for pp in range(2, 5) if pp * chunks <= 6]
    return out


@pytest.mark.parametrize("hops", list(HOPS))
@pytest.mark.parametrize(("schedule", "chunks", "pp"), cases())
def test_the_estimate_extends_a_capped_pipeline_as_the_engine_runs_the_whole(schedule: str, chunks: int, pp: int,
                                                                            hops: str) -> None:
    microbatches = 8 * pp
    assert steady_count(schedule, pp, microbatches, chunks) < microbatches  # the estimate caps this plan
    plan = Plan.from_dict({"workload": "gpt-tiny", "workload_options": {"num_layers": 6},
                           "parallelism": {"dp": 1, "pp": pp, "chunks": chunks},
                           "schedule": {"name": schedule, "microbatches": microbatches},
                           "cluster": {"preset": "local-cpu-2", "devices_per_node": pp}})
    resolved = measured_comm(plan, math.nan, math.nan, None, *HOPS[hops])  # no CPU model
    assert estimate_s(resolved) == pytest.approx(engine_s(resolved), rel=1e-9)


@pytest.mark.parametrize(("hop_s", "runs_full"), [(0.5, False), (3.0, True)])
def test_only_a_communication_bound_steady_state_is_run_at_the_plans_count(hop_s: float, runs_full: bool) -> None:
    """The search prices thousands of plans: a compute-bound pipeline keeps the capped run (8
    micro-batches) and one more pp further on (12), not a run at the plan's count (64). 1F1B, pp 4,
    F 1 and B 2 on the first three stages, F 2 and B 4 on the last (a rank's 3 or 6 per
    micro-batch): a round trip from rank r through the hops of h takes (sum of its stages' F + B +
    2 (3 - r) h) / (4 - r) per micro-batch, under the last rank's 6 for h < 1.5 and over it above.
    (With every stage alike any h > 0 makes 1F1B communication-bound: the round trip from rank 0
    adds 6 h per 4 micro-batches.) Both ways the time is the whole graph's."""
    stages = [StageTime(1.0, 2.0, 0.0, 1.0, 1.0)] * 3 + [StageTime(2.0, 4.0, 0.0, 2.0, 2.0)]
    per_rank = [3.0, 3.0, 3.0, 6.0]
    runs: dict = {}
    time = pipeline_time("1f1b", 4, 64, 1, stages, per_rank, [hop_s] * 3, runs=runs)
    assert sorted(key[0][2] for key in runs) == ([8, 12, 64] if runs_full else [8, 12])
    whole = weighted_run(action_graph("1f1b", 4, 64, 1, (False,) * 4),
                         lambda stage, op: stages[stage].fwd_s if op is Op.FORWARD else stages[stage].bwd_s,
                         [hop_s] * 3)
    assert time.makespan == pytest.approx(whole.makespan, rel=1e-12)
    if not runs_full:  # fill through three stages, the last rank busy throughout, drain through three
        assert time.makespan == pytest.approx(3 * (1.0 + hop_s) + 64 * 6.0 + 3 * (2.0 + hop_s), rel=1e-12)


def test_a_blocking_pipeline_keeps_its_capped_run_where_a_ranks_compute_and_sends_set_the_period() -> None:
    """Under ``p2p: blocking`` a rank's own cycle per micro-batch is its compute and the sends it waits
    for (``blocking_sends_s``): the last rank's 6 and its gradient's send h, its neighbours' 3 + 2 h. With
    h 0.5 the last rank's 6.5 sets the period (a round trip from rank r, as above, takes less), so the
    capped run is extended by 6.5 per micro-batch and equals the whole blocking graph; extended by the
    compute alone (6) it would not, and the run went to the plan's 64."""
    stages = [StageTime(1.0, 2.0, 0.0, 1.0, 1.0)] * 3 + [StageTime(2.0, 4.0, 0.0, 2.0, 2.0)]
    runs: dict = {}
    time = pipeline_time("1f1b", 4, 64, 1, stages, [3.0, 3.0, 3.0, 6.0], [0.5] * 3, runs=runs, blocking=True)
    assert sorted(key[0][2] for key in runs) == [8, 12]
    whole = weighted_run(action_graph("1f1b", 4, 64, 1, (False,) * 4),
                         lambda stage, op: stages[stage].fwd_s if op is Op.FORWARD else stages[stage].bwd_s,
                         [0.5] * 3, blocking=True)
    assert time.makespan == pytest.approx(whole.makespan, rel=1e-12)
    assert whole.makespan > pipeline_time("1f1b", 4, 64, 1, stages, [3.0, 3.0, 3.0, 6.0], [0.5] * 3).makespan
