"""The fast estimate's pipeline time: the schedule's dependency graph, weighted with each stage's real costs.

A pipeline schedule fixes every rank's order of actions; an action starts when the previous action of
its rank and the actions it depends on (``sim.schedules.action_dependencies``) have ended. With no
contention that makes the iteration the longest path through a graph whose nodes are the actions,
weighted by their seconds, and whose cross-rank edges carry one point-to-point transfer. The graph
depends only on (schedule, pp, micro-batches, chunks, recompute flags) and is built once per shape;
pricing a plan is one pass over it in topological order (no event simulation, no simpy).

Why not a closed form in units (what the estimate did before): "m x the slowest rank's time per
micro-batch + the unit run's bubble x the average rank's time per unit" is exact only when every rank
costs the same and F : B is the unit run's 1 : 2. The ramp's critical path passes through every
*other* stage once, so with the LM head on the last stage (about 3.5 blocks at hidden 1,024) the
average overprices the ramp by (slowest - average) per pass, +6% median and +13.5% at most on the
vTrain pp 4 rows with 2 micro-batches; full recompute makes B three forwards, not two, which moves
the interleaved and zero-bubble ramps; and adding every hop to the total ignores the hops that a
warm-up forward hides. Weighting the graph prices all three as the engine does.

``pipeline_time`` is the one entry: the fast estimate (``sim.estimate.Estimator``) and the
calibration's closed form (``sim.calibration.quick_predict``) both price a pipeline through it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from sim.host_cpu import Moving, RankTransfers, Stretch, overlap_stretch
from sim.schedules import (
    SCHEDULES,
    Op,
    action_dependencies,
    check_preconditions,
    completion_key,
    generate_schedule,
    simulate_unit_costs,
    stage_to_rank,
)
from traces.errors import ConfigError

# Past this many micro-batches per pipeline rank the schedule is run at fewer and extended.
STEADY_MICROBATCHES_PER_RANK = 2


@dataclass(frozen=True)
class ActionGraph:
    """One schedule's actions in a topological order (the unit run's start times): per action its
    rank, stage and op, the index of its rank's previous action (-1 for none), and what it waits for
    as (action index, hop) pairs: ``hop`` is the stage boundary s (between stages s and s + 1) whose
    transfer the edge carries when it crosses ranks, else -1. ``kinds`` are the distinct (stage, op)
    and ``kind`` each action's index into them, so a plan prices each kind once."""

    rank: tuple[int, ...]
    stage: tuple[int, ...]
    op: tuple[Op, ...]
    previous: tuple[int, ...]
    needs: tuple[tuple[tuple[int, int], ...], ...]
    kinds: tuple[tuple[int, Op], ...]
    kind: tuple[int, ...]
    pp: int
    microbatches: int
    # A rank's actions run one after another, so its last action ends last, and so does the last
    # backward action (B, I or W) of each stage: per rank and per stage, that action's index.
    rank_last: tuple[int, ...]
    stage_last_backward: tuple[tuple[int, int], ...]
    # per action, the stage boundary its output crosses to another rank (-1: none): the send it issues
    sends: tuple[int, ...] = ()


@lru_cache(maxsize=1024)
def action_graph(name: str, pp: int, microbatches: int, chunks: int, flags: tuple[bool, ...]) -> ActionGraph:
    """The graph of ``generate_schedule(name, pp, microbatches, chunks, flags)`` (flags as
    ``sim.estimate.unit_pipeline`` passes them: ignored for a schedule whose recompute is its shape)."""
    info = SCHEDULES[name]
    recompute = None if info.recompute_is_schedule else list(flags)
    actions = generate_schedule(name, pp, microbatches, chunks, recompute)
    # Any durations > 0 order an action after all it waits for; the unit run also checks for deadlocks.
    run = simulate_unit_costs(actions, pp, chunks, info.placement, f=1.0, b=1.0, w=1.0, r=1.0)
    placed = sorted(((start, rank, position, a) for rank, row in enumerate(run["timeline"])
                     for position, (a, start, _) in enumerate(row)), key=lambda x: (x[0], x[1], x[2]))
    rank_of = stage_ranks(pp, chunks, info.placement)
    index_of: dict[tuple, int] = {}
    last_of_rank: dict[int, int] = {}
    kind_index: dict[tuple[int, Op], int] = {}
    ranks, stages, ops, previous, needs, kind = [], [], [], [], [], []
    last_stage = pp * chunks - 1
    for i, (_, rank, _, a) in enumerate(placed):
        ranks.append(rank)
        stages.append(a.stage)
        ops.append(a.op)
        previous.append(last_of_rank.get(rank, -1))
        edges = []
        for key in action_dependencies(a, last_stage):
            other = key[1]
            edges.append((index_of[key], min(a.stage, other) if rank_of[other] != rank else -1))
        needs.append(tuple(edges))
        kind.append(kind_index.setdefault((a.stage, a.op), len(kind_index)))
        index_of[completion_key(a)] = i
        last_of_rank[rank] = i
    backward_last = {stages[i]: i for i in range(len(ops)) if ops[i] in (Op.BACKWARD, Op.BACKWARD_INPUT,
                                                                          Op.BACKWARD_WEIGHT)}
    sends = [-1] * len(ops)
    for edges in needs:
        for d, hop in edges:
            if hop >= 0:
                sends[d] = hop
    return ActionGraph(tuple(ranks), tuple(stages), tuple(ops), tuple(previous), tuple(needs),
                       tuple(kind_index), tuple(kind), pp, microbatches,
                       tuple(last_of_rank.get(rank, -1) for rank in range(pp)), tuple(sorted(backward_last.items())),
                       tuple(sends))


@dataclass(frozen=True)
class WeightedRun:
    """Seconds: the makespan with the hops and without them ("bare"), and with the hops each rank's
    last compute end and each virtual stage's last backward action end (when its gradients are ready
    for the gradient sync)."""

    makespan: float
    bare: float
    rank_end: tuple[float, ...]
    stage_grads_ready: Mapping[int, float]
    step_s: tuple[float, ...] = ()  # each rank's optimizer step's wall time beside its sends (``Beside.steps``)
    synced: tuple[float, ...] = ()  # when each rank's last gradient bucket has moved (``Beside.buckets``)


def weighted_run(graph: ActionGraph, seconds: Callable[[int, Op], float], hop_s: Sequence[float],
                 beside: Beside | None = None, blocking: bool = False) -> WeightedRun:
    """The longest path through ``graph`` with ``seconds(stage, op)`` per action and ``hop_s[s]`` on an
    edge between stages s and s + 1 that crosses ranks (both directions: the activation forward, its
    gradient back); the same pass also gives the path without hops. ``beside``: what slows a
    rank's compute and its transfers while both run, where anything does (``_sends_beside``).

    ``blocking`` (``schedule.p2p: blocking``): the engine's rule (``sim.lower.blocking_p2p_pass``),
    the compute after a send waits for the transfer, so the send's hop also lies on the edge from its
    sender to the sender's next action, and a rank's end is its last send's end where that is later
    (the optimizer step, a compute, waits for it). The receiver's edge is unchanged: one transfer,
    counted once on each path it lies on."""
    if beside is not None and beside.slows:
        return _sends_beside(graph, seconds, hop_s, beside, blocking)
    durations = [seconds(stage, op) for stage, op in graph.kinds]
    n = len(graph.op)
    end = [0.0] * n
    bare = [0.0] * n
    previous, needs, kind = graph.previous, graph.needs, graph.kind
    sends = graph.sends if blocking else (-1,) * n
    # The plan search runs this for every distinct pipeline it estimates: a plain loop, locals only.
    for i in range(n):
        before = previous[i]
        if before >= 0:
            start, start_bare = end[before], bare[before]
            if sends[before] >= 0:
                start += hop_s[sends[before]]
        else:
            start = start_bare = 0.0
        for d, hop in needs[i]:
            ready = end[d] + hop_s[hop] if hop >= 0 else end[d]
            if ready > start:
                start = ready
            ready = bare[d]
            if ready > start_bare:
                start_bare = ready
        seconds_i = durations[kind[i]]
        end[i] = start + seconds_i
        bare[i] = start_bare + seconds_i
    return WeightedRun(max(end, default=0.0), max(bare, default=0.0),
                       tuple(end[i] + (hop_s[sends[i]] if sends[i] >= 0 else 0.0) if i >= 0 else 0.0
                             for i in graph.rank_last),
                       {stage: end[i] for stage, i in graph.stage_last_backward})


def blocking_sends_s(pp: int, chunks: int, placement: str, hop_s: Sequence[float]) -> list[float]:
    """Per pipeline rank, the seconds of the sends its compute waits for in one micro-batch under
    ``p2p: blocking``: each of its stages' forward sends over the boundary above it and backward over
    the one below, where that boundary crosses ranks (what ``weighted_run(blocking=True)`` adds to
    the rank's own cycle, so to its steady-state period)."""
    rank_of = stage_ranks(pp, chunks, placement)
    out = [0.0] * pp
    for s, k in enumerate(rank_of):
        if s + 1 < len(rank_of) and rank_of[s + 1] != k:
            out[k] += hop_s[s]
        if s > 0 and rank_of[s - 1] != k:
            out[k] += hop_s[s - 1]
    return out


def stage_ranks(pp: int, chunks: int, placement: str) -> tuple[int, ...]:
    """Each virtual stage's pipeline rank."""
    return tuple(stage_to_rank(s, pp, chunks, placement) for s in range(pp * chunks))


def steady_count(name: str, pp: int, microbatches: int, chunks: int) -> int:
    """A smaller micro-batch count with the same steady state (a divisor m / k >= 2 pp that the
    schedule accepts), or the count itself."""
    floor = STEADY_MICROBATCHES_PER_RANK * pp
    best = microbatches
    k = 2
    while microbatches // k >= floor:
        if microbatches % k == 0:
            try:
                check_preconditions(name, pp, microbatches // k, chunks)
            except ConfigError:
                pass
            else:
                best = microbatches // k
        k += 1
    return best


@dataclass(frozen=True)
class StageTime:
    """One virtual stage's seconds per micro-batch, TP communication included: forward, whole
    backward, recompute, and a split backward's I and W (``sim.estimate.StageTimes`` extends it
    with its bytes)."""

    fwd_s: float
    bwd_s: float
    recompute_s: float
    bwd_input_s: float
    bwd_weight_s: float


@dataclass(frozen=True)
class PipelineTime:
    """A whole iteration's pipeline, in seconds: ``WeightedRun``'s fields at the plan's micro-batch count."""

    makespan: float
    bare: float
    rank_end: tuple[float, ...]
    grads_ready: Mapping[int, float]
    step_s: tuple[float, ...] = ()  # ``WeightedRun.step_s``
    synced: tuple[float, ...] = ()  # ``WeightedRun.synced``


# per pipeline rank, its gradient buckets as (virtual stages whose last backward each waits for, seconds, cores)
Buckets = tuple[tuple[tuple[tuple[int, ...], float, float], ...], ...]


@dataclass(frozen=True)
class Beside:
    """What slows a pipeline's compute and its transfers while both run on a rank (the engine's
    rule, ``sim.host_cpu.overlap_stretch``): ``ranks_on_host`` ranks on ``cores`` cores (``None``:
    not shared), ``overlap_slowdown``; the cores each stage boundary's send keeps busy
    (``hop_cores[s]``), and per pipeline rank its gradient ``buckets`` as (virtual stages whose
    last backward each waits for, seconds, cores) and the ``steps``' compute seconds: its optimizer
    step, run once its last action has ended and its buckets have moved (0: none timed here; a step
    that waits for more, e.g. the tied embedding's all-reduce, is left to the estimate's tail)."""

    ranks_on_host: int = 1
    cores: int | None = None
    overlap_slowdown: float = 0.0
    hop_cores: tuple[float, ...] = ()
    buckets: Buckets = ()
    steps: tuple[float, ...] = ()

    @property
    def slows(self) -> bool:
        """Whether anything is slowed (else the plain weighted run is the engine's)."""
        return self.overlap_slowdown > 0.0 or (self.cores is not None and (
            any(self.hop_cores) or any(cores for rank in self.buckets for _, _, cores in rank)))

    def stretch(self, comm_cores: float) -> Stretch:
        return overlap_stretch(self.ranks_on_host, self.cores, comm_cores, self.overlap_slowdown)


SEND_STREAM, COLLECTIVE_STREAM = 0, 1


def _sends_beside(graph: ActionGraph, seconds: Callable[[int, Op], float], hop_s: Sequence[float],
                  beside: Beside, blocking: bool = False) -> WeightedRun:
    """``weighted_run`` with each rank's compute and its transfers slowed while both run
    (``Beside``). A send starts when the action whose output it carries ends, or when the rank's
    previous send ends (one send stream), and its receiver waits for its end; a gradient bucket
    starts when the last backward of the stages it holds ends, behind the rank's earlier buckets
    (one collective stream). Each rank is timed by ``sim.host_cpu.RankTransfers``.

    A send's end depends on how its sender computes after it, which may come after its receiver in
    the graph's order (the unit run's), so the actions are placed as their inputs become known: a
    send is known once its end is, or once its rank has no action left; when every action left
    waits for a send still moving, the one that would end first if its rank computed no more
    (``RankTransfers.ends_alone``) ends then: each action left starts after some such end, so its
    sender computes nothing more before it. ``blocking``: a rank's next action (and its optimizer
    step) waits for its last send, which moves beside no compute of its rank, so ``ends_alone`` is
    its end."""
    durations = [seconds(stage, op) for stage, op in graph.kinds]
    n = len(graph.op)
    sends = graph.sends  # the hop each action's output crosses to another rank (-1: none)
    stage_of_last = {i: stage for stage, i in graph.stage_last_backward}
    waiting = [list(rank_buckets) for rank_buckets in beside.buckets] or [[] for _ in range(graph.pp)]
    done_stages: set[int] = set()
    rank_actions: list[list[int]] = [[] for _ in range(graph.pp)]
    for i in range(n):
        rank_actions[graph.rank[i]].append(i)
    timed = [RankTransfers(beside.stretch, streams=2) for _ in range(graph.pp)]
    sent: list[Moving | None] = [None] * n
    unknown: dict[Moving, int] = {}  # sends whose end is not known yet, by their rank
    end, bare = [0.0] * n, [0.0] * n
    placed = [False] * n
    position = [0] * graph.pp  # per rank: its next action to place
    step_s = [0.0] * graph.pp
    moved: list[list[Moving]] = [[] for _ in range(graph.pp)]  # per rank its buckets

    def known(moving: Moving, rank: int) -> bool:
        if moving.end is None and position[rank] == len(rank_actions[rank]):
            moving.end = timed[rank].ends_alone(moving)  # nothing left to slow it
        return moving.end is not None

    left = n
    while left:
        progressed = False
        for rank in range(graph.pp):
            while position[rank] < len(rank_actions[rank]):
                i = rank_actions[rank][position[rank]]
                if not all(placed[d] and (hop < 0 or known(sent[d], graph.rank[d]))  # type: ignore[arg-type]
                           for d, hop in graph.needs[i]):
                    break
                before = graph.previous[i]
                start, start_bare = (end[before], bare[before]) if before >= 0 else (0.0, 0.0)
                for d, hop in graph.needs[i]:
                    start = max(start, sent[d].end if hop >= 0 else end[d])  # type: ignore[union-attr,type-var]
                    start_bare = max(start_bare, bare[d])
                me = timed[rank]
                if blocking and before >= 0 and sends[before] >= 0:
                    start = max(start, me.ends_alone(sent[before]))  # type: ignore[arg-type]
                me.idle(start)
                end[i] = me.compute(durations[graph.kind[i]])
                bare[i] = start_bare + durations[graph.kind[i]]
                if sends[i] >= 0:
                    hop = sends[i]
                    sent[i] = me.add(SEND_STREAM, hop_s[hop], beside.hop_cores[hop] if beside.hop_cores else 0.0)
                    unknown[sent[i]] = rank
                if i in stage_of_last:  # a stage's gradients are ready: the buckets that waited only for them start
                    done_stages.add(stage_of_last[i])
                    for bucket in [b for b in waiting[rank] if done_stages.issuperset(b[0])]:
                        waiting[rank].remove(bucket)
                        moved[rank].append(me.add(COLLECTIVE_STREAM, bucket[1], bucket[2]))
                placed[i] = True
                position[rank] += 1
                left -= 1
                progressed = True
                if position[rank] == len(rank_actions[rank]) and beside.steps and beside.steps[rank] > 0.0:
                    # its optimizer step, beside the sends still moving (they carry what others wait for)
                    buckets_left = me.queues[COLLECTIVE_STREAM]
                    me.idle(max(me.ends_alone(buckets_left[-1]) if buckets_left else me.now,
                                me.ends_alone(sent[i]) if blocking and sends[i] >= 0 else me.now))  # type: ignore[arg-type]
                    began = me.now
                    step_s[rank] = me.compute(beside.steps[rank]) - began
        if left and not progressed:  # every action left waits for a send still moving
            for m in [m for m in unknown if m.end is not None]:
                del unknown[m]
            first = min(unknown, key=lambda m: timed[unknown[m]].ends_alone(m))
            first.end = timed[unknown.pop(first)].ends_alone(first)
    return WeightedRun(max(end, default=0.0), max(bare, default=0.0),
                       tuple(timed[graph.rank[i]].ends_alone(sent[i]) if blocking and i >= 0 and sends[i] >= 0  # type: ignore[arg-type]
                             else end[i] if i >= 0 else 0.0 for i in graph.rank_last),
                       {stage: end[i] for stage, i in graph.stage_last_backward}, tuple(step_s),
                       tuple(max((timed[rank].ends_alone(m) for m in moved[rank]), default=0.0)
                             for rank in range(graph.pp)))


def _compute_bound(schedule: str, pp: int, microbatches: int, chunks: int, capped: int, makespan: float,
                   slowest: float, run: Callable[[int], WeightedRun]) -> bool:
    """Whether the steady state at ``capped`` micro-batches is set by the slowest rank's compute,
    so that extending it by ``slowest`` per micro-batch is exact.

    The steady state repeats, and each cycle of its dependencies bounds its period: a rank's own
    actions one after another (one micro-batch long: its compute per micro-batch), and a
    micro-batch's round trip from a rank down the pipeline and back through the hops, one
    micro-batch long per micro-batch that rank keeps in flight meanwhile (at most pp x chunks). The
    longest per micro-batch sets the period. If it is a round trip, the makespan grows by steps that
    repeat over the trip's length (1F1B, pp 4, 3 ms hops, 1-1.6 ms forwards: 5.7, 9, 9, 9 ms), not
    by ``slowest`` each, and the capped count need not be in step with the plan's count. So the run
    is repeated at the next count the schedule accepts at least pp x chunks further on (a window
    holding a whole period of any round trip), and the steady state is taken as compute-bound iff
    the makespan grew by exactly ``slowest`` per micro-batch there. (In the steady states seen, no
    step is shorter than ``slowest`` and one per period is longer, so a round trip shows; a window
    of one micro-batch missed two Merak plans of tests/test_estimate_steady.py.) Anything else (a
    round trip, or a ramp not over yet) runs the plan's own count, which is exact."""
    further = capped + pp * chunks
    while further < microbatches:
        try:
            check_preconditions(schedule, pp, further, chunks)
        except ConfigError:
            further += 1
            continue
        grown = run(further).makespan - makespan
        return abs(grown - (further - capped) * slowest) <= 1e-9 * grown  # else (or in a ramp still): run it all
    return False  # the plan's own count is within reach: run it


def pipeline_time(schedule: str, pp: int, microbatches: int, chunks: int, stages: Sequence[StageTime],
                  per_rank: Sequence[float], hop_s: Sequence[float], delta_s: Sequence[float] | None = None,
                  flags: tuple[bool, ...] | None = None,
                  runs: MutableMapping[tuple, WeightedRun] | None = None,
                  beside: Beside | None = None, blocking: bool = False) -> PipelineTime:
    """The schedule's graph weighted with the stages' seconds: the makespan with the hops and without
    them ("bare"), each rank's last compute end and each stage's last backward end.

    ``per_rank``: each pipeline rank's seconds per micro-batch (its stages' forward, backward and
    recompute, plus ``delta_s``); past the capped micro-batch count (``steady_count``) the steady
    state is extended by the slowest rank's where that rank's compute sets its period
    (``_compute_bound``), else the graph is run at the plan's count. ``hop_s[s]``: one point-to-point transfer between
    stages s and s + 1. ``delta_s``: per stage, seconds of re-runs DELTA adds before each backward.
    ``flags``: per stage, whether it recomputes (read only by a schedule whose recompute is its
    shape, Merak's). ``runs``: a cache of weighted runs by their inputs. ``beside``: what slows a
    rank's compute and its sends and gradient buckets while both run (``Beside``; where anything
    does, the graph is run at the plan's micro-batch count, not capped). ``blocking``: the compute
    after a send waits for it (``schedule.p2p: blocking``, ``weighted_run``), so a rank's own cycle
    per micro-batch is its compute and its sends (``blocking_sends_s``)."""
    info = SCHEDULES[schedule]
    n_stages = len(stages)
    delta_s = delta_s if delta_s is not None else (0.0,) * n_stages
    if n_stages == 1:  # one stage: its actions back to back, the last one a backward
        total = microbatches * per_rank[0]
        return PipelineTime(total, total, (total,), {0: total})
    # Under a slowdown the steady state is not the slowest rank's seconds per micro-batch (each
    # rank's compute beside its sends is slowed by how its sends fall), so the run goes to the plan's
    # own count: the same pass as the engine's, the extension then empty.
    slows = beside is not None and beside.slows
    capped = microbatches if slows else steady_count(schedule, pp, microbatches, chunks)
    flags = flags if flags is not None and info.recompute_is_schedule else (False,) * n_stages
    # An ordinary recompute runs inside the backward, just before it (the program's RECOMPUTE
    # waits for the output gradient); Merak's are actions of their own.
    inline = 0.0 if info.recompute_is_schedule else 1.0

    def seconds(stage: int, op: Op) -> float:
        st = stages[stage]
        before = inline * st.recompute_s + delta_s[stage]
        if op is Op.FORWARD:
            return st.fwd_s
        if op is Op.RECOMPUTE:
            return st.recompute_s
        if op is Op.BACKWARD:
            return before + st.bwd_s
        if op is Op.BACKWARD_INPUT:
            return before + (st.bwd_input_s if stage > 0 else 0.0)
        return st.bwd_weight_s if stage > 0 else st.bwd_s  # W (stage 0: the whole backward)

    # Plans that differ only where the pipeline cannot see it (a TP overlap level at tp 1, a memory
    # policy with the same recompute) share a run.
    weights = (tuple((st.fwd_s, st.bwd_s, st.recompute_s, st.bwd_input_s, st.bwd_weight_s) for st in stages),
               tuple(delta_s), tuple(hop_s), beside if slows else None, blocking)

    def run(count: int) -> WeightedRun:
        key = ((schedule, pp, count, chunks, flags), *weights)
        done = runs.get(key) if runs is not None else None
        if done is None:
            done = weighted_run(action_graph(schedule, pp, count, chunks, flags), seconds, hop_s, beside, blocking)
            if runs is not None:
                runs[key] = done
        return done

    full = run(capped)
    cycle = [own + sends for own, sends in zip(per_rank, blocking_sends_s(pp, chunks, info.placement, hop_s),
                                                strict=True)] if blocking else per_rank
    if capped < microbatches and not _compute_bound(schedule, pp, microbatches, chunks, capped, full.makespan,
                                                     max(cycle), run):
        # A cycle through the hops is longer per micro-batch than the slowest rank's compute: its
        # period need not divide the capped count, so only the plan's own count is exact.
        capped, full = microbatches, run(microbatches)
    extend = (microbatches - capped) * max(cycle)
    return PipelineTime(full.makespan + extend, full.bare + extend, tuple(end + extend for end in full.rank_end),
                        {s: t + extend for s, t in full.stage_grads_ready.items()}, full.step_s, full.synced)
