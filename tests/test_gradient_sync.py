"""Gradient-sync methods, simulated and executed: fp16 compression against dense all-reduce."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from exec.contract import LEARNING_RATE
from exec.launcher import run_plan
from sim.plan import Plan
from sim.simulate import simulate
from traces.errors import ConfigError
from traces.runrecord import read_run_record

GPU_PLAN = {"workload": "gpt2-medium", "workload_options": {"seq": 64}, "cluster": {"preset": "dgx-a100-8"},
            "dtype": "fp32", "parallelism": {"dp": 8}, "schedule": {"micro_batch": 1, "microbatches": 1}}
RUN_PLAN = {"workload": "gpt-tiny", "cluster": {"preset": "local-cpu-2"}, "parallelism": {"dp": 2},
            "schedule": {"name": "1f1b", "micro_batch": 2, "microbatches": 2}}
STEPS = 3  # warm-up 1 + 2 measured iterations: three Adam steps
# Adam's defaults (torch.optim.Adam, which exec.contract.make_optimizer uses).
BETA1, BETA2 = 0.9, 0.999
FP16_UNIT_ROUNDOFF = 2.0**-11  # IEEE 754 binary16: 11 significand bits


def with_method(base: dict, method: str, **fields: object) -> Plan:
    return Plan.from_dict({**base, "name": f"gs-{method}", "gradient_sync": {"method": method}, **fields})


def test_fp16_halves_the_wire_and_pays_two_casts() -> None:
    dense, fp16 = (simulate(with_method(GPU_PLAN, m)) for m in ("allreduce", "fp16"))
    rows = {name: r.table[r.table["kind"] == "ALLREDUCE"] for name, r in (("dense", dense), ("fp16", fp16))}
    assert len(rows["dense"]) == len(rows["fp16"]) > 0
    assert list(rows["fp16"]["bytes"]) == [b // 2 for b in rows["dense"]["bytes"]]
    # Each fp16 bucket costs its all-reduce of half the bytes plus 3 x wire bytes at memory bandwidth.
    from sim.cluster import load_cluster
    from sim.comm import ClusterComm

    cluster = load_cluster(GPU_PLAN["cluster"])
    comm = ClusterComm(cluster)
    group = tuple(range(8))
    for dense_bytes, duration in zip(rows["dense"]["bytes"], rows["fp16"]["end_s"] - rows["fp16"]["start_s"],
                                     strict=True):
        wire = dense_bytes // 2
        expected = comm.collective_s("allreduce", wire, group) + 3 * wire / cluster.device.memory_bandwidth_Bps
        assert duration == pytest.approx(expected, rel=1e-9)
    assert fp16.iteration_s < dense.iteration_s  # this plan is all-reduce bound


def test_fp16_needs_fp32_gradients() -> None:
    with pytest.raises(ConfigError) as error:
        simulate(with_method(GPU_PLAN, "fp16", dtype="bf16"))
    assert "gradient_sync.method" in str(error.value) and "\n" not in str(error.value)


def adam_step_bound(t: int) -> float:
    """The largest |m_hat / sqrt(v_hat)| Adam can take at step t, over all gradient sequences:
    by Cauchy-Schwarz, |sum a_i g_i| <= sqrt(sum a_i^2 / b_i) sqrt(sum b_i g_i^2), with a_i, b_i the
    bias-corrected EMA weights of m and v."""
    a = [(1 - BETA1) * BETA1 ** (t - i) / (1 - BETA1**t) for i in range(1, t + 1)]
    b = [(1 - BETA2) * BETA2 ** (t - i) / (1 - BETA2**t) for i in range(1, t + 1)]
    return math.sqrt(sum(x * x / y for x, y in zip(a, b, strict=True)))


@pytest.mark.slow
def test_fp16_training_stays_within_the_fp16_bound_of_dense(tmp_path: Path) -> None:
    params, wire = {}, {}
    for method in ("allreduce", "fp16"):
        out = tmp_path / method
        run_plan(with_method(RUN_PLAN, method), iterations=STEPS - 1, warmup=1, out_dir=out, save_params=True)
        params[method] = [torch.load(out / "params" / f"rank{r}.pt") for r in (0, 1)]
        table = read_run_record(out / "record").instructions
        wire[method] = list(table.loc[table["kind"] == "ALLREDUCE", "bytes"])
    # What the runtime really sent: half the bytes.
    assert wire["fp16"] == [b // 2 for b in wire["allreduce"]]
    fp16, dense = params["fp16"], params["allreduce"]
    # The replicas agree bit for bit: every rank applied the same reduced gradient.
    assert all(torch.equal(fp16[0][k], fp16[1][k]) for k in fp16[0])
    diff = torch.cat([(fp16[0][k] - dense[0][k]).abs().flatten() for k in dense[0]])
    assert diff.max() > 0  # the compression changed something
    # Every element: each run moves it by at most lr * B_t per step.
    assert diff.max() <= 2 * LEARNING_RATE * sum(adam_step_bound(t) for t in range(1, STEPS + 1))
    # A gradient held in fp16 (a share rounded, the sum rounded: relative error <= 2u) moves Adam's
    # m_hat and sqrt(v_hat) by at most 2u each relative, so its step by at most ~4 x 2u relative; over
    # the steps |dtheta| <= lr * sum_t 8u B_t. Gradients below fp16's normal range lose more, so the
    # bound is asked of the median element, not of all.
    typical = LEARNING_RATE * sum(8 * FP16_UNIT_ROUNDOFF * adam_step_bound(t) for t in range(1, STEPS + 1))
    assert diff.median() <= typical


def test_fp16_reducer_rounds_each_gradient_once_to_binary16(tmp_path: Path) -> None:
    """On a one-rank gloo group the sum is the share itself: what comes back is the gradient
    rounded once to fp16, within the unit roundoff of binary16 (a coarser format fails this)."""
    import torch.distributed as dist
    from torch import nn

    from exec.gradient_sync import REDUCERS

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        layer = nn.Linear(64, 64)
        generator = torch.Generator().manual_seed(0)
        magnitudes = 10.0 ** (torch.rand(64, 64, generator=generator) * 5 - 3)  # 1e-3 .. 1e2: fp16 normals
        grads = magnitudes * torch.where(torch.rand(64, 64, generator=generator) < 0.5, -1.0, 1.0)
        layer.weight.grad = grads.clone()
        reducer = REDUCERS["fp16"]([layer.weight], dist.group.WORLD, 1)
        reducer.wait()
        assert reducer.nbytes == grads.numel() * 2
        assert torch.equal(layer.weight.grad, grads.to(torch.float16).to(torch.float32))
        relative = ((layer.weight.grad - grads).abs() / grads.abs()).max().item()
        assert 0 < relative <= FP16_UNIT_ROUNDOFF
    finally:
        dist.destroy_process_group()
