"""Korthikanti et al. 2022 (arXiv:2205.05198) Tables 3-5 as data (sim/data/korthikanti2022_*.csv):
the transcription is self-consistent, every simulated row's configuration runs, and the eff_max fits
docs/accuracy.md section 5 quotes are what the data give (benchmarks/korthikanti_layers.py)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.script_module import load_script

ROOT = Path(__file__).resolve().parent.parent
A100_PEAK = 312e12  # fp16/bf16 dense, NVIDIA A100 datasheet: the peak the paper's MFU divides by
# The fits docs/accuracy.md section 5 reports (benchmarks/korthikanti_layers.py --fit): on all Table 4
# times the A100 default (sim.analytic.GPU_EFF_MAX_BY_FAMILY), on the forward alone a value reported only.
FIT_FORWARD = 0.733  # reported, not the default
# Section 6: the fit on all Table 4 times with the 2022 backward overlap modelled (the column-parallel
# all-reduces behind the weight-gradient GEMMs, AnalyticCosts(tp_backward_overlap=True)); reported, not
# the default (worse on Table 5). The default is the "all" fit without it.
FIT_ALL_WITH_OVERLAP = 0.688


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    return load_script("benchmarks/korthikanti_layers.py")


def test_table4_is_self_consistent(bench):
    table = bench.load_layer_times()
    assert len(table) == 5 and set(table["recompute"]) == {"none", "full", "selective"}
    for row in table.to_dict("records"):
        assert row["forward_ms"] + row["backward_ms"] == pytest.approx(row["combined_ms"], abs=0.051)
        if row["experiment"] != "Baseline no recompute":
            assert round(100 * (row["combined_ms"] / 19.6 - 1)) == row["overhead_pct"]


def test_table5_is_self_consistent(bench):
    table = bench.load_iterations()
    for row in table.to_dict("records"):
        increase = 100 * (row["full_recompute_s"] / row["present_work_s"] - 1)
        assert increase == pytest.approx(row["throughput_increase_pct"], abs=0.1)
        # Model FLOPs, the paper's appendix eq. (7), B = global batch, v = 51,200, s = 2,048.
        B, L, h, s, v = row["global_batch"], row["layers"], row["hidden"], 2048, 51200
        flops = 72 * B * L * s * h**2 * (1 + s / (6 * h) + v / (12 * h * L))
        mfu = 100 * flops / (row["present_work_s"] * row["gpus"] * A100_PEAK)
        assert mfu == pytest.approx(row["mfu_pct"], abs=0.5)
        assert row["gpus"] == row["tp"] * row["pp"]  # no data parallelism (Table 3's caption)


def test_data_parallel_sentence_is_self_consistent(bench):
    table = bench.pd.read_csv(bench.DATA_PARALLEL).set_index("dp")
    # Same model FLOPs per model instance, so MFU scales with 1 / iteration time (to the printed digits).
    ratio = table.loc[1, "iteration_s"] / table.loc[8, "iteration_s"]
    assert table.loc[8, "mfu_pct"] == pytest.approx(table.loc[1, "mfu_pct"] * ratio, abs=0.15)
    assert table.loc[8, "global_batch"] == 8 * table.loc[1, "global_batch"]


def test_every_row_configuration_builds_and_the_simulated_layers_run(bench):
    plans = [bench.row_plan(row, "full") for row in bench.load_iterations().to_dict("records")]
    assert [p.dp for p in plans] == [1, 1, 1, 1]
    assert [p.chunks for p in plans] == [1, 3, 3, 1]  # the paper's m = 3 for 175B and 530B, none stated else
    assert [p.schedule.microbatches for p in plans] == [1, 64, 280, 512]
    table = bench.load_layer_times()
    for overlap in (False, True):
        results = bench.compare_layers(table, bench.sc21.curve_of("default"), overlap)
        assert [r["recompute"] for r in results] == ["none", "full"]  # the rows without sequence parallelism
        plain, full = results
        assert plain["pred_forward_ms"] == pytest.approx(full["pred_forward_ms"])
        # Full recompute re-runs the forward (its all-reduces not hidden) inside the backward: the plain
        # backward plus a forward.
        assert full["pred_backward_ms"] == pytest.approx(plain["pred_backward_ms"] + plain["pred_forward_ms"],
                                                         rel=1e-6)
    for r in bench.compare_layers(table, bench.sc21.curve_of("default"), False):
        for key in ("forward_ms", "backward_ms", "combined_ms"):  # within 10% (measured: at most 4.0%)
            assert r["pred_" + key] == pytest.approx(r[key], rel=0.10)


def test_the_22b_iteration_simulates(bench):
    row = bench.load_iterations().to_dict("records")[0]
    _, _, _, iteration = bench.sc21.run_plan(bench.row_plan(row, "full"), bench.sc21.curve_of("default"))
    assert iteration == pytest.approx(row["full_recompute_s"], rel=0.10)


def test_the_a100_default_and_the_quoted_fit_are_what_table4_gives(bench):
    """Provenance of the A100's eff_max and of the forward-only fit the docs quote: recomputed from the
    data file, each from the default curve (any eff_max on it is replaced by the fit)."""
    from sim.analytic import GPU_EFF_MAX_BY_FAMILY, default_for
    from sim.hardware import get_device

    table = bench.load_layer_times()
    # 0.791 was fitted (section 5) with attention's softmax and dropout at a copy's rate (mem_eff); the
    # measured attention rate (section 13) came later and is held out of this provenance.
    base = replace(bench.sc21.curve_of("default"), attn_mem_eff=None)
    assert default_for(get_device("A100-80GB"), "fp16").eff_max == GPU_EFF_MAX_BY_FAMILY["A100"]
    assert bench.fit_eff_max(table, base, "all", overlap=False) == pytest.approx(GPU_EFF_MAX_BY_FAMILY["A100"],
                                                                                  abs=1e-9)
    assert bench.fit_eff_max(table, base, "all", overlap=True) == pytest.approx(FIT_ALL_WITH_OVERLAP, abs=1e-9)
    for overlap in (False, True):  # the forward has no backward all-reduce to hide
        assert bench.fit_eff_max(table, base, "forward", overlap=overlap) == pytest.approx(FIT_FORWARD, abs=1e-9)


# Section 13, step 5: eff_max refitted on Table 4 (none/full rows) with the measured attention rate held
# (the A100 default since section 13), without and with the 2022 backward overlap; reported, not adopted.
REFIT_WITH_MEASURED_ATTENTION = {False: 0.867, True: 0.741}


def test_the_refits_with_the_measured_attention_rate_the_docs_quote(bench):
    from sim.analytic import GPU_ATTN_MEM_EFF_BY_FAMILY

    base = bench.sc21.curve_of("default")
    assert base.attention_mem_eff == GPU_ATTN_MEM_EFF_BY_FAMILY["A100"]
    table = bench.load_layer_times()
    for overlap, fitted in REFIT_WITH_MEASURED_ATTENTION.items():
        assert bench.fit_eff_max(table, base, "all", overlap=overlap) == pytest.approx(fitted, abs=1e-9)


# Section 12: the joint (eff_max, attn_mem_eff) fit on Table 4's rows without sequence parallelism
# (korthikanti_layers.py --fit-attention --no-tp-backward-overlap); reported, not the default.
JOINT_FIT = (0.891, 0.505)


def test_the_joint_fit_the_docs_quote_is_a_grid_minimum_of_its_declared_rows(bench):
    """The quoted (eff_max, attn_mem_eff) beats every neighbour on its grid (0.001 x 0.005) on the log
    loss over the four distinct times of the no-sequence-parallel rows (the whole grid search takes ~1
    min here; this checks the point it found, from the data file)."""
    from dataclasses import replace

    table = bench.load_layer_times()
    assert set(bench.joint_fit_rows(table)["recompute"]) == {"none", "full", "selective"}
    assert not bench.joint_fit_rows(table)["sequence_parallel"].any()
    base = bench.sc21.curve_of("default")

    def loss(e: float, a: float) -> float:
        curve = replace(base, eff_max=round(e, 6), attn_mem_eff=round(a, 6))
        return bench.log_loss(bench.compare_layers(table, curve, False, rows="joint"))

    e0, a0 = JOINT_FIT
    best = loss(e0, a0)
    for de in (-0.001, 0.0, 0.001):
        for da in (-0.005, 0.0, 0.005):
            if de or da:
                assert loss(e0 + de, a0 + da) > best, (de, da)


# Section 14: the (eff_max, 2022 backward overlap share) fit on the same rows, attention held at the
# measured 0.534 (korthikanti_layers.py --fit-share; declared in sim/data/korthikanti2022.md first).
SHARE_FIT = (0.822, 0.35)


def test_the_share_fit_the_docs_quote_is_a_grid_minimum_of_its_declared_rows(bench):
    """The quoted (eff_max, share) beats every neighbour on its grid (0.001 x 0.01) on the log loss over
    the four distinct times of the no-sequence-parallel rows, and both ends of the share (0: no overlap,
    1: the ideal one) fit worse at any eff_max near the fit (the whole search takes ~30 s here)."""
    from sim.analytic import GPU_ATTN_MEM_EFF_BY_FAMILY

    table = bench.load_layer_times()
    base = bench.sc21.curve_of("default")
    assert base.attention_mem_eff == GPU_ATTN_MEM_EFF_BY_FAMILY["A100"]
    assert bench.SHARE_FIT_ROWS == "joint"

    def loss(e: float, share: float) -> float:
        return bench.log_loss(bench.compare_layers(table, replace(base, eff_max=round(e, 6)), share, rows="joint"))

    e0, s0 = SHARE_FIT
    best = loss(e0, s0)
    for de in (-0.001, 0.0, 0.001):
        for ds in (-0.01, 0.0, 0.01):
            if de or ds:
                assert loss(e0 + de, round(s0 + ds, 6)) > best, (de, ds)
    for end in (0.0, 1.0):
        assert min(loss(e, end) for e in (0.74, 0.78, 0.82, 0.86, 0.90)) > 10 * best


def test_the_stats_name_a_small_tables_rows_and_orders(bench):
    # Table 5 has four rows: 4! = 24 orders (analysis.metrics.spearman_text, shared with megatron_at_scale).
    stats = bench.error_stats([1.42, 18.13, 49.05, 94.42], [1.40, 18.0, 47.8, 95.4])
    assert stats["spearman_text"] == "Spearman 1.000 (4 rows, 24 orders)"
    assert stats["mape"] == pytest.approx((0.02 / 1.42 + 0.13 / 18.13 + 1.25 / 49.05 + 0.98 / 94.42) / 4)
