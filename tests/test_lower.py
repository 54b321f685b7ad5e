"""Lowering, pass by pass: golden text forms of small Programs and structural invariants.

The golden files (tests/golden/lower/*.txt) were read by hand when written: every receive sits
right before its first consumer, every send right after its producer, a swap-in starts with the
compute step before its backward, buckets go last layers first. To accept a deliberate change,
rerun with PARATWIN_UPDATE_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from sim.costs import UniformCosts
from sim.lower import format_program, lower
from sim.memory import build_memory_policy
from sim.plan import Plan, migrate_flat
from sim.program import RECV_KINDS, SEND_KINDS, Kind, Program
from sim.schedules import SCHEDULES, generate_schedule

OP_LETTER = {Kind.FWD: "F", Kind.BWD: "B", Kind.BWD_I: "I", Kind.BWD_W: "W", Kind.RECOMPUTE: "R"}
GOLDEN = Path(__file__).parent / "golden" / "lower"
LAYERS = 4


def small_program(symmetric: bool = False, **fields: object) -> Program:
    plan = Plan.from_dict(migrate_flat({"workload": "gpt-tiny", **fields}))
    per = LAYERS // plan.num_stages
    stage_layers = [tuple(range(s * per, (s + 1) * per)) for s in range(plan.num_stages)]
    costs = UniformCosts(num_layers=LAYERS, saved_bytes=100, output_bytes=10, param_bytes=1000)
    policy = build_memory_policy(plan, stage_layers, costs, capacity_bytes=2**40)
    return lower(plan, stage_layers, costs, policy, symmetric=symmetric)


CASES = {
    "pp2-1f1b": dict(pp=2, microbatches=2, schedule="1f1b"),
    "pp2-1f1b-recompute-swap": dict(pp=2, microbatches=3, schedule="1f1b", recompute="full", swap=[0.5, 0.0]),
    "dp2-gpipe-two-buckets": dict(dp=2, microbatches=2, schedule="gpipe", dp_bucket_mb=0.0019),
    "pp2-zb-v": dict(pp=2, chunks=2, microbatches=2, schedule="zb-v"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_program_text_matches_golden(name: str) -> None:
    text = format_program(small_program(**CASES[name])) + "\n"
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("PARATWIN_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"lowering of {name} changed; review and rerun with PARATWIN_UPDATE_GOLDEN=1"


def _schedule_cases() -> list[tuple[str, int, int, int]]:
    cases = []
    for name, info in SCHEDULES.items():
        chunks = info.min_chunks
        pp = 2
        microbatches = 4 if name != "dualpipev" else 2 * pp
        cases.append((name, pp, chunks, microbatches))
    return cases


@pytest.mark.parametrize(("schedule", "pp", "chunks", "microbatches"), _schedule_cases())
@pytest.mark.parametrize("swap", [False, True])
def test_every_program_is_well_formed(schedule: str, pp: int, chunks: int, microbatches: int, swap: bool) -> None:
    fields: dict[str, object] = dict(pp=pp, dp=2, chunks=chunks, microbatches=microbatches, schedule=schedule,
                                     dp_bucket_mb=0.0019)
    if swap:
        fields["swap"] = [0.5] * (pp * chunks)
    program = small_program(**fields)
    sends: Counter[tuple[int, int, str, int]] = Counter()
    recvs: Counter[tuple[int, int, str, int]] = Counter()
    for rank, rp in program.ranks.items():
        for ins in rp.instructions:
            assert all(d < ins.index for d in ins.deps), f"rank {rank}: {ins.label} waits for a later instruction"
            if ins.kind in SEND_KINDS:
                sends[(rank, ins.peer, ins.tag, ins.bytes)] += 1
            if ins.kind in RECV_KINDS:
                recvs[(ins.peer, rank, ins.tag, ins.bytes)] += 1
            if ins.kind is Kind.SWAP_IN:
                outs = [rp.instructions[d] for d in ins.deps if rp.instructions[d].kind is Kind.SWAP_OUT]
                assert [(o.stage, o.microbatch) for o in outs] == [(ins.stage, ins.microbatch)]
        # The compute of the schedule, each action exactly once, in the schedule's order.
        actions = generate_schedule(schedule, pp, microbatches, chunks)[rp.coords.pp]
        compute = [(i.kind, i.stage, i.microbatch) for i in rp.instructions
                   if i.kind.is_compute and i.kind is not Kind.OPTIMIZER_STEP]
        assert [(OP_LETTER[k], s, m) for k, s, m in compute] == [(a.op.value, a.stage, a.microbatch) for a in actions]
        assert rp.instructions[-1].kind is Kind.OPTIMIZER_STEP
        assert (sum(1 for i in rp.instructions if i.kind is Kind.SWAP_IN)
                == (sum(1 for a in actions if a.op.value in "BI") if swap else 0))
    assert sends == recvs
