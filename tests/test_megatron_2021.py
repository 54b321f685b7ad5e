"""What Megatron-LM v2.5 ran, as options (docs/accuracy.md, section 3): blocking pipeline sends (the
compute after a send waits for its transfer), scatter/gather (each TP rank sends 1/tp, the receivers
all-gather it over NVLink), the fp16 optimizer's kernel-by-kernel step, and the gradient all-reduce
through a flat buffer. Per-layer recompute inside the backward: tests/test_recompute_in_backward.py."""

from __future__ import annotations

import pandas as pd
import pytest

from exec.contract import compile_for_run
from sim.comm import concurrent_groups
from sim.compile import resolve_plan
from sim.costs import UniformCosts
from sim.plan import Plan
from sim.simulate import simulate
from traces.errors import ConfigError

# Large messages on a slow inter-node link, so that a transfer takes a visible share of a step.
COSTS = UniformCosts(num_layers=4, fwd_s=1e-3, bwd_input_s=1e-3, bwd_weight_s=1e-3,
                     saved_bytes=1 << 20, output_bytes=64 << 20, param_bytes=1 << 20)
TWO_NODES = {"name": "two-nodes", "nodes": 2, "devices_per_node": 2, "device": "A100-80GB",
             "intra_node_link": "nvlink3", "inter_node_link": "ib-hdr", "nics_per_node": 1}


def plan(p2p: str = "async", scatter_gather: bool = False, tp: int = 1) -> Plan:
    cluster = TWO_NODES if tp > 1 else {**TWO_NODES, "devices_per_node": 1}
    return Plan.from_dict({"workload": "gpt-tiny", "cluster": cluster, "parallelism": {"pp": 2, "tp": tp},
                           "schedule": {"name": "1f1b", "microbatches": 4, "p2p": p2p,
                                        "p2p_scatter_gather": scatter_gather}})


def top_rows(p: Plan) -> tuple[float, pd.DataFrame]:
    result = simulate(p, full=True, costs=COSTS)
    return result.iteration_s, result.table[result.table["parent"] == -1]


def late_computes(table: pd.DataFrame) -> int:
    """Compute instructions that start before a send issued earlier on their rank has finished."""
    late = 0
    for _, rows in table.groupby("rank"):
        rows = rows.sort_values("index")
        send_end = 0.0
        for row in rows.itertuples():
            if row.kind in ("SEND_ACT", "SEND_GRAD"):
                send_end = max(send_end, row.end_s)
            elif row.stream == "compute" and row.start_s < send_end - 1e-12:
                late += 1
    return late


def test_blocking_sends_hold_the_compute_that_follows() -> None:
    async_s, async_rows = top_rows(plan("async"))
    blocking_s, blocking_rows = top_rows(plan("blocking"))
    assert late_computes(async_rows) > 0  # asynchronous sends overlap the next compute ...
    assert late_computes(blocking_rows) == 0  # ... blocking ones never do
    assert blocking_s > async_s


def test_scatter_gather_sends_a_tp_share_and_gathers_it() -> None:
    whole_s, whole = top_rows(plan("blocking", tp=2))
    split_s, split = top_rows(plan("blocking", scatter_gather=True, tp=2))
    sends = ["SEND_ACT", "SEND_GRAD"]
    assert (split[split["kind"].isin(sends)]["bytes"].to_numpy() * 2
            == whole[whole["kind"].isin(sends)]["bytes"].to_numpy()).all()
    # A receive ends once the TP group has all-gathered the whole tensor after the piece arrived.
    p = plan("blocking", scatter_gather=True, tp=2)
    comm = resolve_plan(p, COSTS).comm
    group = (2, 3)  # the TP group of pipeline rank 1
    gather = comm.collective_s("all_gather", 64 << 20, group, concurrent_groups(comm.cluster, 2, group))
    assert gather > 0
    for row in split[split["kind"] == "RECV_ACT"].itertuples():
        send = split[(split["kind"] == "SEND_ACT") & (split["microbatch"] == row.microbatch)
                     & (split["rank"] == row.rank - 2)]
        assert row.end_s >= float(send["end_s"].iloc[0]) + gather - 1e-12
    # Over one shared NIC, an eighth... here a half of the bytes outweighs an NVLink all-gather.
    assert split_s < whole_s


def test_the_runtime_compiles_scatter_gather_as_the_simulator_lowers_it() -> None:
    # It runs since session 5 (the real gloo run and its bytes: tests/test_runtime.py).
    p = Plan.from_dict({"workload": "gpt-tiny", "cluster": {"preset": "local-cpu-2", "devices_per_node": 4},
                        "parallelism": {"pp": 2, "tp": 2},
                        "schedule": {"microbatches": 2, "p2p_scatter_gather": True}})
    assert compile_for_run(p).program.p2p_gather_tp


def test_megatron_optimizer_step_moves_52_bytes_per_parameter() -> None:
    from sim.analytic import AnalyticCostModel
    from sim.cluster import load_cluster

    device = load_cluster("dgx-a100-8").device
    fused = AnalyticCostModel(device, "fp16").optimizer_step_s(2 * 10**9)  # 1e9 fp16 parameters
    megatron = AnalyticCostModel(device, "fp16", optimizer="megatron-fp16").optimizer_step_s(2 * 10**9)
    assert megatron / fused == pytest.approx(52 / 30)
    assert megatron == pytest.approx(52e9 / (device.memory_bandwidth_Bps * 0.9))
    with pytest.raises(ConfigError, match="optimizer"):
        AnalyticCostModel(device, "fp16", optimizer="sgd")


def test_flat_copies_price_six_bytes_per_gradient_byte_around_the_all_reduce() -> None:
    from sim.gradient_sync import GRADIENT_SYNC, DenseAllReduce, GradTensor, SyncContext

    bucket = (GradTensor(1, 1000, 2),)
    plain = GRADIENT_SYNC["allreduce"].plan(SyncContext(bucket, 4, DenseAllReduce()))
    copied = GRADIENT_SYNC["allreduce"].plan(SyncContext(bucket, 4, DenseAllReduce(flat_copies=True)))
    assert [(p.kind, p.nbytes) for p in plain] == [("allreduce", 2000)]
    assert [(p.kind, p.nbytes) for p in copied] == [("memory", 8000), ("allreduce", 2000), ("memory", 4000)]
    # ... and the simulator charges them: the iteration grows by 6 x the gradient bytes at memory speed.
    base = {"workload": "gpt2-small", "cluster": {"preset": "dgx-a100-8"}, "dtype": "fp16",
            "parallelism": {"dp": 8}, "schedule": {"micro_batch": 4, "microbatches": 1}}
    runs = {flag: simulate(Plan.from_dict({**base, "gradient_sync": {"method": "allreduce", "bucket_mb": 1e6,
                                                                     "flat_copies": flag}}))
            for flag in (False, True)}
    compiled = resolve_plan(Plan.from_dict(base))
    grad_bytes = sum(compiled.costs.layer_costs(i, 4, 1).grad_bytes for i in range(compiled.costs.num_layers))
    extra = 6 * grad_bytes / compiled.cluster.device.memory_bandwidth_Bps
    assert runs[True].iteration_s - runs[False].iteration_s == pytest.approx(extra, rel=1e-6)


def test_the_estimate_prices_blocking_sends_as_the_engine_does_where_they_are_small() -> None:
    """With transfers short beside a step (8 MiB over one HDR NIC: 0.3 ms, a step 6 ms), blocking
    sends mostly wait inside the waits 1F1B already has: the engine adds under 1% (0.63%), and so does
    the estimate, whose weighted run makes the compute after a send wait for it
    (``sim.estimate_pipeline.weighted_run``; before session 14's issue-9b it added nothing); the
    estimate prices scatter/gather's smaller hops."""
    from sim.estimate import Estimator

    costs = UniformCosts(num_layers=4, fwd_s=1e-3, bwd_input_s=1e-3, bwd_weight_s=1e-3,
                         saved_bytes=1 << 20, output_bytes=8 << 20, param_bytes=1 << 20)
    runs = {}
    for mode, sg in (("async", False), ("blocking", False), ("blocking", True)):
        p = plan(mode, sg, tp=2).replace(schedule={"microbatches": 16})
        r = resolve_plan(p, costs)
        estimate = Estimator(r.costs, r.comm, p.dtype).estimate(
            schedule=p.schedule.name, dp=p.dp, tp=p.tp, pp=p.pp, chunks=p.chunks, micro_batch=p.micro_batch,
            microbatches=p.microbatches, stage_layers=r.stage_layers, policy=r.policy, tp_overlap=0,
            sync_method="allreduce", bucket_mb=25, scatter_gather=sg, p2p=mode)
        runs[(mode, sg)] = simulate(p, costs=costs).iteration_s, estimate
    engine_async, engine_blocking = runs[("async", False)][0], runs[("blocking", False)][0]
    assert 0 < engine_blocking - engine_async < 0.01 * engine_async
    for key, (engine, estimate) in runs.items():  # the same durations through the same dependencies
        assert estimate.iteration_s == pytest.approx(engine, rel=1e-9), key
    assert runs[("blocking", True)][1].p2p_s < runs[("blocking", False)][1].p2p_s


def test_a_blocking_exchange_gathers_between_two_computes() -> None:
    """Megatron-LM v2.5 all-gathers a scatter/gather piece after the exchange that follows a compute
    has finished its transfers (``_communicate``: wait, ``torch.cuda.synchronize()``, then
    ``gather_split_1d_tensor``; docs/accuracy.md section 17). On the second stage of a two-micro-batch
    1F1B, micro-batch 1's activation arrives during backward 0; its forward must still start one
    all-gather of the whole tensor after the gradient send that follows backward 0."""
    p = plan("blocking", scatter_gather=True, tp=2).replace(schedule={"microbatches": 2})
    table = simulate(p, full=True, costs=COSTS).table

    def one(kind: str, microbatch: int, rank: int = 2) -> pd.Series:  # rank 2: pipeline rank 1, tp 0
        picked = table[(table["parent"] == -1) & (table["rank"] == rank) & (table["kind"] == kind)
                       & (table["microbatch"] == microbatch)]
        assert len(picked) == 1, (kind, microbatch, rank)
        return picked.iloc[0]

    # By hand: a ring all-gather of the whole 64 MiB tensor over the 2 GPUs of one NVLink node,
    # (n - 1) / n of the bytes at the link's bandwidth plus n - 1 hops of its latency.
    link = resolve_plan(p, COSTS).cluster.intra_node_link
    gather = (2 - 1) / 2 * (64 << 20) / link.effective_bandwidth_Bps + (2 - 1) * link.latency_s
    assert one("SEND_ACT", 1, rank=0)["end_s"] < one("BWD", 0)["end_s"]  # the piece was there early ...
    assert one("FWD", 1)["start_s"] == pytest.approx(one("SEND_GRAD", 0)["end_s"] + gather, rel=1e-9)  # ... still


def test_autograd_accumulation_adds_a_pass_per_backward_after_the_first() -> None:
    """Megatron-LM v2.5's local DDP without contiguous buffers leaves the accumulation of weight gradients
    over micro-batches to autograd: an in-place ``.grad +=`` per parameter after every backward but the
    first (docs/accuracy.md section 17). One rank, three micro-batches, the plan's
    ``workload_options.grad_accumulation``: the iteration grows by two passes of 3 x each layer's gradient
    bytes at the memory-bound kernels' rate, by hand."""
    from sim.analytic_costs import AnalyticCosts
    from sim.cluster import load_cluster

    def plan(mode: str) -> Plan:
        return Plan.from_dict({"workload": "gpt2-small",
                               "workload_options": {"attention": "unfused", "grad_accumulation": mode},
                               "cluster": {"preset": "dgx-a100-8", "devices_per_node": 1},
                               "dtype": "fp16", "schedule": {"micro_batch": 2, "microbatches": 3}})

    times = {mode: simulate(plan(mode)).iteration_s for mode in ("fused", "autograd")}
    fused = resolve_plan(plan("fused")).costs
    assert isinstance(fused, AnalyticCosts)
    grad_bytes = sum(fused.layer_costs(i, 2, 1).grad_bytes for i in range(fused.num_layers))
    rate = load_cluster(plan("fused").cluster).device.memory_bandwidth_Bps * fused.model.efficiency.mem_eff
    assert times["autograd"] - times["fused"] == pytest.approx((3 - 1) * 3 * grad_bytes / rate, rel=1e-6)
    with pytest.raises(ConfigError, match="workload_options.grad_accumulation") as bad:
        resolve_plan(plan("fp32"))
    assert "\n" not in str(bad.value) and "fused, autograd" in str(bad.value)
