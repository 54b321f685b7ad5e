"""Each co-located profiling process's own per-layer medians (issue 12, seventh session): kept in the
bundle (``process_layers``), read back, turned into per-process offsets (``LayerCosts.*_offsets_s``)
and, at a meeting, into a variance that adds to the per-repeat one (``sim.meeting``: an offset adds
up linearly over the layers between meetings). Built on the run-7 loopback profile
(tests/data/comm/README.md), whose two processes are made 5% apart."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from analysis.validation.profiling import _merge_profiles, bracket_profile
from sim.bundle_costs import BundleCostModel
from sim.engine import EngineOptions
from sim.meeting import expected_max_normal, offset_variance
from sim.plan import Plan
from sim.simulate import simulate
from traces.bundle import ProfileBundle, read_bundle, write_bundle

ROOT = Path(__file__).resolve().parents[1]
STORED = ROOT / "tests" / "data" / "comm" / "loopback-2d-run7"
TIMES = ("fwd_s", "bwd_input_s", "bwd_weight_s", "bwd_s", "recompute_s")


def process(bundle: ProfileBundle, factor: float) -> ProfileBundle:
    """``bundle`` as one process that ran every layer ``factor`` times as long would have measured it."""
    layers = bundle.layers.copy()
    for column in TIMES:
        layers[column] = layers[column] * factor
    return ProfileBundle(bundle.meta, layers, bundle.ops, bundle.comm_samples, bundle.comm_fits)


def two_processes(tmp_path: Path, slower: float = 1.05) -> Path:
    stored = read_bundle(STORED)
    merged = _merge_profiles([process(stored, 2 - slower), process(stored, slower)])
    return write_bundle(merged, tmp_path / "two")


def test_the_bundle_keeps_each_processs_medians_and_old_bundles_still_read(tmp_path: Path) -> None:
    assert read_bundle(STORED).process_layers is None  # profiled before the table existed
    back = read_bundle(two_processes(tmp_path)).process_layers
    stored = read_bundle(STORED).layers.set_index("layer")
    assert back is not None and sorted(back["process"].unique()) == [0, 1] and len(back) == 2 * len(stored)
    for p, factor in ((0, 0.95), (1, 1.05)):
        mine = back[back["process"] == p].set_index("layer")
        for column in TIMES:
            assert mine[column].to_numpy() == pytest.approx(stored[column].to_numpy() * factor, rel=1e-12)
    # a bracketed profile (the mean of two taken one after the other) keeps each process's mean: before
    # the run the processes were 5% apart (0.95, 1.05), after it 15% (0.85, 1.15)
    after = read_bundle(two_processes(tmp_path / "after", slower=1.15))
    bracket_profile(read_bundle(tmp_path / "two"), after, tmp_path / "bracketed")
    bracketed = read_bundle(tmp_path / "bracketed").process_layers
    assert bracketed is not None and len(bracketed) == 2 * len(stored)
    for p, factor in ((0, 0.90), (1, 1.10)):
        mine = bracketed[bracketed["process"] == p].set_index("layer")
        for column in TIMES:
            assert mine[column].to_numpy() == pytest.approx(stored[column].to_numpy() * factor, rel=1e-12), (p, column)


def test_each_process_offset_is_its_median_minus_the_merged_one(tmp_path: Path) -> None:
    costs = BundleCostModel.load(two_processes(tmp_path))
    plain = BundleCostModel.load(STORED)
    for layer in range(costs.num_layers):
        c, base = costs.layer_costs(layer, 4, 1), plain.layer_costs(layer, 4, 1)
        assert c.fwd_offsets_s == pytest.approx((-0.05 * base.fwd_s, 0.05 * base.fwd_s), rel=1e-9)
        whole = float(plain.layers.loc[layer, "bwd_s"])  # the backward timed in one call (its spread's column)
        assert c.bwd_offsets_s == pytest.approx((-0.05 * whole, 0.05 * whole), rel=1e-9)
        assert base.fwd_offsets_s == ()
        # twice the micro-batch, twice the offset (as the times scale)
        assert costs.layer_costs(layer, 8, 1).fwd_offsets_s[1] == pytest.approx(2 * c.fwd_offsets_s[1], rel=1e-9)


def test_the_meeting_adds_the_offsets_variance_summed_over_the_stretch(tmp_path: Path) -> None:
    """The dense plan meets once per iteration (its first bucket after both micro-batches): the wait is
    e_2 sqrt(sigma^2 + tau^2), tau^2 the variance of the processes' offsets summed over 2 micro-batches
    of every layer's forward and backward (linear: the same process each time)."""
    bundle = two_processes(tmp_path)
    plan = Plan.load(ROOT / "examples" / "validation" / "embedding" / "emb-dense-dp2.yaml").replace(profile=str(bundle))
    on = simulate(plan, full=True, options=EngineOptions()).iteration_s
    off = simulate(plan, full=True, options=EngineOptions(process_offsets=False)).iteration_s
    shutil.rmtree(tmp_path / "plain", ignore_errors=True)
    plain = simulate(plan.replace(profile=str(STORED)), full=True, options=EngineOptions()).iteration_s
    costs = BundleCostModel.load(bundle)
    layers = [costs.layer_costs(i, plan.micro_batch, 1) for i in range(costs.num_layers)]
    m = plan.microbatches
    sigma2 = m * sum(c.fwd_sd_s ** 2 + c.bwd_sd_s ** 2 for c in layers)
    summed = [m * sum(c.fwd_offsets_s[p] + c.bwd_offsets_s[p] for c in layers) for p in (0, 1)]
    tau2 = offset_variance(summed)
    assert tau2 == pytest.approx((summed[1] - summed[0]) ** 2 / 2)
    e2 = expected_max_normal(2)
    assert off == pytest.approx(plain, rel=1e-12)  # the option off, or no table: as before
    assert on - off == pytest.approx(e2 * (math.sqrt(sigma2 + tau2) - math.sqrt(sigma2)), rel=1e-6)
    assert on - off > 1e-3  # 5% of ~100 ms of compute apart: milliseconds, not noise
    # the fast estimate charges the same wait (sim.estimate: the stage's offsets x micro-batches)
    from sim.compile import resolve_plan
    from tests.test_estimate_cpu import estimate_s

    assert estimate_s(resolve_plan(plan)) == pytest.approx(on, rel=1e-9)
