"""The expected wait at a collective for its latest member (sim.meeting, issue 12 sixth session):
its closed forms, and the engine and the estimate charging it from a cost model's standard
deviations (a profile's spreads) and nothing without them."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sim.compile import resolve_plan
from sim.costs import LayerCosts
from sim.engine import EngineOptions
from sim.estimate import Estimator
from sim.meeting import IQR_PER_SD, expected_max_normal, lateness_s, sd_from_spread
from sim.plan import Plan
from sim.simulate import simulate

ROWS = "sim/data/embrace_rows_wikitext2.json"
# gpt-wordlm on one 8-GPU node (analytic costs: a CPU plan needs a real profile), 8 data-parallel
# ranks, 2 micro-batches
BASE = {"workload": "gpt-wordlm", "workload_options": {"data": "wikitext-2"}, "dtype": "fp32",
        "cluster": {"preset": "a100-64", "nodes": 1}, "parallelism": {"dp": 8},
        "schedule": {"micro_batch": 8, "microbatches": 2}}
DP = 8
RELATIVE_SD = 0.1  # every phase's standard deviation, as a share of its time (a profile spread of 0.135)


class SpreadCosts:
    """A cost model with the standard deviations a profile's spreads would give: ``relative`` x
    each phase's time (what sim.bundle_costs computes from a spread of relative x 1.349)."""

    def __init__(self, base: object, relative: float) -> None:
        self.base, self.relative = base, relative
        self.num_layers = base.num_layers  # type: ignore[attr-defined]

    def layer_costs(self, layer: int, micro_batch: int, tp: int) -> LayerCosts:
        c, k = self.base.layer_costs(layer, micro_batch, tp), self.relative  # type: ignore[attr-defined]
        return replace(c, fwd_sd_s=c.fwd_s * k, bwd_sd_s=c.bwd_s * k, bwd_input_sd_s=c.bwd_input_s * k,
                       bwd_weight_sd_s=c.bwd_weight_s * k, recompute_sd_s=c.recompute_s * k)

    def optimizer_step_s(self, param_bytes: int) -> float:
        return self.base.optimizer_step_s(param_bytes)  # type: ignore[attr-defined]

    def layer_weights(self, by: str) -> list[float]:
        return self.base.layer_weights(by)  # type: ignore[attr-defined]


def _plan(**embedding: object) -> Plan:
    return Plan.from_dict({**BASE, "name": "meeting", "embedding": embedding or {"method": "dense"}})


def _iteration(p: Plan, relative: float, meeting_waits: bool = True, full: bool = True) -> float:
    resolved = resolve_plan(p)
    if relative:
        resolved = replace(resolved, costs=SpreadCosts(resolved.costs, relative))
    return simulate(p, full=full, resolved=resolved, options=EngineOptions(meeting_waits=meeting_waits)).iteration_s


def _compute_variance(p: Plan, relative: float) -> float:
    """The variance of one rank's forwards and backwards of an iteration (independent phases)."""
    costs = resolve_plan(p).costs
    layers = [costs.layer_costs(layer, p.micro_batch, 1) for layer in range(costs.num_layers)]
    return p.microbatches * sum((c.fwd_s * relative) ** 2 + (c.bwd_s * relative) ** 2 for c in layers)


def test_expected_maximum_of_normals_has_its_closed_forms() -> None:
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-9)
    assert expected_max_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), rel=1e-9)
    sample = np.random.default_rng(0).standard_normal((200_000, 8)).max(axis=1).mean()
    assert expected_max_normal(8) == pytest.approx(sample, rel=0.01)
    assert lateness_s(4e-6, 2) == pytest.approx(2e-3 / math.sqrt(math.pi))
    assert lateness_s(4e-6, 1) == 0.0 and lateness_s(0.0, 8) == 0.0


def test_a_profile_spread_is_an_interquartile_range_over_the_median() -> None:
    sample = np.random.default_rng(1).normal(10e-3, 1e-3, 400_000)
    q1, q3 = np.percentile(sample, [25, 75])
    median = float(np.median(sample))
    assert sd_from_spread(median, float((q3 - q1) / median)) == pytest.approx(1e-3, rel=0.01)
    assert pytest.approx(2 * 0.6744897501960817) == IQR_PER_SD  # 2 x the standard normal's 75th percentile
    assert sd_from_spread(1e-3, float("nan")) == 0.0 and sd_from_spread(1e-3, float("inf")) == 0.0
    assert sd_from_spread(1e-3, None) == 0.0 and sd_from_spread(1e-3, pd.NA) == 0.0  # a bundle without spreads


def test_the_all_reduce_waits_for_the_latest_replica_of_the_iterations_compute() -> None:
    p = _plan()
    waited = _iteration(p, RELATIVE_SD) - _iteration(p, RELATIVE_SD, meeting_waits=False)
    assert waited == pytest.approx(lateness_s(_compute_variance(p, RELATIVE_SD), DP), rel=1e-9)
    # the symmetric engine (replica 0 only) waits as long as the full one (every replica arrives late alike)
    assert _iteration(p, RELATIVE_SD, full=False) == pytest.approx(_iteration(p, RELATIVE_SD), rel=1e-12)


def test_without_spreads_nothing_waits() -> None:
    p = _plan()
    assert _iteration(p, 0.0) == _iteration(p, 0.0, meeting_waits=False)


def test_sequential_embrace_meets_before_each_forward_2d_once() -> None:
    """Sequential lookups gate every forward: the ranks meet after each micro-batch, so the two
    micro-batches' waits add (2 e_n sigma_mb); 2D's next lookups follow the tables' step, so its
    ranks meet once per iteration, over both micro-batches (e_n sqrt(2) sigma_mb), as dense."""
    sequential = _plan(method="embrace", schedule="sequential", row_stats=ROWS)
    two_d = _plan(method="embrace", schedule="2d", row_stats=ROWS)
    waits = {name: _iteration(p, RELATIVE_SD) - _iteration(p, RELATIVE_SD, meeting_waits=False)
             for name, p in (("sequential", sequential), ("2d", two_d), ("dense", _plan()))}
    per_iteration = lateness_s(_compute_variance(two_d, RELATIVE_SD), DP)
    assert waits["2d"] == pytest.approx(per_iteration, rel=0.02)
    assert waits["dense"] == pytest.approx(per_iteration, rel=0.02)
    assert waits["sequential"] == pytest.approx(math.sqrt(2) * per_iteration, rel=0.05)


def test_the_estimate_charges_the_engines_wait() -> None:
    p = _plan()
    resolved = resolve_plan(p)

    def estimate(relative: float) -> float:
        costs = SpreadCosts(resolved.costs, relative) if relative else resolved.costs
        return Estimator(costs, resolved.comm, p.dtype).estimate(
            schedule=p.schedule.name, dp=p.dp, tp=p.tp, pp=p.pp, chunks=p.chunks, micro_batch=p.micro_batch,
            microbatches=p.microbatches, stage_layers=resolved.stage_layers, policy=resolved.policy, tp_overlap=0,
            sync_method=p.gradient_sync.method, bucket_mb=p.gradient_sync.bucket_mb).iteration_s

    engine_wait = _iteration(p, RELATIVE_SD) - _iteration(p, 0.0)
    assert estimate(RELATIVE_SD) - estimate(0.0) == pytest.approx(engine_wait, rel=1e-6)


def test_the_estimate_charges_sequential_embraces_waits_per_micro_batch() -> None:
    from sim.embedding import estimate_terms
    from sim.estimate import _layout
    from sim.schedules import SCHEDULES

    p = _plan(method="embrace", schedule="sequential", row_stats=ROWS)
    resolved = resolve_plan(p)
    rank_of, stages_of = _layout(p.pp, p.chunks, SCHEDULES[p.schedule.name].placement)

    def estimate(relative: float) -> float:
        costs = SpreadCosts(resolved.costs, relative) if relative else resolved.costs
        terms = estimate_terms(p, resolved.stage_layers, resolved.comm, costs, list(rank_of), list(stages_of))
        return Estimator(costs, resolved.comm, p.dtype).estimate(
            schedule=p.schedule.name, dp=p.dp, tp=p.tp, pp=p.pp, chunks=p.chunks, micro_batch=p.micro_batch,
            microbatches=p.microbatches, stage_layers=resolved.stage_layers, policy=resolved.policy, tp_overlap=0,
            sync_method=p.gradient_sync.method, bucket_mb=p.gradient_sync.bucket_mb, embedding=terms).iteration_s

    engine_wait = _iteration(p, RELATIVE_SD) - _iteration(p, 0.0)
    assert estimate(RELATIVE_SD) - estimate(0.0) == pytest.approx(engine_wait, rel=0.05)


@pytest.mark.slow  # a real profile: 14-29 s on the loaded 2-core machine
def test_a_real_profiles_spreads_become_the_waits(tmp_path: Path) -> None:
    """lstm-tiny profiled on this CPU (timings are whatever they are; what is checked is how the
    bundle's spreads reach the cost model and the engine, not their values)."""
    from exec.profiler import Steadiness, profile_workload
    from sim.bundle_costs import BundleCostModel
    from traces.bundle import write_bundle

    bundle = profile_workload("lstm-tiny", micro_batch=1, warmup=1, repeats=5, with_ops=False, device="cpu",
                              steady=Steadiness(window=0, max_warmup=0, retries=0))  # a fixed number of rounds
    directory = write_bundle(bundle, tmp_path / "lstm-tiny")
    costs = BundleCostModel.load(directory)
    rows = bundle.layers.set_index("layer")
    for layer in range(costs.num_layers):
        c = costs.layer_costs(layer, 2, 1)  # micro-batch 2: twice the profiled times and deviations
        for phase in ("fwd", "bwd"):
            expected = 2 * rows.loc[layer, f"{phase}_s"] * rows.loc[layer, f"{phase}_spread"] / IQR_PER_SD
            assert getattr(c, f"{phase}_sd_s") == pytest.approx(expected, rel=1e-9), (layer, phase)
    p = Plan.from_dict({"name": "tiny-dp2", "workload": "lstm-tiny", "cluster": {"preset": "local-cpu-2"},
                        "parallelism": {"dp": 2}, "schedule": {"micro_batch": 2, "microbatches": 2},
                        "profile": str(directory)})
    layers = [costs.layer_costs(layer, 2, 1) for layer in range(costs.num_layers)]
    variance = 2 * sum(c.fwd_sd_s ** 2 + c.bwd_sd_s ** 2 for c in layers)
    assert variance > 0
    waited = _iteration(p, 0.0) - _iteration(p, 0.0, meeting_waits=False)
    assert waited == pytest.approx(lateness_s(variance, 2), rel=1e-9)
