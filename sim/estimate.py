"""A fast estimate of a plan's iteration time and peak memory, for ranking thousands of plans.

Closed form over the same inputs as the engine, with no event simulation:

- **Per virtual stage, per micro-batch**: forward, backward and recompute times from the cost model's
  ``LayerCosts``, the TP all-reduces folded in by ``sim.tp_overlap.tp_segments_time`` (the engine's
  own rule for each overlap level) at the cost ``sim.comm.ClusterComm`` gives for the TP group.
  The backward carries (m - 1) / m of the weight-gradient accumulation pass (``grad_accumulate_s``),
  which the engine charges to every backward but micro-batch 0's: the same total per rank. Under
  ``p2p: blocking`` with scatter/gather, a forward or backward that needs a message from another rank
  also carries the receivers' TP all-gather of it (``Estimator._gathered``); a blocking send's own
  transfer is on its sender's path in the pipeline's weighted run.
- **Pipeline**: the schedule's shape comes from its own generator (``sim.schedules.generate_schedule``)
  run on the idealised unit-cost machine (``simulate_unit_costs``: F = I = W = 1; an ordinary
  recompute lengthens the backward and leaves the shape alone, Merak's eager ones are placed); the
  analytic transformer costs have F = I = W per block, so the unit makespan is the real one in units
  of a block pass. Time = m x (bottleneck rank's time per micro-batch) + (unit bubble) x (average
  rank's time per unit), plus one point-to-point hop per stage boundary on the way in and out.
  A newly registered schedule is estimated without a new formula. The unit run is cached per
  (schedule, pp, micro-batches, chunks) and, past 2 x pp micro-batches, run at a
  smaller count and extended linearly (the steady state adds the same work per micro-batch).
- **Data parallelism**: the rank's gradient buckets, cut and priced as lowering and the engine do
  (``sim.gradient_sync_context``: the real tensors' shapes and row sparsity through the method's
  own phase function, so compressed and row-sparse methods are ranked by what they send), each
  issued when the last backward of the stages it holds ends in the unit run, overlapped with the
  rest of the rank's compute; the optimizer step after; the rank that ends last sets the iteration.
- **Sharded embeddings** (``embedding=``, ``sim.embedding.estimate_terms``): the tables' bytes
  leave their stage's buckets; their all-to-alls go on the same collective stream: the last
  micro-batch's gradient exchange before the buckets, the lookups before the forwards (sequential)
  or after the buckets, beside the dense optimizer step (2D).
- **Memory per rank**: parameters, gradients, optimizer state and one gradient bucket, plus the
  activations at the worst moment of the same unit run: per stage, (forwards held until their last
  backward action ends) x (bytes a forward keeps under the memory policy) + (recomputed sets held) x
  (bytes a recompute brings back).

What it leaves out: contention between concurrent transfers, the exact split-backward corner cases of
the first stage, and where the ramp's hops overlap compute. The engine (``sim.simulate``) decides;
``sim.search`` simulates the estimate's best candidates and reports how well the two agree.
Imports neither torch nor simpy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, NamedTuple

from sim.comm import ClusterComm, concurrent_groups, concurrent_senders
from sim.costs import CostModel, LayerCosts, sequence_parallel_grads_s, tp_comm_s
from sim.critical_rank import critical_rank
from sim.embedding import EmbeddingTerms, table_tp_costs
from sim.estimate_pipeline import Beside, Buckets, PipelineTime, StageTime, pipeline_time, steady_count
from sim.gradient_sync import GRADIENT_SYNC, GradientSyncConfig, bucket_buffer_bytes, phases_s
from sim.gradient_sync_context import BucketPlan, bucket_context, bucket_layers
from sim.gradient_sync_distopt import param_gather_phases
from sim.host_cpu import Stretch, cores_taken, host_share, overlap, overlap_stretch, phases_cpu_s
from sim.meeting import add_offsets, instruction_offsets, instruction_variance, lateness_s, offset_variance
from sim.memory import (
    LAYER_VIEWS,
    MemoryPolicy,
    forward_bytes,
    held_bytes,
    in_backward_extra_bytes,
    movable_bytes,
    received_gradient_bytes,
)
from sim.model_state import (
    gradient_buffer_scale,
    held_gradient_bytes,
    held_optimizer_bytes,
    optimizer_share,
    step_peak_bytes,
)
from sim.program import Kind
from sim.schedules import (
    SCHEDULES,
    generate_schedule,
    rank_stages,
    simulate_unit_costs,
    stage_to_rank,
)
from sim.tied_embedding import tied_embedding_bytes, tied_ranks, ties_embedding

# Past STEADY_MICROBATCHES_PER_RANK micro-batches per pipeline rank the unit schedule is run at fewer
# and extended (sim.estimate_pipeline.steady_count).


@dataclass(frozen=True)
class UnitPipeline:
    """A schedule on the unit-cost machine, at the plan's micro-batch count (extended if capped)."""

    makespan: float  # units
    busy: tuple[float, ...]  # per pipeline rank, units
    # Per pipeline rank, the states that can be its memory peak: for each of its virtual stages
    # (rank_stages order), (micro-batches whose forward output is held, recomputed sets held).
    # Only states no other state dominates are kept, so a peak is a max of a few dot products.
    states: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]
    # Per pipeline rank: units from the rank's last compute to the makespan, and per local stage the
    # units from that stage's last backward action to the rank's last compute (when its gradients
    # are ready for the gradient sync).
    idle_after: tuple[float, ...]
    slack: tuple[tuple[float, ...], ...]


@lru_cache(maxsize=4096)
def unit_pipeline(name: str, pp: int, microbatches: int, chunks: int, flags: tuple[bool, ...],
                  r: float) -> UnitPipeline:
    """The schedule's makespan and in-flight micro-batches with F = I = W = 1 and recompute r."""
    info = SCHEDULES[name]
    m = steady_count(name, pp, microbatches, chunks)
    recompute = None if info.recompute_is_schedule else list(flags)
    actions = generate_schedule(name, pp, m, chunks, recompute)
    run = simulate_unit_costs(actions, pp, chunks, info.placement, f=1.0, b=1.0, w=1.0, r=r)
    busy = list(run["busy"])
    makespan = run["makespan"]
    states = tuple(_peak_states(row, pp, chunks, info.placement, rank, m, microbatches)
                   for rank, row in enumerate(run["timeline"]))
    idle_after, slack = [], []
    for rank, row in enumerate(run["timeline"]):
        end = max((e for _, _, e in row), default=0.0)
        idle_after.append(makespan - end)
        last = {}
        for a, _, e in row:
            if a.op.value in ("B", "I", "W"):
                last[a.stage] = max(last.get(a.stage, 0.0), e)
        slack.append(tuple(end - last.get(stage, end) for stage in _layout(pp, chunks, info.placement)[1][rank]))
    if m < microbatches:  # extend the steady state linearly
        extra = microbatches - m
        per_mb = [b / m for b in busy]
        busy = [b + extra * p for b, p in zip(busy, per_mb, strict=True)]
        makespan += extra * max(per_mb)
    return UnitPipeline(makespan, tuple(busy), states, tuple(idle_after), tuple(slack))


def _peak_states(row: list, pp: int, chunks: int, placement: str, rank: int, m: int,
                 microbatches: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Sweep one rank's unit timeline: a forward holds its output from its start until the
    micro-batch's last backward action (W when split, else B) ends, as the engine's ledger does; a
    recomputed set is held from the recompute (or, when the run has none, the first backward
    action) to the same end. A count equal to the capped run's micro-batches (every micro-batch in
    flight, GPipe) stands for the plan's count."""
    from sim.schedules import Op

    local = {s: i for i, s in enumerate(_layout(pp, chunks, placement)[1][rank])}
    recomputed = {(a.stage, a.microbatch) for a, _, _ in row if a.op is Op.RECOMPUTE}
    release: dict[tuple[int, int], float] = {}
    for a, _, end in row:
        if a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
            release[(a.stage, a.microbatch)] = end
        elif a.op is Op.BACKWARD_INPUT:
            release.setdefault((a.stage, a.microbatch), end)
    events: list[tuple[float, int, int, int]] = []  # (time, +1/-1, stage slot, 0 = held fwd / 1 = recomputed)
    for a, start, _ in row:
        key = (a.stage, a.microbatch)
        slot = local[a.stage]
        if a.op is Op.FORWARD:
            events += [(start, 1, slot, 0), (release[key], -1, slot, 0)]
        elif a.op is Op.RECOMPUTE or (a.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and key not in recomputed):
            events += [(start, 1, slot, 1), (release[key], -1, slot, 1)]
    events.sort(key=lambda e: (e[0], e[1]))  # releases first at equal times
    level = [[0, 0] for _ in local]
    candidates: set[tuple[tuple[int, int], ...]] = set()
    rising = False
    for _, delta, slot, which in events:
        if delta < 0 and rising:
            candidates.add(tuple((a, b) for a, b in level))
        rising = delta > 0
        level[slot][which] += delta
    if rising:
        candidates.add(tuple((a, b) for a, b in level))

    def scaled(state: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        return tuple((microbatches if a >= m else a, microbatches if b >= m else b) for a, b in state)

    def covers(y: tuple, x: tuple) -> bool:  # y holds at least what x holds, everywhere
        return all(a <= c and b <= d for (a, b), (c, d) in zip(x, y, strict=True))

    # Pareto filter: a state that another covers cannot be the peak. In order of decreasing total,
    # whatever covers a state comes before it, so each state is checked only against those kept.
    kept: list[tuple] = []
    for state in sorted(candidates, key=lambda c: -sum(a + b for a, b in c)):
        if not any(covers(other, state) for other in kept):
            kept.append(state)
    return tuple(sorted(scaled(c) for c in kept))


@dataclass(frozen=True)
class StageTimes(StageTime):
    """One virtual stage, one micro-batch: times (TP communication included) and bytes. Its split
    backward (zero-bubble schedules) is as the engine runs it: I with the input-gradient TP
    all-reduces and no weight-gradient GEMM to hide them behind, W alone; virtual stage 0 has no
    input gradient to send, so its I is empty and its W does the whole backward."""

    compute_s: float  # forward + backward without TP communication
    recompute_compute_s: float
    static_bytes: int  # parameters + gradients + optimizer state
    param_bytes: int
    grad_bytes: int
    kept_bytes: int  # what a forward leaves on the device under the memory policy
    recompute_extra_bytes: int  # what a recompute brings back
    output_bytes: int
    variance_s2: float = 0.0  # of the stage's forward, backward and recompute times (sim.meeting)
    fwd_compute_s: float = 0.0  # the forward without TP communication
    offsets_s: tuple[float, ...] = ()  # per profiling process, of the same times (sim.meeting)


Removed = tuple[tuple[int, int], ...]  # (layer, gradient bytes) that leave the buckets


@dataclass(frozen=True)
class BucketPrice:
    """One gradient bucket of a pipeline rank: the local stages whose gradients it holds and the
    seconds of its phases on the collective stream."""

    stages: tuple[int, ...]
    seconds: float
    cores: float = 0.0  # that a rank's transfer keeps busy while it moves data (sim.host_cpu)


class Prefetched(NamedTuple):
    """EmbRace 2D's end of an iteration on the tables' rank (``Estimator._prefetched``)."""

    before_s: float  # added to the buckets' time before the dense step's lookups (the table step beyond them)
    table_s: float  # the tables' own step, beside the buckets
    lookups_s: float  # the prefetched lookups the dense step waits for (its synchronous ids): bubble
    dense_s: float  # the dense step, or the last rows exchange beside it if longer


@dataclass(slots=True)
class Estimate:
    """The iteration and its breakdown: the critical rank's (``sim.critical_rank``), as the engine's; its
    kinds add up to the iteration (docs/search.md)."""

    iteration_s: float
    compute_s: float  # forward + backward, without TP communication, all micro-batches
    recompute_s: float  # its forward re-runs, with their own TP communication (as the engine's RECOMPUTE)
    bubble_s: float  # the rest of the iteration but p2p_s: idle, a sharded embedding's exposed lookups included
    tp_comm_s: float  # the forward's and backward's exposed TP communication
    p2p_s: float  # the pipeline's hops, as far as they lengthen the iteration beyond the rank's work
    dp_comm_s: float  # exposed gradient-sync time (the tied embedding's all-reduce included)
    optimizer_s: float  # the step and what follows it (the distributed optimizer's all-gather)
    peak_bytes: tuple[int, ...]  # per pipeline rank
    capacity_bytes: int

    @property
    def fits(self) -> bool:
        return max(self.peak_bytes) <= self.capacity_bytes


@dataclass(frozen=True, slots=True)
class Screen:
    """``Estimator.screen``: the estimate's peak bytes per pipeline rank and a lower bound of its time."""

    peak_bytes: tuple[int, ...]  # the same at every TP overlap level (it changes seconds, not bytes)
    capacity_bytes: int
    lower_bound_s: float
    # a lower bound for the same plan at any TP overlap level: compute and recompute without TP communication
    any_level_bound_s: float

    @property
    def fits(self) -> bool:
        return max(self.peak_bytes) <= self.capacity_bytes


def pipeline_lower_bound(steady_s: float, head_s: Sequence[float], compute_s: Sequence[float], microbatches: int,
                         optimizer_s: Sequence[float]) -> float:
    """A lower bound of the estimate's iteration time (``Estimator.estimate``), from figures that need
    no pipeline run: ``max(steady_s, max_k head_s[k] + microbatches x compute_s[k]) + min_k optimizer_s[k]``.

    ``steady_s``: micro-batches x the slowest rank's seconds per micro-batch (``per_rank``: forward,
    backward and recompute with TP communication); ``head_s[k]``: the forward seconds of the virtual
    stages below rank k's lowest one; ``compute_s[k]``: rank k's forward + backward seconds per
    micro-batch without TP communication; ``optimizer_s[k]``: its optimizer step.

    Proof. The estimate is ``steady + bubble + hops + tail + lookups`` with ``bubble = max(0, bare -
    steady)``, ``hops = max(0, makespan - bare)``, ``tail >= 0`` and ``lookups >= 0``, so it is at
    least ``max(steady, bare) + tail``.
    (1) ``bare`` is the longest path of the weighted run without hops (plus, past the capped
    micro-batch count c, ``(m - c) x max_k per_rank[k]``). Every action on rank k belongs to a stage
    s >= s_k (its lowest) and waits, directly or through its own forward, for F(s - 1, mb), which
    waits for F(s - 2, mb) and so on down to stage 0 (``sim.schedules.action_dependencies``): it
    starts no earlier than ``head_s[k]``. Rank k's actions run one after another, so its last one
    ends no earlier than ``head_s[k]`` + the sum of their durations. Per stage and micro-batch these
    are F = ``fwd_s`` and B = recompute + ``bwd_s``, or I + W = recompute + ``bwd_input_s`` +
    ``bwd_weight_s`` (stage 0: 0 + ``bwd_s``), or Merak's separate recompute: each at least the
    layers' compute, because ``sim.tp_overlap.tp_segments_time`` never finishes before the compute
    it schedules (its compute resource runs every piece back to back at best) and recompute,
    DELTA's re-runs and TP communication are >= 0. So the c micro-batches of the run give
    ``head_s[k] + c x compute_s[k]``, and the extension ``(m - c) x max per_rank >= (m - c) x
    compute_s[k]``: ``bare >= head_s[k] + m x compute_s[k]`` for every k.
    (2) ``tail`` is the largest ``exposed_k + opt_k - earlier_k`` (and 0) where ``earlier_k`` is the
    makespan less rank k's last end: the rank whose last action ends the run has ``earlier = 0``
    exactly (the makespan is that end), its exposed gradient sync is >= 0 and its step is its
    ``optimizer_s`` or longer (the prefetching embedding rank waits for its ids first). So ``tail >=
    min_k optimizer_s[k]``. The two sums are formed in another order than the estimate's, so a
    caller compares with a relative margin (``sim.search_bound.MARGIN``).
    ``tests/test_search_bound.py`` checks bound <= estimate on the grid of ``analysis.estimate_grid``."""
    bare = max(h + microbatches * c for h, c in zip(head_s, compute_s, strict=True))
    return max(steady_s, bare) + min(optimizer_s)


class Estimator:
    """Estimates for plans of one workload on one cluster (one cost model, one communication model)."""

    def __init__(self, costs: CostModel, comm: ClusterComm, dtype: str, workload: str = "",
                 workload_options: Mapping[str, Any] | None = None, overlap_slowdown: float = 0.0) -> None:
        """``workload`` and its options give the gradient buckets their tensors' shapes and row
        sparsity (``sim.gradient_sync_context``); without them every layer is one gradient vector,
        which prices row-sparse methods and PowerSGD as if they compressed nothing.
        ``overlap_slowdown``: the engine's option of that name (``sim.engine.EngineOptions``), priced
        where the closed form knows a compute runs beside a transfer (``_prefetched``)."""
        self.costs, self.comm, self.dtype = costs, comm, dtype
        self.overlap_slowdown = overlap_slowdown
        self.workload, self.workload_options = workload, dict(workload_options or {})
        self._stages: dict[tuple, StageTimes] = {}
        self._stages_shared: dict[tuple, StageTimes] = {}  # by the layers' cost kinds (stage())
        self._accumulation: dict[tuple[int, int], bool] = {}  # (micro_batch, tp) -> _accumulates
        self._kinds: dict[LayerCosts, int] = {}
        self._kinds_of: dict[tuple[int, int, int], int] = {}
        self._buffers: dict[tuple, int] = {}  # bucket_buffer_bytes by its inputs
        self._configs: dict[tuple[str, float], GradientSyncConfig] = {}
        self._buckets: dict[tuple, list[BucketPrice]] = {}
        self._gathers: dict[tuple, float] = {}  # the distributed optimizer's parameter all-gathers
        self._tp_ar: dict[tuple, float] = {}
        self._pipes: dict[tuple, dict] = {}
        self._figures: dict[tuple, dict] = {}  # _rank_figures by the estimate's key
        self._raw: dict[tuple, tuple[float, float, int]] = {}  # group_bound's per-stage sums
        self._runs: dict[tuple, Any] = {}  # weighted pipeline runs by their inputs (sim.estimate_pipeline)
        self._p2p_routes: dict[int, tuple[float, float]] = {}  # (latency, bandwidth) by dp x tp

    # -- pieces --------------------------------------------------------------------------------
    def _tp_comm_s(self, c: LayerCosts, tp: int, sharing: int, backward: bool, with_weight_grads: bool = True) -> float:
        if tp == 1:
            return 0.0

        def price(collective: str, nbytes: int) -> float:
            return self._tp_collective_s(collective, nbytes, tp, sharing)

        return tp_comm_s(c, backward, price, with_weight_grads)

    def _tp_collective_s(self, collective: str, nbytes: int, tp: int, sharing: int) -> float:
        """One collective over a TP group of ``tp`` ranks, ``sharing`` such groups on its links at once."""
        key = (collective, nbytes, tp, sharing)
        cached = self._tp_ar.get(key)
        if cached is None:
            cached = self._tp_ar[key] = self.comm.collective_s(collective, nbytes, tuple(range(tp)), sharing)
        return cached

    def stage(self, layers: tuple[int, ...], recomputed: tuple[int, ...], micro_batch: int, tp: int, level: int,
              swap: float | tuple[int, ...], tp_sharing: int = 1, one_at_a_time: bool = False,
              view: str = "", tables: tuple[int, ...] = (), split_backward: bool = False,
              accumulate_share: float = 0.0) -> StageTimes:
        """``recomputed``: the stage's recomputed layers; ``swap``: the fraction of kept bytes swapped,
        or the layers whose saved bytes are swapped (a per-layer memory policy); ``tp_sharing``: TP
        groups sharing a node's adapters (sim.comm.concurrent_groups; 1 unless a TP group spans nodes);
        ``one_at_a_time``: the backward re-runs one recomputed layer at a time (its largest layer's
        activations are held, not all of them; MemoryPolicy.recompute_in_backward); ``view``:
        how every layer runs (sim.memory.LAYER_VIEWS, MemoryPolicy.view; "": as costed); ``tables``: the
        layers of embedding tables a sharded method holds (their TP communication is its all-gather,
        ``sim.embedding.table_tp_costs``); ``split_backward``: price the I and W steps of a split backward
        (zero-bubble schedules; otherwise ``bwd_input_s`` is the whole backward and ``bwd_weight_s`` 0);
        ``accumulate_share``: the share of the stage's backwards that add their weight gradients into the
        earlier micro-batches' ((m - 1) / m: the engine charges LayerCosts.grad_accumulate_s on every
        backward but micro-batch 0's; the stage times are per micro-batch, so the pass is averaged)."""
        if accumulate_share and not self._accumulates(micro_batch, tp):
            accumulate_share = 0.0  # nothing to add (fused, the default): one cached stage for every m
        key = (layers, recomputed, micro_batch, tp, level, swap, tp_sharing, one_at_a_time, view, tables,
               split_backward, accumulate_share)
        cached = self._stages.get(key)
        if cached is not None:
            return cached
        # Stages whose layers cost the same (a GPT's blocks), with the same choices at the same positions,
        # are priced once: the result depends on the layers only through their costs and the cost of the
        # layer before the first (its output is the stage input, sim.memory.checkpoint_bytes).
        chosen = set(recomputed)
        shared_key = (tuple(self._kind(layer, micro_batch, tp) for layer in (layers[0] - 1, *layers)),
                      tuple(layer in chosen for layer in layers), micro_batch, tp, level,
                      swap if isinstance(swap, (int, float)) else tuple(layer in swap for layer in layers),
                      tp_sharing, one_at_a_time, view, tuple(layer in tables for layer in layers), split_backward,
                      accumulate_share)
        cached = self._stages_shared.get(shared_key)
        if cached is None:
            cached = self._stages_shared[shared_key] = self._price_stage(
                layers, recomputed, micro_batch, tp, level, swap, tp_sharing, one_at_a_time, view, tables,
                split_backward, accumulate_share)
        self._stages[key] = cached
        return cached

    def _accumulates(self, micro_batch: int, tp: int) -> bool:
        """Whether any layer's backward adds a gradient-accumulation pass (LayerCosts.grad_accumulate_s)."""
        key = (micro_batch, tp)
        found = self._accumulation.get(key)
        if found is None:
            found = self._accumulation[key] = any(self.costs.layer_costs(layer, micro_batch, tp).grad_accumulate_s
                                                  for layer in range(self.costs.num_layers))
        return found

    def _kind(self, layer: int, micro_batch: int, tp: int) -> int:
        """A number per distinct LayerCosts value (-1 before the first layer)."""
        if layer < 0:
            return -1
        key = (layer, micro_batch, tp)
        kind = self._kinds_of.get(key)
        if kind is None:
            costs = self.costs.layer_costs(layer, micro_batch, tp)
            kind = self._kinds_of[key] = self._kinds.setdefault(costs, len(self._kinds))
        return kind

    def _price_stage(self, layers: tuple[int, ...], recomputed: tuple[int, ...], micro_batch: int, tp: int,
                     level: int, swap: float | tuple[int, ...], tp_sharing: int, one_at_a_time: bool,
                     view: str, tables: tuple[int, ...], split_backward: bool,
                     accumulate_share: float = 0.0) -> StageTimes:
        from sim.tp_overlap import tp_segments_time

        costs = [self.costs.layer_costs(layer, micro_batch, tp) for layer in layers]
        costs = [table_tp_costs(c) if layer in tables and tp > 1 else c for layer, c in zip(layers, costs, strict=True)]
        if view:
            costs = [LAYER_VIEWS[view](c) for c in costs]
        forward_tp = [self._tp_comm_s(c, tp, tp_sharing, False) for c in costs]
        backward_tp = [self._tp_comm_s(c, tp, tp_sharing, True) for c in costs]
        level = level if tp > 1 else 0

        def timed(phase: list[float], which: Sequence[int], tp_s: list[float] = forward_tp) -> float:
            segments = [(phase[i], tp_s[i], max(costs[i].tp_allreduces, 1)) for i in which]
            return sum(tp_segments_time(segments, level)) if segments else 0.0

        every = range(len(layers))
        rec = [i for i, layer in enumerate(layers) if layer in recomputed]
        fwd = timed([c.fwd_s for c in costs], every)
        # The accumulation pass joins each layer's backward (BWD, or BWD_W when split), as the engine runs it.
        accumulate = [accumulate_share * c.grad_accumulate_s for c in costs]
        bwd = timed([c.bwd_input_s + c.bwd_weight_s + a for c, a in zip(costs, accumulate, strict=True)], every,
                    backward_tp)
        if split_backward:
            input_only_tp = [self._tp_comm_s(c, tp, tp_sharing, True, with_weight_grads=False) for c in costs]
            bwd_input = timed([c.bwd_input_s for c in costs], every, input_only_tp)
            bwd_weight = sum(c.bwd_weight_s for c in costs) + sum(accumulate)
        else:  # the search prices thousands of stages: only split schedules need the two steps
            bwd_input, bwd_weight = bwd, 0.0
        recompute = timed([c.recompute_s for c in costs], rec)
        cost_of = {layer: c for layer, c in zip(layers, costs, strict=True)}

        def cost(layer: int) -> LayerCosts:
            return cost_of.get(layer) or self.costs.layer_costs(layer, micro_batch, tp)

        kept_layers = [layer for layer in layers if layer not in recomputed]
        rec_layers = [layers[i] for i in rec]
        kept = forward_bytes(layers, rec_layers, cost)
        # What a swap moves: the swapped saved bytes less the stage input (sim.memory.movable_bytes).
        swapped = (movable_bytes(layers, kept_layers, cost) * swap
                   if isinstance(swap, (int, float)) else movable_bytes(layers, swap, cost))
        # Re-run one layer at a time inside the backward: only the largest re-run layer is back at once.
        extra = (in_backward_extra_bytes(layers, rec_layers, cost)
                 if one_at_a_time else held_bytes(layers, rec_layers, cost) - kept)
        result = StageTimes(
            fwd_s=fwd, bwd_s=bwd, recompute_s=recompute, bwd_input_s=bwd_input, bwd_weight_s=bwd_weight,
            compute_s=sum(c.fwd_s + c.bwd_input_s + c.bwd_weight_s for c in costs) + sum(accumulate),
            fwd_compute_s=sum(c.fwd_s for c in costs),
            recompute_compute_s=sum(costs[i].recompute_s for i in rec),
            static_bytes=sum(c.param_bytes + c.grad_bytes + c.optimizer_bytes for c in costs),
            param_bytes=sum(c.param_bytes for c in costs),
            grad_bytes=sum(c.grad_bytes for c in costs),
            kept_bytes=int(kept - swapped),
            recompute_extra_bytes=extra,
            output_bytes=costs[-1].output_bytes,
            variance_s2=sum(instruction_variance(Kind.FWD, [c]) + instruction_variance(Kind.BWD, [c]) for c in costs)
            + sum(instruction_variance(Kind.RECOMPUTE, [costs[i]]) for i in rec),
            offsets_s=add_offsets(add_offsets(instruction_offsets(Kind.FWD, costs),
                                              instruction_offsets(Kind.BWD, costs)),
                                  instruction_offsets(Kind.RECOMPUTE, [costs[i] for i in rec])),
        )
        return result

    def sync_config(self, method: str, bucket_mb: float) -> GradientSyncConfig:
        """The method's settings as the search enumerates them: its defaults and a bucket size."""
        key = (method, bucket_mb)
        config = self._configs.get(key)
        if config is None:
            config = self._configs[key] = GRADIENT_SYNC[method].config.model_validate(
                {"method": method, "bucket_mb": bucket_mb})
        return config

    def rank_buckets(self, sync: GradientSyncConfig, stage_layers: Sequence[tuple[int, ...]], removed: Removed,
                     dp: int, tp: int, micro_batch: int, microbatches: int) -> list[BucketPrice]:
        """One pipeline rank's gradient buckets, cut as lowering cuts them (``bucket_layers`` over the
        rank's layers, last first) and priced through the method's own phases on each bucket's real
        tensors (``bucket_context``: shapes, row sparsity measured on the workload's batches), as the
        engine prices the lowered Program. ``removed``: (layer, bytes) a sharded embedding takes out."""
        if dp == 1:
            return []
        key = (sync, tuple(stage_layers), removed, dp, tp, micro_batch, microbatches)
        cached = self._buckets.get(key)
        if cached is not None:
            return cached
        taken = dict(removed)

        def grad_bytes(layer: int) -> int:
            return self.costs.layer_costs(layer, micro_batch, tp).grad_bytes - taken.get(layer, 0)

        source = BucketPlan(self.workload, self.workload_options, self.dtype, dp, tp, micro_batch, microbatches, sync)
        method = GRADIENT_SYNC[sync.method]
        group = tuple(d * tp for d in range(dp))  # pipeline rank 0's replicas (sim.program.rank_of)
        sharing = concurrent_groups(self.comm.cluster, dp * tp, group)
        ordered = sorted((layer for layers in stage_layers for layer in layers), reverse=True)
        cached = []
        for layers in bucket_layers(ordered, grad_bytes, sync.bucket_mb * 2**20):
            phases = method.plan(bucket_context(source, layers, grad_bytes))
            stages = tuple(i for i, st in enumerate(stage_layers) if set(layers) & set(st))
            seconds = phases_s(phases, group, self.comm, self.comm.cluster.device, sync.method, sharing)
            cpu = phases_cpu_s(self.comm, [(p.kind, p.nbytes) for p in phases], dp)
            cached.append(BucketPrice(stages, seconds, cores_taken(cpu, seconds)))
        self._buckets[key] = cached
        return cached

    def param_gather_s(self, sync: GradientSyncConfig, stage_layers: Sequence[tuple[int, ...]], removed: Removed,
                       dp: int, tp: int, micro_batch: int) -> float:
        """Seconds of the distributed optimizer's parameter all-gathers after a rank's step: one per
        bucket, cut as lowering cuts them (``sim.lower.param_gather_pass``)."""
        key = (sync, tuple(stage_layers), removed, dp, tp, micro_batch)
        cached = self._gathers.get(key)
        if cached is None:
            taken = dict(removed)

            def grad_bytes(layer: int) -> int:
                return self.costs.layer_costs(layer, micro_batch, tp).grad_bytes - taken.get(layer, 0)

            ordered = sorted((layer for layers in stage_layers for layer in layers), reverse=True)
            phases = param_gather_phases([sum(grad_bytes(layer) for layer in layers)
                                          for layers in bucket_layers(ordered, grad_bytes, sync.bucket_mb * 2**20)])
            group = tuple(d * tp for d in range(dp))
            cached = self._gathers[key] = phases_s(phases, group, self.comm, self.comm.cluster.device, sync.method,
                                                   concurrent_groups(self.comm.cluster, dp * tp, group))
        return cached

    @staticmethod
    def _bucket_queue(buckets: Sequence[BucketPrice], slacks: Sequence[float],
                      ahead: tuple[int, float] | None = None) -> list[tuple[float, float, float]]:
        """A rank's gradient buckets on its collective stream as (start, end, cores), in seconds from its
        last compute. ``slacks``: per local stage, seconds from its last backward to the rank's last
        compute. A bucket is ready when the last backward of the stages it holds ends (the engine's
        granularity); the stream takes them in the order they become ready. ``ahead``: (local stage,
        seconds) of a sharded embedding's gradient exchange after that stage's last backward, which
        lowering puts before every bucket (``sim.embedding_ps._lower``, ``sim.embedding_embrace._lower``):
        the engine's stream runs in program order, so no bucket starts before it ends. Until session 16
        (issue-9v) it was added after the buckets, as if they could pass it: the same where the tables'
        stage is the rank's last (1F1B), too little where another stage's buckets could have overlapped
        its backward (interleaved, pp 1: 0.84 ms on gpt2-small dp2, two A100s)."""
        free = -slacks[ahead[0]] + ahead[1] if ahead is not None else None
        queue = []
        ready = [(-min(slacks[i] for i in b.stages), b.seconds, b.cores) for b in buckets]
        for at, seconds, cores in sorted(ready, key=lambda r: r[0]):
            start = at if free is None else max(free, at)
            free = start + seconds
            queue.append((start, free, cores))
        return queue

    @classmethod
    def _dp_exposed(cls, buckets: Sequence[BucketPrice], slacks: Sequence[float],
                    ahead: tuple[int, float] | None = None) -> float:
        """Gradient sync left after a rank's last compute (``_bucket_queue``), ``ahead`` included."""
        ends = [end for _, end, _ in cls._bucket_queue(buckets, slacks, ahead)]
        if ahead is not None:
            ends.append(-slacks[ahead[0]] + ahead[1])
        return max([0.0, *ends])

    @classmethod
    def _dp_after(cls, buckets: Sequence[BucketPrice], slacks: Sequence[float],
                  ahead: tuple[int, float] | None = None) -> list[tuple[float, float]]:
        """The buckets that move after a rank's last compute, in ``_bucket_queue``'s order, as (seconds
        after the last compute, cores they keep busy)."""
        return [(end - max(start, 0.0), cores) for start, end, cores in cls._bucket_queue(buckets, slacks, ahead)
                if end > 0.0]

    def p2p_hop_s(self, nbytes: int, dp: int, tp: int) -> float:
        if self.comm.cluster.world_size < 2:
            return 0.0
        # Neighbouring pipeline ranks are dp x tp ranks apart (sim.program.rank_of), so the route
        # depends on that product alone; the search asks for it once per stage of every plan.
        route = self._p2p_routes.get(dp * tp)
        if route is None:
            peer = min(dp * tp, self.comm.cluster.world_size - 1)
            senders = concurrent_senders(self.comm.cluster, dp * tp, 0, peer)
            _, latency, bandwidth = self.comm.p2p_route(0, peer, senders)
            route = self._p2p_routes[dp * tp] = (latency, bandwidth)
        latency, bandwidth = route
        return latency + self.comm.p2p_weight(nbytes) / bandwidth

    # -- the estimate --------------------------------------------------------------------------
    def estimate(self, *, schedule: str, dp: int, tp: int, pp: int, chunks: int, micro_batch: int,
                 microbatches: int, stage_layers: Sequence[tuple[int, ...]], policy: MemoryPolicy,
                 tp_overlap: int, sync_method: str, bucket_mb: float,
                 embedding: EmbeddingTerms | None = None, scatter_gather: bool = False,
                 sync: GradientSyncConfig | None = None, p2p: str = "async") -> Estimate:
        """``scatter_gather``: whether the plan's pipeline messages travel as 1/tp pieces that the receivers
        all-gather (``sim.lower.p2p_gather_tp``); ``sync``: the plan's own gradient-sync settings (default:
        the method's defaults with ``bucket_mb``, as the search enumerates them); ``p2p``: the plan's
        schedule.p2p (``blocking``: the compute after a send waits for its transfer,
        ``sim.estimate_pipeline.weighted_run``, and a scatter/gather's all-gather is on the compute
        path, ``_gathered``)."""
        tables = embedding.tp_table_layers if embedding is not None else ()
        key = (schedule, dp, tp, pp, chunks, micro_batch, microbatches, tuple(map(tuple, stage_layers)), policy,
               tp_overlap, scatter_gather, tables, _gather_on_path(p2p, scatter_gather, tp, pp))
        blocking = p2p == "blocking" and pp > 1
        pipe = self._pipes.get((*key, blocking))
        if pipe is None:  # the stages are the same under both p2p modes; the weighted run is not
            pipe = self._pipes[(*key, blocking)] = self._pipeline({**self._figures_of(key), "blocking": blocking})
        sync = sync or self.sync_config(sync_method, bucket_mb)
        if pp > 1 and self._beside(pipe).slows:
            # Compute beside a rank's transfers is slowed, and on a shared host the transfers beside
            # compute: time the pipeline again with what moves beside it as the engine runs it, the
            # gradient buckets (they can move before a rank's last compute: interleaved, zero-bubble)
            # and each rank's optimizer step (beside its last sends, which a receiver waits for).
            buckets = self._bucket_stages(pipe, sync, dp, tp, embedding) if dp > 1 else ()
            tied = self._tied(pipe, dp, tp, pp, sync)
            steps = tuple(0.0 if k in tied or (embedding is not None and k == embedding.rank)
                          else self._step_s(pipe, k, dp, tp, sync, embedding) for k in range(pp))
            pipe = self._pipeline(pipe, self._beside(pipe, buckets, steps))
        return self._finish(pipe, dp, tp, pp, sync, bucket_mb, embedding)

    def _bucket_stages(self, pipe: dict, sync: GradientSyncConfig, dp: int, tp: int,
                       embedding: EmbeddingTerms | None) -> Buckets:
        """Per pipeline rank, its buckets as ``_finish`` prices them: (the virtual stages whose last
        backward each waits for, its seconds, the cores it keeps busy)."""
        out = []
        for k, stages in enumerate(pipe["stages_of"]):
            removed = embedding.removed_by_layer if embedding is not None and k == embedding.rank else ()
            buckets = self.rank_buckets(sync, pipe["sync_layers"][k], removed, dp, tp, pipe["micro_batch"], pipe["m"])
            out.append(tuple((tuple(stages[i] for i in b.stages), b.seconds, b.cores) for b in buckets))
        return tuple(out)

    def group_bound(self, pp: int, chunks: int, placement: str, micro_batch: int, microbatches: int,
                    stage_layers: Sequence[tuple[int, ...]], tp: int, optimizer_share: float = 1.0) -> float:
        """``pipeline_lower_bound`` from the layers' raw costs (no TP communication, no recompute, no
        memory policy): at most the bound ``screen`` gives any plan with these stages, micro-batch and
        schedule layout, whatever its memory policy, TP overlap, gradient sync or embedding method (a
        policy's selective view only lengthens the backward; a sharded table's view keeps the times);
        ``optimizer_share``: the least share of the parameters a step updates among the group's gradient
        syncs (1/dp where one is the distributed optimizer, ``sim.model_state.optimizer_share``)."""
        rank_of, stages_of = _layout(pp, chunks, placement)
        fwd, compute, params = [], [0.0] * pp, [0] * pp
        for s, layers in enumerate(stage_layers):
            key = (tuple(layers), micro_batch, tp)
            raw = self._raw.get(key)
            if raw is None:
                costs = [self.costs.layer_costs(layer, micro_batch, tp) for layer in layers]
                raw = self._raw[key] = (sum(c.fwd_s for c in costs),
                                        sum(c.fwd_s + c.bwd_input_s + c.bwd_weight_s for c in costs),
                                        sum(c.param_bytes for c in costs))
            fwd.append(raw[0])
            compute[rank_of[s]] += raw[1]
            params[rank_of[s]] += raw[2]
        heads = [sum(fwd[:min(stages_of[k])]) for k in range(pp)]
        return pipeline_lower_bound(0.0, heads, compute, microbatches,
                                    [self.costs.optimizer_step_s(round(p * optimizer_share)) for p in params])

    def screen(self, *, schedule: str, dp: int, tp: int, pp: int, chunks: int, micro_batch: int,
               microbatches: int, stage_layers: Sequence[tuple[int, ...]], policy: MemoryPolicy,
               tp_overlap: int, sync_method: str, bucket_mb: float,
               embedding: EmbeddingTerms | None = None, scatter_gather: bool = False,
               sync: GradientSyncConfig | None = None, p2p: str = "async") -> Screen:
        """What ``estimate`` would say about memory (the same peak, exactly) and a lower bound of its
        iteration time (``pipeline_lower_bound``), without the weighted pipeline run and the gradient
        buckets: what the search's branch and bound (``sim.search_bound``) asks of every plan."""
        tables = embedding.tp_table_layers if embedding is not None else ()
        key = (schedule, dp, tp, pp, chunks, micro_batch, microbatches, tuple(map(tuple, stage_layers)), policy,
               tp_overlap, scatter_gather, tables, _gather_on_path(p2p, scatter_gather, tp, pp))
        fig = self._figures_of(key)
        sync = sync or self.sync_config(sync_method, bucket_mb)
        peaks = self._peaks(fig, dp, pp, sync, bucket_mb, embedding)
        share = optimizer_share(sync, dp)
        if share == 1.0:
            return Screen(peaks, self.comm.capacity_bytes, fig["bound"], fig["level_free_bound"])
        # the distributed optimizer steps 1/dp of the parameters (its all-gather after the step is >= 0)
        optimizer = [self.costs.optimizer_step_s(round(p * share)) for p in fig["params"]]
        steady, heads, compute, m = fig["bound_terms"]
        raw_steady, raw_heads = fig["level_free_terms"]
        return Screen(peaks, self.comm.capacity_bytes, pipeline_lower_bound(steady, heads, compute, m, optimizer),
                      pipeline_lower_bound(raw_steady, raw_heads, compute, m, optimizer))

    def _figures_of(self, key: tuple) -> dict:
        fig = self._figures.get(key)
        if fig is None:
            fig = self._figures[key] = self._rank_figures(*key)
        return fig

    def _rank_figures(self, schedule: str, dp: int, tp: int, pp: int, chunks: int, micro_batch: int,
                      microbatches: int, stage_layers: Sequence[tuple[int, ...]], policy: MemoryPolicy,
                      tp_overlap: int, scatter_gather: bool = False, tables: tuple[int, ...] = (),
                      gather_on_path: bool = False) -> dict:
        """Everything but the weighted pipeline run and the gradient sync: the stages, each rank's
        time per micro-batch, bytes and held activations, and the lower bound of the iteration.
        ``gather_on_path``: the receivers' scatter/gather all-gather runs between two computes
        (``_gather_on_path``, ``_gathered``)."""
        info = SCHEDULES[schedule]
        stages_n = pp * chunks
        tp_sharing = concurrent_groups(self.comm.cluster, dp * tp, tuple(range(tp)))
        stages = [self.stage(tuple(stage_layers[s]), tuple(policy.recompute_layers[s]), micro_batch, tp, tp_overlap,
                             policy.swap_fraction[s] if policy.swap_layers is None else policy.swap_layers[s],
                             tp_sharing, one_at_a_time=policy.recompute_in_backward, view=policy.view,
                             tables=tables, split_backward=info.split_backward,
                             accumulate_share=(microbatches - 1) / microbatches)
                  for s in range(stages_n)]
        rank_of, stages_of = _layout(pp, chunks, info.placement)
        if gather_on_path:
            stages = self._gathered(stages, rank_of, tp, tp_sharing)
        if info.recompute_is_schedule:
            # Merak's eager recomputes move into bubbles: their placement is the schedule's shape.
            unit = unit_pipeline(schedule, pp, microbatches, chunks,
                                 tuple(policy.recomputes(s) for s in range(stages_n)), 1.0)
        else:
            # An ordinary recompute runs inside the backward: it lengthens B, the shape is unchanged.
            unit = unit_pipeline(schedule, pp, microbatches, chunks, (False,) * stages_n, 0.0)

        per_rank = [0.0] * pp  # time per micro-batch, communication included
        compute = [0.0] * pp
        recompute_compute = [0.0] * pp
        # the re-runs with their own TP communication: what the engine's RECOMPUTE instructions last
        recompute_timed = [0.0] * pp
        bwd = [0.0] * pp
        grads = [0] * pp
        params = [0] * pp
        static = [0] * pp
        variance = [0.0] * pp
        offsets: list[tuple[float, ...]] = [()] * pp
        for s, st in enumerate(stages):
            k = rank_of[s]
            variance[k] += st.variance_s2 * microbatches
            offsets[k] = add_offsets(offsets[k], st.offsets_s, microbatches)  # a process's offset adds up
            per_rank[k] += st.fwd_s + st.bwd_s + st.recompute_s
            compute[k] += st.compute_s
            recompute_compute[k] += st.recompute_compute_s
            recompute_timed[k] += st.recompute_s
            bwd[k] += st.bwd_s
            grads[k] += st.grad_bytes
            params[k] += st.param_bytes
            static[k] += st.static_bytes
        model_state = list(static)  # what the optimizer step holds (sim.model_state.step_peak_bytes)
        for k in range(pp):  # the received gradient a rank holds at once, as the engine and the runtime do
            static[k] += received_gradient_bytes(stages_of[k], rank_of, stage_layers,
                                                 lambda layer: self.costs.layer_costs(layer, micro_batch, tp))
        # Scatter/gather: each TP rank sends 1/tp of a message and the receivers all-gather it. Under
        # p2p: async the engine runs the gather on the receive stream once the pieces arrive, so it
        # lengthens the hop (what a consumer waiting for the message waits for) and not the compute;
        # under blocking it runs between two computes, in the stage times (``_gathered``).
        # A blocking send (p2p: blocking) is the same hop, priced in the weighted run: the compute after
        # it waits for it (``weighted_run(blocking=True)``). Often it falls inside a wait the schedule's
        # dependencies already have, not always: across nodes (HDR InfiniBand, gpt2-small at hidden 2048,
        # tp 2, pp 4, 8 micro-batches) it adds 1.7% (1F1B) and 6.0% (interleaved) to the engine's
        # iteration, and the estimate's move equals the engine's (tests/test_estimate_grid.py).
        wire = (lambda nbytes: nbytes // tp) if scatter_gather and tp > 1 else (lambda nbytes: nbytes)
        m = microbatches
        hop_s = [self.p2p_hop_s(wire(st.output_bytes), dp, tp) if pp > 1 else 0.0 for st in stages]
        # the cores a send keeps busy while it moves, as the engine prices a SEND (sim.host_cpu)
        hop_cores = [cores_taken(phases_cpu_s(self.comm, (("p2p", wire(st.output_bytes)),), 2), hop)
                     for st, hop in zip(stages, hop_s, strict=True)]
        if scatter_gather and tp > 1 and pp > 1 and not gather_on_path:
            hop_s = [hop + self._gather_s(st.output_bytes, tp, tp_sharing)
                     for st, hop in zip(stages, hop_s, strict=True)]

        # The peak states keep only those no other covers (``_peak_states``), right while a recomputed
        # set adds bytes. Where a re-run held less than its checkpointed forward kept, the micro-batch's
        # most would be its forward, so the set counts as adding nothing: never under the ledger's
        # peak. No registered workload's costs reach it since the forward and the re-run count a
        # checkpoint the previous layer saves by one rule (sim.memory.input_saved_by_previous;
        # docs/memory.md); kept for costs whose layer saves less than its input (none known).
        held = []
        for k in range(pp):
            held.append(max((sum(n * stages[s].kept_bytes + x * max(stages[s].recompute_extra_bytes, 0)
                                 for s, (n, x) in zip(stages_of[k], state, strict=True))
                             for state in unit.states[k]), default=0))
        delta_s = [0.0] * pp  # DELTA's re-runs per micro-batch, in the rank's backwards
        if policy.delta is not None:  # DELTA decides per micro-batch: replay it on the schedule's order
            from sim.delta_lowering import delta_estimate

            def cost(layer: int) -> LayerCosts:
                return self.costs.layer_costs(layer, micro_batch, tp)

            for k, (extra_s, activations) in enumerate(delta_estimate(schedule, pp, microbatches, chunks, stage_layers,
                                                                      cost, policy.delta)):
                per_rank[k] += extra_s
                recompute_compute[k] += extra_s
                recompute_timed[k] += extra_s
                delta_s[k] = extra_s
                held[k] = activations
        bottleneck = max(range(pp), key=per_rank.__getitem__)
        steady = m * per_rank[bottleneck]
        heads = [sum(stages[s].fwd_s for s in range(min(stages_of[k]))) for k in range(pp)]
        optimizer = [self.costs.optimizer_step_s(p) for p in params]
        # The same bound without TP communication (what the overlap level changes): true of every level.
        raw_heads = [sum(stages[s].fwd_compute_s for s in range(min(stages_of[k]))) for k in range(pp)]
        raw_steady = m * max(c + r for c, r in zip(compute, recompute_compute, strict=True))
        return {"schedule": schedule, "pp": pp, "microbatches": microbatches, "stages": stages,
                "per_rank": per_rank, "hop_s": hop_s, "hop_cores": tuple(hop_cores), "world": dp * tp * pp,
                "delta_s": delta_s, "rank_of": rank_of,
                "flags": tuple(policy.recomputes(s) for s in range(stages_n)),
                "steady": steady, "bwd": bwd, "params": params, "static": static, "grads": grads,
                "model_state": model_state,
                "held": held, "chunks": chunks, "variance": variance, "offsets": offsets,
                "bound": pipeline_lower_bound(steady, heads, compute, m, optimizer),
                "bound_terms": (steady, heads, compute, m), "level_free_terms": (raw_steady, raw_heads),
                "level_free_bound": pipeline_lower_bound(raw_steady, raw_heads, compute, m, optimizer),
                # the breakdown's kinds as the engine's (docs/search.md): a recompute's TP all-reduces are
                # recompute, the forward's and backward's exposed ones TP communication; per pipeline rank, as
                # the breakdown is the critical rank's (sim.critical_rank, chosen in ``_finish``)
                "tp_exposed": [(p - c - r) * m for p, c, r in zip(per_rank, compute, recompute_timed, strict=True)],
                "m": m, "compute": [c * m for c in compute], "recompute": [r * m for r in recompute_timed],
                "micro_batch": micro_batch,
                "sync_layers": [tuple(tuple(stage_layers[s]) for s in stages_of[k]) for k in range(pp)],
                "stages_of": stages_of}

    def _gather_s(self, nbytes: int, tp: int, tp_sharing: int) -> float:
        """A receiver's all-gather of a scatter/gather message of ``nbytes``, as the engine prices it: its
        1/tp pieces (``nbytes // tp``, ``sim.lower``) gathered whole over the TP group."""
        return self._tp_collective_s("all_gather", nbytes // tp * tp, tp, tp_sharing)

    def _gathered(self, stages: list[StageTimes], rank_of: Sequence[int], tp: int,
                  tp_sharing: int) -> list[StageTimes]:
        """The stages with a blocking exchange's scatter/gather on their compute path, as the engine runs it
        (``Program.gather_after_exchange``, ``sim.engine.exchange_waits``; Megatron-LM v2.5's
        ``_communicate`` gathers after its transfers and a synchronize, before the next compute is
        launched): each receive from another rank all-gathers the whole message over the TP group after the
        compute before it, and the compute that needs it waits for it. A stage's forward receives the
        activation of the stage below; its backward (I when split; the recompute before it, which the
        gradient's receive precedes, runs on the same path) the gradient of its own output. Exact because
        ``sim.lower.p2p_pass`` puts each receive right before its consumer, on every schedule (V placements
        included: a boundary inside one rank gathers nothing; ``tests/test_estimate_grid.py``)."""
        last = len(stages) - 1
        out = []
        for s, st in enumerate(stages):
            remote_in = s > 0 and rank_of[s - 1] != rank_of[s]
            remote_out = s < last and rank_of[s + 1] != rank_of[s]
            into = self._gather_s(stages[s - 1].output_bytes, tp, tp_sharing) if remote_in else 0.0
            back = self._gather_s(st.output_bytes, tp, tp_sharing) if remote_out else 0.0
            out.append(replace(st, fwd_s=st.fwd_s + into, bwd_s=st.bwd_s + back, bwd_input_s=st.bwd_input_s + back))
        return out

    def _beside(self, fig: dict, buckets: Buckets = (), steps: tuple[float, ...] = ()) -> Beside:
        """What slows the pipeline's compute and its transfers while both run on a rank, as the engine
        slows them (``sim.host_cpu.overlap_stretch``: ``overlap_slowdown``, and the shared slowdown of
        the sends, ``buckets`` and optimizer ``steps`` on a host whose cores the ranks share)."""
        ranks, cores = host_share(self.comm, fig["world"], self.comm.cluster.devices_per_node)
        return Beside(ranks, cores, self.overlap_slowdown, fig["hop_cores"], buckets, steps)

    def _pipeline(self, fig: dict, beside: Beside | None = None) -> dict:
        """The rank figures with the pipeline's time: the weighted run's bubble and hops, when each
        rank ends and when each stage's gradients are ready, each rank's optimizer step's seconds
        beyond its own beside the rank's sends (``beside``: what slows the run, none by default)."""
        chunks, pp, stages_of = fig["chunks"], fig["pp"], fig["stages_of"]
        timing = self._timed_pipeline(fig["schedule"], pp, fig["microbatches"], chunks, fig["stages"],
                                      fig["per_rank"], fig["hop_s"],
                                      [fig["delta_s"][fig["rank_of"][s]] / chunks for s in range(pp * chunks)],
                                      fig["flags"], beside, fig["blocking"])
        steps = beside.steps if beside is not None and beside.steps and timing.step_s else ()
        steady = fig["steady"]
        return {**fig, "bubble": max(0.0, timing.bare - steady),
                "hops": max(0.0, timing.makespan - timing.bare),
                "earlier": [timing.makespan - end for end in timing.rank_end],
                "rank_end": timing.rank_end, "synced": timing.synced if beside is not None and beside.buckets else (),
                "sync_slack": [tuple(timing.rank_end[k] - timing.grads_ready.get(s, timing.rank_end[k])
                                     for s in stages_of[k]) for k in range(pp)],
                "step_extra": [wall - step for wall, step in zip(timing.step_s, steps, strict=True)] if steps
                else [0.0] * pp}

    def _timed_pipeline(self, schedule: str, pp: int, microbatches: int, chunks: int, stages: Sequence[StageTimes],
                        per_rank: Sequence[float], hop_s: Sequence[float],
                        delta_s: Sequence[float], flags: tuple[bool, ...], beside: Beside | None,
                        blocking: bool) -> PipelineTime:
        """``sim.estimate_pipeline.pipeline_time`` with this estimator's cache of weighted runs; a
        rank's compute and its sends and gradient buckets slowed while both run (``beside``); the
        compute after a send waiting for it (``blocking``)."""
        return pipeline_time(schedule, pp, microbatches, chunks, stages, per_rank, hop_s, delta_s, flags, self._runs,
                             beside, blocking)

    def _prefetched(self, e: EmbeddingTerms, dense_step_s: float, buckets: Sequence[tuple[float, float]],
                    per_microbatch_s: float, m: int, world_size: int) -> Prefetched:
        """EmbRace 2D after the last gradient exchange (``sim.embedding_embrace._finish``): the tables'
        own step runs beside the buckets (``buckets``: seconds and cores of those after the last
        compute) and the synchronous ids wait for both; the dense step waits for the ids and runs
        beside the last rows exchange. Compute beside a transfer and the transfer are both slowed
        as the engine slows them (``sim.host_cpu.overlap_stretch``: the shared slowdown on a host
        whose cores the ranks share, ``overlap_slowdown`` on any), also each micro-batch's gradient
        exchange beside the next micro-batch's forward."""
        ranks, cores = host_share(self.comm, world_size, self.comm.cluster.devices_per_node)
        beside = e.lookups_s - e.blocking_s  # the last rows exchange
        table_s = self.costs.optimizer_step_s(e.table_step_bytes)

        def k(comm_cores: float) -> Stretch:
            return overlap_stretch(ranks, cores, comm_cores, self.overlap_slowdown)

        if cores is None and self.overlap_slowdown == 0.0:  # nothing is stretched (every GPU cluster)
            return Prefetched(max(0.0, table_s - sum(s for s, _ in buckets)), table_s, e.blocking_s,
                              max(dense_step_s, beside))
        table_end, buckets_end = overlap(table_s, [(s, k(u)) for s, u in buckets])
        extra = max(0.0, table_end, buckets_end) - sum(s for s, _ in buckets)
        dense_end, rows_end = overlap(dense_step_s, [(beside, k(e.rows_cores))])
        forward, _ = overlap(per_microbatch_s, [(e.last_grads_s, k(e.grads_cores))])
        return Prefetched(extra + (m - 1) * (forward - per_microbatch_s), table_end, e.blocking_s,
                          max(dense_end, rows_end))

    def _finish(self, pipe: dict, dp: int, tp: int, pp: int, sync: GradientSyncConfig, bucket_mb: float,
                embedding: EmbeddingTerms | None = None) -> Estimate:
        share = optimizer_share(sync, dp)
        tied = self._tied(pipe, dp, tp, pp, sync)
        # Rank k finishes its last backward about k stage-backwards before rank 0; its gradient sync
        # overlaps that backward and its optimizer step follows.
        lookups = 0.0
        finish: dict[int, float] = {}  # each rank's finish, past the makespan of the pipeline's run
        synced: list[float] = []  # each rank's exposed gradient sync
        stepped: list[float] = []  # each rank's optimizer step and what follows it
        for k in range(pp):
            mine = embedding is not None and k == embedding.rank
            removed = embedding.removed_by_layer if mine else ()
            waits = 0.0  # what the rank's compute waits for between its syncs and its step that is neither
            buckets = self.rank_buckets(sync, pipe["sync_layers"][k], removed, dp, tp, pipe["micro_batch"], pipe["m"])
            # a sharded embedding's gradient exchange after its stage's last backward, ahead of the buckets
            ahead = (embedding.index, embedding.last_grads_s) if mine else None
            # the run's own where it timed the buckets beside the compute (as slowed as the engine's), the
            # embedding's exchange then added after them
            beside = bool(pipe["synced"] and buckets)
            exposed = max(0.0, pipe["synced"][k] - pipe["rank_end"][k]) if beside \
                else self._dp_exposed(buckets, pipe["sync_slack"][k], ahead)
            if dp > 1 and buckets:
                # the last bucket waits for the replicas' latest arrival (sim.meeting), once per stretch
                # of compute between meetings (sequential EmbRace: each micro-batch's; else the iteration's)
                meetings = embedding.meetings if mine else 1
                exposed += meetings * lateness_s(pipe["variance"][k] / meetings
                                                 + offset_variance(pipe["offsets"][k]) / meetings ** 2, dp)
            # the rank steps over its own shard of the tables only (under 2D in a step of their own), and over
            # 1/dp of the rest under the distributed optimizer, then all-gathers the parameters
            # (beside the rank's last sends it takes longer: ``step_extra``, from the weighted run)
            opt = self._step_s(pipe, k, dp, tp, sync, embedding) + pipe["step_extra"][k]
            if share < 1.0:
                opt += self.param_gather_s(sync, pipe["sync_layers"][k], removed, dp, tp, pipe["micro_batch"])
            # The tied embedding's all-reduce runs after the buckets, before the step: a gradient sync, as the
            # engine's breakdown counts it (docs/search.md); before a prefetching embedding's lookups too, so
            # its tables' step runs beside it as beside the buckets (until issue-9v it was in the dense step).
            exposed += tied.get(k, 0.0)
            if mine:
                if beside:
                    exposed += embedding.last_grads_s
                if embedding.prefetch:
                    # the tied all-reduce after the buckets (the cores it keeps busy on a CPU host not counted)
                    after = self._dp_after(buckets, pipe["sync_slack"][k], ahead)
                    after += [(tied[k], 0.0)] if k in tied else []
                    end = self._prefetched(embedding, opt, after, pipe["per_rank"][k], pipe["m"], dp * tp * pp)
                    # the buckets' wait beyond the tables' step beside them is gradient sync, both steps the
                    # optimizer's, the lookups the dense step waits for bubble (sim.engine_breakdown)
                    exposed += end.before_s - end.table_s
                    opt = end.table_s + end.dense_s
                    waits = end.lookups_s
                else:
                    lookups = embedding.lookups_s
            finish[k] = exposed + waits + opt - pipe["earlier"][k]
            synced.append(exposed)
            stepped.append(opt)
        pipeline = pipe["steady"] + pipe["bubble"] + pipe["hops"] + lookups
        iteration = pipeline + max(0.0, *finish.values())
        # The breakdown is the critical rank's (sim.critical_rank), as the engine's: what its compute,
        # recompute, gradient sync and step leave of the iteration is its bubble, the hops and a sharded
        # embedding's exposed lookups (waits of the compute stream before the forwards) included.
        c = critical_rank({k: pipeline + f for k, f in finish.items()})
        tp_exposed = max(0.0, pipe["tp_exposed"][c])
        worked = pipe["compute"][c] + tp_exposed + pipe["recompute"][c] + synced[c] + stepped[c]
        rest = max(0.0, iteration - worked)
        hops = min(pipe["hops"], rest)  # the hops' delay to the iteration, as far as the critical rank waits
        return Estimate(
            iteration_s=iteration,
            compute_s=pipe["compute"][c],
            recompute_s=pipe["recompute"][c],
            bubble_s=rest - hops,
            tp_comm_s=tp_exposed,
            p2p_s=hops,
            dp_comm_s=synced[c],
            optimizer_s=stepped[c],
            peak_bytes=self._peaks(pipe, dp, pp, sync, bucket_mb, embedding),
            capacity_bytes=self.comm.capacity_bytes,
        )

    def _step_s(self, pipe: dict, k: int, dp: int, tp: int, sync: GradientSyncConfig,
                embedding: EmbeddingTerms | None) -> float:
        """Pipeline rank ``k``'s optimizer step as the engine runs its OPTIMIZER_STEP: over its own
        shard of the tables only (under 2D in a step of their own), over 1/dp of the rest under the
        distributed optimizer, sequence parallelism's TP sum of the gradients first."""
        share = optimizer_share(sync, dp)
        if embedding is not None and k == embedding.rank:  # 1/dp of the dense parameters, its own shard whole
            dense = pipe["params"][k] - embedding.step_bytes_saved - embedding.shard_bytes
            own = round(share * dense) + (0 if embedding.table_step_bytes else embedding.shard_bytes)
        else:
            own = round(share * pipe["params"][k])
        return (self.costs.optimizer_step_s(own)
                + self._sequence_parallel_grads_s(pipe["sync_layers"][k], dp, tp, pipe["micro_batch"], sync))

    def _sequence_parallel_grads_s(self, rank_layers: Sequence[tuple[int, ...]], dp: int, tp: int,
                                   micro_batch: int, sync: GradientSyncConfig) -> float:
        """Sequence parallelism's TP all-reduce before a rank's step (sim.costs.sequence_parallel_grads_s)."""
        if tp == 1:
            return 0.0
        group = tuple(range(tp))
        sharing = concurrent_groups(self.comm.cluster, dp * tp, group)
        return sequence_parallel_grads_s(
            [self.costs.layer_costs(layer, micro_batch, tp) for layers in rank_layers for layer in layers],
            gradient_buffer_scale(sync, self.dtype),
            lambda collective, nbytes: self.comm.collective_s(collective, nbytes, group, sharing))

    def _tied(self, pipe: dict, dp: int, tp: int, pp: int, sync: GradientSyncConfig) -> dict[int, float]:
        """Seconds of the tied embedding's all-reduce per pipeline rank that runs it (the first and the
        last stage's: sim.tied_embedding, as sim.lower.tied_embedding_pass lowers it)."""
        last = pipe["rank_of"][-1]  # the pipeline rank of the last stage (pp - 1 but in a V placement)
        if not ties_embedding(self.workload_options, pp) or last == pipe["rank_of"][0]:
            return {}
        head = self.costs.layer_costs(max(layer for layers in pipe["sync_layers"][last] for layer in layers),
                                      pipe["micro_batch"], tp)
        group = tied_ranks(tp, dp, last)
        nbytes = tied_embedding_bytes(head, gradient_buffer_scale(sync, self.dtype))
        sharing = concurrent_groups(self.comm.cluster, dp * tp, group)
        seconds = self.comm.collective_s("allreduce", nbytes, group, sharing)
        return {0: seconds, last: seconds}

    def _peaks(self, fig: dict, dp: int, pp: int, sync: GradientSyncConfig, bucket_mb: float,
               embedding: EmbeddingTerms | None) -> tuple[int, ...]:
        """Each pipeline rank's peak bytes: the larger of the pipeline's peak and the optimizer step's
        (its model state and its copies of the gradients, nothing else: sim.model_state.step_peak_bytes)."""
        static, held, grads, model_state = fig["static"], fig["held"], fig["grads"], fig["model_state"]
        peaks = []
        for k in range(pp):
            mine = embedding is not None and k == embedding.rank
            # one flattened bucket in flight (the memory planners count the same buffer), never more than
            # the gradients the rank syncs (sim.gradient_sync.bucket_buffer_bytes)
            synced = grads[k] - (sum(b for _, b in embedding.removed_by_layer) if mine else 0)
            key = (sync, bucket_mb, synced, dp)
            buffer = self._buffers.get(key)
            if buffer is None:
                buffer = self._buffers[key] = bucket_buffer_bytes(sync, bucket_mb, synced, dp, self.dtype)
            # the gradients as held: in an fp32 main-grad buffer where they reduce in fp32 (sim.model_state);
            # the stages counted them in the parameters' dtype
            # the optimizer state as held: 1/dp of it under the distributed optimizer (sim.model_state)
            state = model_state[k] - fig["params"][k] - grads[k]
            unheld = state - held_optimizer_bytes(state, sync, dp)
            pipeline = (static[k] - unheld + held_gradient_bytes(grads[k], sync, self.dtype) - grads[k] + held[k]
                        + buffer)
            at_step = step_peak_bytes(self.costs, model_state[k], grads[k], sync, self.dtype, state, dp)
            peaks.append(max(pipeline, at_step) - (embedding.static_bytes_saved if mine else 0))
        return tuple(peaks)


def _gather_on_path(p2p: str, scatter_gather: bool, tp: int, pp: int) -> bool:
    """Whether a plan's receives all-gather between two computes (``Estimator._gathered``): blocking
    exchanges of scatter/gather pieces between pipeline ranks. (A blocking send's own transfer is the
    weighted run's, ``sim.estimate_pipeline.weighted_run``, for every blocking plan.)"""
    return p2p == "blocking" and scatter_gather and tp > 1 and pp > 1


@lru_cache(maxsize=1024)
def _layout(pp: int, chunks: int, placement: str) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(pipeline rank of each virtual stage, virtual stages of each rank in chunk order)."""
    rank_of = tuple(stage_to_rank(s, pp, chunks, placement) for s in range(pp * chunks))
    return rank_of, tuple(tuple(rank_stages(k, pp, chunks, placement)) for k in range(pp))


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation (scipy's, average ranks for ties); nan for fewer than 3 points or
    a constant sequence."""
    if len(xs) != len(ys):
        raise ValueError("spearman needs two sequences of the same length")
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return float("nan")
    from scipy.stats import spearmanr

    return float(spearmanr(xs, ys).statistic)
