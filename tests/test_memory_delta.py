"""DELTA (``sim.delta``, ``sim.delta_lowering``): the filter and the director on hand-made cases,
the simulated ledger within the budget at paper scale, and real 2-rank pp2 runs that train exactly
like one process while executing the very decisions the simulator made."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.compile import compile_plan
from sim.delta import DeltaSettings, LayerFacts, Step, decide
from sim.plan import Plan
from sim.simulate import simulate
from traces.errors import ConfigError

# Two layers per stage: layer 0 saves 100 bytes, layer 1 saves 300; each forward takes 1 s.
FACTS = {0: LayerFacts(saved=100, checkpoint=10, forward_s=1.0, backward_s=2.0, recompute_s=1.0),
         1: LayerFacts(saved=300, checkpoint=10, forward_s=1.0, backward_s=2.0, recompute_s=1.0)}
TWO_FORWARDS = [Step("F", 0, 0), Step("F", 0, 1)]


def settings(budget: int, bandwidth: float, tiny: int = 0, director: str = "cost") -> DeltaSettings:
    return DeltaSettings(budget_bytes=budget, tiny_bytes=tiny, host_latency_s=0.0, host_bandwidth_Bps=bandwidth,
                         director=director)


def test_filter_picks_largest_size_times_staleness() -> None:
    """After the second forward (t = 4 s) the rank holds 800 bytes over a 700 budget. Size x
    staleness: mb0 layer 1 = 300 x 4, mb0 layer 0 = 100 x 4, mb1 layer 1 = 300 x 2: mb0's layer 1
    goes, and one release is enough."""
    out = decide(TWO_FORWARDS, [(0, 1)], FACTS, 0, settings(700, bandwidth=1e3))
    assert out.swapped == {(0, 0): (1,)} and out.dropped == {}
    assert out.peak_bytes == 800 and out.short_bytes == 0


def test_director_swaps_when_cheaper_than_recompute_else_drops() -> None:
    # out and back: 2 x 300 B / 1000 B/s = 0.6 s < 1 s of recompute: swap; at 100 B/s, 6 s: drop.
    assert decide(TWO_FORWARDS, [(0, 1)], FACTS, 0, settings(700, bandwidth=1e3)).swapped == {(0, 0): (1,)}
    slow = decide(TWO_FORWARDS, [(0, 1)], FACTS, 0, settings(700, bandwidth=1e2))
    assert slow.dropped == {(0, 0): (1,)} and slow.swapped == {}
    forced = decide(TWO_FORWARDS, [(0, 1)], FACTS, 0, settings(700, bandwidth=1e3, director="recompute"))
    assert forced.dropped == {(0, 0): (1,)}


def test_tiny_tensors_are_never_released() -> None:
    """With both layers under a 301-byte tiny limit nothing may go: the rank stays 300 bytes over
    the budget (reported, not hidden). With a 200-byte limit the 300-byte layer is still a victim."""
    out = decide(TWO_FORWARDS, [(0, 1)], FACTS, 0, settings(500, bandwidth=1e3, tiny=301))
    assert out.swapped == {} and out.dropped == {}
    assert out.short_bytes == 300
    small = decide(TWO_FORWARDS, [(0, 1)], FACTS, 0, settings(700, bandwidth=1e3, tiny=200))
    assert small.swapped == {(0, 0): (1,)}


def test_backward_return_can_push_out_other_micro_batches() -> None:
    """F0 F1 (mb0's layer 1 dropped), then B0 recomputes it: back over budget, so mb1's tensors go
    (mb0's, needed now, are not candidates)."""
    steps = [*TWO_FORWARDS, Step("B", 0, 0), Step("B", 0, 1)]
    out = decide(steps, [(0, 1)], FACTS, 0, settings(700, bandwidth=1e2))
    assert out.dropped[(0, 0)] == (1,)
    assert (0, 1) in out.dropped


def gpt_plan(budget_gb: float, **memory: object) -> Plan:
    return Plan.from_dict({"name": "gpt-8.3b-delta", "workload": "gpt-8.3b", "cluster": "a100-64", "dtype": "fp16",
                           "parallelism": {"dp": 2, "tp": 8, "pp": 4},
                           "schedule": {"name": "1f1b", "micro_batch": 16, "microbatches": 16},
                           "memory": {"policy": "delta", "budget_gb": budget_gb, **memory}})


@pytest.mark.parametrize("budget_gb", [30.0, 20.0])
def test_simulated_peak_within_budget_and_lowering_is_deterministic(budget_gb: float) -> None:
    result = simulate(gpt_plan(budget_gb))
    assert max(m.peak_bytes for m in result.memory.values()) <= budget_gb * 2**30
    kinds = set(result.table["kind"])
    assert "RECOMPUTE" in kinds  # a PCIe Gen4 host link is slower than recomputing a block
    first = compile_plan(gpt_plan(budget_gb)).program
    again = compile_plan(gpt_plan(budget_gb)).program
    assert first.ranks[0].instructions == again.ranks[0].instructions


def test_delta_refuses_merak_schedules_and_fixed_swaps() -> None:
    merak = Plan.from_dict({**gpt_plan(30).model_dump(), "schedule": {"name": "merak-shifted", "micro_batch": 16,
                                                                        "microbatches": 16}})
    with pytest.raises(ConfigError, match="fixes its own recomputation"):
        compile_plan(merak)
    with pytest.raises(ConfigError, match="drop memory.swap"):
        compile_plan(gpt_plan(30, swap=[0.5] * 4))


# ---------------------------------------------------------------------------------------------
# Real runs: gloo ranks execute the decisions; parameters equal one process's.


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "director"), [("gpipe", "cost"), ("gpipe", "recompute"), ("zb-h1", "recompute")])
def test_pp2_delta_run_equals_one_process(schedule: str, director: str, gpt_tiny_profile: Path,
                                          tmp_path: Path) -> None:
    """pp 2, four micro-batches of one, a budget halfway between the static bytes and the
    keep-everything peak of the fuller rank (from the engine with no policy, on the same profile).
    ZB-H1 splits the backward: per-micro-batch recomputed runs feed BWD_I / BWD_W's segments."""
    from tests.test_runtime import check_against_reference, plan_of
    from traces.runrecord import read_run_record

    base = plan_of(pp=2, schedule=schedule, microbatches=4, micro_batch=1).model_copy(
        update={"name": f"gpt-tiny-pp2-{schedule}-delta-{director}", "profile": str(gpt_tiny_profile)})
    keep = simulate(base, full=True)
    budget = max((sum(v for k, v in m.breakdown.items() if k in ("parameters", "gradients", "optimizer"))
                  + m.peak_bytes) // 2 for m in keep.memory.values())
    budget_gb = budget / 2**30
    plan = base.model_copy(update={"memory": Plan.from_dict({"workload": "gpt-tiny", "memory": {
        "policy": "delta", "budget_gb": budget_gb, "tiny_mb": 0.0, "director": director}}).memory})
    simulated = simulate(plan, full=True)
    # The ledger stays within the budget, or where no release can reach it (ZB-H1's last stage holds
    # two micro-batches between I and W), within what recomputing everything leaves; 1% slack for the
    # few kB of embedding and loss tensors that no layer choice moves.
    floor = simulate(base.model_copy(update={"memory": Plan.from_dict({"workload": "gpt-tiny", "memory": {
        "policy": "full"}}).memory}), full=True)
    for rank, memory in simulated.memory.items():
        assert memory.peak_bytes <= max(budget, floor.memory[rank].peak_bytes) * 1.01, f"rank {rank}"
    program = compile_plan(plan, symmetric=False).program
    lowered = {i.kind.value for rp in program.ranks.values() for i in rp.instructions}
    assert ("SWAP_OUT" if director == "cost" else "RECOMPUTE") in lowered
    check_against_reference(plan, tmp_path)
    table = read_run_record(tmp_path / plan.name / "record").instructions
    assert set(table["kind"]) >= lowered - {"ALLREDUCE"}
    swaps = table[table["kind"] == "SWAP_OUT"]
    assert (swaps["bytes"] > 0).all()


@pytest.mark.slow
@pytest.mark.parametrize(("workload", "pp", "schedule"), [("resnet-tiny", 2, "gpipe"), ("gpt-tiny", 1, "1f1b")])
def test_delta_recompute_without_profile_equals_one_process(workload: str, pp: int, schedule: str,
                                                            tmp_path: Path) -> None:
    """A ResNet (BatchNorm recomputed in train mode) over two pipeline ranks, and a GPT in a single
    process, with the runtime's exact structural costs (zero times: the director always drops);
    the budget is halfway between the static bytes and the no-policy peak of the fuller rank."""
    from exec.contract import compile_for_run
    from tests.test_runtime import check_against_reference, plan_of

    base = plan_of(workload=workload, pp=pp, schedule=schedule, microbatches=4, micro_batch=2).model_copy(
        update={"name": f"{workload}-pp{pp}-delta"})
    from sim.engine import Engine

    # The engine directly: with zero times a whole simulation (samples per second) is undefined.
    run = compile_for_run(base)
    engine = Engine(run.program, run.resolved.costs, run.resolved.comm, run.resolved.policy, base.micro_batch)
    engine.run()
    budget = max((sum(ledger.static.values()) + ledger.peak) // 2 for ledger in engine.ledgers.values())
    plan = base.model_copy(update={"memory": Plan.from_dict({"workload": workload, "memory": {
        "policy": "delta", "budget_gb": budget / 2**30, "tiny_mb": 0.0}}).memory})
    program = compile_for_run(plan).program
    assert any(i.kind.value == "RECOMPUTE" for rp in program.ranks.values() for i in rp.instructions)
    check_against_reference(plan, tmp_path)


def assert_estimate_agrees_with_engine(plan: Plan) -> None:
    """The plan search's estimate of a GPT-8.3B DELTA plan (dp2 tp8 pp4, 1F1B, 16 x 16) against the
    engine: peak per rank within 3% of the ledger, iteration within 10%."""
    from sim.compile import resolve_plan
    from sim.estimate import Estimator

    resolved = resolve_plan(plan)
    estimate = Estimator(resolved.costs, resolved.comm, plan.dtype).estimate(
        schedule="1f1b", dp=2, tp=8, pp=4, chunks=1, micro_batch=16, microbatches=16,
        stage_layers=resolved.stage_layers, policy=resolved.policy, tp_overlap=0, sync_method="allreduce",
        bucket_mb=25.0)
    engine = simulate(plan)
    peaks = [m.peak_bytes for _, m in sorted(engine.memory.items())]
    for predicted, simulated in zip(estimate.peak_bytes, peaks, strict=True):
        assert predicted == pytest.approx(simulated, rel=0.03)
    assert estimate.iteration_s == pytest.approx(engine.iteration_s, rel=0.10)


def test_fast_estimate_replays_delta() -> None:
    """The plan search's estimate prices DELTA by the same replay (it averages the per-micro-batch
    recomputes; measured 7% fast at this budget)."""
    assert_estimate_agrees_with_engine(gpt_plan(24.0))


def _bf16_plan(reduce_dtype: str) -> Plan:
    """GPT-2 medium in bf16 on one DGX A100 (dp 2, tp 2, pp 2, 8 micro-batches of 4) under a 3 GiB DELTA
    budget, where the held gradients decide releases: ``reduce_dtype`` auto keeps Megatron's fp32
    main-grad buffer (2 B per parameter over the bf16 gradients, sim.model_state), param does not."""
    return Plan.from_dict({
        "name": "delta-bf16", "workload": "gpt2-medium", "cluster": {"preset": "dgx-a100-8"}, "dtype": "bf16",
        "parallelism": {"dp": 2, "tp": 2, "pp": 2}, "schedule": {"name": "1f1b", "micro_batch": 4, "microbatches": 8},
        "gradient_sync": {"method": "allreduce", "reduce_dtype": reduce_dtype},
        "memory": {"policy": "delta", "budget_gb": 3.0}})


def _estimate(estimator, plan: Plan, resolved):  # noqa: ANN001, ANN202 - sim.estimate types
    return estimator.estimate(schedule="1f1b", dp=2, tp=2, pp=2, chunks=1, micro_batch=4, microbatches=8,
                              stage_layers=resolved.stage_layers, policy=resolved.policy, tp_overlap=0,
                              sync_method="allreduce", bucket_mb=25.0, sync=plan.gradient_sync)


@pytest.mark.parametrize("reduce_dtype", ["auto", "param"])
def test_the_estimates_delta_replay_holds_the_gradients_as_the_ledger_does(reduce_dtype: str) -> None:
    """The estimate replays DELTA with the bytes the lowering decides with (the held gradients' fp32
    extra and one bucket: ``gradient_extra_bytes``), so it makes the lowering's decisions: per rank the
    same recompute seconds as the Program's RECOMPUTE instructions. Without them (before session 7's
    9d) it released less (3.84 ms recomputed per micro-batch on rank 0 against the lowering's 6.40 under
    auto) and put a plan the engine runs at 2.90 GiB at 3.23 GiB: over budget, pruned by the search."""
    from sim.compile import resolve_plan
    from sim.delta_lowering import delta_estimate
    from sim.estimate import Estimator
    from sim.program import Kind

    plan = _bf16_plan(reduce_dtype)
    resolved = resolve_plan(plan)

    def cost(layer: int):  # noqa: ANN202 - LayerCosts
        return resolved.costs.layer_costs(layer, plan.micro_batch, plan.tp)

    replayed = delta_estimate("1f1b", 2, 8, 1, resolved.stage_layers, cost, resolved.policy.delta)
    program = compile_plan(plan).program
    for k, (recompute_s, _) in enumerate(replayed):
        lowered = program.ranks[program.rank_of(0, k, 0)].instructions
        written = sum(cost(layer).recompute_s for i in lowered if i.kind is Kind.RECOMPUTE for layer in i.layers)
        assert recompute_s == pytest.approx(written / 8, rel=1e-9, abs=1e-12), k
    assert replayed[0][0] > 0  # the case: DELTA releases on rank 0

    estimate = _estimate(Estimator(resolved.costs, resolved.comm, plan.dtype), plan, resolved)
    engine = simulate(plan)
    peaks = [m.peak_bytes for _, m in sorted(engine.memory.items())][:2]  # dp 0, tp 0: pipeline ranks 0, 1
    assert max(peaks) <= 3 * 2**30
    assert estimate.fits
    for predicted, simulated in zip(estimate.peak_bytes, peaks, strict=True):
        # the estimate holds one bucket beside the activations' peak (conservative, as the MILP)
        assert predicted == pytest.approx(simulated, rel=0.02)


def test_one_estimator_keeps_delta_plans_of_different_gradient_syncs_apart() -> None:
    """The search prices every candidate with one Estimator, which caches a pipeline's figures by its
    memory policy. Two DELTA candidates that differ only in ``gradient_sync.reduce_dtype`` hold different
    gradients, so DELTA releases differently (rank 0 recomputes 6.40 vs 4.48 ms per micro-batch): each
    must get its own figures, as a fresh Estimator gives it, whichever came first."""
    from sim.compile import resolve_plan
    from sim.estimate import Estimator

    plans = [_bf16_plan("param"), _bf16_plan("auto")]
    resolved = [resolve_plan(p) for p in plans]
    assert resolved[0].policy != resolved[1].policy  # the cache key tells them apart
    shared = Estimator(resolved[0].costs, resolved[0].comm, "bf16")
    together = [_estimate(shared, p, r) for p, r in zip(plans, resolved, strict=True)]
    alone = [_estimate(Estimator(r.costs, r.comm, "bf16"), p, r) for p, r in zip(plans, resolved, strict=True)]
    assert together == alone
    assert together[0].recompute_s != together[1].recompute_s
