"""Lowering: Plan (+ partition and costs) -> Program, one ordered instruction list per rank.

The schedule generator decides the order of compute on each pipeline rank; lowering adds what
the order implies: the receive before a stage's first use of a remote activation or gradient,
the send after it is produced, swap-out after a forward and a prefetching swap-in one compute
step before the backward that needs it, data-parallel gradient buckets once their last gradient
is written, and the optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sim.costs import CostModel, LayerCosts
from sim.embedding import EMBEDDING_METHODS
from sim.gradient_sync import GRADIENT_SYNC, wire_bytes
from sim.gradient_sync_context import bucket_context, bucket_layers
from sim.gradient_sync_distopt import PARAM_GATHER_TAG, param_gather_phases
from sim.memory import MemoryPolicy
from sim.model_state import gradient_buffer_scale, optimizer_share
from sim.plan import Plan
from sim.program import Coords, Instruction, Kind, Program, RankProgram
from sim.schedules import SCHEDULES, Action, Op, generate_schedule, stage_to_rank
from sim.tied_embedding import TIED_TAG, tied_embedding_bytes, ties_embedding


def lower(
    plan: Plan,
    stage_layers: Sequence[Sequence[int]],
    costs: CostModel,
    policy: MemoryPolicy,
    symmetric: bool = True,
) -> Program:
    """The passes, composed: compute order, swaps, point-to-point messages, gradient sync, step."""
    info = SCHEDULES[plan.schedule.name]
    orders = generate_schedule(plan.schedule.name, plan.pp, plan.microbatches, plan.chunks,
                               recompute=[policy.recomputes(s) for s in range(plan.num_stages)])
    program = Program(world_size=plan.world_size, dp=plan.dp, pp=plan.pp, tp=plan.tp,
                      stage_layers=[tuple(layers) for layers in stage_layers], ranks={}, symmetric=symmetric,
                      p2p_gather_tp=p2p_gather_tp(plan), gather_after_exchange=plan.schedule.p2p == "blocking",
                      grad_buffer_scale=gradient_buffer_scale(plan.gradient_sync, plan.dtype),
                      optimizer_share=optimizer_share(plan.gradient_sync, plan.dp))
    stage_rank = [stage_to_rank(s, plan.pp, plan.chunks, info.placement) for s in range(plan.num_stages)]
    ranks = [program.rank_of(0, p, 0) for p in range(plan.pp)] if symmetric else range(plan.world_size)
    for rank in ranks:
        coords = program.coords_of(rank)
        stages = tuple(s for s in range(plan.num_stages) if stage_rank[s] == coords.pp)
        draft = _Draft(plan, program, coords, stage_rank, costs, policy)
        compute_pass(draft, orders[coords.pp])
        if policy.delta is not None:
            from sim.delta_lowering import delta_pass

            delta_pass(draft)
        swap_pass(draft)
        p2p_pass(draft)
        embedding = EMBEDDING_METHODS[plan.embedding.method]
        if embedding.lower is not None:  # e.g. sharded tables leave the gradient sync (sim.embedding)
            embedding.lower(draft, stages)
        gradient_sync_pass(draft, stages)
        tied_embedding_pass(draft, stages)
        optimizer_step_pass(draft, stages)
        param_gather_pass(draft, stages)
        if embedding.finish is not None:
            embedding.finish(draft, stages)
        if plan.schedule.p2p == "blocking":
            blocking_p2p_pass(draft)
        program.ranks[rank] = RankProgram(rank=rank, coords=coords, stages=stages,
                                          instructions=draft.finalize())
    return program


def p2p_gather_tp(plan: Plan) -> bool:
    """Whether stage-boundary tensors travel as 1/tp slices all-gathered by the receivers
    (``schedule.p2p_scatter_gather``). Not under sequence parallelism: the tensor is already each TP
    rank's own 1/tp of the sequence, and Megatron-LM then sends it whole (its scatter/gather runs only
    ``if args.scatter_gather_tensors_in_pipeline and not args.sequence_parallel``,
    megatron/p2p_communication.py in the 2022 code with sequence parallelism)."""
    return plan.schedule.p2p_scatter_gather and plan.tp > 1 and not plan.workload_options.get("sequence_parallel")


# ---------------------------------------------------------------------------------------------
# A rank's instructions while passes work on them: dependencies point at nodes, not positions,
# so a pass can insert anywhere; ``finalize`` numbers them once at the end.


@dataclass(eq=False)
class Node:
    kind: Kind
    stage: int = -1
    microbatch: int = -1
    deps: list[Node] = field(default_factory=list)
    save: bool = True
    eager: bool = False  # a RECOMPUTE that does not wait for the output gradient (Merak)
    peer: int = -1
    group: tuple[int, ...] = ()
    tag: str = ""
    bytes: int = 0
    layers: tuple[int, ...] = ()
    method: str = ""
    phases: tuple[tuple[str, int], ...] = ()


class _Draft:
    def __init__(self, plan: Plan, program: Program, coords: Coords, stage_rank: list[int],
                 costs: CostModel, policy: MemoryPolicy) -> None:
        self.plan, self.program, self.coords = plan, program, coords
        self.stage_rank, self.costs, self.policy = stage_rank, costs, policy
        self.nodes: list[Node] = []
        self.excluded_grad_bytes: dict[int, int] = {}  # layer -> gradient bytes synced outside the buckets
        self._by_key: dict[tuple[Kind, int, int], Node] = {}

    def find(self, kind: Kind, stage: int, microbatch: int) -> Node | None:
        return self._by_key.get((kind, stage, microbatch))

    def append(self, node: Node) -> Node:
        return self._insert(len(self.nodes), node)

    def insert_before(self, anchor: Node, node: Node) -> Node:
        return self._insert(self._position(anchor), node)

    def insert_after(self, anchor: Node, node: Node) -> Node:
        return self._insert(self._position(anchor) + 1, node)

    def _insert(self, position: int, node: Node) -> Node:
        self.nodes.insert(position, node)
        if node.stage >= 0 and node.microbatch >= 0:
            self._by_key.setdefault((node.kind, node.stage, node.microbatch), node)
        return node

    def _position(self, anchor: Node) -> int:
        return self.nodes.index(anchor)  # nodes compare by identity (eq=False)

    def peer(self, stage: int) -> int:
        return self.program.rank_of(self.coords.dp, self.stage_rank[stage], self.coords.tp)

    def is_remote(self, stage: int) -> bool:
        return self.stage_rank[stage] != self.coords.pp

    def cost(self, layer: int) -> LayerCosts:
        return self.policy.layer_view(self.costs.layer_costs(layer, self.plan.micro_batch, self.plan.tp))

    def synced_grad_bytes(self, layer: int) -> int:
        """The layer's gradient bytes that go through the data-parallel buckets (a sharded embedding
        table's are exchanged elsewhere)."""
        return self.cost(layer).grad_bytes - self.excluded_grad_bytes.get(layer, 0)

    def message_bytes(self, stage: int) -> int:
        """Bytes one rank sends of the activation leaving ``stage`` (and of the gradient coming back
        to it): all of it, or its 1/tp share under scatter/gather (``Program.p2p_gather_tp``)."""
        nbytes = self.cost(self.program.stage_layers[stage][-1]).output_bytes
        return nbytes // self.plan.tp if self.program.p2p_gather_tp else nbytes

    def finalize(self) -> list[Instruction]:
        index = {id(node): i for i, node in enumerate(self.nodes)}
        return [
            Instruction(index=i, kind=n.kind, stage=n.stage, microbatch=n.microbatch,
                        deps=tuple(sorted({index[id(d)] for d in n.deps})), save=n.save, peer=n.peer,
                        group=n.group, tag=n.tag, bytes=n.bytes, layers=n.layers, method=n.method,
                        phases=n.phases)
            for i, n in enumerate(self.nodes)
        ]


# ---------------------------------------------------------------------------------------------
# Passes, in the order ``lower`` runs them.

_COMPUTE_KIND = {Op.FORWARD: Kind.FWD, Op.RECOMPUTE: Kind.RECOMPUTE, Op.BACKWARD: Kind.BWD,
                 Op.BACKWARD_INPUT: Kind.BWD_I, Op.BACKWARD_WEIGHT: Kind.BWD_W}


def compute_pass(draft: _Draft, actions: Sequence[Action]) -> None:
    """One compute node per schedule action, depending on the compute of this rank it needs."""
    last_stage = draft.plan.num_stages - 1
    for action in actions:
        s, mb = action.stage, action.microbatch
        kind = _COMPUTE_KIND[action.op]
        node = Node(kind, s, mb, save=action.save, eager=action.eager)
        if kind is Kind.FWD:
            if s > 0 and not draft.is_remote(s - 1):
                node.deps.append(draft.find(Kind.FWD, s - 1, mb))
        elif kind is Kind.BWD_W:
            node.deps.append(draft.find(Kind.BWD_I, s, mb))
        else:
            forward = draft.find(Kind.FWD, s, mb)
            node.deps.append(forward)
            if kind is not Kind.RECOMPUTE:
                node.deps.append(draft.find(Kind.RECOMPUTE, s, mb))
            if not node.eager and s < last_stage and not draft.is_remote(s + 1):
                node.deps.append(draft.find(Kind.BWD, s + 1, mb) or draft.find(Kind.BWD_I, s + 1, mb))
        node.layers = (draft.policy.recompute_layers[s] if kind is Kind.RECOMPUTE
                       else draft.program.stage_layers[s])
        node.deps = [d for d in node.deps if d is not None]
        draft.append(node)


def swap_pass(draft: _Draft) -> None:
    """Swap part of each forward's kept bytes to host right after it; prefetch them back so the
    swap-in starts with the compute step before the backward that needs them (but never before
    the forward whose swap-out it undoes)."""
    compute = [n for n in draft.nodes if n.kind.is_compute]  # a memory pass may have placed swap-outs
    prefetches: list[tuple[int, Node]] = []  # (compute position to start before, swap-out)
    forward_at: dict[tuple[int, int], int] = {}
    for position, node in enumerate(compute):
        swaps = draft.policy.swaps(node.stage)
        if node.kind is Kind.FWD:
            forward_at[(node.stage, node.microbatch)] = position
            if swaps:
                per_layer = draft.policy.swap_layers
                swap_out = Node(Kind.SWAP_OUT, node.stage, node.microbatch, deps=[node],
                                bytes=draft.policy.swap_bytes(node.stage, node.layers, node.save, draft.cost),
                                layers=() if per_layer is None else tuple(
                                    layer for layer in node.layers if layer in per_layer[node.stage]))
                draft.insert_after(node, swap_out)
        elif node.kind in (Kind.BWD, Kind.BWD_I) and draft.find(Kind.SWAP_OUT, node.stage, node.microbatch):
            point = max(position - 1, forward_at[(node.stage, node.microbatch)] + 1)
            prefetches.append((point, node))
    # Stable by start point, so prefetches for the same point keep their backward order.
    for point, backward in sorted(prefetches, key=lambda item: item[0]):
        swap_out = draft.find(Kind.SWAP_OUT, backward.stage, backward.microbatch)
        assert swap_out is not None
        swap_in = Node(Kind.SWAP_IN, backward.stage, backward.microbatch,
                       deps=[swap_out, compute[point - 1]], bytes=swap_out.bytes, layers=swap_out.layers)
        draft.insert_before(compute[point], swap_in)
        backward.deps.append(swap_in)


def p2p_pass(draft: _Draft) -> None:
    """Receive a remote activation or gradient right before its first consumer; send what a
    remote stage needs right after it is produced."""
    last_stage = draft.plan.num_stages - 1
    for node in [n for n in draft.nodes if n.kind.is_compute]:
        s, mb = node.stage, node.microbatch
        if node.kind is Kind.FWD:
            if s > 0 and draft.is_remote(s - 1):
                recv = Node(Kind.RECV_ACT, s, mb, peer=draft.peer(s - 1), tag=f"act:{s}:{mb}",
                            bytes=draft.message_bytes(s - 1))
                node.deps.append(draft.insert_before(node, recv))
            if s < last_stage and draft.is_remote(s + 1):
                draft.insert_after(node, Node(Kind.SEND_ACT, s, mb, deps=[node], peer=draft.peer(s + 1),
                                              tag=f"act:{s + 1}:{mb}", bytes=draft.message_bytes(s)))
            continue
        needs_gradient = node.kind in (Kind.BWD, Kind.BWD_I) or (node.kind is Kind.RECOMPUTE and not node.eager)
        if needs_gradient and s < last_stage and draft.is_remote(s + 1):
            recv = draft.find(Kind.RECV_GRAD, s, mb) or draft.insert_before(
                node, Node(Kind.RECV_GRAD, s, mb, peer=draft.peer(s + 1), tag=f"grad:{s}:{mb}",
                           bytes=draft.message_bytes(s)))
            node.deps.append(recv)
        if node.kind in (Kind.BWD, Kind.BWD_I) and s > 0 and draft.is_remote(s - 1):
            draft.insert_after(node, Node(Kind.SEND_GRAD, s, mb, deps=[node], peer=draft.peer(s - 1),
                                          tag=f"grad:{s - 1}:{mb}", bytes=draft.message_bytes(s - 1)))


def blocking_p2p_pass(draft: _Draft) -> None:
    """Megatron-LM 2021's blocking exchanges (plan ``schedule.p2p: blocking``): the compute after a
    send waits for its transfer to finish, so the compute stream carries every transfer's time. (The
    receive side, a scatter/gather's all-gather after the exchange, is the engine's timing rule
    ``Program.gather_after_exchange``, not a dependency here: docs/accuracy.md, section 17.)
    Not modelled: the rendezvous (a transfer also waits for its receiver to reach the exchange),
    which Megatron's pairing of each step's sends and receives in one batch makes deadlock-free,
    but this Program's per-consumer receives would not be (docs/accuracy.md, sections 3 and 17)."""
    sends: list[Node] = []
    for node in draft.nodes:
        if node.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
            sends.append(node)
        elif node.kind.is_compute:
            node.deps.extend(sends)
            sends = []


def _last_gradient_writers(draft: _Draft) -> dict[int, Node]:
    """Per stage, the instruction that writes its weight gradients last (a BWD or a BWD_W)."""
    writers: dict[int, Node] = {}
    for node in draft.nodes:
        if node.kind in (Kind.BWD, Kind.BWD_W):
            writers[node.stage] = node
    return writers


def gradient_sync_pass(draft: _Draft, stages: Sequence[int]) -> None:
    """Data-parallel gradient buckets in backward order (last layers first), each once the last
    gradient it holds is written; a bucket carries what the plan's gradient-sync method sends."""
    if draft.plan.dp == 1:
        return
    method = GRADIENT_SYNC[draft.plan.gradient_sync.method]
    writers = _last_gradient_writers(draft)
    coords = draft.coords
    group = _dp_group(draft)
    for number, layers in enumerate(_buckets(draft, stages)):
        touched = [s for s in stages if set(layers) & set(draft.program.stage_layers[s])]
        phases = method.plan(bucket_context(draft.plan, layers, draft.synced_grad_bytes))
        draft.append(Node(Kind.ALLREDUCE, deps=[writers[s] for s in touched], group=group,
                          tag=f"dp:{coords.pp}:{coords.tp}:{number}", bytes=wire_bytes(phases),
                          layers=layers, method=method.name, phases=tuple((p.kind, p.nbytes) for p in phases)))


def tied_embedding_pass(draft: _Draft, stages: Sequence[int]) -> None:
    """A tied word embedding (sim.tied_embedding): on the first and the last stage's ranks, after the
    data-parallel buckets, one all-reduce of the embedding's gradient between the two, which the step
    waits for (optimizer_step_pass depends on every ALLREDUCE). In place on the gradient: bytes 0."""
    plan, last = draft.plan, draft.plan.num_stages - 1
    if not ties_embedding(plan.workload_options, plan.pp) or not {0, last} & set(stages) \
            or draft.stage_rank[0] == draft.stage_rank[last]:  # both on one rank (a V placement): one matrix
        return
    head = draft.program.stage_layers[last][-1]
    nbytes = tied_embedding_bytes(draft.cost(head), draft.program.grad_buffer_scale)
    coords = draft.coords
    group = (draft.peer(0), draft.peer(last))
    layer = draft.program.stage_layers[0][0] if 0 in stages else head
    draft.append(Node(Kind.ALLREDUCE, deps=[n for n in draft.nodes if n.kind is Kind.ALLREDUCE]
                      + list(_last_gradient_writers(draft).values()), group=group,
                      tag=f"{TIED_TAG}:{coords.dp}:{coords.tp}", layers=(layer,), method="allreduce",
                      phases=(("allreduce", nbytes),)))


def optimizer_step_pass(draft: _Draft, stages: Sequence[int]) -> None:
    syncs = [n for n in draft.nodes if n.kind is Kind.ALLREDUCE]
    draft.append(Node(Kind.OPTIMIZER_STEP, deps=[*syncs, *_last_gradient_writers(draft).values()],
                            layers=tuple(layer for s in stages for layer in draft.program.stage_layers[s])))


def param_gather_pass(draft: _Draft, stages: Sequence[int]) -> None:
    """Under the distributed optimizer (a method that ``shards_optimizer``): after the step, one
    all-gather per bucket of the updated parameters, in their own dtype (sim.gradient_sync_distopt).
    It holds no buffer of its own (Megatron-LM gathers into its gradient buffer's storage): bytes 0."""
    method = GRADIENT_SYNC[draft.plan.gradient_sync.method]
    if draft.plan.dp == 1 or not method.shards_optimizer:
        return
    step = next(n for n in reversed(draft.nodes) if n.kind is Kind.OPTIMIZER_STEP and not n.method)
    buckets = _buckets(draft, stages)
    phases = param_gather_phases([sum(draft.synced_grad_bytes(layer) for layer in layers) for layers in buckets])
    coords = draft.coords
    draft.append(Node(Kind.ALLREDUCE, deps=[step], group=_dp_group(draft),
                      tag=f"{PARAM_GATHER_TAG}:{coords.pp}:{coords.tp}",
                      layers=tuple(layer for layers in buckets for layer in layers), method=method.name,
                      phases=tuple((p.kind, p.nbytes) for p in phases)))


def _dp_group(draft: _Draft) -> tuple[int, ...]:
    return tuple(draft.program.rank_of(d, draft.coords.pp, draft.coords.tp) for d in range(draft.plan.dp))


def _buckets(draft: _Draft, stages: Sequence[int]) -> list[tuple[int, ...]]:
    layers = sorted((layer for s in stages for layer in draft.program.stage_layers[s]), reverse=True)
    return bucket_layers(layers, draft.synced_grad_bytes, draft.plan.gradient_sync.bucket_mb * 2**20)


# ---------------------------------------------------------------------------------------------
# A text form of Programs, for golden tests and for reading.


def format_rank(rank_program: RankProgram) -> str:
    """One line per instruction: index, label, dependencies and the fields that are set."""
    lines = []
    for ins in rank_program.instructions:
        extras = [f"deps={','.join(map(str, ins.deps))}" if ins.deps else "",
                  "nosave" if not ins.save else "",
                  f"peer={ins.peer}" if ins.peer >= 0 else "",
                  f"group={','.join(map(str, ins.group))}" if ins.group else "",
                  f"bytes={ins.bytes}" if ins.bytes else "",
                  f"layers={_span(ins.layers)}" if ins.layers else "",
                  f"method={ins.method}" if ins.method else "",
                  # one all-reduce is what bytes= says; other methods spell their phases out
                  f"phases={'+'.join(f'{k}:{b}' for k, b in ins.phases)}"
                  if len(ins.phases) > 1 or any(k not in ("allreduce", "all_to_all") for k, _ in ins.phases)
                  else ""]
        lines.append(f"{ins.index:3d} {ins.label:<22} " + " ".join(e for e in extras if e))
    return "\n".join(line.rstrip() for line in lines)


def _span(layers: tuple[int, ...]) -> str:
    ascending = list(layers) == list(range(layers[0], layers[0] + len(layers)))
    return f"{layers[0]}-{layers[-1]}" if ascending and len(layers) > 1 else ",".join(map(str, layers))


def format_program(program: Program) -> str:
    return "\n\n".join(f"rank {rank}\n{format_rank(rp)}" for rank, rp in sorted(program.ranks.items()))
