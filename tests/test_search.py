"""Plan search (sim/search.py, sim/estimate.py): what it returns compiles, what it prunes is counted
and never simulated, what it writes simulates to what it reported, every registered choice is
enumerated, and the fast estimate ranks plans as the engine does."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from analysis.search_report import ranked_frame
from sim.compile import compile_plan, resolve_plan
from sim.estimate import spearman
from sim.memory import MEMORY_POLICIES, NoRecompute, register_memory_policy
from sim.plan import Plan
from sim.schedules import SCHEDULES, check_preconditions, register_schedule
from sim.search import DOES_NOT_FIT, SearchSpace, schedule_chunks, search
from sim.simulate import simulate
from traces.errors import ConfigError

# gpt2-small has 12 heads: on 8 GPUs tp = 8 does not divide them, so the TP check must prune.
SPACE = SearchSpace("gpt2-small", "dgx-a100-8", global_batch=16, dtype="fp16", max_micro_batch=2,
                    fractions=(0.5,), tp_overlaps=(0, 3), bucket_mbs=(25.0,), max_chunks=2)


@pytest.fixture(scope="module")
def result():
    return search(SPACE, top_k=8, sample=24, seed=1)


def test_every_candidate_the_search_returns_compiles(result) -> None:
    rng = random.Random(0)
    checked = result.simulated + rng.sample(result.ranked, min(60, len(result.ranked)))
    for ranked in checked:
        compile_plan(result.plan_of(ranked.candidate))  # raises ConfigError if it does not


def test_pruning_is_counted_by_reason_and_nothing_pruned_is_simulated(result, monkeypatch) -> None:
    assert result.considered == sum(result.pruned.values()) + len(result.ranked)
    assert result.pruned["parallelism.tp"] > 0  # tp 8 on 12 heads
    assert result.pruned["schedule.microbatches"] + result.pruned["schedule.name"] > 0
    simulated = []
    import sim.search as search_module

    real = search_module.simulate_candidate
    monkeypatch.setattr(search_module, "simulate_candidate",
                        lambda candidate, *args: simulated.append(candidate) or real(candidate, *args))
    again = search(SPACE, top_k=5, sample=5, seed=2, workers=1)  # in this process, where the spy is
    assert simulated and again.pruned == result.pruned
    heads = 12
    for c in simulated:
        check_preconditions(c.schedule, c.pp, c.microbatches, c.chunks)  # raises if violated
        assert heads % c.tp == 0
        resolve_plan(again.plan_of(c))


def test_engine_in_worker_processes_gives_the_figures_of_one_process(result) -> None:
    # The fixture's 32 plans ran in worker processes (one per core, this machine has 2); the same plans
    # simulated here, one by one, must give the same figures (all but the engine's own wall time).
    assert len(result.simulated) >= 8
    serial = search(SPACE, top_k=8, sample=24, seed=1, workers=1)
    def figures(r):
        return replace(r.simulated, wall_s=0.0)
    assert [r.candidate for r in serial.simulated] == [r.candidate for r in result.simulated]
    assert [figures(r) for r in serial.simulated] == [figures(r) for r in result.simulated]


def test_estimate_in_worker_processes_gives_the_one_process_ranking(monkeypatch) -> None:
    import sim.search as search_module

    space = replace(SPACE, tp_overlaps=(0,))
    one = search(space, top_k=0, sample=0, workers=1)
    monkeypatch.setattr(search_module, "MIN_PARALLEL_COMBINATIONS", 0)  # this small space, in 2 workers
    two = search(space, top_k=0, sample=0, workers=2)
    assert (one.considered, one.pruned, one.not_enumerated) == (two.considered, two.pruned, two.not_enumerated)
    assert [(r.candidate, r.estimate) for r in one.ranked] == [(r.candidate, r.estimate) for r in two.ranked]
    assert len(one.ranked) > 10


def test_embedding_methods_are_a_searched_dimension(result) -> None:
    from sim.embedding import EMBEDDING_METHODS

    methods = {dict(r.candidate.embedding)["method"] for r in result.ranked}
    assert methods == set(EMBEDDING_METHODS)  # gpt2-small has a token table: every method is searched
    sharded = [r for r in result.ranked if EMBEDDING_METHODS[dict(r.candidate.embedding)["method"]].sharded]
    assert sharded and all(r.candidate.dp > 1 for r in sharded)
    by_candidate = {r.candidate: r for r in result.ranked}
    twins = 0
    for ranked in sharded[:5]:
        plan = result.plan_of(ranked.candidate)
        assert plan.embedding.method == dict(ranked.candidate.embedding)["method"]
        # the estimate prices the sharded tables as the engine does (sim/estimate.py's embedding terms)
        engine = simulate(plan)
        assert ranked.estimate.iteration_s == pytest.approx(engine.iteration_s, rel=0.1)
        # ... and not as dense ones: a rank holds only its shard of the table and its optimizer state
        twin = by_candidate.get(replace(ranked.candidate, embedding=(("method", "dense"),)))
        if twin is not None:
            twins += 1
            assert max(ranked.estimate.peak_bytes) < max(twin.estimate.peak_bytes)
    assert twins


def test_optimising_memory_policies_are_built_for_the_best_shapes_only() -> None:
    per_plan = {name for name, kind in MEMORY_POLICIES.items() if kind.per_plan}
    assert {"optimal", "delta"} <= per_plan
    # GPT-8.3B on one 8-GPU node with replicated optimizer state (the dense all-reduce): memory is
    # tight, so an optimising policy can choose something new (with distopt's sharded state the best
    # shapes keep everything, and the optimum is the enumerated `none`)
    space = SearchSpace("gpt-8.3b", "dgx-a100-8", global_batch=64, max_micro_batch=8, fractions=(),
                        tp_overlaps=(0,), bucket_mbs=(25.0,), max_chunks=1, refine_shapes=5,
                        gradient_syncs=("allreduce",))
    result = search(space, top_k=0, sample=0)
    optimised = [r for r in result.ranked if dict(r.candidate.memory)["policy"] in per_plan]
    shapes = {replace(r.candidate, memory=()) for r in optimised}
    assert optimised and len(shapes) <= space.refine_shapes
    # where the optimum chose what an enumerated policy does, the duplicate is pruned, and counted
    by_shape = {}
    for r in result.ranked:
        by_shape.setdefault(replace(r.candidate, memory=()), []).append(r)
    for r in optimised:
        assert all((o.estimate.iteration_s, o.estimate.peak_bytes) != (r.estimate.iteration_s, r.estimate.peak_bytes)
                   for o in by_shape[replace(r.candidate, memory=())] if o is not r)
    # each is the best shapes' own optimum: the plan it writes compiles to the policy the search priced
    for ranked in optimised[:3]:
        resolved = resolve_plan(result.plan_of(ranked.candidate))
        assert resolved.plan.memory.policy == dict(ranked.candidate.memory)["policy"]
        engine = simulate(result.plan_of(ranked.candidate))
        assert not engine.oom and ranked.estimate.iteration_s == pytest.approx(engine.iteration_s, rel=0.1)


def test_lossy_gradient_sync_is_searched_only_when_asked(result) -> None:
    from sim.gradient_sync import GRADIENT_SYNC

    lossy = {name for name, method in GRADIENT_SYNC.items() if not method.exact}
    assert {"fp16", "topk", "s2", "powersgd"} <= lossy and "allreduce" not in lossy
    assert not {dict(r.candidate.gradient_sync)["method"] for r in result.ranked} & lossy
    assert all("lossy" in result.not_enumerated[f"gradient_sync.method {name}"] for name in lossy)
    asked = search(replace(SPACE, dtype="fp32", lossy_gradient_sync=True, tp_overlaps=(0,)), top_k=0, sample=0)
    assert "fp16" in {dict(r.candidate.gradient_sync)["method"] for r in asked.ranked}  # fp32 gradients: it applies


def test_memory_pruning_uses_the_estimate() -> None:
    # gpt-175b cannot fit on one 8-GPU node in any plan: everything that passes the checks is pruned
    # for memory, and nothing is simulated.
    tight = search(SearchSpace("gpt-175b", "dgx-a100-8", global_batch=8, max_micro_batch=1, fractions=(),
                               tp_overlaps=(0,), bucket_mbs=(25.0,), max_chunks=2), top_k=3, sample=0)
    assert tight.pruned[DOES_NOT_FIT] > 0 and not tight.ranked and tight.best is None


def test_the_written_best_plan_loads_and_simulates_to_the_reported_time(result, tmp_path) -> None:
    from analysis.search_report import write_search

    paths = write_search(result, tmp_path)
    best = result.best
    assert best is not None and best.simulated is not None
    plan = Plan.load(paths["best"])
    again = simulate(plan)
    assert again.iteration_s == pytest.approx(best.simulated.iteration_s, rel=1e-9)
    import pandas as pd

    table = pd.read_parquet(paths["ranked"])
    assert len(table) == len(result.ranked) and table["simulated"].sum() == len(result.simulated)


def test_every_registered_schedule_is_enumerated() -> None:
    names = {name for name, _ in schedule_chunks(SPACE)}
    assert names == set(SCHEDULES)


def test_a_newly_registered_schedule_and_memory_policy_are_searched() -> None:
    from typing import Literal

    class KeepAll(NoRecompute):
        """Test-only: keep everything (a renamed none)."""

        policy: Literal["test-keep"] = "test-keep"  # type: ignore[assignment]

    info = replace(SCHEDULES["1f1b"], name="test-1f1b")
    register_schedule(info)
    register_memory_policy("test-keep", KeepAll, MEMORY_POLICIES["none"].build)
    try:
        found = search(SearchSpace("gpt2-small", "dgx-a100-8", global_batch=8, max_micro_batch=1, fractions=(),
                                   tp_overlaps=(0,), bucket_mbs=(25.0,), max_chunks=2), top_k=0, sample=0)
        schedules = {r.candidate.schedule for r in found.ranked}
        policies = {dict(r.candidate.memory)["policy"] for r in found.ranked}
        assert "test-1f1b" in schedules and "test-keep" in policies
        one = next(r for r in found.ranked if r.candidate.schedule == "test-1f1b")
        twin = next(r for r in found.ranked if r.candidate == replace(one.candidate, schedule="1f1b"))
        assert one.estimate.iteration_s == twin.estimate.iteration_s
    finally:
        del SCHEDULES["test-1f1b"]
        del MEMORY_POLICIES["test-keep"]


def test_the_estimate_ranks_plans_as_the_engine_does(result) -> None:
    """On a random sample of surviving plans. The estimate and the engine price compute with the same
    cost model and communication with the same collective formulas; they differ only in how a
    schedule's ramp, point-to-point hops and gradient-sync overlap are approximated (a few percent
    of an iteration), while random plans differ by far more. Spearman >= 0.9 on 24 plans is ~4.5
    standard deviations (1/sqrt(23)) above no association, and below the issue's 0.95 goal, which the
    search reports for the real spaces; the median time error must stay within 10%."""
    agreement = result.agreement
    assert agreement is not None and agreement.sample_size == 24
    sample = result.sampled
    rho = spearman([r.estimate.iteration_s for r in sample], [r.simulated.iteration_s for r in sample])
    assert rho == agreement.spearman_sample
    assert rho >= 0.9
    assert agreement.time_error_median <= 0.10


def test_spearman_handles_ties_and_order() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2, 3], [5, 5, 6, 7]) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        spearman([1, 2], [1])


def test_a_cpu_cluster_without_profile_is_refused_with_the_simulators_message() -> None:
    with pytest.raises(ConfigError, match="profile"):
        search(SearchSpace("gpt-tiny", "local-cpu-2", dtype="fp32"), top_k=1, sample=0)


def test_blocking_p2p_is_searched_when_asked_on_pipelined_plans_only(result) -> None:
    assert {r.candidate.p2p for r in result.ranked} == {"async"}  # not asked: as before
    asked = search(replace(SPACE, tp_overlaps=(0,), p2p=("async", "blocking")), top_k=4, sample=0)
    plain = search(replace(SPACE, tp_overlaps=(0,)), top_k=0, sample=0)
    assert asked.considered == sum(asked.pruned.values()) + len(asked.ranked)
    blocking = [r for r in asked.ranked if r.candidate.p2p == "blocking"]
    assert blocking and all(r.candidate.pp > 1 for r in blocking)
    # Every pipelined survivor comes in both modes, each with its own estimate; one-stage plans once.
    pipelined = [r for r in plain.ranked if r.candidate.pp > 1]
    assert len(asked.ranked) == len(plain.ranked) + len(pipelined)
    # a blocking plan waits for its sends (sim.estimate_pipeline.weighted_run): never below its async twin,
    # above it where a send is on the critical path (not always: GPipe pp 2 hides each behind the ramp)
    estimated = {r.candidate: r.estimate.iteration_s for r in asked.ranked}
    moves = [estimated[r.candidate] - estimated[replace(r.candidate, p2p="async")] for r in blocking]
    assert min(moves) >= 0 and sum(move > 0 for move in moves) > len(moves) / 2
    plan = asked.plan_of(blocking[0].candidate)
    assert plan.schedule.p2p == "blocking" and "p2p=blocking" in blocking[0].candidate.describe()
    # ranked.parquet says which mode each row is: no two rows with the same settings
    frame = ranked_frame(asked)
    assert list(frame["p2p"]) == [r.candidate.p2p for r in asked.ranked]
    assert not frame.loc[:, "dp":"p2p"].duplicated().any()
    compile_plan(plan)


def test_the_search_can_be_held_to_named_gradient_sync_methods() -> None:
    base = dict(dtype="fp32", global_batch=16, max_micro_batch=2, fractions=(), tp_overlaps=(0,), bucket_mbs=(25.0,),
                max_chunks=1, refine_shapes=0)
    everything = search(SearchSpace("gpt2-medium", "dgx-a100-8", **base), top_k=0, sample=0)
    assert {"allreduce", "distopt"} <= {dict(r.candidate.gradient_sync)["method"] for r in everything.ranked}
    # a lossy method named is searched without --lossy-gradient-sync: naming it is the consent
    held = search(SearchSpace("gpt2-medium", "dgx-a100-8", gradient_syncs=("distopt", "fp16"), **base),
                  top_k=0, sample=0)
    assert {dict(r.candidate.gradient_sync)["method"] for r in held.ranked} == {"distopt", "fp16"}
    with pytest.raises(ConfigError, match="gradient_syncs"):
        search(SearchSpace("gpt2-medium", "dgx-a100-8", gradient_syncs=("allreduse",), **base), top_k=0, sample=0)
