"""The ids request's host work as a profile measurement (issue 12, eighth session): before a
synchronous ids exchange the runtime's thread makes the batch and finds the unique ids, their
owners, order and counts (``exec.embedding.request_host_work``); the validation profile times it
per request (bundle ``settings.ids_request_host_s``, absent from older bundles: nothing charged) and
the engine and the estimate charge it on every synchronous ids exchange (``sim.embedding.exchange_s``).
Only presence and exact accounting are tested here, no time."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from analysis.validation.profiling import has_ids_request, profile_plan_workload
from sim.compile import resolve_plan
from sim.embedding import ids_request_host_s
from sim.plan import Plan
from traces.bundle import read_bundle, write_bundle

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_estimate_cpu import engine_s, estimate_s  # noqa: E402
from test_overlap_cpu import loopback_plan  # noqa: E402


@pytest.mark.slow
def test_the_profile_of_a_2_rank_embedding_plan_holds_its_ids_request_host_work() -> None:
    plan = Plan.from_dict({"workload": "gpt-tiny", "parallelism": {"dp": 2},
                           "schedule": {"microbatches": 2, "micro_batch": 1},
                           "embedding": {"method": "embrace", "schedule": "sequential"},
                           "cluster": {"preset": "local-cpu-2", "devices_per_node": 2}})
    assert has_ids_request(plan) and not has_ids_request(plan.replace(embedding={"method": "dense"}))
    host_s = profile_plan_workload(plan, processes=2, warmup=1, repeats=2).meta["settings"]["ids_request_host_s"]
    assert math.isfinite(host_s) and host_s > 0


@pytest.mark.parametrize("method", ["embrace-seq", "embrace-2d", "ps"])
def test_a_prediction_from_a_bundle_with_it_differs_by_exactly_it_per_request(tmp_path: Path, method: str) -> None:
    """The run-7 loopback profile (which predates the measurement: 0 charged) and the same bundle
    with 1 ms of host work per request: each synchronous ids exchange holds the rank's thread
    between its computes (sequential EmbRace: one per micro-batch; 2D: the next iteration's, one per
    micro-batch, after the dense step; the parameter server: one per iteration), so the iteration
    moves by exactly that many milliseconds, in the engine and in the estimate."""
    without = loopback_plan(tmp_path, method, cpu=None)
    assert ids_request_host_s(resolve_plan(without).costs) == 0.0  # an older bundle: nothing charged
    bundle = read_bundle(Path(without.profile))
    bundle.meta["settings"]["ids_request_host_s"] = 1e-3
    write_bundle(bundle, tmp_path / "with-host-work")
    with_it = without.replace(profile=str(tmp_path / "with-host-work"))
    requests = 1 if method == "ps" else without.microbatches
    a, b = resolve_plan(without), resolve_plan(with_it)
    assert engine_s(b) - engine_s(a) == pytest.approx(requests * 1e-3, abs=1e-9)
    assert estimate_s(b) - estimate_s(a) == pytest.approx(requests * 1e-3, abs=1e-9)


def test_the_merged_profile_keeps_the_median_over_the_processes_or_nothing(tmp_path: Path) -> None:
    """Two co-located processes measured 1 and 3 ms: the merged profile says 2 (their median, as
    for every time); where one of them did not measure it, the merged profile does not claim it."""
    from analysis.validation.profiling import _merge_profiles

    plan = loopback_plan(tmp_path, "embrace-seq", cpu=None)
    one, two = (read_bundle(Path(plan.profile)) for _ in range(2))
    one.meta["settings"]["ids_request_host_s"], two.meta["settings"]["ids_request_host_s"] = 1e-3, 3e-3
    assert _merge_profiles([one, two]).meta["settings"]["ids_request_host_s"] == pytest.approx(2e-3)
    del two.meta["settings"]["ids_request_host_s"]
    assert "ids_request_host_s" not in _merge_profiles([one, two]).meta["settings"]
