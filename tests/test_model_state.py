"""Model-state bytes as Megatron-LM holds them (sim.model_state): 16-bit gradients accumulate in an fp32
main-grad buffer where they all-reduce in fp32 (bf16 by default, ``reduce_dtype``), and the memory
ledger, the fast estimate and the MILP planner all count that buffer alike."""

from __future__ import annotations

import pytest

from sim.compile import compile_plan, resolve_plan
from sim.estimate import Estimator
from sim.gradient_sync import DenseAllReduce, vector_wire_bytes
from sim.memory_optimal import layer_choice_model
from sim.model_state import gradient_buffer_scale
from sim.plan import Plan, migrate_flat
from sim.simulate import simulate
from tests.script_module import load_script

# (plan dtype, reduce_dtype) -> bytes per parameter of the held gradient buffer; Megatron-LM v2.5 and
# 739cb43 megatron/model/distributed.py lines 124-130 (fp32 when accumulate_allreduce_grads_in_fp32,
# which megatron/arguments.py forces for bf16), torch DDP for ``param``.
HELD = [("bf16", "auto", 4), ("fp16", "auto", 2), ("fp32", "auto", 4),
        ("bf16", "param", 2), ("fp16", "fp32", 4), ("fp32", "fp32", 4)]


def plan(dtype: str, choice: str) -> Plan:
    return Plan.from_dict(migrate_flat({
        "name": "t", "workload": "gpt2-medium", "cluster": {"preset": "dgx-a100-8"}, "dtype": dtype,
        "micro_batch": 2, "microbatches": 4, "schedule": "1f1b", "tp": 2, "pp": 2, "dp": 2,
    })).replace(gradient_sync={"reduce_dtype": choice})


def bucket_growth(p: Plan, base: Plan) -> int:
    """How much larger the one 25 MiB bucket in flight is under ``p``'s reduce dtype than ``base``'s."""
    return (vector_wire_bytes(p.gradient_sync, 25 * 2**20, p.dp, p.dtype)
            - vector_wire_bytes(base.gradient_sync, 25 * 2**20, base.dp, base.dtype))


@pytest.mark.parametrize(("dtype", "choice", "held"), HELD)
def test_the_gradient_buffer_has_the_all_reduce_dtype(dtype: str, choice: str, held: int) -> None:
    element = {"fp32": 4, "fp16": 2, "bf16": 2}[dtype]
    assert gradient_buffer_scale(DenseAllReduce(reduce_dtype=choice), dtype) * element == held


@pytest.mark.parametrize(("dtype", "choice", "held"), HELD)
def test_ledger_and_estimate_hold_the_main_grad_buffer(dtype: str, choice: str, held: int) -> None:
    p = plan(dtype, choice)
    result = simulate(p)
    resolved = resolve_plan(p)
    rank0 = resolved.stage_layers[0]
    grads = sum(resolved.costs.layer_costs(layer, p.micro_batch, p.tp).grad_bytes for layer in rank0)
    element = {"fp32": 4, "fp16": 2, "bf16": 2}[dtype]
    breakdown = result.memory[0].breakdown
    assert breakdown["gradients"] == grads * held // element
    if dtype != "fp32":  # Megatron's mixed precision: 16-bit weights, fp32 master and Adam moments
        params = breakdown["parameters"] // 2
        assert breakdown["parameters"] + breakdown["gradients"] + breakdown["optimizer"] == (2 + held + 12) * params
    # The fast estimate's peak moves by exactly the ledger's extra gradient bytes ...
    base = plan(dtype, "param")
    estimator = Estimator(resolved.costs, resolved.comm, dtype)

    def peak(q: Plan) -> int:
        return estimator.estimate(schedule="1f1b", dp=2, tp=2, pp=2, chunks=1, micro_batch=2, microbatches=4,
                                  stage_layers=resolved.stage_layers, policy=resolved.policy, tp_overlap=0,
                                  sync_method="allreduce", bucket_mb=q.gradient_sync.bucket_mb,
                                  sync=q.gradient_sync).peak_bytes[0]

    # ... plus the bucket it has in flight, which is in the all-reduce's dtype too
    assert peak(p) - peak(base) == breakdown["gradients"] - grads + bucket_growth(p, base)


def test_the_milp_planner_counts_the_same_buffer() -> None:
    fp32, param = (plan("bf16", c).replace(memory={"policy": "optimal"}) for c in ("auto", "param"))
    models = []
    for p in (fp32, param):
        resolved = resolve_plan(p)
        models.append(layer_choice_model(p, resolved.stage_layers, resolved.costs, resolved.comm.capacity_bytes))
    grads = sum(resolve_plan(param).costs.layer_costs(layer, 2, 2).grad_bytes
                for layer in resolve_plan(param).stage_layers[0])
    # bf16: 4 bytes per gradient instead of 2, and the bucket in flight in fp32
    assert models[0].static[0] - models[1].static[0] == grads + bucket_growth(fp32, param)
    compile_plan(fp32)  # and the plan still lowers


def test_megatrons_fp16_optimizer_holds_fp32_gradient_copies_during_its_step() -> None:
    """SC'21 Table 1's 1.7B row (one stage, Megatron-LM v2.5's fp16 optimizer): the rank's peak is its
    step, 20 B per parameter (fp16 weights and gradients, fp32 gradient copies, masters, Adam
    moments; Megatron's docs/distrib_optimizer.md), and the fast estimate says the same."""

    sc21 = load_script("benchmarks/megatron_at_scale.py")
    row = sc21.load_table().iloc[0].to_dict()
    p = sc21.plan_for(row, "interleaved-1f1b", 1, True)
    engine, costs, compiled, _ = sc21.run_plan(p, sc21.curve_of("default"))
    ledger = engine.ledgers[0]
    n = ledger.static["parameters"] // 2
    assert ledger.peak == 20 * n
    assert ledger.peak_breakdown["comm_buffers"] == 4 * n and ledger.peak_breakdown["activations"] == 0
    r = compiled.resolved
    estimate = Estimator(costs, r.comm, "fp16").estimate(
        schedule=p.schedule.name, dp=p.dp, tp=p.tp, pp=p.pp, chunks=p.chunks, micro_batch=p.micro_batch,
        microbatches=p.microbatches, stage_layers=r.stage_layers, policy=r.policy, tp_overlap=0,
        sync_method="allreduce", bucket_mb=25.0, sync=p.gradient_sync.model_copy(update={"bucket_mb": 25.0}))
    # (25 MiB buckets: the estimate counts one bucket_mb bucket in flight, and the plan's one bucket of
    # 1e6 MiB stands for "everything at once", which the estimate does not clip to the rank's gradients)
    assert estimate.peak_bytes[0] == 20 * n


def _step_case(policy: str, budget_gb: float | None) -> Plan:
    """GPT-2 medium on one DGX A100 (dp 2, tp 2, pp 2, 4 micro-batches of 1): its pipeline's peak is
    below its optimizer step's under Megatron's fp16 optimizer (20 B per parameter at the step)."""
    return Plan.from_dict({
        "name": "step", "workload": "gpt2-medium", "cluster": {"preset": "dgx-a100-8"}, "dtype": "fp16",
        "parallelism": {"dp": 2, "tp": 2, "pp": 2}, "schedule": {"name": "1f1b", "micro_batch": 1, "microbatches": 4},
        "memory": {"policy": policy, "budget_gb": budget_gb}})


def test_the_memory_planners_plan_against_the_optimizer_steps_copies() -> None:
    """The MILP and DELTA count what a rank holds during the optimizer step (``step_peak_bytes``: the
    ledger's bytes there, exactly). Under a budget between the pipeline's peak and the step's, the MILP
    without that term (the planner before session 7) returns a plan it says fits, and the engine's
    ledger overflows the budget at the step; the planners now refuse it (no per-layer choice changes
    the step). Under a budget above the step, both plan, and the engine stays within it."""
    from dataclasses import replace

    from sim.analytic_costs import AnalyticCosts
    from sim.cluster import load_cluster
    from sim.memory_optimal import RECOMPUTE, policy_of
    from sim.workloads import transformer_config, transformer_layers
    from traces.errors import ConfigError

    p = _step_case("optimal", None)
    cluster = load_cluster(p.cluster)
    costs = AnalyticCosts(transformer_layers(transformer_config(p.workload)), cluster.device, "fp16", cluster,
                          optimizer="megatron-fp16")
    resolved = resolve_plan(p, costs)
    model = layer_choice_model(p, resolved.stage_layers, costs, resolved.comm.capacity_bytes)
    without_step = replace(model, step=())
    frugal = max(without_step.peaks((RECOMPUTE,) * len(model.layers)))
    assert frugal < min(model.step)  # the case: recomputing everything fits a budget the step overflows

    low = (frugal + min(model.step)) // 2
    old = replace(without_step, capacity=low)
    choice = old.solve()
    assert choice is not None and old.fits(choice)  # the old planner: "fits"
    tight = _step_case("optimal", low / 2**30)
    ran = simulate(tight, costs=costs, resolved=replace(resolved, plan=tight,
                                                        policy=policy_of(old, choice, tight.num_stages)))
    peaks = [ran.memory[r] for r in sorted(ran.memory)]
    assert max(m.peak_bytes for m in peaks) > low  # ... and the engine overflows its budget, at the step:
    assert all(m.breakdown["activations"] == 0 for m in peaks)
    assert [m.peak_bytes for m in peaks] == list(model.step)  # the one rule is the ledger's bytes there
    assert replace(model, capacity=low).solve() is None
    for policy in ("optimal", "delta"):
        with pytest.raises(ConfigError, match="optimizer step") as error:
            resolve_plan(_step_case(policy, low / 2**30), costs)
        assert error.value.field == "memory"

    roomy = max(model.step) * 1.02
    for policy in ("optimal", "delta"):
        result = simulate(_step_case(policy, roomy / 2**30), costs=costs)
        assert max(m.peak_bytes for m in result.memory.values()) <= roomy, policy
