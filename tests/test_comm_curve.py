"""A collective's time from the benchmark's samples (sim.comm_curve), where sim.comm.ClusterComm
prices it for the engine and the estimate alike (issue 12: the 100 Mbit/s tbf link's burst).

The curve's rules on numbers chosen to show them, then the measured 100 Mbit/s link of the lead's
shaped-network run 7 (tests/data/comm) through a real plan: its sharded exchanges and its bucket
priced from the samples, not the fitted line, in the engine and in the estimate."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sim.comm import ClusterComm
from sim.comm_curve import MeasuredCurve, pooled_monotone
from sim.compile import compile_plan
from sim.embedding import estimate_terms, exchange_s
from sim.engine import EngineOptions
from sim.estimate import Estimator
from sim.plan import Plan
from sim.program import Kind
from sim.simulate import simulate
from traces.bundle import read_bundle

LINK = Path(__file__).parent / "data" / "comm" / "netns-100mbit-run7"
SIZES = np.array([1e3, 5e3, 25e3, 125e3])
ALPHA, BANDWIDTH = 2e-4, 1e7  # the fitted line: 200 us, 10 MB/s


def curve(times: list[float]) -> MeasuredCurve:
    made = MeasuredCurve.from_samples(SIZES, np.array(times), ALPHA, BANDWIDTH)
    assert made is not None
    return made


def test_exact_at_each_sample_and_straight_between_neighbours() -> None:
    times = [3e-4, 4e-4, 9e-4, 2e-2]  # non-decreasing: every sample kept as measured
    c = curve(times)
    for size, t in zip(SIZES, times, strict=True):
        assert c.seconds(size) == pytest.approx(t, rel=1e-12)
    # halfway in bytes between two samples: halfway in time (each segment its own alpha-beta line)
    assert c.seconds(15e3) == pytest.approx((4e-4 + 9e-4) / 2)
    assert c.seconds(75e3) == pytest.approx((9e-4 + 2e-2) / 2)


def test_a_larger_message_never_costs_less() -> None:
    assert pooled_monotone(np.array([3.0, 1.0, 2.0, 10.0])).tolist() == [2.0, 2.0, 2.0, 10.0]
    assert pooled_monotone(np.array([1.0, 5.0, 4.0, 6.0])).tolist() == [1.0, 4.5, 4.5, 6.0]
    c = curve([6e-4, 3e-4, 4.5e-4, 2e-2])  # scheduler noise at the small sizes: the first three pooled
    assert [c.seconds(s) for s in SIZES[:3]] == pytest.approx([4.5e-4] * 3)
    assert c.seconds(SIZES[3]) == pytest.approx(2e-2)
    grid = np.geomspace(1, 1e7, 400)  # inside, below and above the samples
    prices = [c.seconds(s) for s in grid]
    assert all(b >= a for a, b in zip(prices, prices[1:], strict=False))


def test_beyond_the_samples_the_fitted_bandwidth_extends_the_curve() -> None:
    c = curve([2.5e-4, 4e-4, 9e-4, 2e-2])
    assert c.seconds(1e6) == pytest.approx(2e-2 + (1e6 - 125e3) / BANDWIDTH)  # above: from the last sample
    assert c.seconds(800) == pytest.approx(2.5e-4 - 200 / BANDWIDTH)  # below: the same slope down ...
    assert c.seconds(16) == pytest.approx(ALPHA)  # ... never under the fitted latency
    assert curve([1e-4, 4e-4, 9e-4, 2e-2]).seconds(16) == pytest.approx(1e-4)  # nor over the first sample
    assert MeasuredCurve.from_samples(np.array([1e3, 1e3]), np.array([1e-4, 2e-4]), ALPHA, BANDWIDTH) is None


def _measured_link() -> tuple[pd.DataFrame, pd.DataFrame]:
    bundle = read_bundle(LINK)
    assert bundle.comm_samples is not None and bundle.comm_fits is not None
    return bundle.comm_samples, bundle.comm_fits


def test_the_shaped_links_burst_is_priced_from_its_samples() -> None:
    samples, fits = _measured_link()
    cluster = compile_plan(_plan("dense")).resolved.cluster
    measured, line = ClusterComm(cluster, fits, samples), ClusterComm(cluster, fits)
    a2a = samples[samples["primitive"] == "all_to_all"].sort_values("bytes")
    small, large = a2a.iloc[3], a2a.iloc[5]  # 135 KB (inside tbf's 256 KB burst), 3.5 MB (beyond it)
    for row in (small, large):
        assert measured.collective_s("all_to_all", int(row["bytes"]), (0, 1)) == pytest.approx(row["median_s"])
    # what the fitted line said instead: the burst's sizes too slow, the large ones too fast
    assert line.collective_s("all_to_all", int(small["bytes"]), (0, 1)) > 1.5 * small["median_s"]
    assert line.collective_s("all_to_all", int(large["bytes"]), (0, 1)) < large["median_s"] / 1.5
    bucket = samples[(samples["primitive"] == "all_reduce") & (samples["bytes"] == 3506224)]["median_s"].item()
    assert measured.collective_s("allreduce", 3506224, (0, 1)) == pytest.approx(bucket)  # the engine's name


def _plan(method: str) -> Plan:
    embedding = {"method": method} if method == "dense" else \
        {"method": method, "row_stats": "examples/validation/embedding/rows-gpt-wordlm-h64-s32.json"}
    return Plan.from_dict({
        "name": f"emb-{method}-100mbit", "workload": "gpt-wordlm",
        "workload_options": {"data": "wikitext-2", "hidden": 64, "heads": 2, "seq": 32},
        "cluster": {"preset": "local-cpu-2", "intra_node_link": {
            "kind": "ethernet", "latency_s": 3.0e-05, "name": "veth-tbf-100mbit", "bandwidth_Bps": 12500000.0,
            "source": "tc tbf rate 100mbit (scripts/netns_lib.sh)"}},
        "profile": str(LINK), "dtype": "fp32", "parallelism": {"dp": 2},
        "schedule": {"micro_batch": 4, "microbatches": 2}, "embedding": embedding})


@pytest.mark.parametrize("method", ["embrace", "ps"])
def test_engine_and_estimate_price_a_plans_exchanges_from_the_samples(method: str) -> None:
    p = _plan(method)
    samples, fits = _measured_link()
    compiled = compile_plan(p)
    curves = ClusterComm(compiled.resolved.cluster, fits, samples)
    # without meeting waits an exchange's row is exactly its price (the identical ranks arrive together)
    t = simulate(p, options=EngineOptions(meeting_waits=False)).table
    t = t[(t["kind"] == "ALLTOALL") & (t["parent"] == -1) & (t["rank"] == 0)]
    by_label = {i.label: i for i in compiled.program.ranks[0].instructions}
    imbalance = compiled.program.alltoall_imbalance
    assert len(t) == (6 if method == "embrace" else 3)
    for name, duration in zip(t["name"], t["end_s"] - t["start_s"], strict=True):
        assert duration == pytest.approx(exchange_s(curves, by_label[name].phases, (0, 1), imbalance), rel=1e-9)
    # the estimate's terms: every lookup (ids + rows) and the last gradient exchange, the same curve
    # (the ids' 16-byte counts below the samples included)
    resolved = compiled.resolved
    terms = estimate_terms(p, resolved.stage_layers, resolved.comm, resolved.costs, [0], [(0,)])
    assert terms is not None
    priced = {ins.tag: exchange_s(curves, ins.phases, (0, 1), imbalance) for ins in by_label.values()
              if ins.kind is Kind.ALLTOALL}
    lookups = sum(s for tag, s in priced.items() if tag.split(":")[1] in ("ids", "rows"))
    last = [s for tag, s in priced.items() if tag.split(":")[1] in ("grads", "push")][-1]
    assert terms.lookups_s == pytest.approx(lookups, rel=1e-9)
    assert terms.last_grads_s == pytest.approx(last, rel=1e-9)


def test_the_dense_plans_bucket_is_priced_from_the_samples() -> None:
    samples, fits = _measured_link()
    compiled = compile_plan(_plan("dense"))
    curves = ClusterComm(compiled.resolved.cluster, fits, samples)
    t = simulate(_plan("dense"), options=EngineOptions(meeting_waits=False)).table
    buckets = t[(t["kind"] == "ALLREDUCE") & (t["parent"] == -1) & (t["rank"] == 0)]
    assert len(buckets) >= 1 and all(3506224 < b < 17854464 for b in buckets["bytes"])  # between two samples
    for nbytes, duration in zip(buckets["bytes"], buckets["end_s"] - buckets["start_s"], strict=True):
        assert duration == pytest.approx(curves.collective_s("allreduce", nbytes, (0, 1)), rel=1e-9)


def test_a_pipelines_messages_are_priced_from_the_samples_in_the_engine_and_the_estimate() -> None:
    """Point-to-point on the sampled curve (issue 12, eighth session): a message weighs on its
    route's channel what the samples say it takes alone (``ClusterComm.p2p_weight``), so a lone
    send lasts the curve's time, not the fitted line's, and the estimate's hop is the same."""
    samples, fits = _measured_link()
    p = _plan("dense").model_copy(update={"name": "pp2-100mbit"})
    p = Plan.from_dict({**p.model_dump(mode="json", exclude_none=True), "parallelism": {"pp": 2},
                        "schedule": {"name": "gpipe", "micro_batch": 4, "microbatches": 1}})
    compiled = compile_plan(p)
    curves = ClusterComm(compiled.resolved.cluster, fits, samples)
    line = ClusterComm(compiled.resolved.cluster, fits)
    _, alpha, bandwidth = curves.p2p_route(0, 1)
    t = simulate(p, full=True, options=EngineOptions(meeting_waits=False)).table
    sends = t[(t["kind"].isin(["SEND_ACT", "SEND_GRAD"])) & (t["parent"] == -1)]
    assert len(sends) == 2
    p2p = samples[samples["primitive"] == "send_recv"].sort_values("bytes")
    curve = MeasuredCurve.from_samples(p2p["bytes"].to_numpy(), p2p["median_s"].to_numpy(), alpha, bandwidth)
    assert curve is not None
    for nbytes, duration in zip(sends["bytes"], sends["end_s"] - sends["start_s"], strict=True):
        assert curve.seconds(nbytes) > alpha  # inside the samples, above the fitted latency
        assert duration == pytest.approx(curve.seconds(nbytes), rel=1e-9)
        # the fitted line said otherwise (the burst's sizes slower)
        assert alpha + line.p2p_weight(nbytes) / bandwidth > 1.5 * duration
    estimator = Estimator(compiled.resolved.costs, compiled.resolved.comm, p.dtype, p.workload, p.workload_options)
    nbytes = int(sends["bytes"].iloc[0])
    assert estimator.p2p_hop_s(nbytes, 1, 1) == pytest.approx(curve.seconds(nbytes), rel=1e-9)
