"""The fast estimate prices EmbRace as the engine runs it (issue 12, seventh session): each rank's
optimizer steps over its own shard of the tables (under 2D the tables' own step beside the buckets),
and on a host whose cores the ranks share, the cores that the transfers moving beside compute take
from it and the compute from them (``sim.host_cpu.overlap_stretch``, the engine's rule), so the
search ranks embedding methods on a CPU cluster as the engine does; and ``overlap_slowdown`` on any
cluster (eighth session). On the run-7 loopback profile (tests/data/comm/README.md)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from sim.compile import ResolvedPlan, resolve_plan
from sim.embedding import estimate_terms
from sim.engine import EngineOptions
from sim.estimate import Estimator, _layout
from sim.estimate_pipeline import steady_count
from sim.plan import Plan
from sim.schedules import SCHEDULES
from sim.simulate import simulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_overlap_cpu import LOOPBACK_CPU, loopback_plan, measured_comm  # noqa: E402


def estimate_s(resolved: ResolvedPlan, overlap_slowdown: float = 0.0) -> float:
    p = resolved.plan
    rank_of, stages_of = _layout(p.pp, p.chunks, SCHEDULES[p.schedule.name].placement)
    terms = estimate_terms(p, resolved.stage_layers, resolved.comm, resolved.costs, list(rank_of), list(stages_of))
    return Estimator(resolved.costs, resolved.comm, p.dtype, p.workload, p.workload_options,
                     overlap_slowdown).estimate(
        schedule=p.schedule.name, dp=p.dp, tp=p.tp, pp=p.pp, chunks=p.chunks, micro_batch=p.micro_batch,
        microbatches=p.microbatches, stage_layers=resolved.stage_layers, policy=resolved.policy,
        tp_overlap=0, sync_method=p.gradient_sync.method, bucket_mb=p.gradient_sync.bucket_mb,
        embedding=terms, p2p=p.schedule.p2p).iteration_s


def engine_s(resolved: ResolvedPlan, overlap_slowdown: float = 0.0) -> float:
    return simulate(resolved.plan, full=True, resolved=resolved,
                    options=EngineOptions(overlap_slowdown=overlap_slowdown)).iteration_s


def heavier(scale: float) -> pd.DataFrame:
    """The measured CPU of communicating, ``scale`` times as much per call and per byte."""
    return LOOPBACK_CPU.assign(cpu_alpha_s=LOOPBACK_CPU["cpu_alpha_s"] * scale,
                               cpu_bandwidth_Bps=LOOPBACK_CPU["cpu_bandwidth_Bps"] / scale)


@pytest.mark.parametrize("name", ["embrace-2d", "embrace-seq", "ps", "dense"])
def test_the_estimate_steps_over_the_ranks_own_shard_as_the_engine_does(tmp_path: Path, name: str) -> None:
    # Before: every rank's step over the whole tables (8.5 MB more on this profile, 7.5 ms):
    # 2D +5.2%, sequential +2.5%, ps +4.4% against the engine.
    resolved = resolve_plan(loopback_plan(tmp_path, name, cpu=None))
    assert estimate_s(resolved) == pytest.approx(engine_s(resolved), rel=0.02)


@pytest.mark.parametrize("scale", [1.0, 4.0, 8.0])
def test_the_estimate_slows_the_2d_overlaps_by_the_cores_communication_takes(tmp_path: Path, scale: float) -> None:
    alone = resolve_plan(loopback_plan(tmp_path / "alone", cpu=None))
    shared = resolve_plan(loopback_plan(tmp_path / "shared", cpu=heavier(scale)))
    assert shared.cluster.host_cores == 2 and shared.comm.measures_cpu
    engine, estimate = engine_s(shared), estimate_s(shared)
    # the engine's 2D iteration is longer with the CPU measured (shared slowdown: 2.1 ms at the
    # measured CPU, 8.5 ms at 4x, 17.0 ms at 8x, mostly the buckets slowed beside the tables' step;
    # the comm-first rule gave 0.25 ms and 4.6 ms) and the estimate moves with it
    assert engine - engine_s(alone) > 2e-4 * scale
    assert estimate == pytest.approx(engine, rel=1e-3)
    assert estimate - estimate_s(alone) == pytest.approx(engine - engine_s(alone), rel=0.05)


def test_cores_that_are_not_shared_are_not_priced(tmp_path: Path) -> None:
    """A cluster that does not say its hosts' cores (every GPU cluster) keeps the estimate it had."""
    alone = resolve_plan(loopback_plan(tmp_path / "alone", cpu=None))
    shared = resolve_plan(loopback_plan(tmp_path / "shared", cpu=heavier(8.0)))
    unshared = replace(shared, cluster=shared.cluster.model_copy(update={"host_cores": None}))
    unshared.comm.cluster = unshared.cluster
    assert estimate_s(unshared) == estimate_s(alone)
    assert engine_s(unshared) == engine_s(alone)


@pytest.mark.parametrize("cpu", [True, False])
@pytest.mark.parametrize("slowdown", [1.0, 3.0])
def test_the_estimate_honours_overlap_slowdown_as_the_engine_does(tmp_path: Path, cpu: bool, slowdown: float) -> None:
    """``EngineOptions.overlap_slowdown`` slows the 2D plan's compute beside its transfers in the
    engine; the estimate prices it by the same function (``sim.host_cpu.overlap_stretch``), with
    the measured CPU of communicating (the floor of the shared slowdown's compute stretch) and
    without (cores not shared: the slowdown alone)."""
    resolved = resolve_plan(loopback_plan(tmp_path, cpu=LOOPBACK_CPU if cpu else None))
    engine, estimate = engine_s(resolved, slowdown), estimate_s(resolved, slowdown)
    assert engine - engine_s(resolved) > 1e-4 * slowdown  # the plan's compute overlaps its transfers
    assert estimate == pytest.approx(engine, rel=1e-6)


@pytest.mark.parametrize("microbatches", [4, 8])
@pytest.mark.parametrize(("schedule", "chunks"), [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved-1f1b", 2),
                                                  ("zb-v", 2)])
def test_the_estimate_slows_compute_beside_a_pipelines_sends_as_the_engine_does(schedule: str, chunks: int,
                                                                                microbatches: int) -> None:
    """Under ``overlap_slowdown`` the engine slows every compute that runs while its rank's sends
    move; the estimate's weighted pipeline run does the same (``sim.estimate_pipeline._sends_beside``),
    also past the schedule's capped micro-batch count (8 here: the run then goes to the plan's count;
    extending the capped run's steady state unslowed was 0.1-0.4% under the engine). A 10 Gbit/s
    link between the two stages makes the sends long enough to matter."""
    plan = Plan.from_dict({"workload": "gpt-tiny", "parallelism": {"pp": 2, "chunks": chunks},
                           "schedule": {"name": schedule, "microbatches": microbatches},
                           "cluster": {"preset": "dgx-a100-8", "devices_per_node": 2, "intra_node_link": "eth-10g"}})
    resolved = resolve_plan(plan)
    assert steady_count(schedule, 2, microbatches, chunks) == 4  # capped at 8
    slowed = engine_s(resolved, 1.0)
    assert slowed - engine_s(resolved) > 5e-5  # the sends overlap compute
    assert estimate_s(resolved, 1.0) == pytest.approx(slowed, rel=1e-9)


def test_a_ranks_sends_queue_behind_each_other_while_it_computes() -> None:
    """With a long sequence on a 10 Gbit/s link a send outlasts the action after it, so under the
    interleaved schedule a rank's next send starts when its previous one has moved (one send
    stream, as the engine's egress channel runs them), and the compute after it is slowed until
    then. The estimate equals the engine only with that queue (``_sends_beside``: starting each
    send at its action's end put it 0.17% under)."""
    plan = Plan.from_dict({"workload": "gpt-tiny", "workload_options": {"seq": 2048},
                           "parallelism": {"pp": 2, "chunks": 2},
                           "schedule": {"name": "interleaved-1f1b", "microbatches": 4, "micro_batch": 8},
                           "cluster": {"preset": "dgx-a100-8", "devices_per_node": 2, "intra_node_link": "eth-10g"}})
    resolved = resolve_plan(plan)
    slowed = engine_s(resolved, 1.0)
    assert slowed - engine_s(resolved) > 1e-3  # the sends overlap compute
    assert estimate_s(resolved, 1.0) == pytest.approx(slowed, rel=1e-9)


@pytest.mark.parametrize(("schedule", "chunks", "microbatches"), [("interleaved-1f1b", 2, 4), ("zb-v", 2, 4),
                                                                  ("dualpipev", 2, 8), ("1f1b", 1, 8)])
def test_compute_beside_buckets_before_a_ranks_last_compute_is_slowed_as_the_engine_slows_it(
        schedule: str, chunks: int, microbatches: int) -> None:
    """With chunks a rank's later virtual stages finish their backward before its last compute, so
    their gradient buckets move beside it; the engine slows that compute under ``overlap_slowdown``,
    and so does the estimate (the buckets in ``_sends_beside``, two per stage here, queued on the
    collective stream; priced only after the run, pp 4 dp 2 with 8 layers was -6.8% under the
    engine on interleaved, -5.8% on ZB-V, -0.8% on DualPipeV; starting each bucket when it is
    ready, not behind the one before, -1.7 to -3.3%). 1F1B: the same path where no bucket moves
    before the last compute."""
    plan = Plan.from_dict({"workload": "gpt-tiny", "workload_options": {"hidden": 512, "num_layers": 16},
                           "gradient_sync": {"method": "allreduce", "bucket_mb": 1},
                           "parallelism": {"dp": 2, "pp": 4, "chunks": chunks},
                           "schedule": {"name": schedule, "microbatches": microbatches},
                           "cluster": {"preset": "dgx-a100-8", "devices_per_node": 8, "intra_node_link": "eth-10g"}})
    resolved = resolve_plan(plan)
    assert estimate_s(resolved) == pytest.approx(engine_s(resolved), rel=1e-9)  # exact without the slowdown
    slowed = engine_s(resolved, 0.5)
    assert slowed - engine_s(resolved) > 1e-4
    assert estimate_s(resolved, 0.5) == pytest.approx(slowed, rel=1e-9)


@pytest.mark.parametrize(("schedule", "chunks"), [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_a_pipelines_sends_share_the_hosts_cores_in_the_estimate_as_in_the_engine(tmp_path: Path, schedule: str,
                                                                                   chunks: int) -> None:
    """The run-7 loopback profile with the CPU of communicating, the dense word LM split in two
    stages on the 2-core host: the engine slows each rank's compute beside its sends and the sends
    beside its compute (``overlap_stretch``), so a receiver waits longer; the estimate times each
    rank's compute and sends by the same rule (``sim.host_cpu.RankTransfers`` in
    ``sim.estimate_pipeline._sends_beside``), the last send beside the sender's optimizer step too.
    Before (sends' CPU not priced): -0.54% (1F1B), -1.14% (interleaved); the optimizer step left
    out of the run: -0.11% both."""
    data = loopback_plan(tmp_path, "dense").model_dump()
    data["parallelism"] = {"dp": 1, "pp": 2, "chunks": chunks}
    data["schedule"] = {"name": schedule, "microbatches": 4}
    resolved = resolve_plan(Plan.from_dict(data))
    assert estimate_s(resolved) == pytest.approx(engine_s(resolved), rel=1e-9)


@pytest.mark.parametrize(("schedule", "chunks", "pp"), [("1f1b", 1, 4), ("interleaved-1f1b", 2, 2), ("zb-h1", 1, 2),
                                                        ("zb-v", 2, 2)])
def test_buckets_and_sends_share_the_hosts_cores_in_the_estimate_as_in_the_engine(schedule: str, chunks: int,
                                                                                   pp: int) -> None:
    """dp 2 on a host of 2 cores shared by all the ranks: a rank's sends and gradient buckets move at
    once beside its compute, and their cores add up (``sim.host_cpu.RankTransfers``); the buckets'
    slowed end is the rank's gradient sync, and its optimizer step runs beside its last sends.
    Costs without spreads, so no meeting waits (the estimate adds those after the run: with the
    run-7 loopback profile's spreads it is -0.5 to +0.9% off on these schedules, exact with the
    engine's ``meeting_waits`` off). Before: -0.6% (1F1B) to -3.0% (ZB-H1, pp 4)."""
    plan = Plan.from_dict({"workload": "gpt-tiny", "parallelism": {"dp": 2, "pp": pp, "chunks": chunks},
                           "gradient_sync": {"method": "allreduce", "bucket_mb": 0.5},
                           "schedule": {"name": schedule, "microbatches": 4},
                           "cluster": {"preset": "local-cpu-2", "devices_per_node": 2 * pp}})
    resolved = measured_comm(plan, 4e-4, 2e9, 2)
    assert resolved.cluster.host_cores == 2 and resolved.comm.measures_cpu
    alone = measured_comm(plan, 4e-4, 2e9, None)
    assert engine_s(resolved) - engine_s(alone) > 1e-4  # the cores shared slow the iteration
    assert estimate_s(resolved) == pytest.approx(engine_s(resolved), rel=1e-9)


@pytest.mark.parametrize(("schedule", "chunks", "pp"), [("1f1b", 1, 4), ("zb-v", 2, 2)])
def test_a_blocking_send_holds_its_sender_where_the_hosts_cores_are_shared(schedule: str, chunks: int,
                                                                            pp: int) -> None:
    """``schedule.p2p: blocking`` on the shared 2-core host of the test above: the compute after a send
    waits for it (``sim.lower.blocking_p2p_pass``), so the send moves beside no compute of its rank (only
    the rank's buckets) and is not slowed by it; the estimate's run holds the sender until its send has
    moved (``_sends_beside``, ``RankTransfers.ends_alone``), exactly as the engine. Engine, blocking
    against async here: -24% (1F1B pp 4), -8% (ZB-V): the slowdown of compute beside sends is gone."""
    def plan(p2p: str) -> Plan:
        return Plan.from_dict({"workload": "gpt-tiny", "parallelism": {"dp": 2, "pp": pp, "chunks": chunks},
                               "gradient_sync": {"method": "allreduce", "bucket_mb": 0.5},
                               "schedule": {"name": schedule, "microbatches": 4, "p2p": p2p},
                               "cluster": {"preset": "local-cpu-2", "devices_per_node": 2 * pp}})

    blocking = measured_comm(plan("blocking"), 4e-4, 2e9, 2)
    assert abs(engine_s(blocking) / engine_s(measured_comm(plan("async"), 4e-4, 2e9, 2)) - 1) > 0.01
    assert estimate_s(blocking) == pytest.approx(engine_s(blocking), rel=1e-9)
