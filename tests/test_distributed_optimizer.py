"""Megatron-LM's distributed optimizer (``gradient_sync: {method: distopt}``, sim.gradient_sync_distopt):
its bytes per parameter are Megatron's table, the ledger, the fast estimate and the memory planners
hold the same bytes at the step (sim.model_state.step_peak_bytes), the engine and the estimate price
the reduce-scatter, the step over 1/d and the parameter all-gather alike, and the search enumerates it."""

from __future__ import annotations

import pytest

from sim.analytic_costs import AnalyticCosts
from sim.cluster import load_cluster
from sim.compile import compile_plan, resolve_plan
from sim.estimate import Estimator
from sim.gradient_sync_distopt import PARAM_GATHER_TAG
from sim.memory_optimal import layer_choice_model
from sim.plan import Plan
from sim.program import Kind
from sim.simulate import simulate
from sim.workloads import transformer_config, transformer_layers
from traces.errors import ConfigError

# Bytes per parameter with Megatron-LM's distributed optimizer over d replicas (NVIDIA/Megatron-LM 23.04,
# 2360d73, docs/distrib_optimizer.md l.13-14): fp16 parameters and gradients 4 + 16/d, 16-bit
# parameters with fp32 gradients (bf16) 6 + 12/d.
MEGATRON = {"fp16": lambda d: 4 + 16 / d, "bf16": lambda d: 6 + 12 / d}


def plan(dtype: str, method: str, dp: int, policy: str = "full") -> Plan:
    return Plan.from_dict({
        "name": f"distopt-{dtype}-{method}-dp{dp}", "workload": "gpt2-medium", "cluster": {"preset": "dgx-a100-8"},
        "dtype": dtype, "parallelism": {"dp": dp, "tp": 4 // dp, "pp": 2},
        "schedule": {"name": "1f1b", "micro_batch": 1, "microbatches": 4},
        "memory": {"policy": policy}, "gradient_sync": {"method": method}})


def megatron_costs(p: Plan) -> AnalyticCosts:
    cluster = load_cluster(p.cluster)
    return AnalyticCosts(transformer_layers(transformer_config(p.workload)), cluster.device, p.dtype, cluster,
                         optimizer="megatron-fp16")


def estimate(p: Plan, costs: AnalyticCosts):  # noqa: ANN201 - sim.estimate.Estimate
    r = resolve_plan(p, costs)
    return Estimator(costs, r.comm, p.dtype).estimate(
        schedule="1f1b", dp=p.dp, tp=p.tp, pp=p.pp, chunks=1, micro_batch=p.micro_batch,
        microbatches=p.microbatches, stage_layers=r.stage_layers, policy=r.policy, tp_overlap=0,
        sync_method=p.gradient_sync.method, bucket_mb=p.gradient_sync.bucket_mb, sync=p.gradient_sync)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("dp", [2, 4])
def test_a_rank_holds_megatrons_bytes_per_parameter_at_the_step(dtype: str, dp: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """What the engine's ledger holds while each pipeline rank steps is Megatron's bytes per parameter,
    and the rule the fast estimate and the memory planners count (step_peak_bytes) says the same."""
    from sim.engine import Engine, MemoryLedger

    at_step: dict[int, int] = {}
    change = MemoryLedger.change_buffers

    def recording(ledger: MemoryLedger, delta: int, now: float, label: str) -> None:
        change(ledger, delta, now, label)
        if label.startswith("OPTIMIZER_STEP"):  # the step's copies on (the first call), then off
            at_step.setdefault(id(ledger), ledger.in_use)

    monkeypatch.setattr(MemoryLedger, "change_buffers", recording)
    p = plan(dtype, "distopt", dp)
    costs = megatron_costs(p)
    compiled = compile_plan(p, costs)
    engine = Engine(compiled.program, costs, compiled.resolved.comm, compiled.resolved.policy, p.micro_batch)
    engine.run()
    r = compiled.resolved
    milp = layer_choice_model(p.replace(memory={"policy": "optimal"}), r.stage_layers, costs, r.comm.capacity_bytes)
    for k in (0, 1):  # pipeline ranks 0 and 1 (dp x tp = 4 ranks a stage)
        ledger = engine.ledgers[k * 4]
        n = ledger.static["parameters"] / 2
        assert at_step[id(ledger)] == pytest.approx(MEGATRON[dtype](dp) * n, abs=2)
        assert milp.step[k] == at_step[id(ledger)]


def test_engine_and_estimate_price_the_reduce_scatter_the_shard_step_and_the_all_gather() -> None:
    p = plan("bf16", "distopt", 4, policy="none")
    costs = megatron_costs(p)
    program = compile_plan(p, costs).program
    rank0 = program.ranks[0].instructions
    buckets = [i for i in rank0 if i.kind is Kind.ALLREDUCE and not i.tag.startswith(PARAM_GATHER_TAG)]
    gather = rank0[-1]
    assert {k for i in buckets for k, _ in i.phases} == {"reducescatter"}
    assert gather.tag.startswith(PARAM_GATHER_TAG) and rank0[gather.deps[0]].kind is Kind.OPTIMIZER_STEP
    params = sum(costs.layer_costs(layer, 1, 1).param_bytes for s in program.ranks[0].stages
                 for layer in program.stage_layers[s])
    assert sum(b for _, b in gather.phases) == params and {k for k, _ in gather.phases} == {"allgather"}
    # bf16 reduce-scatters in fp32 (Megatron's fp32 gradient buffer): twice the parameters' bytes
    assert sum(b for i in buckets for _, b in i.phases) == 2 * params
    ran = simulate(p, costs=costs)
    est = estimate(p, costs)
    assert est.iteration_s == pytest.approx(ran.iteration_s, rel=1e-9)
    dense = estimate(plan("bf16", "allreduce", 4, policy="none"), costs)
    assert est.optimizer_s < dense.optimizer_s  # a step over 1/4 of the parameters, then the all-gather
    assert est.optimizer_s > costs.optimizer_step_s(params // 4)


def test_the_search_enumerates_it_and_its_bound_holds() -> None:
    from sim.search import SearchSpace, sync_variants

    variants, _ = sync_variants(SearchSpace(workload="gpt2-medium", cluster="dgx-a100-8", global_batch=8))
    assert any(v["method"] == "distopt" for v in variants)
    p = plan("fp16", "distopt", 4, policy="none")
    costs = megatron_costs(p)
    r = resolve_plan(p, costs)
    e = Estimator(costs, r.comm, p.dtype)
    asked = dict(schedule="1f1b", dp=4, tp=1, pp=2, chunks=1, micro_batch=1, microbatches=4,
                 stage_layers=r.stage_layers, policy=r.policy, tp_overlap=0, sync_method="distopt", bucket_mb=25.0,
                 sync=p.gradient_sync)
    full = e.estimate(**asked).iteration_s
    assert e.screen(**asked).lower_bound_s <= full
    assert e.group_bound(2, 1, "loop", 1, 4, r.stage_layers, 1, 1 / 4) <= full


def test_flat_copies_are_refused() -> None:
    with pytest.raises(ConfigError) as error:
        compile_plan(plan("fp16", "distopt", 2).replace(gradient_sync={"flat_copies": True}))
    assert error.value.field == "gradient_sync.flat_copies"


@pytest.mark.parametrize("policy", ["optimal", "delta"])
def test_the_memory_planners_plan_with_the_shard(policy: str) -> None:
    """A budget just above what a rank holds at the step with its shard (fp16, dp 2: 12 B per parameter)
    and below the replicated optimizer's step (20 B): the planners refuse the dense plan (its step does
    not fit), plan the distributed one with the room its shard leaves, and the engine keeps it within
    the budget."""
    from dataclasses import replace

    from sim.memory_optimal import RECOMPUTE

    dense, sharded = plan("fp16", "allreduce", 2, policy), plan("fp16", "distopt", 2, policy)
    costs = megatron_costs(dense)
    r = resolve_plan(sharded.replace(memory={"policy": "full"}), costs)
    milp = layer_choice_model(sharded.replace(memory={"policy": "optimal"}), r.stage_layers, costs,
                              r.comm.capacity_bytes)
    pipeline = max(replace(milp, step=()).peaks((RECOMPUTE,) * len(milp.layers)))  # everything recomputed
    budget = max(max(milp.step), pipeline) * 1.05 / 2**30
    with pytest.raises(ConfigError, match="optimizer step"):
        resolve_plan(dense.replace(memory={"policy": policy, "budget_gb": budget}), costs)
    ran = simulate(sharded.replace(memory={"policy": policy, "budget_gb": budget}), costs=costs)
    assert max(m.peak_bytes for m in ran.memory.values()) <= budget * 2**30
    # ... using the room the shard leaves: it keeps activations (everything recomputed takes 19% longer
    # here; a planner counting the whole optimizer state sees no room and recomputes everything)
    everything = simulate(sharded.replace(memory={"policy": "full"}), costs=costs).iteration_s
    assert ran.iteration_s < 0.95 * everything
