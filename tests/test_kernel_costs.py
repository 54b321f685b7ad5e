"""Closed-form checks of sim.analytic's kernel-by-kernel transformer costs (issue 9)."""

from __future__ import annotations

import math

import pytest

from sim.analytic import (
    ACTIVATION_BYTES,
    AnalyticCostModel,
    EfficiencyCurve,
    gemm_time,
    host_launches,
    padded_vocab,
    transformer_layer_times,
)
from sim.hardware import get_device
from sim.workloads import transformer_config, transformer_layers

A100 = get_device("A100-80GB")
PHYSICAL = EfficiencyCurve(eff_max=0.8, flops_half=0.0, mem_eff=0.9)


def layers(**options):
    return transformer_layers(transformer_config("gpt2-medium", **options))


def test_a100_has_108_sms_from_the_whitepaper():
    assert A100.sm_count == 108
    assert get_device("H100-SXM").sm_count == 132
    assert get_device("local-cpu").sm_count is None


def test_wave_quantisation_at_a_known_shape():
    # 108 SMs, 128x128 tiles at best: a 1,024 x 1,024 output is 8 x 8 = 64 tiles, one wave; 1,792 x
    # 1,024 is 14 x 8 = 112 tiles (or 7 x 8 = 56 with 256x128), and 1,920 x 1,024 is 8 x 8 = 64 of
    # 256x128 after padding 1,920 to 2,048: one wave of 256x128 tiles.
    peak, eff, k = 312e12, 0.8, 4096
    per_sm = eff * peak / 108
    one_wave_128 = 2 * 128 * 128 * k / per_sm
    t = gemm_time(1024, 1024, k, 1, peak, eff, 1e30, 2, 108)
    assert t == pytest.approx(one_wave_128)
    # 109 tiles of 128x128 need two waves; with 256x128 tiles they are 55 (one wave of a tile twice
    # as big): the same time as two 128 waves. 13,952 x 128 is exactly 109 x 1 tiles of 128x128.
    assert gemm_time(109 * 128, 128, k, 1, peak, eff, 1e30, 2, 108) == pytest.approx(2 * one_wave_128)
    # Without an SM count the work is continuous: exactly flops / (eff x peak).
    assert gemm_time(1000, 1000, k, 1, peak, eff, 1e30, 2, None) == pytest.approx(2 * 1000 * 1000 * k / (eff * peak))
    # A wave model is never faster than the continuous one.
    for m in (100, 1000, 2048, 5000):
        assert gemm_time(m, 3072, 1024, 1, peak, eff, 1e30, 2, 108) >= gemm_time(m, 3072, 1024, 1, peak, eff,
                                                                                 1e30, 2, None) * (1 - 1e-12)


def test_small_gemm_is_memory_bound():
    # [1, 4096] x [4096, 4096]: 33 MB of weights at 1.8 TB/s, far longer than its 33 MFLOPs (without
    # the tile model, which pads the single row to a 128-row tile: the model is for token-sized m).
    t = gemm_time(1, 4096, 4096, 1, 312e12, 0.8, 1.8e12, 2, None)
    assert t == pytest.approx(2 * (4096 + 4096 * 4096 + 4096) / 1.8e12)


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_layernorm_and_elementwise_bytes_of_a_block_in_closed_form(dropout):
    # hidden 1,024, seq 1,024, micro-batch 2, fp16, tp 1, flash attention: X = 2 x 1,024 x 1,024,
    # F = 4X. Forward: LN1 2eX, dropout-add (3e + 1)X twice (3eX without dropout: no mask), LN2 2eX,
    # bias-GELU 2eF.
    block = layers(hidden=1024, heads=16, num_layers=1, seq=1024, dropout=dropout)[1]
    e, X = 2, 2 * 1024 * 1024
    F = 4 * X
    mask = X if dropout else 0
    k = transformer_layer_times(block, 2, 1, A100, "fp16", PHYSICAL, "flash")
    assert k.elementwise_bytes_fwd == pytest.approx(2 * e * X + 2 * (3 * e * X + mask) + 2 * e * X + 2 * e * F)
    assert k.extra_saved_bytes == pytest.approx(2 * mask)  # the two hidden dropout masks, 1 byte each
    # Under TP the hidden-size kernels are replicated on every rank; only GELU's F divides by t.
    k8 = transformer_layer_times(block, 2, 8, A100, "fp16", PHYSICAL, "flash")
    assert k.elementwise_bytes_fwd - k8.elementwise_bytes_fwd == pytest.approx(2 * e * F * (1 - 1 / 8))


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_unfused_attention_moves_the_score_tensors(dropout):
    # Unfused adds, per micro-batch and TP rank, S = b (a/t) s^2 elements: softmax 2eS, with dropout its
    # kernel 2eS + S, and the context copy 2eX/t; it saves the softmax output eS, with dropout its mask
    # S and output eS, and not flash's log-sum-exp (b a/t s elements).
    block = layers(hidden=2048, heads=16, num_layers=1, seq=2048, dropout=dropout)[1]
    b, t, e = 1, 2, ACTIVATION_BYTES["fp16"]
    S, X = b * 16 / t * 2048 * 2048, b * 2048 * 2048
    drop = 1 if dropout else 0
    lse = b * 16 / t * 2048 * e
    flash = transformer_layer_times(block, b, t, A100, "fp16", PHYSICAL, "flash")
    unfused = transformer_layer_times(block, b, t, A100, "fp16", PHYSICAL, "unfused")
    assert unfused.elementwise_bytes_fwd - flash.elementwise_bytes_fwd == pytest.approx(
        2 * e * S + drop * (2 * e * S + S) + 2 * e * X / t)
    assert unfused.extra_saved_bytes - flash.extra_saved_bytes == pytest.approx(e * S + drop * (S + e * S) - lse)
    assert unfused.fwd_s > flash.fwd_s
    costs_u = AnalyticCostModel(A100, "fp16", PHYSICAL, attention="unfused").layer_costs(block, b, t)
    costs_f = AnalyticCostModel(A100, "fp16", PHYSICAL, attention="flash").layer_costs(block, b, t)
    assert costs_u.saved_bytes - costs_f.saved_bytes == pytest.approx(e * S + drop * (S + e * S) - lse, abs=1)


def test_no_dropout_runs_no_dropout_kernel():
    # A p 0 workload pays for no dropout kernel: its block is faster than Megatron's p 0.1 one by the
    # dropout bytes alone, and launches 1 + 3 fewer kernels (sim.analytic.DROPOUT_LAUNCHES).
    on, off = (layers(hidden=1024, heads=16, num_layers=1, seq=1024, dropout=p)[1] for p in (0.1, 0.0))
    k_on = transformer_layer_times(on, 2, 1, A100, "fp16", PHYSICAL, "unfused")
    k_off = transformer_layer_times(off, 2, 1, A100, "fp16", PHYSICAL, "unfused")
    assert k_off.fwd_s < k_on.fwd_s and k_off.bwd_input_s < k_on.bwd_input_s
    assert k_on.bwd_weight_s == k_off.bwd_weight_s
    assert host_launches("block", 1, dropout=False) == (16, 18, 24)
    assert host_launches("embedding", 1, dropout=False) == (13, 0, 14)


def test_vocabulary_padded_to_a_multiple_of_128_tp():
    assert padded_vocab(50257, 1) == 50304
    assert padded_vocab(50257, 8) == 51200
    assert padded_vocab(51200, 8) == 51200
    head = layers(hidden=1024, heads=16, num_layers=1, seq=1024, vocab=50257)[-1]
    model = AnalyticCostModel(A100, "fp16", PHYSICAL, attention="unfused")
    c1, c8 = model.layer_costs(head, 1, 1), model.layer_costs(head, 1, 8)
    assert c1.param_bytes == 2 * (50304 * 1024 + 2 * 1024)
    assert c8.param_bytes == 2 * (51200 // 8 * 1024 + 2 * 1024)
    # The cross-entropy works on [b s, V/t] fp32 logits: 38 bytes per logit forward.
    k = transformer_layer_times(head, 1, 1, A100, "fp16", PHYSICAL)
    assert k.elementwise_bytes_fwd == pytest.approx(2 * 2 * 1024 * 1024 + 38 * 1024 * 50304)


def test_no_fixed_cost_per_call_by_default_and_times_grow_with_work():
    block = layers(hidden=1024, heads=16, num_layers=1, seq=1024)[1]
    model = AnalyticCostModel(A100, "fp16", PHYSICAL, attention="unfused")
    small, big = model.layer_costs(block, 1, 1), model.layer_costs(block, 8, 1)
    assert 0 < small.fwd_s < big.fwd_s <= 8 * small.fwd_s * 1.0001
    # At hidden 1,024 / seq 1,024 the unfused block's memory-bound work is about as long as its GEMMs:
    # above the GEMM-only time, below three times it.
    gemm_only = 8 * block.flops_fwd / (0.8 * 312e12)
    assert gemm_only < big.fwd_s < 3 * gemm_only
    assert math.isfinite(big.bwd_input_s) and big.bwd_weight_s > 0


def test_a_plan_chooses_its_attention_and_the_simulator_prices_it():
    from sim.plan import Plan
    from sim.simulate import simulate

    def run(attention: str):
        return simulate(Plan.from_dict({
            "name": "attention", "workload": "gpt2-small", "cluster": "dgx-a100-8", "dtype": "fp16",
            "workload_options": {"seq": 2048, "attention": attention}, "parallelism": {"dp": 8},
            "schedule": {"name": "1f1b", "micro_batch": 4, "microbatches": 1}}))

    flash, unfused = run("flash"), run("unfused")
    # Unfused attention moves and keeps the [b, heads, s, s] scores: slower, and more memory at seq 2,048.
    assert unfused.iteration_s > 1.05 * flash.iteration_s
    assert unfused.peak_memory_bytes > flash.peak_memory_bytes
