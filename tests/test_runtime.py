"""The runtime executes a plan's Program for real: every parallel layout trains exactly like one process.

Each case launches real gloo ranks with ``run_plan`` for three optimizer steps (one warm-up plus
two measured iterations) and compares the losses of every step and every parameter afterwards
with a single-process reference that sees the same seeded weights, the same global batch and the
same micro-batching (``exec.runtime.batch_seed``), and takes the same Adam steps.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from exec.launcher import RunFailed, run_plan
from exec.parallel.tp import apply_tensor_parallel
from exec.runtime import FAULT_ENV, LEARNING_RATE, batch_seed, load_workload, make_optimizer, setup_for_run
from exec.structure import StructuralCosts
from exec.workloads import run_layers
from sim.plan import Plan
from sim.simulate import prepare
from traces.runrecord import read_run_record
from traces.schema import INSTRUCTION_TABLE

pytestmark = pytest.mark.slow

STEPS = 3  # = warmup 1 + iterations 2


def plan_of(workload: str = "gpt-tiny", dp: int = 1, tp: int = 1, pp: int = 1, schedule: str = "1f1b",
            microbatches: int = 2, micro_batch: int = 2, **extra: object) -> Plan:
    world = dp * tp * pp
    return Plan(name=f"{workload}-dp{dp}-tp{tp}-pp{pp}-{schedule}", workload=workload, dp=dp, tp=tp, pp=pp,
                schedule=schedule, microbatches=microbatches, micro_batch=micro_batch,
                cluster={"preset": "local-cpu-2", "devices_per_node": world}, **extra)


def reference(plan: Plan, steps: int = STEPS) -> tuple[torch.nn.ModuleList, list[float]]:
    """One process, the whole model, the same batches and Adam steps, one thread like each rank
    (convolutions and BatchNorm round differently with another thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(plan, steps)
    finally:
        torch.set_num_threads(threads)


def _reference(plan: Plan, steps: int) -> tuple[torch.nn.ModuleList, list[float]]:
    workload = load_workload(plan)
    model = workload.build_layers(0, None)
    optimizer = make_optimizer(list(model.parameters()))
    losses = []
    count = plan.dp * plan.microbatches
    for iteration in range(steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for replica in range(plan.dp):
            for mb in range(plan.microbatches):
                batch = workload.make_batch(plan.micro_batch, seed=batch_seed(iteration, replica, mb, plan.dp,
                                                                              plan.microbatches))
                loss = workload.loss(run_layers(model, batch.inputs), batch.targets)
                (loss / count).backward()
                total += loss.item()
        optimizer.step()
        losses.append(total / count)
    return model, losses


def expected_params(model: torch.nn.ModuleList, plan: Plan, tp_rank: int) -> dict[str, torch.Tensor]:
    """The reference parameters as TP rank ``tp_rank`` holds them."""
    sharded = apply_tensor_parallel(copy.deepcopy(model), tp_rank, plan.tp, group=None)
    return {f"{i}.{name}": p.detach() for i, layer in enumerate(sharded)
            for name, p in layer.named_parameters()}


def key_bias_mask(name: str, value: torch.Tensor, plan: Plan) -> torch.Tensor | None:
    """Entries of a QKV bias that shift the keys (head-major layout [head][q, k, v][head_dim])."""
    if not name.endswith(("attn.qkv.bias", "attn.qkv.linear.bias")):
        return None
    workload = load_workload(plan)
    head_dim = workload.cfg.hidden // workload.cfg.heads
    position = torch.arange(value.numel()) % (3 * head_dim)
    return (position >= head_dim) & (position < 2 * head_dim)


# Parameters: Adam divides each gradient element by its own running magnitude, so the rounding
# differences of another summation order (all-reduce, TP partial sums, micro-batch accumulation)
# become, for elements whose gradient is tiny, differences of the step itself (seen here: up to
# 1.5e-5 on single elements). So each tensor must agree to 1e-5 relative in norm, and every element
# to 1e-4 (1/30 of the largest movement Adam makes in three steps, 3 x lr): a wrong shard, a lost
# micro-batch or a missing all-reduce moves whole rows by the order of that movement.
TENSOR_RTOL = 1e-5
ELEMENT_ATOL = 1e-4


def assert_params_close(name: str, value: torch.Tensor, expected: torch.Tensor, plan: Plan,
                        rank: int) -> None:
    """Equal within fp32 tolerance, except where the true gradient is exactly zero.

    A key bias adds the same q.b_k to every score of a query, which softmax ignores, so its
    gradient is zero up to rounding noise, and Adam turns that noise into steps of up to the
    learning rate in either direction. Those entries are only checked to have moved by no more
    than Adam's largest steps (lr per step)."""
    where = f"rank {rank} parameter {name}"
    assert value.shape == expected.shape, f"{where}: shape {tuple(value.shape)} != {tuple(expected.shape)}"
    keys = key_bias_mask(name, value, plan)
    if keys is not None:
        assert (value[keys] - expected[keys]).abs().max() <= 2 * LEARNING_RATE * STEPS, where
        value, expected = value[~keys], expected[~keys]
    error = (value - expected).norm() / expected.norm().clamp_min(1e-12)
    assert error <= TENSOR_RTOL, f"{where}: relative error {error:.2e} > {TENSOR_RTOL}"
    worst = (value - expected).abs().max()
    assert worst <= ELEMENT_ATOL, f"{where}: largest element difference {worst:.2e} > {ELEMENT_ATOL}"


def check_against_reference(plan: Plan, tmp_path: Path) -> None:
    result = run_plan(plan, iterations=STEPS - 1, warmup=1, out_dir=tmp_path / plan.name, timeout_s=120,
                      save_params=True)
    model, ref_losses = reference(plan)
    assert len(result.losses) == STEPS
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    # Every parameter of the model is held by some pipeline rank, and equal to the reference's.
    for tp_rank in range(plan.tp):
        expected = expected_params(model, plan, tp_rank)
        seen = set()
        for rank in range(plan.world_size):
            if rank % plan.tp != tp_rank:
                continue
            held = torch.load(result.paths["params"] / f"rank{rank}.pt")
            for name, value in held.items():
                assert_params_close(name, value, expected[name], plan, rank)
                seen.add(name)
        assert seen == set(expected), f"parameters nobody holds: {sorted(set(expected) - seen)[:5]}"
    # The table has the simulator's columns and every instruction of every measured iteration.
    assert list(result.table.columns[: len(INSTRUCTION_TABLE.columns)]) == INSTRUCTION_TABLE.column_names
    assert sorted(result.table["iteration"].unique()) == [1, 2]
    assert (result.table["end_s"] >= result.table["start_s"]).all()
    # ... and those are exactly the instructions of the Program the simulator interprets.
    program = setup_for_run(plan).program
    lowered = sorted((r, i.index, i.kind.value) for r, rp in program.ranks.items() for i in rp.instructions)
    for _, rows in result.table.groupby("iteration"):
        assert sorted(zip(rows["rank"], rows["index"], rows["kind"], strict=True)) == lowered
    record = read_run_record(result.paths["record"])
    assert len(record.instructions) == len(result.table)
    assert result.paths["trace"].is_file()


CASES = [
    plan_of(dp=2),
    plan_of(pp=2, schedule="gpipe"),
    plan_of(pp=2, schedule="1f1b"),
    plan_of(pp=2, schedule="merak-shifted", microbatches=4, micro_batch=1),
    plan_of(pp=2, schedule="zb-h1"),
    plan_of(tp=2),
    plan_of(dp=2, pp=2, schedule="1f1b"),
    plan_of(tp=2, pp=2, schedule="zb-h1"),
    plan_of(workload="lstm-tiny", dp=2),
    plan_of(workload="resnet-tiny", dp=2),
]


@pytest.mark.parametrize("plan", CASES, ids=[p.name for p in CASES])
def test_run_equals_single_process_reference(plan: Plan, tmp_path: Path) -> None:
    check_against_reference(plan, tmp_path)


def test_recompute_and_swap_do_not_change_training(tmp_path: Path) -> None:
    plan = plan_of(pp=2, schedule="1f1b", recompute=[0.5, 0.0], swap=[0.5, 0.5])
    check_against_reference(plan, tmp_path)
    table = read_run_record(tmp_path / plan.name / "record").instructions
    assert {"RECOMPUTE", "SWAP_OUT", "SWAP_IN"} <= set(table["kind"])
    assert (table.loc[table["kind"] == "SWAP_OUT", "bytes"] > 0).all()


def test_message_bytes_are_the_lowered_bytes(tmp_path: Path) -> None:
    """StructuralCosts sizes messages exactly: each send moves the bytes the Program says."""
    plan = plan_of(pp=2, schedule="1f1b")
    result = run_plan(plan, iterations=1, warmup=0, out_dir=tmp_path / "bytes", timeout_s=120)
    setup = prepare(plan, costs=StructuralCosts(load_workload(plan), plan.micro_batch, plan.dtype, plan.tp))
    sends = result.table[result.table["kind"].isin(["SEND_ACT", "SEND_GRAD"])]
    block = setup.costs.layer_costs(1, plan.micro_batch, 1).output_bytes
    assert len(sends) == 2 * plan.microbatches
    assert (sends["bytes"] == block).all()


def test_failing_rank_stops_the_run_naming_rank_and_instruction(tmp_path: Path, monkeypatch) -> None:
    plan = plan_of(pp=2, schedule="1f1b")
    monkeypatch.setenv(FAULT_ENV, "rank=1,index=2,iteration=1")  # rank 1's BWD s1 mb0, second iteration
    with pytest.raises(RunFailed) as info:
        run_plan(plan, iterations=2, warmup=0, out_dir=tmp_path / "fault", timeout_s=60)
    message = str(info.value)
    assert "rank 1 failed at iteration 1 instruction 2 (BWD s1 mb0)" in message
    assert "injected fault" in message
    # The iteration measured before the failure is kept.
    record = read_run_record(tmp_path / "fault" / "record")
    assert record.summary["status"] == "failed"
    assert set(record.instructions["rank"]) == {0, 1}
    assert set(record.instructions["iteration"]) == {0}


def test_hanging_rank_is_stopped_by_the_timeout(tmp_path: Path, monkeypatch) -> None:
    plan = plan_of(pp=2, schedule="1f1b")
    monkeypatch.setenv(FAULT_ENV, "rank=0,index=0,iteration=0,mode=hang")
    with pytest.raises(RunFailed) as info:
        run_plan(plan, iterations=1, warmup=0, out_dir=tmp_path / "hang", timeout_s=4)
    assert "run hung" in str(info.value)
    assert "rank 0 at iteration 0 instruction 0 (FWD s0 mb0" in str(info.value)
    assert os.environ.get(FAULT_ENV)  # only this test's environment carried the fault


def test_module_entry_under_torchrun(tmp_path: Path) -> None:
    """``python -m exec.runtime plan.yaml`` under torchrun writes the same run record."""
    import socket
    import subprocess
    import sys

    plan = plan_of(pp=2, schedule="1f1b")
    plan_path = plan.dump(tmp_path / "plan.yaml")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(port), "-m", "exec.runtime",
               str(plan_path), "--out", str(tmp_path / "out"), "--iterations", "2", "--warmup", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    record = read_run_record(tmp_path / "out" / "record")
    torch.testing.assert_close(torch.tensor(record.summary["losses"]), torch.tensor(reference(plan)[1]),
                               rtol=1e-5, atol=1e-6)
    assert sorted(record.instructions["iteration"].unique()) == [1, 2]
