"""Swapping moves what the Program says: every SWAP_OUT / SWAP_IN the runtime executed moved the
bytes its lowered instruction carries (the simulator's ledger moves exactly those), for a fraction
swap and for DELTA's per-layer swaps. The runtime copies each storage once (views of one QKV
output, a tensor two operators save) and the lowering does not count the stage input the runtime
keeps on the device (sim.memory.movable_bytes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.plan import Plan


def memory_of(workload: str, **memory: object) -> object:
    return Plan.from_dict({"workload": workload, "memory": memory}).memory


def check_swap_bytes(plan: Plan, tmp_path: Path) -> int:
    """Run ``plan`` against the single-process reference and compare every swap row's bytes with
    its lowered instruction. The first stage's input (the batch's token ids or images, which the
    cost model does not size: ``checkpoint_bytes`` of layer 0 is 0) stays on the device and is the
    one difference allowed. Returns how many swap rows were compared."""
    from exec.contract import compile_for_run
    from tests.test_runtime import check_against_reference
    from traces.runrecord import read_run_record

    check_against_reference(plan, tmp_path)
    table = read_run_record(tmp_path / plan.name / "record").instructions
    program = compile_for_run(plan).program
    from exec.workloads import get_workload

    inputs = get_workload(plan.workload).make_batch(plan.micro_batch).inputs
    batch_input = inputs.numel() * inputs.element_size()
    compared = 0
    for rank, rp in program.ranks.items():
        for ins in rp.instructions:
            if ins.kind.value not in ("SWAP_OUT", "SWAP_IN"):
                continue
            rows = table[(table["rank"] == rank) & (table["index"] == ins.index)]
            assert len(rows), f"rank {rank} {ins.label}: not executed"
            moves_first = not ins.layers or program.stage_layers[0][0] in ins.layers
            first_stage_input = batch_input if ins.stage == 0 and moves_first else 0
            for measured in rows["bytes"]:
                assert measured == ins.bytes - first_stage_input, \
                    f"rank {rank} {ins.label}: runtime moved {measured} B, the Program says {ins.bytes} B"
                compared += 1
    return compared


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["gpt-tiny", "resnet-tiny"])
def test_swap_all_moves_the_lowered_bytes(workload: str, tmp_path: Path) -> None:
    from tests.test_runtime import plan_of

    plan = plan_of(workload=workload, pp=2, schedule="gpipe", microbatches=4, micro_batch=2).model_copy(
        update={"name": f"{workload}-swap-all", "memory": memory_of(workload, policy="none", swap=[1.0, 1.0])})
    assert check_swap_bytes(plan, tmp_path) == 2 * 2 * 4 * 2  # ranks x (out, in) x micro-batches x iterations


@pytest.mark.slow
def test_delta_swaps_move_the_lowered_bytes(gpt_tiny_profile: Path, tmp_path: Path) -> None:
    """DELTA (director cost: on a CPU a copy is cheaper than a recompute) under a budget halfway
    between the static bytes and the keep-everything peak: per-layer swaps, some of the first layer
    of a stage (whose input stays on the device)."""
    from sim.simulate import simulate
    from tests.test_runtime import plan_of

    base = plan_of(pp=2, schedule="gpipe", microbatches=4, micro_batch=1).model_copy(
        update={"name": "gpt-tiny-delta-swap-bytes", "profile": str(gpt_tiny_profile)})
    keep = simulate(base, full=True)
    budget = max((sum(v for k, v in m.breakdown.items() if k in ("parameters", "gradients", "optimizer"))
                  + m.peak_bytes) // 2 for m in keep.memory.values())
    plan = base.model_copy(update={"memory": memory_of("gpt-tiny", policy="delta", budget_gb=budget / 2**30,
                                                       tiny_mb=0.0, director="swap")})
    assert check_swap_bytes(plan, tmp_path) > 0
