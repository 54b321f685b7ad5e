"""docs/accuracy.md section 18: the sizing compares against the fused kernel exactly as the simulator
prices it, and counts the fallback's fp32 passes."""

from __future__ import annotations

from benchmarks.unfused_softmax_sizing import fused_bytes_per_element, size, unfused_bytes_per_element
from sim.analytic import EfficiencyCurve, unfused_attention_core_times
from sim.hardware import get_device


def test_fused_bytes_are_the_simulators_softmax_without_dropout() -> None:
    # The baseline must be what sim.analytic prices now, or the "extra" is against something else.
    device = get_device("A100-80GB")
    heads, s = 16, 2048
    curve = EfficiencyCurve(eff_max=0.8, flops_half=0.0)
    t = unfused_attention_core_times(heads, s, 128, device, "bf16", curve, dropout=False)
    S = heads * s * s
    assert fused_bytes_per_element(2) == (t.elementwise_bytes_fwd / S, t.elementwise_bytes_bwd / S)


def test_fallback_moves_fp32_scores_in_every_pass() -> None:
    # cast in (2 + 4), scale (8), masked_fill (8), softmax (8), cast out (4 + 2); backward the same
    # chain with softmax reading its output too (12).
    assert unfused_bytes_per_element(2) == (36, 40)


def test_mtnlg_shape_extra_time_is_between_the_two_rates() -> None:
    z = size("A100-80GB", heads_per_rank=16, seq=2048, micro_batch=1)
    assert z.score_elements == 16 * 2048 ** 2
    assert z.fused_s < z.unfused_s_low < z.unfused_s_high
