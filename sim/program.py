"""The Program: what every rank executes, in order, for one training iteration.

Both engines interpret it: ``sim.engine`` with simpy, ``exec.interpreter`` with real tensors. An
instruction covers one (virtual) stage and one micro-batch, or one bucket or one step; it names
the stream it runs on and the instructions of the same rank it must wait for. Cross-rank
dependencies are implicit and symmetric: a ``SEND_*`` matches the ``RECV_*`` with the same tag
on the peer rank, and a collective matches the instructions with the same tag on every rank of
its group. This module imports neither torch nor simpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Kind(str, Enum):
    FWD = "FWD"
    BWD = "BWD"  # input and weight gradients together
    BWD_I = "BWD_I"  # input gradient only (zero-bubble split)
    BWD_W = "BWD_W"  # weight gradient only
    RECOMPUTE = "RECOMPUTE"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    SWAP_OUT = "SWAP_OUT"
    SWAP_IN = "SWAP_IN"
    ALLREDUCE = "ALLREDUCE"  # data-parallel gradient bucket
    ALLTOALL = "ALLTOALL"  # sharded embedding rows (or their ids, or their gradients) to their owners
    OPTIMIZER_STEP = "OPTIMIZER_STEP"
    # A memory policy deciding at run time (DELTA, memory.decide: runtime): on the compute stream, it
    # brings saved tensors back and releases others. ``tag``: prefetch (start bringing back the next
    # backward's swapped tensors) or return (before a backward: its tensors back on the device, then
    # release while over budget); ``bytes``: the rank's activation budget. (Forwards release after
    # each layer themselves.)
    DECIDE = "DECIDE"

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS


COMPUTE_KINDS = frozenset({Kind.FWD, Kind.BWD, Kind.BWD_I, Kind.BWD_W, Kind.RECOMPUTE, Kind.OPTIMIZER_STEP})
SEND_KINDS = frozenset({Kind.SEND_ACT, Kind.SEND_GRAD})
RECV_KINDS = frozenset({Kind.RECV_ACT, Kind.RECV_GRAD})
COLLECTIVE_KINDS = frozenset({Kind.ALLREDUCE, Kind.ALLTOALL})


class Stream(str, Enum):
    COMPUTE = "compute"
    P2P_SEND = "p2p_send"
    P2P_RECV = "p2p_recv"
    COLLECTIVE = "collective"
    COPY = "copy"


STREAM_OF: dict[Kind, Stream] = {
    **{k: Stream.COMPUTE for k in COMPUTE_KINDS},
    Kind.SEND_ACT: Stream.P2P_SEND,
    Kind.SEND_GRAD: Stream.P2P_SEND,
    Kind.RECV_ACT: Stream.P2P_RECV,
    Kind.RECV_GRAD: Stream.P2P_RECV,
    Kind.SWAP_OUT: Stream.COPY,
    Kind.SWAP_IN: Stream.COPY,
    Kind.ALLREDUCE: Stream.COLLECTIVE,
    # On the same stream as the buckets: one communicator, whose program order is the priority
    # of its messages (sim.embedding_lower orders them by when their consumer needs them).
    Kind.ALLTOALL: Stream.COLLECTIVE,
    Kind.DECIDE: Stream.COMPUTE,
}


@dataclass(frozen=True)
class Instruction:
    """One step of a rank's program.

    ``deps`` are indices of earlier instructions of the same rank. ``save`` is False for a
    checkpointed forward (only the stage input is kept; a RECOMPUTE must precede the backward).
    ``peer`` is the other rank of a send/receive; ``group`` the ranks of a collective.
    ``layers`` are the model layer indices the instruction walks (compute) or covers (a bucket);
    ``bytes`` of a bucket are what it puts on the wire, after its gradient-sync method encodes it.
    """

    index: int
    kind: Kind
    stage: int = -1
    microbatch: int = -1
    deps: tuple[int, ...] = ()
    save: bool = True
    peer: int = -1
    group: tuple[int, ...] = ()
    tag: str = ""
    bytes: int = 0
    layers: tuple[int, ...] = ()
    method: str = ""  # ALLREDUCE: the gradient-sync method of the bucket (sim.gradient_sync);
    # ALLTOALL and an embedding's own OPTIMIZER_STEP: the embedding method (sim.embedding)
    # ALLREDUCE: the method's phases for this bucket, (kind, bytes) in order: collectives
    # ("allreduce", "allgather") and "memory" (encode/decode traffic); see sim.gradient_sync.Phase.
    # ALLTOALL: its all-to-alls in order (sim.embedding.exchange_phases: the ids send counts first)
    phases: tuple[tuple[str, int], ...] = ()

    @property
    def stream(self) -> Stream:
        return STREAM_OF[self.kind]

    @property
    def label(self) -> str:
        parts = [self.kind.value]
        if self.stage >= 0:
            parts.append(f"s{self.stage}")
        if self.microbatch >= 0:
            parts.append(f"mb{self.microbatch}")
        if self.tag and (not self.kind.is_compute or self.kind is Kind.DECIDE):
            parts.append(self.tag)
        return " ".join(parts)


@dataclass(frozen=True)
class Coords:
    """Where a rank sits in the dp x pp x tp grid (tp fastest, then dp, then pp)."""

    dp: int
    pp: int
    tp: int


@dataclass
class RankProgram:
    rank: int
    coords: Coords
    stages: tuple[int, ...]  # virtual stages this rank holds, in chunk order
    instructions: list[Instruction] = field(default_factory=list)

    def add(self, kind: Kind, **fields: object) -> Instruction:
        instruction = Instruction(index=len(self.instructions), kind=kind, **fields)  # type: ignore[arg-type]
        self.instructions.append(instruction)
        return instruction


@dataclass
class Program:
    """All rank programs of one iteration. ``ranks`` may hold only the representatives of
    symmetric groups (see ``sim.lower.lower``); ``world_size`` is always the full count."""

    world_size: int
    dp: int
    pp: int
    tp: int
    stage_layers: list[tuple[int, ...]]  # virtual stage -> model layer indices
    ranks: dict[int, RankProgram]
    symmetric: bool
    # layer -> parameter bytes of it that a rank does not hold (a sharded embedding table's other
    # shards, sim.embedding_embrace); the memory ledger leaves them and their gradients and state out.
    unheld_param_bytes: dict[int, int] = field(default_factory=dict)
    # An all-to-all lasts as long as its most loaded destination: that destination's share over the
    # even 1/n, as measured on real batches (row-sharded tables); scales the bytes' transfer time.
    alltoall_imbalance: float = 1.0
    # Scatter/gather (schedule.p2p_scatter_gather): a SEND/RECV carries 1/tp of the tensor; the receiver
    # all-gathers the whole tensor (its bytes x tp) over its TP group before the receive ends.
    p2p_gather_tp: bool = False
    # Blocking exchanges (schedule.p2p: blocking): a receive's all-gather starts only once the compute
    # before it in the rank's program and the sends issued since have finished, as Megatron-LM v2.5's
    # _communicate waits for its batch's transfers and synchronises before it gathers (docs/accuracy.md,
    # section 17). A timing rule of the engine, not a dependency: the runtime posts a receive with the
    # sends around it, as Megatron batches them; waiting for a send before posting the matching peer's
    # receive would deadlock (a send completes only once its receiver has posted).
    gather_after_exchange: bool = False
    # Bytes of the gradient buffer a rank holds per byte of its layers' gradients: 2.0 where 16-bit
    # gradients accumulate in an fp32 main-grad buffer (Megatron-LM; sim.model_state), else 1.0.
    grad_buffer_scale: float = 1.0
    # The share of the optimizer state a rank holds and of the parameters its step updates: 1/dp under
    # the distributed optimizer (sim.gradient_sync_distopt; sim.model_state.optimizer_share), else 1.0.
    optimizer_share: float = 1.0

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def coords_of(self, rank: int) -> Coords:
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return Coords(dp=dp, pp=pp, tp=tp)

    def num_instructions(self) -> int:
        return sum(len(p.instructions) for p in self.ranks.values())
