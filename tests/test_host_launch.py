"""The host launch path in the kernel model (issue 9, session 5): a layer call's forward, and its
backward as one pass, take max(GPU time, kernel launches x host seconds per launch)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sim.analytic import (
    MEGATRON_LAUNCHES,
    AnalyticCostModel,
    EfficiencyCurve,
    host_launches,
    transformer_layer_times,
)
from sim.hardware import get_device
from sim.implementations import MEGATRON_DROPOUT
from sim.workloads import transformer_config, transformer_layers
from traces.errors import ConfigError

A100 = get_device("A100-80GB")
PHYSICAL = EfficiencyCurve(eff_max=0.8, flops_half=0.0, mem_eff=0.9)
SLOW_HOST = replace(PHYSICAL, host_launch_s=40e-6)


def gpt(hidden: int, heads: int = 16, seq: int = 1024):
    return transformer_layers(transformer_config("gpt2-medium", hidden=hidden, heads=heads, num_layers=2, seq=seq,
                                                dropout=MEGATRON_DROPOUT))  # Megatron-LM's launches


def phases(k):
    return k.fwd_s, k.bwd_input_s + k.bwd_weight_s


def test_no_host_cost_by_default_changes_nothing():
    embed, block, head = (gpt(1024)[i] for i in (0, 1, -1))
    for layer in (embed, block, head):
        k = transformer_layer_times(layer, 1, 1, A100, "fp16", PHYSICAL, "unfused")
        assert "host" not in dict(k.parts)
    assert EfficiencyCurve(0.8, 0.0).host_launch_s == 0.0


def test_a_small_layer_is_host_bound_and_takes_exactly_its_launches():
    # Hidden 256, sequence 128, micro-batch 1: every kernel is a few microseconds on an A100, far below
    # 40 us per launch, so the forward takes 17 launches and the backward 21 + 24.
    block = gpt(256, heads=4, seq=128)[1]
    gpu = transformer_layer_times(block, 1, 1, A100, "fp16", PHYSICAL, "unfused")
    k = transformer_layer_times(block, 1, 1, A100, "fp16", SLOW_HOST, "unfused")
    assert gpu.fwd_s < 17 * 40e-6 and gpu.bwd_input_s + gpu.bwd_weight_s < 45 * 40e-6
    assert k.fwd_s == pytest.approx(17 * 40e-6)
    assert k.bwd_input_s + k.bwd_weight_s == pytest.approx(45 * 40e-6)
    # The excess is reported as its own kind, split over the backward's sides by their launches.
    host = dict(k.parts)["host"]
    assert host[0] == pytest.approx(17 * 40e-6 - gpu.fwd_s)
    assert host[1] / host[2] == pytest.approx(21 / 24)
    # Under tensor parallelism the block's all-reduces are not counted (they lengthen the stream more
    # than their launch); the vocabulary-parallel embedding adds its 7 masking kernels.
    k2 = transformer_layer_times(block, 1, 2, A100, "fp16", SLOW_HOST, "unfused")
    assert k2.fwd_s == pytest.approx(17 * 40e-6)
    embed = gpt(256, heads=4, seq=128)[0]
    e1, e2 = (transformer_layer_times(embed, 1, t, A100, "fp16", SLOW_HOST, "unfused") for t in (1, 2))
    assert (e1.fwd_s, e2.fwd_s) == pytest.approx((14 * 40e-6, 21 * 40e-6))


def test_a_large_layer_hides_the_host():
    # Hidden 8,192, sequence 2,048: the block's forward GEMMs alone are ~14 ms of tensor-core time,
    # so 17 x 40 us of launches overlap it completely.
    block = gpt(8192, heads=64, seq=2048)[1]
    gpu = transformer_layer_times(block, 1, 1, A100, "fp16", PHYSICAL, "unfused")
    k = transformer_layer_times(block, 1, 1, A100, "fp16", SLOW_HOST, "unfused")
    assert phases(k) == pytest.approx(phases(gpu), rel=0, abs=0)
    assert dict(k.parts)["host"] == (0.0, 0.0, 0.0)


def test_the_time_is_the_max_of_the_two_streams_for_every_layer_kind():
    for layer in (gpt(1024)[0], gpt(1024)[1], gpt(1024)[-1]):
        for c in (5e-6, 20e-6, 80e-6):
            for tp in (1, 4):
                gpu = transformer_layer_times(layer, 2, tp, A100, "fp16", PHYSICAL, "unfused")
                k = transformer_layer_times(layer, 2, tp, A100, "fp16", replace(PHYSICAL, host_launch_s=c),
                                            "unfused")
                n_f, n_bi, n_bw = host_launches(layer.kind, tp)
                assert k.fwd_s == pytest.approx(max(gpu.fwd_s, n_f * c))
                assert k.bwd_input_s + k.bwd_weight_s == pytest.approx(
                    max(gpu.bwd_input_s + gpu.bwd_weight_s, (n_bi + n_bw) * c))


def test_launch_blocking_adds_every_launch_to_the_gpu_time():
    """CUDA_LAUNCH_BLOCKING=1 as a bound: the host never runs ahead, so a large layer that hides its
    launches under max(GPU, host) pays all of them, and a small one pays its GPU time on top."""
    blocking = replace(SLOW_HOST, host_launch_blocking=True)
    assert EfficiencyCurve.from_dict(blocking.to_dict()) == blocking
    assert not EfficiencyCurve.from_dict({"eff_max": 0.8, "flops_half": 0.0}).host_launch_blocking
    for block in (gpt(8192, heads=64, seq=2048)[1], gpt(256, heads=4, seq=128)[1]):
        gpu = transformer_layer_times(block, 1, 1, A100, "fp16", PHYSICAL, "unfused")
        k = transformer_layer_times(block, 1, 1, A100, "fp16", blocking, "unfused")
        assert k.fwd_s == pytest.approx(gpu.fwd_s + 17 * 40e-6)
        assert k.bwd_input_s + k.bwd_weight_s == pytest.approx(gpu.bwd_input_s + gpu.bwd_weight_s + 45 * 40e-6)
        assert dict(k.parts)["host"][0] == pytest.approx(17 * 40e-6)


def test_the_layer_costs_carry_it_to_recompute_and_the_engines():
    block = gpt(512, heads=8, seq=256)[1]
    model = AnalyticCostModel(A100, "fp16", SLOW_HOST, attention="unfused")
    c = model.layer_costs(block, 1, 1)
    assert c.fwd_s == pytest.approx(17 * 40e-6)
    assert c.recompute_s == c.fwd_s  # a recompute launches the forward's kernels again


def test_counts_are_megatrons_and_bad_curves_are_refused():
    assert host_launches("block", 1) == MEGATRON_LAUNCHES["block"][0] == (17, 21, 24)
    assert host_launches("block", 8) == (17, 21, 24)
    assert host_launches("embedding", 8) == (21, 1, 14)
    with pytest.raises(ConfigError, match="host_launch_s"):
        EfficiencyCurve(0.8, 0.0, host_launch_s=-1e-6)


def test_the_simulator_and_the_fast_estimate_both_slow_down_a_host_bound_plan():
    from sim.analytic_costs import AnalyticCosts
    from sim.cluster import load_cluster
    from sim.compile import compile_plan
    from sim.estimate import Estimator
    from sim.plan import Plan
    from sim.simulate import simulate

    plan = Plan.from_dict({
        "name": "host-bound", "workload": "gpt2-small", "dtype": "fp16",
        "cluster": {"preset": "dgx-a100-8", "devices_per_node": 2},
        "workload_options": {"hidden": 256, "heads": 4, "num_layers": 4, "seq": 128},
        "parallelism": {"pp": 2}, "schedule": {"name": "1f1b", "micro_batch": 1, "microbatches": 4}})
    cluster = load_cluster(plan.cluster)
    layers = transformer_layers(transformer_config(plan.workload, **plan.workload_options))
    times = {}
    for name, curve in (("gpu", PHYSICAL), ("host", SLOW_HOST)):
        costs = AnalyticCosts(layers, cluster.device, plan.dtype, cluster, curve)
        resolved = compile_plan(plan, costs).resolved
        fast = Estimator(resolved.costs, resolved.comm, plan.dtype).estimate(
            schedule=plan.schedule.name, dp=plan.dp, tp=plan.tp, pp=plan.pp, chunks=plan.chunks,
            micro_batch=plan.micro_batch, microbatches=plan.microbatches, stage_layers=resolved.stage_layers,
            policy=resolved.policy, tp_overlap=0, sync_method=plan.gradient_sync.method,
            bucket_mb=plan.gradient_sync.bucket_mb)
        times[name] = (simulate(plan, costs=costs).iteration_s, fast.iteration_s)
    # Host-bound: the host path sets the pace in both, and the two agree as closely as without it.
    assert times["host"][0] > 2 * times["gpu"][0]
    assert times["host"][1] > 2 * times["gpu"][1]
    assert times["host"][1] == pytest.approx(times["host"][0], rel=0.1)


def test_the_shipped_host_cost_is_what_one_model_shape_gives_on_the_other():
    """The one scalar fitted on each model shape of the vTrain single-node data (closed-form predictor,
    120 rows drawn with seed 0) predicts the other shape: the shipped default is that fit, not a guess."""
    from analysis.calibrate import (
        default_calibration,
        error_metrics,
        fit_host,
        load_rows,
        predict_rows,
        quick_predictor,
        subsample,
    )
    from sim.analytic import GPU_HOST_LAUNCH_S, default_for
    from sim.calibration import model_splits

    assert default_for(A100, "fp16").host_launch_s == GPU_HOST_LAUNCH_S
    assert default_for(get_device("local-cpu"), "fp32").host_launch_s == 0.0
    for _, fit_rows, held in model_splits(load_rows()):
        calibration = fit_host(subsample(fit_rows, 120, 0), quick_predictor(), default_calibration())
        assert calibration.curve.host_launch_s == pytest.approx(GPU_HOST_LAUNCH_S, abs=3e-6)
        held_out = error_metrics(held["iter_time_s"], predict_rows(held, quick_predictor(), calibration))
        assert held_out["median_abs_error"] < 0.07 and held_out["spearman"] > 0.98
