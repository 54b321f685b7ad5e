"""Compute slowed while its rank moves data (issue 12, seventh session): ``EngineOptions.overlap_slowdown``
counts only the time a transfer overlaps the compute, and only while data moves (not while a
collective waits for its group); on a host whose cores the ranks share, a measured communication
CPU cost slows the overlapped compute and the transfer both, sharing the cores in proportion to
what each wants (``sim.host_cpu``, eighth session)."""

from __future__ import annotations

import math
import shutil
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from analysis.validation.comm import merge_cpu_fits
from sim.comm import ClusterComm
from sim.compile import ResolvedPlan, compile_plan, resolve_plan
from sim.costs import UniformCosts
from sim.engine import EngineOptions
from sim.host_cpu import Stretch, overlap, overlap_stretch, shared_stretch
from sim.plan import Plan
from sim.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "examples" / "validation" / "embedding"
COSTS = UniformCosts(num_layers=6, fwd_s=1e-3, bwd_input_s=1e-3, bwd_weight_s=1e-3, saved_bytes=1 << 20,
                     output_bytes=1 << 16, param_bytes=1 << 22)


def rank0(plan: Plan, full: bool, **options: object) -> tuple[float, dict[int, tuple[float, float]]]:
    result = simulate(plan, costs=COSTS, full=full, options=EngineOptions(**options))  # type: ignore[arg-type]
    rows = result.table[(result.table["rank"] == 0) & (result.table["parent"] < 0)]
    return result.iteration_s, {int(i): (float(b), float(e)) for i, b, e in zip(rows["index"], rows["start_s"],
                                                                                 rows["end_s"], strict=True)}


@pytest.mark.parametrize("full", [False, True])
def test_the_2d_forward_is_slowed_only_while_the_gradient_exchange_moves_data(full: bool) -> None:
    plan = Plan.load(PLANS / "emb-embrace-2d-dp2.yaml").replace(profile=None)
    _, before = rank0(plan, full)
    s = 1.0
    _, after = rank0(plan, full, overlap_slowdown=s)
    fwd, exchange = 3, 2  # FWD mb1 starts with the gradient exchange of mb0 (docs/embrace.md, 2D schedule)
    assert plan.embedding.schedule == "2d"
    assert before[fwd][0] == before[exchange][0]
    moving = before[exchange][1] - before[exchange][0]
    compute = before[fwd][1] - before[fwd][0]
    assert 0 < moving < compute
    # while it moves, the forward progresses 1 / (1 + s) as fast: it ends moving x s / (1 + s) later
    assert after[fwd][1] - after[fwd][0] == pytest.approx(compute + moving * s / (1 + s), rel=1e-9)
    assert after[0] == before[0] and after[1] == before[1]  # nothing overlaps the first micro-batch


@pytest.mark.parametrize("name", ["dense", "embrace-seq"])
def test_a_schedule_whose_compute_overlaps_no_transfer_is_not_slowed(name: str) -> None:
    plan = Plan.load(PLANS / f"emb-{name}-dp2.yaml").replace(profile=None)
    assert rank0(plan, True, overlap_slowdown=2.0)[0] == rank0(plan, True)[0]


def measured_comm(plan: Plan, cpu_alpha_s: float, cpu_Bps: float, host_cores: int | None,
                  alpha_s: float = 1e-3, bandwidth_Bps: float = 1e9) -> ResolvedPlan:
    """``plan`` resolved with a benchmark's fits for every kind it sends (the times of the cluster's
    own link model, at the plan's sizes: ``alpha_s`` + bytes / ``bandwidth_Bps``, 1 ms + bytes / 1 GB/s
    unless told), CPU measured as given."""
    resolved = resolve_plan(plan, COSTS)
    cluster = resolved.cluster.model_copy(update={"host_cores": host_cores})
    fits = pd.DataFrame([{"primitive": p, "backend": "gloo", "world_size": 2, "alpha_s": alpha_s,
                          "bandwidth_Bps": bandwidth_Bps, "r2": 1.0, "note": "", "cpu_alpha_s": cpu_alpha_s,
                          "cpu_bandwidth_Bps": cpu_Bps} for p in ("all_reduce", "all_to_all", "send_recv")])
    return replace(resolved, cluster=cluster, comm=ClusterComm(cluster, fits))


def forward_mb1(resolved: ResolvedPlan) -> tuple[float, float]:
    """(FWD mb1's duration, the mb0 gradient exchange's duration) on rank 0 of the 2D plan."""
    result = simulate(resolved.plan, full=True, resolved=resolved, options=EngineOptions())
    rows = result.table[(result.table["rank"] == 0) & (result.table["parent"] < 0)].set_index("index")
    return (float(rows.loc[3, "end_s"] - rows.loc[3, "start_s"]),
            float(rows.loc[2, "end_s"] - rows.loc[2, "start_s"]))


def test_a_measured_cpu_cost_slows_the_overlapped_compute_and_the_transfer_both() -> None:
    plan = Plan.load(PLANS / "emb-embrace-2d-dp2.yaml").replace(profile=None)
    free, exchange = forward_mb1(measured_comm(plan, math.nan, math.nan, 2))  # CPU not measured
    cpu_alpha, cpu_Bps = 4e-4, 2e9
    shared = measured_comm(plan, cpu_alpha, cpu_Bps, 2)
    slowed, moved = forward_mb1(shared)
    grads = next(i for i in compile_plan(plan, resolved=shared).program.ranks[0].instructions if i.index == 2)
    u = sum(cpu_alpha + nbytes / cpu_Bps for _, nbytes in (grads.phases or (("all_to_all", grads.bytes),))) \
        / exchange
    assert 0 < u < 1
    # 2 ranks on 2 cores: the compute thread and the transfer want 1 + u cores of each rank's one,
    # so both progress 1 / (1 + u) as fast while they overlap
    k = shared_stretch(2, 2, u)
    assert k.compute == pytest.approx(1 + u) and k.transfer == pytest.approx(1 + u)
    assert moved == pytest.approx(exchange * k.transfer, rel=1e-9)  # the exchange ends inside the forward
    assert slowed == pytest.approx(free + exchange * (k.compute - 1), rel=1e-9)
    assert (slowed, moved) == pytest.approx(overlap(free, [(exchange, k)]), rel=1e-9)  # the estimate's form
    # a host with a core for every thread, or cores not shared (a GPU), slows nothing
    assert forward_mb1(measured_comm(plan, cpu_alpha, cpu_Bps, 4)) == (free, exchange)
    assert forward_mb1(measured_comm(plan, cpu_alpha, cpu_Bps, None)) == (free, exchange)


def test_a_send_is_slowed_on_its_channel_while_its_rank_computes() -> None:
    """A point-to-point send moves on its rank's egress channel (``sim.channel.SharedChannel``): the
    shared slowdown re-times it there, latency and bytes, as it re-times a collective."""
    plan = Plan.from_dict({"workload": "gpt-tiny", "parallelism": {"pp": 2},
                           "schedule": {"name": "gpipe", "microbatches": 4}})
    costs = UniformCosts(num_layers=4, fwd_s=3e-3, bwd_input_s=1e-3, bwd_weight_s=1e-3, saved_bytes=1 << 16,
                         output_bytes=1 << 20, param_bytes=1 << 20)

    def rows(host_cores: int | None) -> pd.DataFrame:
        resolved = measured_comm(plan, 4e-4, 2e9, host_cores)
        resolved = replace(resolved, costs=costs)
        table = simulate(plan, full=True, resolved=resolved, options=EngineOptions()).table
        return table[(table["rank"] == 0) & (table["parent"] < 0)].set_index("index")

    alone, shared = rows(None), rows(2)
    send, fwd = 1, 2  # SEND_ACT of mb0, then FWD of mb1 beside it
    assert alone.loc[send, "kind"] == "SEND_ACT" and alone.loc[fwd, "kind"] == "FWD"
    took = {name: t.loc[send, "end_s"] - t.loc[send, "start_s"] for name, t in (("alone", alone), ("shared", shared))}
    nbytes = int(alone.loc[send, "bytes"])
    assert took["alone"] == pytest.approx(1e-3 + nbytes / 1e9, rel=1e-9)
    u = (4e-4 + nbytes / 2e9) / took["alone"]
    assert took["shared"] == pytest.approx(took["alone"] * (1 + u), rel=1e-9)
    assert shared.loc[fwd, "start_s"] == alone.loc[fwd, "start_s"]


def test_the_shared_stretch_shares_the_cores_in_proportion_to_what_each_side_wants() -> None:
    assert shared_stretch(2, 2, 0.0) == (1.0, 1.0)
    assert shared_stretch(2, 2, 0.5) == (1.5, 1.5)  # 1.5 cores wanted of each rank's one
    assert shared_stretch(2, 4, 0.5) == (1.0, 1.0)  # 3 cores wanted of 4: every thread keeps what it wants
    # 4 ranks on 2 cores: the compute had half a core (lockstep profile), now 0.5 / 1.25 of one;
    # the transfer had its 0.25 alone, now 0.25 x 0.5 / 1.25
    assert shared_stretch(4, 2, 0.25) == pytest.approx((1.25, 2.5))
    assert shared_stretch(2, 3, 0.74) == pytest.approx((1.74 / 1.5, 1.74 / 1.5))
    assert shared_stretch(2, None, 5.0) == (1.0, 1.0)
    # overlap_slowdown is the compute's floor; the transfer keeps the shared rule's stretch
    assert overlap_stretch(2, 2, 0.5, 1.0) == (2.0, 1.5)
    assert overlap_stretch(2, None, 0.5, 1.0) == (2.0, 1.0)


def test_overlap_gives_both_ends_over_a_sequence_of_transfers() -> None:
    k = Stretch(2.0, 3.0)
    assert overlap(1.0, []) == (1.0, 0.0)
    assert overlap(1.0, [(3.0, k)]) == pytest.approx((2.0, 2.0 + 3.0 - 2.0 / 3.0))  # compute ends first
    assert overlap(4.0, [(1.0, k)]) == pytest.approx((3.0 + 4.0 - 1.5, 3.0))  # the transfer ends first
    # two transfers: the compute outlasts the first, ends beside the second, which then ends alone
    assert overlap(2.0, [(1.0, k), (2.0, k)]) == pytest.approx((3.0 + 1.0, 3.0 + 1.0 + 2.0 - 1.0 / 3.0))


# the run-7 loopback profile of the 2D plan (tests/data/comm/README.md) and the CPU of communicating
# measured on the same host (runs/comm-cpu-12a, docs/embrace.md "The host's CPU"; loaded machine)
LOOPBACK_2D = ROOT / "tests" / "data" / "comm" / "loopback-2d-run7"
LOOPBACK_CPU = pd.DataFrame([("all_reduce", 2, 3.19e-4, 2.27e9), ("all_to_all", 2, 1.21e-4, 5.40e9),
                             ("send_recv", 2, 6.8e-5, 4.85e9)],
                            columns=["primitive", "world_size", "cpu_alpha_s", "cpu_bandwidth_Bps"])


def loopback_plan(tmp_path: Path, name: str = "embrace-2d", cpu: pd.DataFrame | None = LOOPBACK_CPU) -> Plan:
    """The validation plan on the run-7 loopback profile, with ``cpu`` added to its link fits."""
    bundle = tmp_path / "profile"
    if not bundle.exists():
        shutil.copytree(LOOPBACK_2D, bundle)
        if cpu is not None:
            merge_cpu_fits(bundle, cpu)
    return Plan.load(PLANS / f"emb-{name}-dp2.yaml").replace(profile=str(bundle))


def test_the_iteration_ends_with_its_last_instruction_not_a_superseded_timeout(tmp_path: Path) -> None:
    """A compute re-timed while transfers start and end leaves its earlier wake-up in simpy's queue
    (a timeout cannot be cancelled); the iteration is the last instruction's end, not the clock after
    those wake-ups (they put the 2D plan's iteration 3.3 ms past its last instruction)."""
    plan = loopback_plan(tmp_path)
    for options in (EngineOptions(), EngineOptions(overlap_slowdown=1.0), EngineOptions(meeting_waits=False)):
        result = simulate(plan, full=True, options=options)
        assert result.iteration_s == float(result.table["end_s"].max())


def test_a_runtime_delta_forward_is_slowed_layer_by_layer_while_its_rank_sends() -> None:
    """Run-time DELTA runs a forward layer by layer (``Engine._delta_forward``); each layer goes
    through ``_progress`` like any compute, and its row shows the time it took. Times of whole
    seconds (UniformCosts) also check that a compute whose rest falls below the clock's resolution
    ends (it looped forever, so the test gives up after 60 s)."""
    import signal

    def give_up(*_: object) -> None:
        raise TimeoutError("the simulation did not end")

    plan = Plan.from_dict({"workload": "gpt-tiny", "parallelism": {"pp": 2},
                           "schedule": {"name": "gpipe", "microbatches": 4},
                           "memory": {"policy": "delta", "budget_gb": 0.008, "decide": "runtime", "tiny_mb": 0}})
    costs = UniformCosts(num_layers=4, saved_bytes=1 << 16, output_bytes=1 << 12, param_bytes=1 << 20)
    previous = signal.signal(signal.SIGALRM, give_up)
    signal.alarm(60)
    try:
        tables = {s: simulate(plan, full=True, costs=costs, options=EngineOptions(overlap_slowdown=s, layer_rows=True))
                  .table for s in (0.0, 1.0)}
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    s = 1.0
    rows = {k: t[(t["rank"] == 0) & (t["parent"] < 0)].set_index("index") for k, t in tables.items()}
    fwd, send = 2, 1  # FWD mb1 starts as the send of mb0's output does and outlasts it
    assert rows[0.0].loc[fwd, "kind"] == "FWD" and rows[0.0].loc[send, "kind"] == "SEND_ACT"
    moving = rows[0.0].loc[send, "end_s"] - rows[0.0].loc[send, "start_s"]
    took = {k: r.loc[fwd, "end_s"] - r.loc[fwd, "start_s"] for k, r in rows.items()}
    assert took[s] == pytest.approx(took[0.0] + moving * s / (1 + s), rel=1e-12)
    # the layers' rows add up to the compute, slowdown included (the releases between them are copies)
    layers = {k: t[(t["rank"] == 0) & (t["parent"] == fwd) & (t["kind"] == "FWD")] for k, t in tables.items()}
    assert len(layers[s]) == 2
    spent = {k: float((x["end_s"] - x["start_s"]).sum()) for k, x in layers.items()}
    assert spent[s] - spent[0.0] == pytest.approx(moving * s / (1 + s), rel=1e-9)
