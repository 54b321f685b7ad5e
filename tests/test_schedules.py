"""Tests of sim/schedules.py: orders against torch.distributed.pipelining and Merak's code,
structural validity over a grid, unit-cost properties (bubbles, memory, Merak's gain)."""

from __future__ import annotations

import json
import os
import socket
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.schedules import (
    SCHEDULES,
    Action,
    Op,
    check_preconditions,
    generate_schedule,
    merak_recompute,
    rank_stages,
    simulate_unit_costs,
    stage_to_rank,
    validate_schedule,
)
from tests.schedule_chunks import chunks_in_range
from traces.errors import ConfigError


def strings(actions: list[list[Action]]) -> list[list[str]]:
    return [[str(a) for a in row] for row in actions]


def run(name: str, pp: int, m: int, chunks: int = 1, recompute=None, **costs) -> dict:
    actions = generate_schedule(name, pp, m, chunks, recompute)
    placement = SCHEDULES[name].placement
    validate_schedule(actions, pp, m, chunks, placement)
    return simulate_unit_costs(actions, pp, chunks, placement, **costs)


# ---------------------------------------------------------------------------------------------
# torch.distributed.pipelining as the reference order


@pytest.fixture(scope="module")
def torch_order():
    """pipeline_order of a torch schedule class, built on a fake process group with meta stages.

    Nothing runs: the multi-stage schedules compute `pipeline_order` (their executed program)
    in __init__, and the single-stage ones expose their documented order the same way.
    """
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as S
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "a process group is already set up in the test process"

    def order(cls_name: str, pp: int, n: int, chunks: int) -> list[list[str]]:
        cls = getattr(S, cls_name)
        num_stages = pp * chunks
        dist.init_process_group("fake", rank=0, world_size=pp, store=FakeStore())
        try:
            v_shape = cls_name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
            mine = rank_stages(0, pp, chunks, "v" if v_shape else "loop")
            stages = [
                PipelineStage(torch.nn.Linear(2, 2, device="meta"), s, num_stages, torch.device("meta"))
                for s in mine
            ]
            single = cls_name in ("Schedule1F1B", "ScheduleGPipe")
            schedule = cls(stages[0], n) if single else cls(stages, n)
            rows = []
            for rank in range(pp):
                row = []
                for action in schedule.pipeline_order[rank]:
                    if action is None:
                        continue
                    # DualPipeV's OVERLAP_F_B holds (forward, backward); torch runs them in order.
                    for sub in action.sub_actions or (action,):
                        if sub.computation_type.value in ("F", "B", "I", "W"):
                            row.append(f"{sub.stage_index}{sub.computation_type.value}{sub.microbatch_index}")
                rows.append(row)
            return rows
        finally:
            dist.destroy_process_group()

    return order


TORCH_PEERS = [
    ("gpipe", "ScheduleGPipe", 1),
    ("interleaved-1f1b", "ScheduleInterleaved1F1B", 2),
    ("interleaved-1f1b", "ScheduleInterleaved1F1B", 3),
    ("zb-h1", "ScheduleInterleavedZeroBubble", 1),  # torch's ZB1P with one stage per rank
    ("zb-v", "ScheduleZBVZeroBubble", 2),
    ("dualpipev", "ScheduleDualPipeV", 2),
]
SIZES = [(2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 6), (4, 8), (4, 9), (5, 10), (6, 13), (8, 8), (8, 16)]


@pytest.mark.parametrize(("name", "cls_name", "chunks"), TORCH_PEERS)
def test_order_equals_torch(torch_order, name, cls_name, chunks):
    compared = 0
    for pp, m in SIZES:
        try:
            check_preconditions(name, pp, m, chunks)
        except ConfigError:
            continue
        if name == "zb-h1" and m % max(1, m // pp):
            # torch's ZB1P applies the interleaved round rule (m divisible by m // pp) even with
            # one stage per rank, where rounds play no part in the order; ZB-H1 needs no such
            # rule, so we accept these sizes and torch refuses them.
            with pytest.raises(ValueError, match="multiple of the number of rounds"):
                torch_order(cls_name, pp, m, chunks)
            continue
        assert strings(generate_schedule(name, pp, m, chunks)) == torch_order(cls_name, pp, m, chunks), (
            pp,
            m,
        )
        compared += 1
    assert compared >= 6


def test_1f1b_equals_torch_except_last_rank_off_by_one(torch_order):
    # Schedule1F1B.pipeline_order (its documented IR; the class does not execute it) gives the
    # last rank forwards F1..Fm instead of F0..F(m-1): it increments the forward index before the
    # first steady-state forward although that rank has no warm-up forward. Schedule1F1B's
    # executed loop warms up with min(m, pp - s) forwards, which is our order; the gloo test
    # below checks that on a real run. Every other rank matches action for action.
    for pp, m in SIZES:
        if m < pp:  # Schedule1F1B rejects fewer micro-batches than stages
            continue
        ours = strings(generate_schedule("1f1b", pp, m))
        theirs = torch_order("Schedule1F1B", pp, m, 1)
        assert ours[:-1] == theirs[:-1], (pp, m)
        last = pp - 1
        prefix = f"{last}F"
        shifted = [f"{prefix}{int(a[len(prefix) :]) + 1}" if a.startswith(prefix) else a for a in ours[-1]]
        assert theirs[-1] == shifted, (pp, m)
        assert ours[-1][:2] == [f"{last}F0", f"{last}B0"]


def _record_torch_run(rank: int, pp: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=pp)
    logs = {}
    for cls in (Schedule1F1B, ScheduleGPipe):
        for n in (pp, pp + 2):
            stage = PipelineStage(torch.nn.Linear(4, 4), rank, pp, torch.device("cpu"))
            log: list[str] = []
            forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

            def fwd(mb, *a, _f=forward, _log=log, **k):
                _log.append(f"{rank}F{mb}")
                return _f(mb, *a, **k)

            def bwd(mb, *a, _b=backward, _log=log, **k):
                _log.append(f"{rank}B{mb}")
                return _b(mb, *a, **k)

            stage.forward_one_chunk, stage.backward_one_chunk = fwd, bwd
            schedule = cls(stage, n, loss_fn=lambda out, target: ((out - target) ** 2).mean())
            batch = torch.randn(n, 4)
            if rank == 0:
                schedule.step(batch)
            elif rank == pp - 1:
                schedule.step(target=batch)
            else:
                schedule.step()
            logs[f"{cls.__name__}/{n}"] = log
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as fh:
        json.dump(logs, fh)
    dist.destroy_process_group()


@pytest.mark.slow
def test_1f1b_and_gpipe_equal_torch_executed_order(tmp_path):
    """Real 3-rank gloo run of torch's Schedule1F1B / ScheduleGPipe, recording the order in which
    each stage's forward_one_chunk / backward_one_chunk are called."""
    from tests.forked import start_ranks

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pp = 3
    start_ranks(_record_torch_run, (pp, port, str(tmp_path)), pp)
    logs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(pp)]
    for name, cls_name in (("1f1b", "Schedule1F1B"), ("gpipe", "ScheduleGPipe")):
        for n in (pp, pp + 2):
            ours = strings(generate_schedule(name, pp, n))
            assert [logs[r][f"{cls_name}/{n}"] for r in range(pp)] == ours, (name, n)


def test_stage_to_rank_matches_torch():
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for pp in range(1, 7):
        for chunks in range(1, 5):
            for placement in ("loop", "v"):
                theirs = generate_stage_to_rank_mapping(pp, pp * chunks, style=placement)
                assert {s: stage_to_rank(s, pp, chunks, placement) for s in range(pp * chunks)} == theirs
    assert rank_stages(1, 4, 2, "v") == [1, 6]
    with pytest.raises(ValueError):
        stage_to_rank(8, 4, 2, "loop")


# ---------------------------------------------------------------------------------------------
# Merak: the orders its code produces


# Derived by running the `steps()` generators of Merak's FullCriticalPathTrainSchedule
# ("merak-shifted"), PreRecomputeTrainSchedule ("merak-cooldown") and
# LastNoRecomputeTrainSchedule ("merak-cooldown-lastnorecompute") in
# github.com/HPDL-Group/Merak Merak/core/pipeline/schedule.py (commit 1593043) with stub
# instruction classes, and reading each stage's instruction stream: ForwardPass on a
# checkpointing stage -> F~ and a later R right before B; PreCheckpointForwardPass -> F~;
# RecomputeRecvGrad (issued before the gradient is received) -> R!; buffers resolved to
# micro-batches. "~" = forward without saved activations, "!" = eager recompute.
MERAK_REFERENCE = {
    ("merak-shifted", 4, 6): [
        "0F0~ 0F1~ 0F2~ 0F3~ 0R0 0B0 0F4~ 0R1 0B1 0F5~ 0R2 0B2 0R3! 0B3 0R4! 0B4 0R5! 0B5",
        "1F0~ 1F1~ 1F2~ 1R0! 1B0 1F3~ 1R1 1B1 1F4~ 1R2 1B2 1F5~ 1R3 1B3 1R4! 1B4 1R5! 1B5",
        "2F0~ 2F1~ 2F2~ 2R0! 2B0 2R1! 2B1 2F3~ 2R2 2B2 2F4~ 2R3 2B3 2F5~ 2R4 2B4 2R5 2B5",
        "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5",
    ],
    ("merak-cooldown", 4, 6): [
        "0F0~ 0F1~ 0F2~ 0F3~ 0R0 0B0 0F4~ 0R1 0B1 0F5~ 0R2 0B2 0R3! 0B3 0R4! 0B4 0R5! 0B5",
        "1F0~ 1F1~ 1F2~ 1R0 1B0 1F3~ 1R1 1B1 1F4~ 1R2 1B2 1F5~ 1R3 1B3 1R4! 1B4 1R5! 1B5",
        "2F0~ 2F1~ 2R0 2B0 2F2~ 2R1 2B1 2F3~ 2R2 2B2 2F4~ 2R3 2B3 2F5~ 2R4 2B4 2R5! 2B5",
        "3F0~ 3R0 3B0 3F1~ 3R1 3B1 3F2~ 3R2 3B2 3F3~ 3R3 3B3 3F4~ 3R4 3B4 3F5~ 3R5 3B5",
    ],
    ("merak-cooldown-lastnorecompute", 4, 6): [
        "0F0~ 0F1~ 0F2~ 0F3~ 0R0 0B0 0F4~ 0R1 0B1 0F5~ 0R2 0B2 0R3! 0B3 0R4! 0B4 0R5! 0B5",
        "1F0~ 1F1~ 1F2~ 1R0 1B0 1F3~ 1R1 1B1 1F4~ 1R2 1B2 1F5~ 1R3 1B3 1R4! 1B4 1R5! 1B5",
        "2F0~ 2F1~ 2R0! 2B0 2F2~ 2R1 2B1 2F3~ 2R2 2B2 2F4~ 2R3 2B3 2F5~ 2R4 2B4 2R5 2B5",
        "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5",
    ],
    ("merak-shifted", 2, 4): [
        "0F0~ 0F1~ 0F2~ 0R0! 0B0 0R1! 0B1 0F3~ 0R2 0B2 0R3 0B3",
        "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3",
    ],
    ("merak-shifted", 3, 5): [
        "0F0~ 0F1~ 0F2~ 0R0! 0B0 0F3~ 0R1 0B1 0F4~ 0R2 0B2 0R3! 0B3 0R4! 0B4",
        "1F0~ 1F1~ 1F2~ 1R0! 1B0 1R1! 1B1 1F3~ 1R2 1B2 1F4~ 1R3 1B3 1R4 1B4",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2F4 2B4",
    ],
}


@pytest.mark.parametrize("key", list(MERAK_REFERENCE))
def test_merak_orders_match_merak_code(key):
    name, pp, m = key
    assert [" ".join(row) for row in strings(generate_schedule(name, pp, m))] == MERAK_REFERENCE[key]


def test_merak_structure_for_larger_pipelines():
    # The rules the reference shows, checked where no literal is kept: last stage plain, stage
    # s <= pp-3 recomputes its last pp-s-1 micro-batches eagerly, pp-3 also m0, pp-2 m0 and m1.
    for pp in (4, 6, 8):
        for m in (pp, pp + 3, 2 * pp):
            ranks = generate_schedule("merak-shifted", pp, m)
            assert all(a.op in (Op.FORWARD, Op.BACKWARD) and a.save for a in ranks[-1])
            for s in range(pp - 1):
                eager = {a.microbatch for a in ranks[s] if a.op is Op.RECOMPUTE and a.eager}
                tail = set(range(m - (pp - s - 1), m)) if s <= pp - 3 else set()
                head = {0, 1} if s == pp - 2 else {0} if s == pp - 3 else set()
                assert eager == tail | head, (pp, m, s)
            second_last = [str(a) for a in ranks[pp - 2] if a.op is not Op.RECOMPUTE]
            s = pp - 2
            assert second_last[:5] == [f"{s}F0~", f"{s}F1~", f"{s}F2~", f"{s}B0", f"{s}B1"]


# ---------------------------------------------------------------------------------------------
# Validity over a grid, and preconditions


def _expected_rejection(name: str, pp: int, m: int, chunks: int) -> bool:
    """The documented preconditions, restated independently of check_preconditions."""
    if name.startswith("merak"):
        return pp < 2 or m < pp or (name == "merak-shifted" and m < 4)
    if name == "interleaved-1f1b":
        rounds = max(1, m // pp)
        return m % rounds != 0
    if name == "dualpipev":
        return m < 2 * pp
    return False


def _chunk_choices(name: str) -> list[int]:
    info = SCHEDULES[name]
    return [info.min_chunks] if info.max_chunks is not None else [2, 3]


def test_grid_valid_or_rejected():
    accepted = 0
    for name in SCHEDULES:
        placement = SCHEDULES[name].placement
        for chunks in _chunk_choices(name):
            for pp in range(2, 9):
                for m in range(1, 17):
                    if _expected_rejection(name, pp, m, chunks):
                        with pytest.raises(ConfigError):
                            generate_schedule(name, pp, m, chunks)
                        continue
                    actions = generate_schedule(name, pp, m, chunks)
                    validate_schedule(actions, pp, m, chunks, placement)
                    result = simulate_unit_costs(actions, pp, chunks, placement)
                    assert result["makespan"] > 0
                    accepted += 1
    assert accepted > 900


def test_preconditions_messages():
    with pytest.raises(ConfigError) as err:
        check_preconditions("merak-shifted", 4, 3, 1)
    assert err.value.field == "schedule"
    assert "microbatches >= pp and >= 4 (got 3)" in err.value.problem
    assert err.value.fix == "raise microbatches to 4"
    with pytest.raises(ConfigError, match="raise microbatches to 4"):
        check_preconditions("merak-shifted", 2, 3, 1)
    with pytest.raises(ConfigError, match="unknown schedule"):
        check_preconditions("2f2b", 4, 8, 1)
    with pytest.raises(ConfigError, match="chunks"):
        check_preconditions("interleaved-1f1b", 4, 8, 1)
    with pytest.raises(ConfigError, match="chunks"):
        check_preconditions("zb-v", 4, 8, 3)
    with pytest.raises(ConfigError, match="divisible by max"):
        check_preconditions("interleaved-1f1b", 4, 9, 2)
    with pytest.raises(ConfigError, match="2 \\* pp = 8"):
        check_preconditions("dualpipev", 4, 7, 2)
    with pytest.raises(ConfigError, match="one flag per virtual stage"):
        generate_schedule("1f1b", 4, 8, 1, [True] * 3)
    with pytest.raises(ConfigError, match="fixes which stages recompute"):
        generate_schedule("merak-shifted", 4, 8, 1, [True] * 4)
    # Merak accepts its own policy spelled out.
    assert generate_schedule("merak-shifted", 4, 8, 1, merak_recompute("merak-shifted", 4))


def _valid_1f1b() -> list[list[Action]]:
    return generate_schedule("1f1b", 2, 2, 1, [True, False])


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s[0].remove(Action(Op.BACKWARD, 0, 1)), "no backward"),
        (lambda s: s[1].append(Action(Op.FORWARD, 1, 0)), "appears twice"),
        (
            lambda s: s[0].insert(0, s[0].pop(s[0].index(Action(Op.BACKWARD, 0, 0)))),
            "backward before forward",
        ),
        (lambda s: s[0].remove(Action(Op.RECOMPUTE, 0, 0)), "has no RECOMPUTE"),
        (lambda s: s[1].insert(1, Action(Op.RECOMPUTE, 1, 0)), "saved its activations"),
        (lambda s: s[1].append(Action(Op.FORWARD, 0, 1)), "belongs to rank 0"),
        (lambda s: s[1].append(Action(Op.BACKWARD_INPUT, 1, 1)), "both a full backward"),
        (lambda s: s[1].append(Action(Op.FORWARD, 1, 7)), "micro-batch outside"),
        (lambda s: s.pop(), "rank lists"),
    ],
)
def test_validate_rejects(mutate, message):
    schedule = _valid_1f1b()
    validate_schedule(schedule, 2, 2, 1, "loop")
    mutate(schedule)
    with pytest.raises(ValueError, match=message):
        validate_schedule(schedule, 2, 2, 1, "loop")


def test_validate_split_backward_and_recompute_position():
    schedule = generate_schedule("zb-h1", 2, 3)
    row = schedule[1]
    i, w = row.index(Action(Op.BACKWARD_INPUT, 1, 0)), row.index(Action(Op.BACKWARD_WEIGHT, 1, 0))
    row[i], row[w] = row[w], row[i]
    with pytest.raises(ValueError, match="W before I"):
        validate_schedule(schedule, 2, 3, 1, "loop")
    schedule = generate_schedule("1f1b", 2, 2, 1, [True, True])
    row = schedule[1]
    row.append(row.pop(row.index(Action(Op.RECOMPUTE, 1, 1))))
    with pytest.raises(ValueError, match="after the forward and before the backward"):
        validate_schedule(schedule, 2, 2, 1, "loop")


def test_simulate_detects_deadlock():
    # Well formed on each rank, but rank 1 runs micro-batch 1 before 0 while rank 0 needs B0's
    # gradient before it forwards micro-batch 1.
    F, B = Op.FORWARD, Op.BACKWARD
    schedule = [
        [Action(F, 0, 0), Action(B, 0, 0), Action(F, 0, 1), Action(B, 0, 1)],
        [Action(F, 1, 1), Action(B, 1, 1), Action(F, 1, 0), Action(B, 1, 0)],
    ]
    validate_schedule(schedule, 2, 2, 1, "loop")
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate_unit_costs(schedule, 2, 1, "loop")


# ---------------------------------------------------------------------------------------------
# Unit-cost properties (f = b = 1; w = 0 makes a full backward cost b)


@pytest.mark.parametrize("pp", range(2, 9))
def test_gpipe_and_1f1b_makespan_bubble_memory(pp):
    for m in range(1, 17):
        for name in ("gpipe", "1f1b"):
            res = run(name, pp, m, f=1, b=1, w=0)
            assert res["makespan"] == (m + pp - 1) * 2
            assert all(x == 2 * m for x in res["busy"])
            assert Fraction(res["bubble_fraction"]).limit_denominator(1000) == Fraction(pp - 1, m + pp - 1)
            want = {s: m if name == "gpipe" else min(pp - s, m) for s in range(pp)}
            assert res["peak_inflight"] == want


def test_1f1b_full_recompute_puts_recompute_on_the_critical_path():
    for pp, m in ((4, 4), (4, 9), (8, 16)):
        res = run("1f1b", pp, m, recompute=[True] * pp, f=1, b=1, w=0, r=1)
        assert res["makespan"] == (m + pp - 1) * 3
        assert all(v == 1 for v in res["peak_activations"].values())


def test_zb_h1_bubble_is_a_third_of_1f1b():
    # f = b = w = 1: 1F1B's full backward costs b + w = 2. Measured: ZB-H1 idles exactly pp-1
    # units per rank (makespan 3m + pp - 1) against 1F1B's 3(pp-1): exactly one third, for
    # m >= pp, at the same peak in-flight micro-batches.
    for pp in range(2, 9):
        for m in range(pp, 17):
            zb = run("zb-h1", pp, m, f=1, b=1, w=1)
            one = run("1f1b", pp, m, f=1, b=1, w=1)
            assert zb["makespan"] == 3 * m + pp - 1
            assert one["makespan"] == 3 * (m + pp - 1)
            assert all(x == pp - 1 for x in zb["bubble"])
            assert all(3 * z == o for z, o in zip(zb["bubble"], one["bubble"], strict=True))
            assert zb["peak_inflight"] == one["peak_inflight"]


def test_interleaved_divides_bubble_by_chunks():
    # Each action of a chunk covers 1/chunks of the rank's layers, so it costs 1/chunks.
    # With m a multiple of pp (Megatron's condition) the idle time per rank is exactly
    # 3(pp-1)/chunks (f = b = w = 1 per whole stage).
    for pp in (2, 4, 8):
        for m in (pp, 2 * pp):
            for chunks in (2, 3, 4):
                c = 1 / chunks
                res = run("interleaved-1f1b", pp, m, chunks, f=c, b=c, w=c)
                assert res["makespan"] == pytest.approx(3 * m + 3 * (pp - 1) / chunks)


def test_zb_v_and_dualpipev_are_bubble_free_after_the_ramp():
    # Per-chunk costs 1/2; the only idle time is the later ranks' wait for their first input,
    # (pp-1) chunk forwards = (pp-1)/2. ZB-V reaches it from m >= 2pp-1 micro-batches,
    # DualPipeV whenever it runs (m >= 2pp).
    for pp in (2, 4, 8):
        for m in (2 * pp - 1, 2 * pp, 3 * pp):
            res = run("zb-v", pp, m, 2, f=0.5, b=0.5, w=0.5)
            assert res["makespan"] == pytest.approx(3 * m + (pp - 1) / 2)
            if m >= 2 * pp:
                res = run("dualpipev", pp, m, 2, f=0.5, b=0.5, w=0.5)
                assert res["makespan"] == pytest.approx(3 * m + (pp - 1) / 2)


@pytest.mark.parametrize("pp", [4, 8])
def test_merak_shifted_gain_is_fixed(pp):
    # Baseline: 1F1B with full recompute on every stage, recompute inside the backward.
    # Measured with zero communication (r = 1 recompute unit):
    # - f = b = r = 1: merak-shifted saves pp + 1 units for every m; merak-cooldown-lastnorecompute
    #   saves the same, the pp-2 tricks have no room: stage pp-2's wait for m0's gradient
    #   (f + b = 2 on the last stage) only fits F1 + R0.
    # - f = 1, b = 2, r = 1 (backward twice the forward, the usual ratio): it saves pp + 2 units,
    #   Merak's stated gain; the wait now fits F1 + F2 + R0 and the shifted schedule is r ahead of
    #   the lastnorecompute ablation. merak-cooldown (last stage still recomputing) saves pp - 1.
    for m in (pp, pp + 3, 2 * pp, 4 * pp):
        for costs, shifted_gain, lnr_gain in (
            (dict(f=1, b=1, w=0, r=1), pp + 1, pp + 1),
            (dict(f=1, b=2, w=0, r=1), pp + 2, pp + 1),
        ):
            base = run("1f1b", pp, m, recompute=[True] * pp, **costs)["makespan"]
            assert base - run("merak-shifted", pp, m, **costs)["makespan"] == shifted_gain
            assert base - run("merak-cooldown-lastnorecompute", pp, m, **costs)["makespan"] == lnr_gain
            assert base - run("merak-cooldown", pp, m, **costs)["makespan"] == pp - 1
        # Against a baseline that already skips the last stage's recompute the gain is pp - 1
        # (f = b = r = 1).
        base = run("1f1b", pp, m, recompute=[True] * (pp - 1) + [False], f=1, b=1, w=0, r=1)["makespan"]
        assert base - run("merak-shifted", pp, m, f=1, b=1, w=0, r=1)["makespan"] == pp - 1


def test_merak_gain_scales_with_recompute_cost():
    # f = 1, b = 2: the saving is (pp + 2) * r for a cheaper recompute as well.
    for pp in (4, 8):
        base = run("1f1b", pp, 2 * pp, recompute=[True] * pp, f=1, b=2, w=0, r=0.25)["makespan"]
        shifted = run("merak-shifted", pp, 2 * pp, f=1, b=2, w=0, r=0.25)["makespan"]
        assert base - shifted == pytest.approx((pp + 2) * 0.25)


def test_eager_recompute_does_not_wait_for_the_gradient():
    # f = 1, b = 2: stage 2 of 4 pre-recomputes m0 right after F2, while the last stage is still
    # computing B0; the same action made ordinary (eager=False) has to wait for that gradient.
    costs = dict(f=1, b=2, w=0, r=1)
    actions = generate_schedule("merak-shifted", 4, 4)
    res = simulate_unit_costs(actions, 4, 1, "loop", **costs)
    row = {str(a): (start, end) for a, start, end in res["timeline"][2]}
    grad0 = {str(a): end for a, _, end in res["timeline"][3]}["3B0"]
    assert row["2R0!"][0] == row["2F2~"][1] < grad0
    actions[2] = [Action(a.op, a.stage, a.microbatch, a.save) for a in actions[2]]  # all eager=False
    lazy = simulate_unit_costs(actions, 4, 1, "loop", **costs)
    assert {str(a): start for a, start, _ in lazy["timeline"][2]}["2R0"] == grad0
    assert lazy["makespan"] > res["makespan"]


# ---------------------------------------------------------------------------------------------
# Property: any request is either refused with ConfigError or yields a valid, deadlock-free plan


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(SCHEDULES)),
    pp=st.integers(1, 8),
    m=st.integers(1, 20),
    chunks=st.integers(1, 4),
    flags=st.lists(st.booleans(), min_size=32, max_size=32),
    give_recompute=st.booleans(),
    chunks_fit_the_schedule=st.sampled_from([True, True, True, False]),
)
def test_property_valid_or_config_error(name, pp, m, chunks, flags, give_recompute, chunks_fit_the_schedule):
    # In three draws of four the chunks fit the schedule: drawn freely, most refusals were for the chunks
    # and 22 of 150 examples reached the checks below in one counted run (46 in another).
    if chunks_fit_the_schedule:
        chunks = chunks_in_range(name, chunks)
    info = SCHEDULES[name]
    recompute = flags[: pp * chunks] if give_recompute and not info.recompute_is_schedule else None
    try:
        actions = generate_schedule(name, pp, m, chunks, recompute)
    except ConfigError as err:
        assert str(err).startswith(err.field)
        return
    validate_schedule(actions, pp, m, chunks, info.placement)
    result = simulate_unit_costs(actions, pp, chunks, info.placement, f=1, b=1, w=1, r=1)
    n_actions = sum(len(row) for row in actions)
    per_pair = 3 if info.split_backward else 2
    assert n_actions >= pp * chunks * m * 2
    assert n_actions <= pp * chunks * m * (per_pair + 1)
    assert result["makespan"] >= max(result["busy"])
    assert all(p <= m for p in result["peak_inflight"].values())
