"""Pipeline schedules: for every pipeline rank, the ordered list of compute actions of one iteration.

A schedule says *what* each rank computes and in which order: forwards (F), full backwards (B),
split backwards (I = input gradient, W = weight gradient, Zero Bubble) and recomputations (R) of
checkpointed forwards, each for one virtual stage and one micro-batch. Communication is not part
of a schedule: the Plan -> Program lowering adds the sends and receives that the cross-stage
dependencies imply, and both engines (simpy and the real runtime) execute the result.

Names and sources:
- ``gpipe``, ``1f1b``, ``interleaved-1f1b``, ``zb-h1``, ``zb-v``, ``dualpipev``: the orders of
  torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
  ScheduleInterleavedZeroBubble with one stage per rank = ZB-H1, ScheduleZBVZeroBubble,
  ScheduleDualPipeV), checked action by action in tests/test_schedules.py.
- ``merak-shifted``, ``merak-cooldown``, ``merak-cooldown-lastnorecompute``: Merak's shifted
  critical path schedule and its two ablations (Merak, TPDS 2023; public code
  github.com/HPDL-Group/Merak, Merak/core/pipeline/schedule.py: FullCriticalPathTrainSchedule,
  PreRecomputeTrainSchedule, LastNoRecomputeTrainSchedule), re-derived from that code's
  instruction streams (see ``_merak``).

Recomputation has two flavours that matter for time, so an R action carries ``eager``:
ordinary activation checkpointing recomputes inside the backward, i.e. only after the output
gradient of (stage, mb) has arrived (``eager=False``); Merak's pre-recompute runs the recompute as
soon as the rank reaches it, *before* waiting for that gradient (``eager=True``), which is how
it moves recomputation off the critical path into bubbles.

This module is pure Python: no torch, no simpy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from traces.errors import ConfigError


class Op(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients together
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    RECOMPUTE = "R"


@dataclass(frozen=True)
class Action:
    """One compute action of a rank.

    ``save`` (FORWARD only): False = checkpointed forward, only the stage input is kept; a
    RECOMPUTE of (stage, microbatch) must then come before its backward on that rank.
    ``eager`` (RECOMPUTE only): False = ordinary checkpointing, the recompute is started by the
    backward and so waits for the output gradient of (stage, microbatch), exactly like B/I;
    True = Merak's pre-recompute, it starts as soon as the rank reaches it (it depends only on
    the forward), so it can fill the wait for that gradient.
    """

    op: Op
    stage: int
    microbatch: int
    save: bool = True
    eager: bool = False

    def __str__(self) -> str:
        # torch's action notation ("2F0" = stage 2 forward of micro-batch 0), plus "~" for a
        # forward that saves nothing and "!" for an eager recompute.
        mark = "~" if self.op is Op.FORWARD and not self.save else ""
        mark += "!" if self.op is Op.RECOMPUTE and self.eager else ""
        return f"{self.stage}{self.op.value}{self.microbatch}{mark}"


Builder = Callable[[int, int, int, Sequence[bool]], list[list[Action]]]  # (pp, m, chunks, recompute)
Check = Callable[[int, int], None]  # (pp, microbatches): raise ConfigError


@dataclass(frozen=True)
class ScheduleInfo:
    """One registered schedule: what it needs, how to generate it, one line of docs."""

    name: str
    placement: str  # "loop" or "v" (see stage_to_rank)
    chunks: str  # the rule, for people: "1", ">= 2", "2"
    min_chunks: int
    max_chunks: int | None  # None = no upper bound
    split_backward: bool  # uses I/W actions (the executor must split the backward)
    description: str
    preconditions: str
    torch_class: str | None  # the torch.distributed.pipelining class with the same order
    build: Builder  # per pipeline rank, the ordered actions (see generate_schedule)
    recompute_is_schedule: bool = False  # Merak: the recompute placement is fixed by the schedule
    check: Check | None = None  # preconditions beyond the chunk count


SCHEDULES: dict[str, ScheduleInfo] = {}


def register_schedule(info: ScheduleInfo) -> ScheduleInfo:
    """Add a schedule to the registry that plans, the simulator, the runtime and `paratwin options` read."""
    if info.name in SCHEDULES:
        raise ValueError(f"schedule {info.name!r} is registered twice")
    SCHEDULES[info.name] = info
    return info


def _info(name: str, placement: str, chunks: str, split_backward: bool, **rest: object) -> ScheduleInfo:
    low, high = {"1": (1, 1), "2": (2, 2), ">= 2": (2, None)}[chunks]
    return register_schedule(ScheduleInfo(name, placement, chunks, low, high, split_backward, **rest))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Placement


def stage_to_rank(stage: int, pp: int, chunks: int, placement: str) -> int:
    """The pipeline rank that holds virtual stage ``stage`` (0 .. pp*chunks-1).

    "loop": stage s on rank s % pp (interleaved). "v": chunks zig-zag, chunk 0 on ranks 0..pp-1,
    chunk 1 on pp-1..0, chunk 2 on 0..pp-1 again (torch's generate_stage_to_rank_mapping "v").
    """
    if not 0 <= stage < pp * chunks:
        raise ValueError(f"stage {stage} outside 0..{pp * chunks - 1} (pp={pp}, chunks={chunks})")
    chunk, offset = divmod(stage, pp)
    if placement == "loop":
        return offset
    if placement == "v":
        return offset if chunk % 2 == 0 else pp - 1 - offset
    raise ValueError(f"unknown placement {placement!r}: use 'loop' or 'v'")


def rank_stages(rank: int, pp: int, chunks: int, placement: str) -> list[int]:
    """The virtual stages of ``rank``, in chunk order."""
    return [s for s in range(pp * chunks) if stage_to_rank(s, pp, chunks, placement) == rank]


# ---------------------------------------------------------------------------------------------
# Preconditions


def _interleaved_rounds(pp: int, microbatches: int) -> tuple[int, int]:
    """torch's flexible interleaving: (number of rounds, micro-batches per round)."""
    rounds = max(1, microbatches // pp)
    return rounds, microbatches // rounds


def check_preconditions(name: str, pp: int, microbatches: int, chunks: int) -> None:
    """Raise ConfigError (field, problem, fix) when ``name`` cannot run with these sizes."""
    info = SCHEDULES.get(name)
    if info is None:
        raise ConfigError("schedule", f"unknown schedule {name!r}", f"use one of {', '.join(SCHEDULES)}")
    if pp < 1:
        raise ConfigError("pp", f"pipeline depth must be >= 1 (got {pp})", "set pp to 1 or more")
    if microbatches < 1:
        raise ConfigError(
            "microbatches",
            f"need at least 1 micro-batch (got {microbatches})",
            "set microbatches to 1 or more",
        )
    if chunks < info.min_chunks or (info.max_chunks is not None and chunks > info.max_chunks):
        raise ConfigError(
            "chunks", f"{name} needs chunks {info.chunks} (got {chunks})", f"set chunks to {info.min_chunks}"
        )
    if info.check is not None:
        info.check(pp, microbatches)


def _merak_check(name: str) -> Check:
    # Merak's engine asserts micro_batches >= pipeline size for all its schedules, and >= 4 for
    # full_critical_path_1f1b (merak_engine.py, scheduler_method); the stage pp-2 and pp-3 special
    # cases also need a stage before the last one.
    def check(pp: int, microbatches: int) -> None:
        need = max(pp, 4) if name == "merak-shifted" else pp
        if pp < 2:
            raise ConfigError("pp", f"{name} needs pp >= 2 (got {pp})", "use 1f1b for pp = 1")
        if microbatches < need:
            extra = " and >= 4" if name == "merak-shifted" else ""
            raise ConfigError(
                "schedule",
                f"{name} needs microbatches >= pp{extra} (got {microbatches})",
                f"raise microbatches to {need}",
            )

    return check


def _interleaved_check(pp: int, microbatches: int) -> None:
    rounds, _ = _interleaved_rounds(pp, microbatches)
    if microbatches % rounds:
        lower = (microbatches // rounds) * rounds
        raise ConfigError(
            "microbatches",
            f"interleaved-1f1b needs microbatches divisible by max(1, microbatches // pp) = {rounds} "
            f"(got {microbatches})",
            f"use {lower} or {lower + rounds} micro-batches, or a multiple of pp",
        )


def _dualpipev_check(pp: int, microbatches: int) -> None:
    if microbatches < 2 * pp:
        raise ConfigError(
            "microbatches",
            f"dualpipev needs microbatches >= 2 * pp = {2 * pp} (got {microbatches})",
            f"raise microbatches to {2 * pp}",
        )


# ---------------------------------------------------------------------------------------------
# Generators. Each returns, per rank, a list of (op, stage, microbatch); recompute is added after.

Step = tuple[Op, int, int]
FWD, BWD, BWD_I, BWD_W, RECOMP = Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.RECOMPUTE


def _gpipe(pp: int, m: int) -> list[list[Step]]:
    return [[(FWD, s, i) for i in range(m)] + [(BWD, s, i) for i in range(m)] for s in range(pp)]


def _one_f_one_b_stage(s: int, pp: int, m: int) -> list[Step]:
    # Warm up with min(m, pp - s) forwards (as torch's Schedule1F1B executes it; Megatron's
    # "pp-s-1 warm-up forwards, then F B pairs" is the same sequence), then B, F, B, F ...
    warmup = min(m, pp - s)
    order: list[Step] = [(FWD, s, i) for i in range(warmup)]
    for i in range(m):
        order.append((BWD, s, i))
        if warmup + i < m:
            order.append((FWD, s, warmup + i))
    return order


def _one_f_one_b(pp: int, m: int) -> list[list[Step]]:
    return [_one_f_one_b_stage(s, pp, m) for s in range(pp)]


def _interleaved(pp: int, m: int, chunks: int) -> list[list[Step]]:
    # Megatron's interleaved 1F1B as torch generalises it: micro-batches go in rounds of
    # `per_round`; within a round a rank runs all of chunk 0, then all of chunk 1, ... forwards,
    # and backwards in the reverse chunk order. Rank r warms up with (chunks-1)*per_round +
    # 2*(pp-1-r) forwards, then alternates F and B, then drains the remaining backwards.
    _, per_round = _interleaved_rounds(pp, m)
    total = m * chunks
    group = per_round * chunks

    def nth(j: int, backward: bool) -> tuple[int, int]:  # (chunk, microbatch) of the j-th F or B
        q = j % group
        chunk = q // per_round
        return (chunks - 1 - chunk if backward else chunk), (j // group) * per_round + q % per_round

    ranks = []
    for r in range(pp):
        warmup = min((chunks - 1) * per_round + 2 * (pp - 1 - r), total)
        fwd = [(FWD, c * pp + r, mb) for c, mb in (nth(j, False) for j in range(total))]
        bwd = [(BWD, c * pp + r, mb) for c, mb in (nth(j, True) for j in range(total))]
        order = fwd[:warmup]
        for i in range(total - warmup):
            order += [fwd[warmup + i], bwd[i]]
        ranks.append(order + bwd[total - warmup :])
    return ranks


def _zb_h1(pp: int, m: int) -> list[list[Step]]:
    # 1F1B order with B replaced by I; rank r emits W(t - r) right after I(t), so its first r
    # W's are postponed and the last r run after the final I, filling the drain bubble.
    ranks = []
    for s, order in enumerate(_one_f_one_b(pp, m)):
        split: list[Step] = []
        for op, stage, mb in order:
            if op is FWD:
                split.append((FWD, stage, mb))
                continue
            split.append((BWD_I, stage, mb))
            if mb >= s:
                split.append((BWD_W, stage, mb - s))
        split += [(BWD_W, s, mb) for mb in range(max(0, m - s), m)]
        ranks.append(split)
    return ranks


def _zb_v(pp: int, m: int) -> list[list[Step]]:
    # ZB-V (Qi et al., Section 6), in the form torch's ScheduleZBVZeroBubble generates: the order
    # is built for n = max(2pp-1, m) micro-batches (enough to fill the V) and the actions of
    # micro-batches >= m are then dropped.
    n = max(2 * pp - 1, m)
    return [[step for step in _zb_v_rank(r, pp, n) if step[2] < m] for r in range(pp)]


def _zb_v_rank(r: int, pp: int, n: int) -> list[Step]:
    down, up = r, 2 * pp - 1 - r  # chunk 0 (going down the ranks) and chunk 1 (coming back)
    nxt = {("F", down): 0, ("F", up): 0, ("I", down): 0, ("I", up): 0}
    order: list[Step] = []

    def emit(op: Op, stage: int, weight_too: bool = False) -> None:
        key = ("F" if op is FWD else "I", stage)
        mb = nxt[key]
        nxt[key] += 1
        order.append((op, stage, mb))
        if weight_too:
            order.append((BWD_W, stage, mb))

    for _ in range(2 * (pp - r) - 1):  # fill: chunk-0 forwards down the V
        emit(FWD, down)
    for _ in range(r):
        emit(FWD, up)
        emit(FWD, down)
    for _ in range(pp - r):  # the turn: chunk-1 forwards with their backwards
        emit(FWD, up)
        emit(BWD_I, up, weight_too=True)
    while nxt[("F", up)] < nxt[("F", down)] or nxt[("F", down)] < n:  # steady state
        if nxt[("F", down)] < n:
            emit(FWD, down)
        emit(BWD_I, down, weight_too=True)
        emit(FWD, up)
        emit(BWD_I, up, weight_too=True)
    w_down, w_up = nxt[("I", down)], nxt[("I", up)]
    for _ in range(r):  # drain: input gradients first, weight gradients fill the tail
        emit(BWD_I, down)
        emit(BWD_I, up)
    for _ in range(pp - r):
        emit(BWD_I, down)
        order.append((BWD_W, down, w_down))
        w_down += 1
    order += [(BWD_W, up, mb) for mb in range(w_up, nxt[("I", up)])]
    order += [(BWD_W, down, mb) for mb in range(w_down, nxt[("I", down)])]
    return order


def _dualpipev(pp: int, m: int) -> list[list[Step]]:
    # DualPipeV as torch's ScheduleDualPipeV generates it (after deepseek-ai/DualPipe). Its
    # OVERLAP_F_B pairs (a forward of one chunk with a full backward of the other) become two
    # consecutive actions, forward first, which is the order torch runs them in when no overlap
    # function is registered.
    return [_dualpipev_rank(r, pp, m) for r in range(pp)]


def _dualpipev_rank(r: int, pp: int, m: int) -> list[Step]:
    down, up = r, 2 * pp - 1 - r
    next_f = {down: 0, up: 0}
    next_b = {down: 0, up: 0}  # B and I share the micro-batch counter
    pending_w: list[tuple[int, int]] = []
    order: list[Step] = []

    def fwd(stage: int) -> None:
        order.append((FWD, stage, next_f[stage]))
        next_f[stage] += 1

    def bwd(stage: int, split: bool) -> None:
        mb = next_b[stage]
        next_b[stage] += 1
        order.append((BWD_I if split else BWD, stage, mb))
        if split:
            pending_w.append((stage, mb))

    def weight() -> None:
        if pending_w:
            stage, mb = pending_w.pop(0)
            order.append((BWD_W, stage, mb))

    for _ in range(2 * (pp - r - 1)):
        fwd(down)
    for _ in range(r + 1):
        fwd(down)
        fwd(up)
    for _ in range(pp - r - 1):
        bwd(up, split=True)
        weight()
        fwd(up)
    for _ in range(m - 2 * pp + r + 1):  # main phase: F(down)+B(up), F(up)+B(down) pairs
        fwd(down)
        bwd(up, split=False)
        fwd(up)
        bwd(down, split=False)
    for _ in range(pp - r - 1):
        bwd(up, split=False)
        fwd(up)
        bwd(down, split=False)
    # Drain: the second half of the drain splits its backwards so W's fill the tail; odd ranks
    # switch before the chunk-1 backward of the middle step, even ranks after it.
    split = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        bwd(up, split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        bwd(down, split)
    for _ in range(pp - r - 1):
        weight()
        bwd(down, split)
    for _ in range(r + 1):
        weight()
    return order


def _merak(name: str, pp: int, m: int) -> list[list[Action]]:
    """Merak's three schedules as action lists (re-derived from Merak/core/pipeline/schedule.py).

    Reading of Merak's instructions: ForwardPass on a checkpointing stage = forward that keeps
    only its input, recomputed inside BackwardPass after the gradient arrives (our F save=False
    + R eager=False right before B); PreCheckpointForwardPass = the same forward, but its
    recompute is the separate RecomputeRecvGrad, issued *before* the gradient is received (our
    R eager=True); a stage with act_ckpt_interval = 0 (Merak's last stage in two variants)
    saves everything (F save=True, no R). Merak's step loop is DeepSpeed's TrainSchedule, whose
    compute order is plain 1F1B.

    Interpretations (where Merak's code and the design note differ or are silent):
    - Merak weights checkpointing per layer (act_ckpt_ratio, and stage pp-2 copies pp-3's ratio
      in the shifted schedule); here a checkpointing stage recomputes its whole forward. The
      lowering scales R's cost by the stage's recomputed fraction.
    - In merak-shifted, stage pp-2 sends its m1 activation only after it has pre-recomputed m0
      and received m0's gradient (RecomputeRecvGrad0 then SendActivation1). That is a
      communication placement, not a compute order; a lowering that sends each activation when
      its forward ends can only let the last stage start F1 earlier than Merak does.
    - merak-cooldown (PreRecomputeTrainSchedule) keeps checkpointing on the last stage, as the
      engine does not switch it off for that schedule.
    """
    last = pp - 1
    ranks = []
    for s in range(pp):
        order = _one_f_one_b_stage(s, pp, m)
        checkpoint = name == "merak-cooldown" or s != last
        # The drain set: Merak pre-checkpoints micro-batch mb on stage s when m - mb + s < pp,
        # i.e. the last pp-s-1 micro-batches, whose backward waits happen in the drain.
        drain = {mb for mb in range(m) if m - mb + s < pp}
        if name == "merak-cooldown":
            eager = drain
        elif s == pp - 2:  # both other variants exclude stage pp-2 from the drain set
            eager = {0, 1} if name == "merak-shifted" else {0}
        elif s == pp - 3 and name == "merak-shifted":
            eager = drain | {0}
        else:
            eager = drain
        if name == "merak-shifted" and s == pp - 2:
            # 1F1B on stage pp-2 runs F0 F1 B0 F2 B1 ...; Merak runs F2 in the wait for B0's
            # gradient (FullCriticalPathTrainSchedule, frist_bp): F0 F1 F2 B0 B1 F3 B2 ...
            i_b0 = order.index((BWD, s, 0))
            order[i_b0], order[i_b0 + 1] = order[i_b0 + 1], order[i_b0]
        actions: list[Action] = []
        for op, stage, mb in order:
            if op is FWD:
                actions.append(Action(FWD, stage, mb, save=not checkpoint))
                continue
            if checkpoint:
                actions.append(Action(RECOMP, stage, mb, eager=mb in eager))
            actions.append(Action(op, stage, mb))
        ranks.append(actions)
    return ranks


def _with_recompute(steps: Callable[[int, int, int], list[list[Step]]]) -> Builder:
    """A schedule of plain steps, with checkpointing added: a stage whose flag is set keeps only
    its input in the forward and recomputes (ordinarily) right before its first backward action."""

    def build(pp: int, m: int, chunks: int, recompute: Sequence[bool]) -> list[list[Action]]:
        ranks = []
        for rank_steps in steps(pp, m, chunks):
            actions: list[Action] = []
            for op, stage, mb in rank_steps:
                if op is FWD:
                    actions.append(Action(FWD, stage, mb, save=not recompute[stage]))
                    continue
                if recompute[stage] and op in (BWD, BWD_I):
                    actions.append(Action(RECOMP, stage, mb))
                actions.append(Action(op, stage, mb))
            ranks.append(actions)
        return ranks

    return build


def _merak_builder(name: str) -> Builder:
    def build(pp: int, m: int, chunks: int, recompute: Sequence[bool]) -> list[list[Action]]:
        return _merak(name, pp, m)

    return build


def merak_recompute(name: str, pp: int) -> list[bool]:
    """Which stages checkpoint in a Merak schedule (the only ``recompute`` it accepts)."""
    return [name == "merak-cooldown" or s != pp - 1 for s in range(pp)]


def generate_schedule(
    name: str, pp: int, microbatches: int, chunks: int = 1, recompute: Sequence[bool] | None = None
) -> list[list[Action]]:
    """Per pipeline rank, the ordered compute actions of one iteration of schedule ``name``.

    ``recompute[s]`` (one entry per virtual stage) = True: stage s checkpoints; its forwards keep
    only their input (save=False) and an ordinary (eager=False) RECOMPUTE of (s, mb) sits right
    before its first backward action (B or I). Merak's schedules fix their own recompute
    placement; they accept ``recompute`` only as None or exactly ``merak_recompute(name, pp)``.
    """
    check_preconditions(name, pp, microbatches, chunks)
    info = SCHEDULES[name]
    stages = pp * chunks
    if recompute is not None and len(recompute) != stages:
        raise ConfigError(
            "recompute",
            f"needs one flag per virtual stage ({stages}), got {len(recompute)}",
            f"pass {stages} booleans (pp * chunks)",
        )
    if info.recompute_is_schedule:
        policy = merak_recompute(name, pp)
        if recompute is not None and list(recompute) != policy:
            raise ConfigError(
                "recompute",
                f"{name} fixes which stages recompute ({policy}), got {list(recompute)}",
                "leave recompute unset for Merak schedules",
            )
    flags = list(recompute) if recompute is not None else [False] * stages
    return info.build(pp, microbatches, chunks, flags)


# ---------------------------------------------------------------------------------------------
# The registry: one record per schedule.

# fmt: off
_info(
    "gpipe", "loop", "1", False,
    description="All forwards, then all backwards (fill-drain). Peak in-flight m on every stage.",
    preconditions="pp >= 1, microbatches >= 1",
    torch_class="ScheduleGPipe",
    build=_with_recompute(lambda pp, m, c: _gpipe(pp, m)),
)
_info(
    "1f1b", "loop", "1", False,
    description="One-forward-one-backward (PipeDream-Flush / Megatron): stage s runs min(m, pp-s) "
    "forwards, then alternates B and F. Bubble (p-1)/(m+p-1); peak in-flight min(pp-s, m).",
    preconditions="pp >= 1, microbatches >= 1 (torch's Schedule1F1B also needs microbatches >= pp)",
    torch_class="Schedule1F1B",
    build=_with_recompute(lambda pp, m, c: _one_f_one_b(pp, m)),
)
_info(
    "interleaved-1f1b", "loop", ">= 2", False,
    description="Megatron interleaved 1F1B with `chunks` virtual stages per rank (stage s on rank "
    "s % pp), in torch's flexible form: max(1, m // pp) rounds of equal size. Bubble divided by "
    "chunks; more in-flight activations on the first ranks.",
    preconditions="chunks >= 2, microbatches divisible by max(1, microbatches // pp)",
    torch_class="ScheduleInterleaved1F1B",
    build=_with_recompute(_interleaved),
    check=_interleaved_check,
)
_info(
    "zb-h1", "loop", "1", True,
    description="Zero Bubble H1 (Qi et al., ICLR 2024): 1F1B with the backward split into I and W; "
    "rank r delays its W's by r steps so they fill the drain bubble. Bubble (p-1)(F+I-W) instead "
    "of (p-1)(F+I+W), same in-flight micro-batches as 1F1B.",
    preconditions="pp >= 1, microbatches >= 1",
    torch_class="ScheduleInterleavedZeroBubble (one stage per rank)",
    build=_with_recompute(lambda pp, m, c: _zb_h1(pp, m)),
)
_info(
    "zb-v", "v", "2", True,
    description="Zero Bubble V: two chunks per rank in a V (chunk 0 on ranks 0..pp-1, chunk 1 back "
    "on pp-1..0), split backward; no bubble beyond the ramp at F=I=W.",
    preconditions="chunks == 2, microbatches >= 1",
    torch_class="ScheduleZBVZeroBubble",
    build=_with_recompute(lambda pp, m, c: _zb_v(pp, m)),
)
_info(
    "dualpipev", "v", "2", True,
    description="DualPipeV (DeepSeek-V3's DualPipe cut to one V): V placement; the steady state "
    "pairs a forward of one chunk with a full backward of the other (an executor may overlap "
    "the pair; here they are two consecutive actions, forward first, as torch runs them), the "
    "drain splits backwards into I and W.",
    preconditions="chunks == 2, microbatches >= 2 * pp",
    torch_class="ScheduleDualPipeV",
    build=_with_recompute(lambda pp, m, c: _dualpipev(pp, m)),
    check=_dualpipev_check,
)
_info(
    "merak-shifted", "loop", "1", False,
    description="Merak's shifted critical path: 1F1B, checkpointing on every stage but the last; "
    "the last pp-s-1 micro-batches of stage s <= pp-3 recompute eagerly in the drain, stage pp-2 "
    "pre-recomputes m0 and m1 and runs forward m2 in its first-backward wait, stage pp-3 "
    "pre-recomputes m0.",
    preconditions="pp >= 2, microbatches >= pp and >= 4",
    torch_class=None,
    recompute_is_schedule=True,
    build=_merak_builder("merak-shifted"),
    check=_merak_check("merak-shifted"),
)
_info(
    "merak-cooldown", "loop", "1", False,
    description="Merak ablation pre_recompute_1f1b: checkpointing on all stages; only the drain "
    "(last pp-s-1 micro-batches of stage s) recomputes eagerly.",
    preconditions="pp >= 2, microbatches >= pp",
    torch_class=None,
    recompute_is_schedule=True,
    build=_merak_builder("merak-cooldown"),
    check=_merak_check("merak-cooldown"),
)
_info(
    "merak-cooldown-lastnorecompute", "loop", "1", False,
    description="Merak ablation last_no_recompute_1f1b: like merak-cooldown, but the last stage "
    "does not checkpoint and stage pp-2 pre-recomputes m0 instead of its drain micro-batch.",
    preconditions="pp >= 2, microbatches >= pp",
    torch_class=None,
    recompute_is_schedule=True,
    build=_merak_builder("merak-cooldown-lastnorecompute"),
    check=_merak_check("merak-cooldown-lastnorecompute"),
)
# fmt: on


# ---------------------------------------------------------------------------------------------
# Validation


def validate_schedule(
    actions: list[list[Action]], pp: int, microbatches: int, chunks: int, placement: str
) -> None:
    """Check that ``actions`` is a complete, well-formed schedule; raise ValueError naming the fault.

    Every (stage, mb) has exactly one F and either one B or one I plus one W, all on the rank
    that holds the stage; F before B/I, I before W; a forward with save=False has exactly one R,
    placed after its F and before its B/I, and a saved forward has none. Deadlock freedom across
    ranks is checked by ``simulate_unit_costs``.
    """
    if len(actions) != pp:
        raise ValueError(f"schedule has {len(actions)} rank lists, expected pp={pp}")
    positions: dict[tuple[Op, int, int], tuple[int, int]] = {}
    forwards: dict[tuple[int, int], Action] = {}
    for rank, rank_actions in enumerate(actions):
        for index, a in enumerate(rank_actions):
            if not isinstance(a, Action):
                raise ValueError(f"rank {rank} position {index}: {a!r} is not an Action")
            if not 0 <= a.microbatch < microbatches:
                raise ValueError(
                    f"rank {rank} position {index}: {a} has micro-batch outside 0..{microbatches - 1}"
                )
            owner = stage_to_rank(a.stage, pp, chunks, placement)
            if owner != rank:
                raise ValueError(
                    f"rank {rank} position {index}: {a} belongs to rank {owner} ({placement} placement)"
                )
            if not a.save and a.op is not Op.FORWARD:
                raise ValueError(f"rank {rank}: {a} has save=False, which only a FORWARD may have")
            if a.eager and a.op is not Op.RECOMPUTE:
                raise ValueError(f"rank {rank}: {a} has eager=True, which only a RECOMPUTE may have")
            key = (a.op, a.stage, a.microbatch)
            if key in positions:
                raise ValueError(f"{a} appears twice (rank {positions[key][0]} and rank {rank})")
            positions[key] = (rank, index)
            if a.op is Op.FORWARD:
                forwards[(a.stage, a.microbatch)] = a

    def at(op: Op, s: int, mb: int) -> int | None:
        found = positions.get((op, s, mb))
        return None if found is None else found[1]

    for s in range(pp * chunks):
        for mb in range(microbatches):
            name = f"stage {s} micro-batch {mb}"
            f, b, i, w, r = (at(op, s, mb) for op in (FWD, BWD, BWD_I, BWD_W, RECOMP))
            if f is None:
                raise ValueError(f"{name}: no forward")
            if b is None and (i is None or w is None):
                missing = (
                    "backward (B, or I and W)" if i is None and w is None else ("W" if w is None else "I")
                )
                raise ValueError(f"{name}: no {missing}")
            if b is not None and (i is not None or w is not None):
                raise ValueError(f"{name}: has both a full backward B and split I/W")
            first_backward = b if b is not None else i
            assert first_backward is not None
            if f > first_backward:
                raise ValueError(
                    f"{name}: backward before forward on rank {stage_to_rank(s, pp, chunks, placement)}"
                )
            if i is not None and w is not None and w < i:
                raise ValueError(f"{name}: W before I")
            saved = forwards[(s, mb)].save
            if saved and r is not None:
                raise ValueError(f"{name}: RECOMPUTE of a forward that saved its activations")
            if not saved and r is None:
                raise ValueError(
                    f"{name}: checkpointed forward (save=False) has no RECOMPUTE before its backward"
                )
            if r is not None and not f < r < first_backward:
                raise ValueError(f"{name}: RECOMPUTE must come after the forward and before the backward")


# ---------------------------------------------------------------------------------------------
# Unit-cost list scheduler


DoneKey = tuple[str, int, int]  # (what ended: "F", "grad", "W", "R"; stage; micro-batch)


def completion_key(a: Action) -> DoneKey:
    """What an action's end makes available: a B or I ends the stage's input gradient ("grad")."""
    if a.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
        return ("grad", a.stage, a.microbatch)
    return (a.op.value, a.stage, a.microbatch)


def action_dependencies(a: Action, last_stage: int) -> list[DoneKey]:
    """The completions an action waits for, besides the previous action of its rank: F(s, mb) after
    F(s-1, mb); B/I(s, mb) after F(s, mb) and the gradient of (s+1, mb); W after I; R after F and,
    unless eager, after the gradient of (s+1, mb). The one rule of ``simulate_unit_costs`` and of the
    fast estimate's weighted run (``sim.estimate_pipeline``)."""
    s, mb = a.stage, a.microbatch
    if a.op is Op.FORWARD:
        return [("F", s - 1, mb)] if s > 0 else []
    if a.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
        return [("F", s, mb)] + ([("grad", s + 1, mb)] if s < last_stage else [])
    if a.op is Op.BACKWARD_WEIGHT:
        return [("grad", s, mb)]
    wait_grad = not a.eager and s < last_stage
    return [("F", s, mb)] + ([("grad", s + 1, mb)] if wait_grad else [])


def simulate_unit_costs(
    actions: list[list[Action]],
    pp: int,
    chunks: int,
    placement: str,
    f: float = 1.0,
    b: float = 1.0,
    w: float = 1.0,
    r: float = 1.0,
) -> dict:
    """Run the schedule on an idealised machine: zero communication, fixed action costs.

    Costs: F = f, I = b, W = w, full B = b + w (input plus weight gradient; pass w=0 for a
    backward that costs b), R = r. Each action starts when the previous action of its rank has
    ended and its dependencies have: F(s, mb) after F(s-1, mb); B/I(s, mb) after B/I(s+1, mb)
    (the last stage: after its own F); W after I; R after F and, unless eager, after B/I(s+1, mb).

    Returns makespan, per-rank busy and bubble time, overall bubble fraction (idle / (pp *
    makespan)), per-stage peaks of in-flight micro-batches (forward started, B/I not finished)
    and of full activation sets held (saved forward or recompute started, B/I not finished), and
    the timeline (per rank: (action, start, end)). Raises RuntimeError on a deadlock.
    """
    last_stage = pp * chunks - 1
    cost = {Op.FORWARD: f, Op.BACKWARD: b + w, Op.BACKWARD_INPUT: b, Op.BACKWARD_WEIGHT: w, Op.RECOMPUTE: r}
    # Each action's dependencies, completion key and cost, worked out once: the scheduler below
    # visits a blocked action many times (a plan search runs this for every pipeline shape).
    prepared = [[(a, tuple(action_dependencies(a, last_stage)), completion_key(a), cost[a.op]) for a in row]
                for row in actions]
    end_of: dict[tuple[str, int, int], float] = {}
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    free = [0.0] * pp
    pos = [0] * pp
    remaining = sum(len(x) for x in actions)
    while remaining:
        progressed = False
        for rank in range(pp):
            row, at, clock, placed = prepared[rank], pos[rank], free[rank], timeline[rank]
            while at < len(row):
                a, needs, key, duration = row[at]
                start = clock
                for d in needs:
                    ready = end_of.get(d)
                    if ready is None:
                        break
                    start = max(start, ready)
                else:
                    clock = start + duration
                    end_of[key] = clock
                    placed.append((a, start, clock))
                    at += 1
                    continue
                break
            if at != pos[rank]:
                remaining -= at - pos[rank]
                pos[rank], free[rank] = at, clock
                progressed = True
        if not progressed:
            stuck = ", ".join(
                f"rank {k} at {actions[k][pos[k]]}" for k in range(pp) if pos[k] < len(actions[k])
            )
            raise RuntimeError(f"schedule deadlocks: {stuck}")

    makespan = max(free) if any(actions) else 0.0
    busy = [sum(end - start for _, start, end in row) for row in timeline]
    bubble = [makespan - x for x in busy]

    # Peaks by a sweep over (time, +1/-1) events; at equal times releases go first.
    events: dict[int, list[tuple[float, int]]] = {}
    full: dict[int, list[tuple[float, int]]] = {}
    grad_end = {(k[1], k[2]): t for k, t in end_of.items() if k[0] == "grad"}
    for row in timeline:
        for a, start, _ in row:
            release = grad_end[(a.stage, a.microbatch)]
            if a.op is Op.FORWARD:
                events.setdefault(a.stage, []).extend([(start, 1), (release, -1)])
            if (a.op is Op.FORWARD and a.save) or a.op is Op.RECOMPUTE:
                full.setdefault(a.stage, []).extend([(start, 1), (release, -1)])

    def peak(evts: list[tuple[float, int]]) -> int:
        level = best = 0
        for _, delta in sorted(evts):
            level += delta
            best = max(best, level)
        return best

    stages = range(pp * chunks)
    return {
        "makespan": makespan,
        "busy": busy,
        "bubble": bubble,
        "bubble_fraction": sum(bubble) / (pp * makespan) if makespan else 0.0,
        "peak_inflight": {s: peak(events.get(s, [])) for s in stages},
        "peak_activations": {s: peak(full.get(s, [])) for s in stages},
        "timeline": timeline,
    }
