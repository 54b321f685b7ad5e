"""Lowering: Plan (+ partition and costs) -> Program, one ordered instruction list per rank.

The schedule generator decides the order of compute on each pipeline rank; lowering adds what
the order implies: the receive before a stage's first use of a remote activation or gradient,
the send after it is produced, swap-out after a forward and a prefetching swap-in one compute
step before the backward that needs it, data-parallel gradient buckets once their last gradient
is written, and the optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sim.costs import CostModel, LayerCosts
from sim.plan import Plan
from sim.program import Coords, Instruction, Kind, Program, RankProgram
from sim.schedules import SCHEDULES, Action, Op, generate_schedule, merak_recompute, stage_to_rank

_BACKWARD_OPS = (Op.BACKWARD, Op.BACKWARD_INPUT)


@dataclass(frozen=True)
class MemoryPolicy:
    """Per virtual stage: which layers recompute, and the fraction of saved bytes swapped out."""

    recompute_layers: tuple[tuple[int, ...], ...]
    swap_fraction: tuple[float, ...]

    def recomputes(self, stage: int) -> bool:
        return bool(self.recompute_layers[stage])

    def forward_kept_bytes(self, stage: int, layers: Sequence[int], save: bool,
                           cost: Callable[[int], LayerCosts]) -> int:
        """Bytes a forward of ``layers`` of ``stage`` leaves on the device: everything it saves or,
        when checkpointed, only the input of each recomputed layer plus the other layers' saves."""
        recomputed = set() if save else set(self.recompute_layers[stage])
        return sum(checkpoint_bytes(layer, cost) if layer in recomputed else cost(layer).saved_bytes
                   for layer in layers)


def checkpoint_bytes(layer: int, cost: Callable[[int], LayerCosts]) -> int:
    """A checkpointed layer keeps only its input: the previous layer's output."""
    return cost(layer - 1).output_bytes if layer > 0 else 0


def recompute_fractions(plan: Plan) -> list[float]:
    """Fraction of each virtual stage's layers that are recomputed in the backward pass."""
    stages, pp = plan.num_stages, plan.pp
    if SCHEDULES[plan.schedule].recompute_is_schedule:
        # Merak's schedules decide which stages checkpoint (all but the last, in most variants).
        return [1.0 if flag else 0.0 for flag in merak_recompute(plan.schedule, pp)]
    if isinstance(plan.recompute, list):
        return [float(f) for f in plan.recompute]
    if plan.recompute == "none":
        return [0.0] * stages
    if plan.recompute == "full":
        return [1.0] * stages
    # Stage-aware (Merak): r_i = 1 - (1 - r0)(P - 1)/(P - 1 - i) on pipeline rank i < P - 1, none on
    # the last, so (kept fraction) x (1F1B in-flight micro-batches P - i) is the same on every stage.
    fractions = []
    for stage in range(stages):
        i = stage % pp
        if pp == 1 or i == pp - 1:
            fractions.append(0.0 if pp > 1 else plan.recompute_ratio)
            continue
        fractions.append(max(0.0, 1.0 - (1.0 - plan.recompute_ratio) * (pp - 1) / (pp - 1 - i)))
    return fractions


def memory_policy(plan: Plan, stage_layers: Sequence[Sequence[int]]) -> MemoryPolicy:
    fractions = recompute_fractions(plan)
    recompute_layers = tuple(
        tuple(layers[: math.ceil(round(f * len(layers), 9))])
        for f, layers in zip(fractions, stage_layers, strict=True)
    )
    swap = tuple(plan.swap) if plan.swap is not None else (0.0,) * plan.num_stages
    return MemoryPolicy(recompute_layers=recompute_layers, swap_fraction=swap)


def lower(
    plan: Plan,
    stage_layers: Sequence[Sequence[int]],
    costs: CostModel,
    policy: MemoryPolicy,
    symmetric: bool = True,
) -> Program:
    info = SCHEDULES[plan.schedule]
    orders = generate_schedule(plan.schedule, plan.pp, plan.microbatches, plan.chunks,
                               recompute=[policy.recomputes(s) for s in range(plan.num_stages)])
    program = Program(world_size=plan.world_size, dp=plan.dp, pp=plan.pp, tp=plan.tp,
                      stage_layers=[tuple(layers) for layers in stage_layers], ranks={}, symmetric=symmetric)
    stage_rank = [stage_to_rank(s, plan.pp, plan.chunks, info.placement) for s in range(plan.num_stages)]
    ranks = [program.rank_of(0, p, 0) for p in range(plan.pp)] if symmetric else range(plan.world_size)
    for rank in ranks:
        coords = program.coords_of(rank)
        stages = tuple(s for s in range(plan.num_stages) if stage_rank[s] == coords.pp)
        rank_program = RankProgram(rank=rank, coords=coords, stages=stages)
        builder = _RankBuilder(plan, program, rank_program, stage_rank, costs, policy)
        builder.emit_pipeline(orders[coords.pp])
        builder.emit_gradient_sync()
        program.ranks[rank] = rank_program
    return program


class _RankBuilder:
    def __init__(self, plan: Plan, program: Program, rank_program: RankProgram, stage_rank: list[int],
                 costs: CostModel, policy: MemoryPolicy) -> None:
        self.plan, self.program, self.rp = plan, program, rank_program
        self.stage_rank, self.costs, self.policy = stage_rank, costs, policy
        self.coords: Coords = rank_program.coords
        self.done: dict[tuple[Kind, int, int], int] = {}  # (kind, stage, mb) -> instruction index
        self.last_grad_writer: dict[int, int] = {}
        self.last_compute: int | None = None

    # -- helpers -------------------------------------------------------------------------------
    def _peer(self, stage: int) -> int:
        return self.program.rank_of(self.coords.dp, self.stage_rank[stage], self.coords.tp)

    def _is_remote(self, stage: int) -> bool:
        return self.stage_rank[stage] != self.coords.pp

    def _message_bytes(self, stage: int) -> int:
        """Bytes of the activation leaving ``stage`` (and of the gradient coming back to it)."""
        last_layer = self.program.stage_layers[stage][-1]
        return self._cost(last_layer).output_bytes

    def _cost(self, layer: int) -> LayerCosts:
        return self.costs.layer_costs(layer, self.plan.micro_batch, self.plan.tp)

    def _add(self, kind: Kind, stage: int = -1, microbatch: int = -1, deps: Sequence[int | None] = (),
             **fields: object) -> Instruction:
        clean = tuple(sorted({d for d in deps if d is not None}))
        instruction = self.rp.add(kind, stage=stage, microbatch=microbatch, deps=clean, **fields)
        if kind.is_compute:
            self.last_compute = instruction.index
        if stage >= 0 and microbatch >= 0:
            self.done[(kind, stage, microbatch)] = instruction.index
        return instruction

    # -- pipeline ------------------------------------------------------------------------------
    def emit_pipeline(self, actions: Sequence[Action]) -> None:
        prefetch_before = self._swap_prefetch_points(actions)
        for position, action in enumerate(actions):
            for stage, mb in prefetch_before.get(position, ()):
                # Starts with the next compute step: when the compute emitted last has finished.
                swap_out = self.rp.instructions[self.done[(Kind.SWAP_OUT, stage, mb)]]
                self._add(Kind.SWAP_IN, stage, mb, deps=[swap_out.index, self.last_compute], bytes=swap_out.bytes)
            handler = {
                Op.FORWARD: self._forward,
                Op.RECOMPUTE: self._recompute,
                Op.BACKWARD: self._backward,
                Op.BACKWARD_INPUT: self._backward,
                Op.BACKWARD_WEIGHT: self._backward_weight,
            }[action.op]
            handler(action)

    def _swap_prefetch_points(self, actions: Sequence[Action]) -> dict[int, list[tuple[int, int]]]:
        """Swap-in of a backward's activations starts when the compute step before it starts (but
        never before the forward whose swap-out it undoes)."""
        points: dict[int, list[tuple[int, int]]] = {}
        forward_at: dict[tuple[int, int], int] = {}
        for position, action in enumerate(actions):
            if action.op is Op.FORWARD:
                forward_at[(action.stage, action.microbatch)] = position
            if action.op in _BACKWARD_OPS and self.policy.swap_fraction[action.stage] > 0:
                point = max(position - 1, forward_at[(action.stage, action.microbatch)] + 1)
                points.setdefault(point, []).append((action.stage, action.microbatch))
        return points

    def _forward(self, action: Action) -> None:
        s, mb = action.stage, action.microbatch
        layers = self.program.stage_layers[s]
        if s == 0:
            source = None
        elif self._is_remote(s - 1):
            source = self._add(Kind.RECV_ACT, s, mb, peer=self._peer(s - 1), tag=f"act:{s}:{mb}",
                               bytes=self._message_bytes(s - 1)).index
        else:
            source = self.done[(Kind.FWD, s - 1, mb)]
        fwd = self._add(Kind.FWD, s, mb, deps=[source], save=action.save, layers=layers)
        if s + 1 < self.plan.num_stages and self._is_remote(s + 1):
            self._add(Kind.SEND_ACT, s, mb, deps=[fwd.index], peer=self._peer(s + 1),
                      tag=f"act:{s + 1}:{mb}", bytes=self._message_bytes(s))
        if self.policy.swap_fraction[s] > 0:
            kept = self.policy.forward_kept_bytes(s, layers, action.save, self._cost)
            self._add(Kind.SWAP_OUT, s, mb, deps=[fwd.index], bytes=int(kept * self.policy.swap_fraction[s]))

    def _recompute(self, action: Action) -> None:
        """An eager recompute (Merak's pre-recompute) needs only the forward; an ordinary one is
        started by the backward and so also waits for the output gradient."""
        s, mb = action.stage, action.microbatch
        grad = None if action.eager else self._output_gradient(s, mb)
        self._add(Kind.RECOMPUTE, s, mb, deps=[self.done[(Kind.FWD, s, mb)], grad],
                  layers=self.policy.recompute_layers[s])

    def _output_gradient(self, s: int, mb: int) -> int | None:
        """The instruction that delivers d loss / d output of (s, mb), receiving it if remote."""
        if s == self.plan.num_stages - 1:
            return None
        if not self._is_remote(s + 1):
            return self.done.get((Kind.BWD, s + 1, mb), self.done.get((Kind.BWD_I, s + 1, mb)))
        received = self.done.get((Kind.RECV_GRAD, s, mb))
        if received is None:
            received = self._add(Kind.RECV_GRAD, s, mb, peer=self._peer(s + 1), tag=f"grad:{s}:{mb}",
                                 bytes=self._message_bytes(s)).index
        return received

    def _backward(self, action: Action) -> None:
        s, mb = action.stage, action.microbatch
        kind = Kind.BWD if action.op is Op.BACKWARD else Kind.BWD_I
        grad = self._output_gradient(s, mb)
        deps = [grad, self.done[(Kind.FWD, s, mb)], self.done.get((Kind.RECOMPUTE, s, mb)),
                self.done.get((Kind.SWAP_IN, s, mb))]
        bwd = self._add(kind, s, mb, deps=deps, layers=self.program.stage_layers[s])
        if kind is Kind.BWD:
            self.last_grad_writer[s] = bwd.index
        if s > 0 and self._is_remote(s - 1):
            self._add(Kind.SEND_GRAD, s, mb, deps=[bwd.index], peer=self._peer(s - 1),
                      tag=f"grad:{s - 1}:{mb}", bytes=self._message_bytes(s - 1))

    def _backward_weight(self, action: Action) -> None:
        s, mb = action.stage, action.microbatch
        w = self._add(Kind.BWD_W, s, mb, deps=[self.done[(Kind.BWD_I, s, mb)]],
                      layers=self.program.stage_layers[s])
        self.last_grad_writer[s] = w.index

    # -- data parallelism and the step -----------------------------------------------------------
    def emit_gradient_sync(self) -> None:
        """Gradient buckets in backward order (last layers first), then the optimizer step."""
        syncs: list[int] = []
        if self.plan.dp > 1:
            group = tuple(self.program.rank_of(d, self.coords.pp, self.coords.tp) for d in range(self.plan.dp))
            for number, (layers, nbytes) in enumerate(self._buckets()):
                stages = {s for s in self.rp.stages if set(layers) & set(self.program.stage_layers[s])}
                bucket = self._add(Kind.ALLREDUCE, deps=[self.last_grad_writer[s] for s in stages],
                                   group=group, tag=f"dp:{self.coords.pp}:{self.coords.tp}:{number}",
                                   bytes=nbytes, layers=layers)
                syncs.append(bucket.index)
        self._add(Kind.OPTIMIZER_STEP, deps=[*syncs, *self.last_grad_writer.values()],
                  layers=tuple(layer for s in self.rp.stages for layer in self.program.stage_layers[s]))

    def _buckets(self) -> list[tuple[tuple[int, ...], int]]:
        limit = self.plan.dp_bucket_mb * 2**20
        layers = sorted((layer for s in self.rp.stages for layer in self.program.stage_layers[s]), reverse=True)
        buckets: list[tuple[tuple[int, ...], int]] = []
        current: list[int] = []
        size = 0
        for layer in layers:
            grad = self._cost(layer).grad_bytes
            if grad == 0:
                continue
            current.append(layer)
            size += grad
            if size >= limit:
                buckets.append((tuple(current), size))
                current, size = [], 0
        if current:
            buckets.append((tuple(current), size))
        return buckets
