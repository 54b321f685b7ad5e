"""The unfused attention's own bandwidth rate (``EfficiencyCurve.attn_mem_eff``, issue 9): the masked
softmax and the attention dropout, forward and backward, run at memory bandwidth x attn_mem_eff; the
score and context bmms, the context's permute copy and every other kernel keep their rates."""

from __future__ import annotations

import json

import pytest

import sim.analytic
from analysis.estimate_grid import estimate_plan
from sim.analytic import ACTIVATION_BYTES, EfficiencyCurve, calibrated_curve, transformer_layer_times
from sim.hardware import get_device
from sim.plan import Plan
from sim.simulate import simulate
from sim.workloads import transformer_config, transformer_layers
from traces.errors import ConfigError

A100 = get_device("A100-80GB")
COPY = EfficiencyCurve(eff_max=0.8, flops_half=0.0, mem_eff=0.9)  # no host path: parts are GPU time only
B, T = 2, 4  # micro-batch, TP degree


def block(dropout: float = 0.1):
    return transformer_layers(transformer_config("gpt2-medium", dropout=dropout))[1]


def parts(curve: EfficiencyCurve, attention: str = "unfused", dropout: float = 0.1):
    k = transformer_layer_times(block(dropout), B, T, A100, "fp16", curve, attention)
    return k, dict(k.parts)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_softmax_and_dropout_bytes_move_at_the_attention_rate(dropout) -> None:
    """The attention part moves by exactly the softmax's and the dropout's bytes (counted here from
    their reads and writes: S = b (a / t) s^2 elements) times the change of 1 / bandwidth."""
    x = block(dropout).extra
    S = B * x["heads"] / T * x["seq"] ** 2
    e, drop = ACTIVATION_BYTES["fp16"], 1.0 if dropout else 0.0
    fwd_bytes = e * 2 * S + drop * (e * 2 * S + S)  # softmax read + write; dropout read + write + mask
    bwd_bytes = e * 3 * S + drop * (e * 2 * S + S)  # softmax dy, y -> dx; dropout dy, mask -> dx
    _, base = parts(COPY, dropout=dropout)
    _, slow = parts(EfficiencyCurve(0.8, 0.0, 0.9, attn_mem_eff=0.45), dropout=dropout)
    per_byte = 1 / (A100.memory_bandwidth_Bps * 0.45) - 1 / (A100.memory_bandwidth_Bps * 0.9)
    assert slow["attention"][0] - base["attention"][0] == pytest.approx(fwd_bytes * per_byte, rel=1e-9)
    assert slow["attention"][1] - base["attention"][1] == pytest.approx(bwd_bytes * per_byte, rel=1e-9)
    assert slow["attention"][2] == base["attention"][2] == 0.0
    for kind in base.keys() - {"attention"}:  # GEMMs, the block's layernorm / dropout / residual kernels
        assert slow[kind] == base[kind], kind


def test_the_elementwise_part_scales_by_mem_eff_over_attn_mem_eff() -> None:
    """Without counting bytes: the attention part minus its rate-independent rest (bmms, context copy)
    scales as 1 / attn_mem_eff; attn_mem_eff = mem_eff is the same model as None."""
    att = {r: parts(EfficiencyCurve(0.8, 0.0, 0.9, attn_mem_eff=r))[1]["attention"] for r in (0.9, 0.6, 0.3)}
    for phase in (0, 1):
        # a(r) = rest + E * 0.9 / r, so (a(0.3) - a(0.9)) / (a(0.6) - a(0.9)) = (3 - 1) / (1.5 - 1)
        ratio = (att[0.3][phase] - att[0.9][phase]) / (att[0.6][phase] - att[0.9][phase])
        assert ratio == pytest.approx(4.0, rel=1e-9)
    assert parts(EfficiencyCurve(0.8, 0.0, 0.9, attn_mem_eff=0.9))[0] == parts(COPY)[0]


def test_recomputation_prices_the_core_at_the_same_rate() -> None:
    """Korthikanti's selective recompute re-runs the core's forward, torch's selective recompute its
    memory-bound kernels: both at the rate the forward ran them."""
    base, base_parts = parts(COPY)
    slow, slow_parts = parts(EfficiencyCurve(0.8, 0.0, 0.9, attn_mem_eff=0.45))
    delta_fwd = slow_parts["attention"][0] - base_parts["attention"][0]
    assert delta_fwd > 0
    assert slow.attention_core_recompute_s - base.attention_core_recompute_s == pytest.approx(delta_fwd, rel=1e-9)
    assert slow.selective_recompute_s - base.selective_recompute_s == pytest.approx(delta_fwd, rel=1e-9)
    assert slow.elementwise_bytes_fwd == base.elementwise_bytes_fwd  # bytes do not depend on the rate


def test_flash_attention_and_other_layers_do_not_see_it() -> None:
    slow = EfficiencyCurve(0.8, 0.0, 0.9, attn_mem_eff=0.3)
    assert parts(slow, "flash")[0] == parts(COPY, "flash")[0]
    head = transformer_layers(transformer_config("gpt2-medium", dropout=0.1))[-1]
    assert transformer_layer_times(head, B, T, A100, "fp16", slow, "unfused") == \
        transformer_layer_times(head, B, T, A100, "fp16", COPY, "unfused")


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5])
def test_a_rate_outside_0_1_is_refused_naming_the_field(bad) -> None:
    with pytest.raises(ConfigError, match="attn_mem_eff"):
        EfficiencyCurve(0.8, 0.0, 0.9, attn_mem_eff=bad)


def test_the_curve_round_trips_through_its_dict_and_a_calibration_record(tmp_path, monkeypatch) -> None:
    curve = EfficiencyCurve(0.79, 1e9, 0.9, host_launch_s=4e-5, attn_mem_eff=0.6)
    assert EfficiencyCurve.from_dict(json.loads(json.dumps(curve.to_dict()))) == curve
    assert EfficiencyCurve.from_dict({"eff_max": 0.8, "flops_half": 0.0}).attention_mem_eff == 0.9
    record = tmp_path / "a100.json"
    record.write_text(json.dumps({"efficiency_curve": curve.to_dict(), "use_as_default": True}))
    monkeypatch.setitem(sim.analytic.CALIBRATED_CURVES, "A100", record)
    assert calibrated_curve(A100, "fp16") == curve


def _plan() -> Plan:
    options = {"attention": "unfused", "dropout": 0.1, "seq": 2048}  # seq 2,048, mb 4: GPU-bound, not host-bound
    return Plan.from_dict({"workload": "gpt2-medium", "workload_options": options,
                           "cluster": {"preset": "dgx-a100-8"}, "dtype": "fp16",
                           "parallelism": {"pp": 2, "tp": 2, "dp": 2},
                           "schedule": {"name": "1f1b", "micro_batch": 4, "microbatches": 4}})


def test_a_family_default_reaches_the_engine_and_the_fast_estimate(monkeypatch) -> None:
    """Set as the A100's default (GPU_ATTN_MEM_EFF_BY_FAMILY, where the search and every plan get their
    curve), the rate slows the engine's iteration and the fast estimate's alike."""
    before_engine, before_estimate = simulate(_plan()).iteration_s, estimate_plan(_plan()).iteration_s
    monkeypatch.setitem(sim.analytic.GPU_ATTN_MEM_EFF_BY_FAMILY, "A100", 0.45)
    after_engine, after_estimate = simulate(_plan()).iteration_s, estimate_plan(_plan()).iteration_s
    assert after_engine > before_engine * 1.01
    assert after_estimate == pytest.approx(after_engine, rel=0.005)
    assert after_estimate - before_estimate == pytest.approx(after_engine - before_engine, rel=0.05)
