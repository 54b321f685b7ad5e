"""Megatron-LM's asynchronous TP all-reduce in the backward (issue 9, session 5c): with
``AnalyticCosts(tp_backward_overlap=True)`` each column-parallel linear's input-gradient all-reduce
runs while its weight-gradient GEMM does, so a block's backward is shorter by min(all-reduce, GEMM)
for each of its two (QKV, fc1); the engine and the fast estimate price it through one rule
(``sim.costs.tp_comm_s``). Off by default: Megatron-LM v2.5 (SC'21) ran the all-reduces after the compute.
A share in [0, 1] instead of a bool (issue 9, session 10): that share of each collective runs under its
GEMM, min(share x all-reduce, GEMM) hidden; 0 and 1 price exactly as False and True."""

from __future__ import annotations

import math

import pytest

from sim.analytic import EfficiencyCurve, transformer_layer_times
from sim.analytic_costs import AnalyticCosts
from sim.cluster import load_cluster
from sim.compile import compile_plan
from sim.costs import LayerCosts, tp_comm_s
from sim.engine import Engine, EngineOptions
from sim.estimate import Estimator
from sim.plan import Plan
from sim.workloads import transformer_config, transformer_layers
from traces.errors import ConfigError

CURVE = EfficiencyCurve(eff_max=0.8, flops_half=0.0, mem_eff=0.9)
BLOCK = 1  # layer 0 is the embedding


def tp8_plan(hidden: int, seq: int, micro_batch: int) -> Plan:
    return Plan.from_dict({
        "name": "tp8-overlap", "workload": "gpt2-medium", "dtype": "fp16", "cluster": "dgx-a100-8",
        "workload_options": {"hidden": hidden, "heads": 16, "num_layers": 2, "seq": seq},
        "parallelism": {"tp": 8}, "schedule": {"name": "1f1b", "micro_batch": micro_batch, "microbatches": 1}})


def run(plan: Plan, overlap: bool | float) -> tuple[Engine, AnalyticCosts, float, float]:
    """(engine, costs, simulated iteration, estimated iteration) of ``plan`` with the option set."""
    cluster = load_cluster(plan.cluster)
    layers = transformer_layers(transformer_config(plan.workload, **plan.workload_options))
    costs = AnalyticCosts(layers, cluster.device, plan.dtype, cluster, CURVE, attention="unfused",
                          tp_backward_overlap=overlap)
    compiled = compile_plan(plan, costs)
    r = compiled.resolved
    engine = Engine(compiled.program, r.costs, r.comm, r.policy, plan.micro_batch, 0, EngineOptions(layer_rows=True))
    iteration = engine.run()
    fast = Estimator(r.costs, r.comm, plan.dtype).estimate(
        schedule=plan.schedule.name, dp=plan.dp, tp=plan.tp, pp=plan.pp, chunks=plan.chunks,
        micro_batch=plan.micro_batch, microbatches=plan.microbatches, stage_layers=r.stage_layers,
        policy=r.policy, tp_overlap=0, sync_method=plan.gradient_sync.method, bucket_mb=plan.gradient_sync.bucket_mb)
    return engine, costs, iteration, fast.iteration_s


def block_backward_s(engine: Engine) -> float:
    return sum(r.end_s - r.start_s for r in engine.rows if r.rank == 0 and r.layer == BLOCK and r.kind == "BWD")


@pytest.mark.parametrize("hidden, seq, micro_batch", [(12288, 2048, 4), (512, 128, 1)])
def test_a_blocks_backward_is_shorter_by_min_of_each_allreduce_and_its_weight_gradient_gemm(hidden, seq, micro_batch):
    plan = tp8_plan(hidden, seq, micro_batch)
    plain, costs_off, iter_off, est_off = run(plan, False)
    hidden_run, costs_on, iter_on, est_on = run(plan, True)
    layer = costs_on.specs[BLOCK]
    # The two GEMMs, from the kernel model directly: QKV's and fc1's weight gradient.
    k = transformer_layer_times(layer, micro_batch, 8, costs_on.model.device, "fp16", CURVE, "unfused")
    assert k.column_wgrad_s == costs_on.layer_costs(BLOCK, micro_batch, 8).tp_bwd_overlap_s
    assert len(k.column_wgrad_s) == 2 and all(w > 0 for w in k.column_wgrad_s)
    assert costs_off.layer_costs(BLOCK, micro_batch, 8).tp_bwd_overlap_s == ()
    # One all-reduce as the engine prices it: a forward's TP time over the block's two all-reduces.
    c = costs_on.layer_costs(BLOCK, micro_batch, 8)
    one = plain._tp_comm_s(c, 0, False) / c.tp_allreduces
    expected = sum(min(one, w) for w in k.column_wgrad_s)
    assert block_backward_s(plain) - block_backward_s(hidden_run) == pytest.approx(expected, rel=1e-9)
    # Both blocks hide the same; the estimate agrees with the engine on what the iteration saves.
    assert iter_off - iter_on == pytest.approx(2 * expected, rel=1e-6)
    assert est_off - est_on == pytest.approx(iter_off - iter_on, rel=1e-6)


def test_which_side_limits_the_hiding():
    """Big GEMMs hide the whole all-reduce; at a small shape the all-reduce outlasts the GEMMs."""
    for (hidden, seq, mb), gemm_bound in (((12288, 2048, 4), False), ((512, 128, 1), True)):
        plan = tp8_plan(hidden, seq, mb)
        engine, costs, _, _ = run(plan, True)
        c = costs.layer_costs(BLOCK, mb, 8)
        one = engine._tp_comm_s(c, 0, False) / c.tp_allreduces
        assert all((w < one) == gemm_bound for w in c.tp_bwd_overlap_s)


def test_the_rule_hides_nothing_forward_nor_in_a_split_input_gradient_step():
    c = LayerCosts(fwd_s=1.0, bwd_input_s=1.0, bwd_weight_s=1.0, recompute_s=1.0, param_bytes=0, grad_bytes=0,
                   optimizer_bytes=0, saved_bytes=0, output_bytes=0, tp_allreduces=2, tp_comm_bytes=8,
                   tp_bwd_overlap_s=(0.3, 2.0))
    price = lambda collective, nbytes: 1.0  # noqa: E731  (one second per all-reduce)
    assert tp_comm_s(c, False, price) == 2.0
    assert tp_comm_s(c, True, price) == pytest.approx(2.0 - (0.3 + 1.0))
    assert tp_comm_s(c, True, price, with_weight_grads=False) == 2.0


def test_off_by_default_and_nothing_to_hide_without_tp():
    plan = tp8_plan(512, 128, 1)
    cluster = load_cluster(plan.cluster)
    layers = transformer_layers(transformer_config(plan.workload, **plan.workload_options))
    assert AnalyticCosts(layers, cluster.device, "fp16", cluster, CURVE).layer_costs(BLOCK, 1, 8).tp_bwd_overlap_s == ()
    on = AnalyticCosts(layers, cluster.device, "fp16", cluster, CURVE, tp_backward_overlap=True)
    assert on.layer_costs(BLOCK, 1, 1).tp_bwd_overlap_s == ()  # tp 1: no all-reduce
    assert on.layer_costs(0, 1, 8).tp_bwd_overlap_s == ()  # the embedding all-reduces only forward


@pytest.mark.parametrize("hidden, seq, micro_batch", [(12288, 2048, 4), (512, 128, 1)])
def test_a_share_of_0_or_1_prices_exactly_as_off_or_on(hidden, seq, micro_batch):
    plan = tp8_plan(hidden, seq, micro_batch)
    for flag, share in ((False, 0.0), (True, 1.0), (True, 1)):
        _, _, iteration, estimate = run(plan, flag)
        _, _, iteration_share, estimate_share = run(plan, share)
        assert (iteration_share, estimate_share) == (iteration, estimate)


@pytest.mark.parametrize("hidden, seq, micro_batch", [(12288, 2048, 4), (512, 128, 1)])
def test_a_middle_share_hides_min_of_that_share_of_each_allreduce_and_its_gemm(hidden, seq, micro_batch):
    share = 0.4
    plan = tp8_plan(hidden, seq, micro_batch)
    plain, _, iter_off, est_off = run(plan, False)
    ideal, _, iter_on, _ = run(plan, True)
    partial, costs, iter_share, est_share = run(plan, share)
    c = costs.layer_costs(BLOCK, micro_batch, 8)
    assert c.tp_bwd_overlap_share == share
    one = plain._tp_comm_s(c, 0, False) / c.tp_allreduces
    expected = sum(min(share * one, w) for w in c.tp_bwd_overlap_s)
    assert block_backward_s(plain) - block_backward_s(partial) == pytest.approx(expected, rel=1e-9)
    assert iter_off - iter_share == pytest.approx(2 * expected, rel=1e-6)
    assert est_off - est_share == pytest.approx(iter_off - iter_share, rel=1e-6)
    assert iter_share < iter_off
    # Between the ideal and none; where the GEMMs are shorter than the share (small shapes) as the ideal.
    gemm_bound = all(w <= share * one for w in c.tp_bwd_overlap_s)
    assert iter_share == pytest.approx(iter_on, rel=1e-12) if gemm_bound else iter_on < iter_share
    assert gemm_bound == (hidden == 512)


def test_the_rule_scales_the_hidden_share_of_reduce_scatters_and_re_gathers_alike():
    price = lambda collective, nbytes: 1.0  # noqa: E731  (one second per collective)
    c = LayerCosts(fwd_s=1.0, bwd_input_s=1.0, bwd_weight_s=1.0, recompute_s=1.0, param_bytes=0, grad_bytes=0,
                   optimizer_bytes=0, saved_bytes=0, output_bytes=0, tp_allreduces=2, tp_comm_bytes=8,
                   tp_bwd_overlap_s=(0.3, 2.0), tp_bwd_overlap_share=0.5)
    assert tp_comm_s(c, True, price) == pytest.approx(2.0 - (0.3 + 0.5))
    assert tp_comm_s(c, False, price) == 2.0  # the forward hides nothing whatever the share
    sp = LayerCosts(fwd_s=1.0, bwd_input_s=1.0, bwd_weight_s=1.0, recompute_s=1.0, param_bytes=0, grad_bytes=0,
                    optimizer_bytes=0, saved_bytes=0, output_bytes=0, tp_allreduces=2, tp_comm_bytes=8,
                    tp_sequence_parallel=True, tp_bwd_overlap_s=(0.3, 2.0), tp_bwd_regathers=2,
                    tp_bwd_regather_overlap_s=(0.1, 5.0), tp_bwd_overlap_share=0.5)
    # two (reduce-scatter + all-gather) = 4 s, less min(0.5, 0.3) + min(0.5, 2); two re-gathers = 2 s,
    # less min(0.5, 0.1) + min(0.5, 5)
    assert tp_comm_s(sp, True, price) == pytest.approx(4.0 - 0.8 + 2.0 - 0.6)


@pytest.mark.parametrize("bad", [1.5, -0.1, math.nan, "half", None])
def test_a_share_outside_0_1_is_refused_by_name(bad):
    plan = tp8_plan(512, 128, 1)
    cluster = load_cluster(plan.cluster)
    layers = transformer_layers(transformer_config(plan.workload, **plan.workload_options))
    with pytest.raises(ConfigError, match="tp_backward_overlap"):
        AnalyticCosts(layers, cluster.device, "fp16", cluster, CURVE, tp_backward_overlap=bad)
