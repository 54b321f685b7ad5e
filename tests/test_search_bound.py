"""Branch and bound in the plan search (sim/search_bound.py): the lower bound never exceeds the estimate,
and the bounded search hands the engine the plans the exhaustive search would (same best K, same order,
same refined shapes), with fewer plans estimated; the estimate's gradient bucket is clipped to the rank's
gradients."""

from __future__ import annotations

from dataclasses import replace

import pytest

from analysis.estimate_grid import grid_plans
from sim.compile import resolve_plan
from sim.estimate import Estimator
from sim.gradient_sync import bucket_buffer_bytes, vector_wire_bytes
from sim.plan import Plan
from sim.schedules import SCHEDULES
from sim.search import SearchSpace, estimate_phase
from sim.search_bound import BOUNDED, MARGIN

# gpt2-small on one DGX A100: every registered schedule, memory policy (the optimising ones refined for
# the best shapes), TP overlap 0/3, 1-2 micro-batch sizes; 11,668 plans, 2,361 estimated exhaustively.
SPACE = SearchSpace("gpt2-small", "dgx-a100-8", global_batch=16, dtype="fp16", max_micro_batch=2,
                    fractions=(0.5,), tp_overlaps=(0, 3), bucket_mbs=(25.0,), max_chunks=2)
# A 33B-parameter GPT (hidden 8,192, 40 layers) on the same node: memory is tight, most plans do not fit, and
# the optimising memory policies (built for the best 20 shapes) give 16 plans, most in the best 20.
TIGHT = replace(SPACE, workload_options={"hidden": 8192, "heads": 64, "num_layers": 40, "seq": 2048}, tp_overlaps=(0,))


def _asked(plan: Plan, r) -> dict:  # noqa: ANN001 - ResolvedPlan
    return dict(schedule=plan.schedule.name, dp=plan.dp, tp=plan.tp, pp=plan.pp, chunks=plan.chunks,
                micro_batch=plan.micro_batch, microbatches=plan.microbatches, stage_layers=r.stage_layers,
                policy=r.policy, tp_overlap=plan.parallelism.tp_overlap, sync_method=plan.gradient_sync.method,
                bucket_mb=plan.gradient_sync.bucket_mb)


def test_the_lower_bounds_never_exceed_the_estimate_on_the_estimate_grid() -> None:
    """On every plan of analysis.estimate_grid (all schedules, pp 2-8, m below/at/above pp, tp, dp, no and full
    recompute, LM-head-heavy and flat, one node and one node per stage): group bound <= plan bound <= estimate,
    and the screen's peak is the estimate's; with tp > 1 at every TP overlap level."""
    checked, tight = 0, 0.0
    estimators: dict[str, Estimator] = {}  # one per workload and cluster, as the search holds one
    for _, plan in grid_plans():
        r = resolve_plan(plan)
        estimator = estimators.setdefault(repr((plan.workload_options, plan.cluster)), Estimator(
            r.costs, r.comm, plan.dtype, plan.workload, plan.workload_options))
        asked = _asked(plan, r)
        estimate = estimator.estimate(**asked)
        screen = estimator.screen(**asked)
        group = estimator.group_bound(plan.pp, plan.chunks, SCHEDULES[plan.schedule.name].placement,
                                      plan.micro_batch, plan.microbatches, r.stage_layers, plan.tp)
        assert screen.peak_bytes == estimate.peak_bytes, plan.name
        assert group <= screen.any_level_bound_s * (1 + MARGIN), plan.name
        assert screen.lower_bound_s <= estimate.iteration_s * (1 + MARGIN), plan.name
        for level in (1, 2, 3) if plan.tp > 1 else ():  # the level-free bound and the peak hold at every level
            other = estimator.estimate(**{**asked, "tp_overlap": level})
            assert other.peak_bytes == estimate.peak_bytes, plan.name
            assert screen.any_level_bound_s <= other.iteration_s * (1 + MARGIN), plan.name
            assert estimator.screen(**{**asked, "tp_overlap": level}).lower_bound_s <= other.iteration_s * (1 + MARGIN)
        tight = max(tight, screen.lower_bound_s / estimate.iteration_s)
        checked += 1
    assert checked > 500
    assert tight > 0.9  # the bound is not vacuous: on some plans it is within 10% of the estimate


@pytest.fixture(scope="module")
def exhaustive():
    return {name: estimate_phase(space, top_k=50, workers=1, bound=False)
            for name, space in (("space", SPACE), ("tight", TIGHT))}


@pytest.mark.parametrize(("name", "top_k"), [("space", 1), ("space", 8), ("space", 50), ("tight", 1), ("tight", 8)])
def test_the_bounded_search_hands_the_engine_what_the_exhaustive_search_would(exhaustive, name, top_k) -> None:
    every = exhaustive[name]
    bounded = estimate_phase(SPACE if name == "space" else TIGHT, top_k=top_k, workers=1, bound=True)
    assert bounded.bounded and not every.bounded
    # the best K in order (ties in enumeration order), with the same estimates
    assert ([(r.candidate, r.estimate) for r in bounded.survivors[:top_k]]
            == [(r.candidate, r.estimate) for r in every.survivors[:top_k]])

    # the optimising memory policies were built for the same shapes and gave the same plans
    def refined(phase):
        return [(r.candidate, r.estimate) for r in phase.survivors if not r.order]

    assert refined(bounded) == refined(every)
    assert bool(refined(every)) == (name == "tight")
    # every plan is accounted for, and the bound did prune
    assert bounded.considered == every.considered
    assert bounded.considered == sum(bounded.pruned.values()) + len(bounded.survivors)
    assert bounded.pruned[BOUNDED] > 0 and len(bounded.survivors) < len(every.survivors)


def test_the_estimate_clips_a_huge_bucket_to_the_rank_gradients() -> None:
    """A 1e6 MiB bucket is one bucket of the rank's gradients (the reducer never holds more), not a TB."""
    plan = Plan.from_dict({"name": "clip", "workload": "gpt2-small", "cluster": "dgx-a100-8", "dtype": "fp16",
                           "parallelism": {"dp": 4, "pp": 2},
                           "schedule": {"name": "1f1b", "micro_batch": 2, "microbatches": 4},
                           "gradient_sync": {"method": "allreduce", "bucket_mb": 1e6}})
    r = resolve_plan(plan)
    estimator = Estimator(r.costs, r.comm, plan.dtype, plan.workload, plan.workload_options)
    huge = estimator.estimate(**_asked(plan, r))
    whole = estimator.estimate(**{**_asked(plan, r), "bucket_mb": 1e4})  # 10 GiB: more than the gradients too
    assert huge.peak_bytes == whole.peak_bytes
    assert max(huge.peak_bytes) < 10 * 2**30
    grads = sum(r.costs.layer_costs(layer, 2, 1).grad_bytes for layer in r.stage_layers[0])
    sync = plan.gradient_sync
    assert grads > 2**20
    assert bucket_buffer_bytes(sync, 1e6, grads, 4, "fp16") == vector_wire_bytes(sync, grads, 4, "fp16")
    assert bucket_buffer_bytes(sync, 1.0, grads, 4, "fp16") == vector_wire_bytes(sync, 2**20, 4, "fp16")
    assert bucket_buffer_bytes(sync, 1e6, grads, 1, "fp16") == 0


def test_the_bounded_search_samples_fitting_plans_from_every_plan_and_simulates_the_exhaustive_best(exhaustive):
    from sim.search import search

    result = search(SPACE, top_k=4, sample=6, seed=3, workers=1, bound=True)
    every = {r.candidate: r.estimate for r in exhaustive["space"].survivors}
    assert [r.candidate for r in result.estimated_top] == [r.candidate for r in exhaustive["space"].survivors[:4]]
    assert len(result.sampled) == 6 and result.agreement is not None
    for r in result.sampled:  # survivors of the exhaustive search, estimated alike, simulated
        assert every[r.candidate] == r.estimate and r.simulated is not None and r in result.ranked
    assert not {r.candidate for r in result.sampled} <= {r.candidate for r in exhaustive["space"].survivors[:50]}
    assert result.considered == sum(result.pruned.values()) + len(result.ranked)
