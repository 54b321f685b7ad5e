"""The simpy engine: interprets a Program on modelled devices and links.

Each rank has five streams (compute, p2p send, p2p receive, collective, host copy), each a simpy
process that takes its instructions in program order and starts one once its dependencies have
finished. Sends put bytes on the sender's egress channel for the link class towards the peer
(shared fairly by concurrent transfers); a receive ends when its matching send's bytes arrive.
Collectives cost what the ``CommModel`` says; in full mode they also wait for every member of the
group, in symmetric mode the other members are identical replicas and arrive at the same time.
Compute instructions walk their layers: per-layer compute, TP all-reduces (with Merak's
sub-pipelined overlap levels), and the memory ledger.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import simpy

from sim.channel import SharedChannel
from sim.cluster import ClusterSpec
from sim.comm import concurrent_groups, concurrent_senders
from sim.costs import CostModel, LayerCosts, tp_comm_s
from sim.gradient_sync import Phase, phases_s
from sim.memory import MemoryPolicy, checkpoint_bytes, held_bytes
from sim.program import Instruction, Kind, Program, Stream
from sim.tp_overlap import tp_segments_time


class CommModel(Protocol):
    """What the engine needs to know about the cluster."""

    capacity_bytes: int
    cluster: ClusterSpec  # its device prices the encoding of compressed gradient buckets

    def p2p_route(self, src: int, dst: int, concurrent: int = 1) -> tuple[str, float, float]:
        """(link class of the sender's egress, latency s, bandwidth B/s) while ``concurrent``
        senders of the node send off it (sim.comm.concurrent_senders)."""
        ...

    def collective_s(self, primitive: str, nbytes: int, ranks: Sequence[int], concurrent: int = 1) -> float:
        """Seconds while ``concurrent`` groups like this one share the nodes (sim.comm.concurrent_groups)."""
        ...

    def host_copy(self) -> tuple[float, float]:
        """(latency s, bandwidth B/s) of the device-host link."""
        ...


@dataclass(frozen=True)
class EngineOptions:
    overlap_slowdown: float = 0.0  # compute runs this much slower while the device communicates
    # The runtime's own cost of starting a compute instruction once it may start (Python dispatch,
    # hooks, posting its sends): measured on calibration runs (analysis.validation.runtime_costs).
    dispatch_s: float = 0.0
    layer_rows: bool = False  # emit one child row per layer of each compute instruction


class Row(NamedTuple):
    rank: int
    index: int
    kind: str
    stage: int
    microbatch: int
    stream: str
    start_s: float
    end_s: float
    bytes: int
    mem_after: int
    parent: int = -1
    layer: int = -1
    name: str = ""


@dataclass
class MemoryLedger:
    """Bytes in use on one device over time, by category."""

    capacity: int
    static: dict[str, int] = field(default_factory=dict)
    activations: int = 0
    buffers: int = 0  # communication buffers: received gradients, flattened gradient buckets
    peak: int = 0
    activation_peak: int = 0  # the most activation bytes held at once (not necessarily at ``peak``)
    peak_breakdown: dict[str, int] = field(default_factory=dict)
    oom_at_s: float | None = None
    oom_instruction: str = ""

    @property
    def in_use(self) -> int:
        return sum(self.static.values()) + self.activations + self.buffers

    def change_activations(self, delta: int, now: float, label: str) -> None:
        self.activations += delta
        self.activation_peak = max(self.activation_peak, self.activations)
        self._check(now, label)

    def change_buffers(self, delta: int, now: float, label: str) -> None:
        self.buffers += delta
        self._check(now, label)

    def _check(self, now: float, label: str) -> None:
        used = self.in_use
        if used > self.peak:
            self.peak = used
            self.peak_breakdown = {**self.static, "activations": self.activations, "comm_buffers": self.buffers}
        if used > self.capacity and self.oom_at_s is None:
            self.oom_at_s, self.oom_instruction = now, label


class Engine:
    def __init__(self, program: Program, costs: CostModel, comm: CommModel, policy: MemoryPolicy,
                 micro_batch: int, tp_overlap: int = 0, options: EngineOptions | None = None) -> None:
        self.program, self.costs, self.comm, self.policy = program, costs, comm, policy
        self.micro_batch, self.tp_overlap = micro_batch, tp_overlap
        self.stage_ranks = program.dp * program.tp  # ranks holding one pipeline stage (sim.comm)
        self._senders_of: dict[tuple[int, int], int] = {}
        self._groups_of: dict[tuple[int, ...], int] = {}
        self.options = options or EngineOptions()
        self.env = simpy.Environment()
        self.rows: list[Row] = []
        self.finished: dict[int, list[simpy.Event]] = {}
        self.arrivals: dict[tuple[int, str], simpy.Event] = defaultdict(self.env.event)  # (receiver, tag)
        self.collective_arrivals: dict[str, list[int]] = defaultdict(list)
        self.collective_done: dict[str, simpy.Event] = defaultdict(self.env.event)
        self.channels: dict[tuple[int, str], SharedChannel] = {}
        self.comm_active: dict[int, int] = defaultdict(int)
        self.ledgers: dict[int, MemoryLedger] = {}
        self.compute_busy: dict[int, float] = defaultdict(float)
        self.grad_buffers: dict[tuple[int, int, int], int] = {}
        self._layer_cache: dict[int, LayerCosts] = {}
        # (rank, stage, micro-batch) -> the layers its RECOMPUTE re-runs: what its forward does not keep
        self.recomputed = {(rank, i.stage, i.microbatch): i.layers for rank, rp in program.ranks.items()
                           for i in rp.instructions if i.kind is Kind.RECOMPUTE}

    # -- set-up --------------------------------------------------------------------------------
    def _layer(self, layer: int) -> LayerCosts:
        cached = self._layer_cache.get(layer)
        if cached is None:
            cached = self._layer_cache[layer] = self.policy.layer_view(
                self.costs.layer_costs(layer, self.micro_batch, self.program.tp))
        return cached

    def _ledger_for(self, rank: int) -> MemoryLedger:
        layers = [layer for s in self.program.ranks[rank].stages for layer in self.program.stage_layers[s]]
        costs = [self._layer(layer) for layer in layers]
        # The share of each layer this rank holds: all of it, or its shard of a sharded table.
        held = [1.0 - self.program.unheld_param_bytes.get(layer, 0) / c.param_bytes if c.param_bytes else 1.0
                for layer, c in zip(layers, costs, strict=True)]
        return MemoryLedger(
            capacity=self.comm.capacity_bytes,
            static={
                "parameters": round(sum(c.param_bytes * h for c, h in zip(costs, held, strict=True))),
                "gradients": round(sum(c.grad_bytes * h for c, h in zip(costs, held, strict=True))),
                "optimizer": round(sum(c.optimizer_bytes * h for c, h in zip(costs, held, strict=True))),
            },
        )

    def run(self) -> float:
        for rank, rank_program in self.program.ranks.items():
            self.finished[rank] = [self.env.event() for _ in rank_program.instructions]
            ledger = self._ledger_for(rank)
            ledger.change_activations(0, 0.0, "start")
            self.ledgers[rank] = ledger
            by_stream: dict[Stream, list[Instruction]] = defaultdict(list)
            for instruction in rank_program.instructions:
                by_stream[instruction.stream].append(instruction)
            for stream, instructions in by_stream.items():
                self.env.process(self._stream(rank, stream, instructions))
        self.env.run()
        unfinished = [(rank, i) for rank, events in self.finished.items() for i, e in enumerate(events)
                      if not e.processed]
        if unfinished:
            rank, index = unfinished[0]
            raise RuntimeError(f"simulation deadlocked: rank {rank} never finished "
                               f"{self.program.ranks[rank].instructions[index].label} "
                               f"({len(unfinished)} instructions unfinished)")
        return self.env.now

    # -- streams -------------------------------------------------------------------------------
    def _stream(self, rank: int, stream: Stream, instructions: list[Instruction]):
        done = self.finished[rank]
        for position, instruction in enumerate(instructions):
            pending = [done[d] for d in instruction.deps if not done[d].processed]
            if pending:
                yield self.env.all_of(pending)
            if stream is Stream.COMPUTE and position and self.options.dispatch_s:
                yield self.env.timeout(self.options.dispatch_s)
            start = self.env.now
            if stream is Stream.COMPUTE:
                yield from self._compute(rank, instruction)
            elif stream is Stream.P2P_SEND:
                yield from self._send(rank, instruction)
            elif stream is Stream.P2P_RECV:
                arrival = self.arrivals[(rank, instruction.tag)]
                if not arrival.processed:
                    yield arrival
                start = max(start, arrival.value)
                held = instruction.bytes
                if self.program.p2p_gather_tp:  # scatter/gather: the TP group all-gathers the pieces
                    held *= self.program.tp
                    group = self._tp_group(rank)
                    yield self.env.timeout(self.comm.collective_s("all_gather", held, group, self._groups(group)))
                if instruction.kind is Kind.RECV_GRAD:  # held until its backward has used it
                    self.ledgers[rank].change_buffers(held, self.env.now, instruction.label)
                    self.grad_buffers[(rank, instruction.stage, instruction.microbatch)] = held
            elif stream is Stream.COLLECTIVE:
                yield from self._collective(rank, instruction)
            else:
                yield from self._copy(rank, instruction)
            self._record(rank, instruction, start, self.env.now)
            done[instruction.index].succeed()

    def _record(self, rank: int, instruction: Instruction, start: float, end: float, layer: int = -1,
                parent: int = -1) -> None:
        self.rows.append(Row(rank, instruction.index, instruction.kind.value, instruction.stage,
                             instruction.microbatch, instruction.stream.value, start, end, instruction.bytes,
                             self.ledgers[rank].in_use, parent, layer, instruction.label))

    def _send(self, rank: int, instruction: Instruction):
        link_class, latency, bandwidth = self.comm.p2p_route(rank, instruction.peer,
                                                             self._senders(rank, instruction.peer))
        channel = self.channels.get((rank, link_class))
        if channel is None:
            channel = self.channels[(rank, link_class)] = SharedChannel(self.env, bandwidth)
        start = self.env.now
        self.comm_active[rank] += 1
        yield self.env.timeout(latency)
        yield channel.transfer(instruction.bytes)
        self.comm_active[rank] -= 1
        self.arrivals[(instruction.peer, instruction.tag)].succeed(start)

    def _collective(self, rank: int, instruction: Instruction):
        """Every member holds its flattened bucket from its arrival; in full mode the collective runs
        once the whole group has arrived, in symmetric mode the identical peers arrive together."""
        ledger = self.ledgers[rank]
        ledger.change_buffers(instruction.bytes, self.env.now, instruction.label)
        self.comm_active[rank] += 1
        sharing = self._groups(instruction.group)
        if instruction.kind is Kind.ALLTOALL:  # sharded embedding rows, ids or gradients (sim.embedding)
            nbytes = round(instruction.bytes * self.program.alltoall_imbalance)
            duration = self.comm.collective_s("all_to_all", nbytes, instruction.group, sharing)
        else:
            # A bucket without phases (a Program written by hand) is one all-reduce of its bytes.
            phases = [Phase(kind, nbytes) for kind, nbytes in instruction.phases  # type: ignore[arg-type]
                      ] or [Phase("allreduce", instruction.bytes)]
            duration = phases_s(phases, instruction.group, self.comm, self.comm.cluster.device, instruction.method,
                                sharing)
        if self.program.symmetric:
            yield self.env.timeout(duration)
        else:
            done = self.collective_done[instruction.tag]
            arrived = self.collective_arrivals[instruction.tag]
            arrived.append(rank)
            if len(arrived) == len(instruction.group):
                self.env.timeout(duration).callbacks.append(lambda _event: done.succeed())
            yield done
        self.comm_active[rank] -= 1
        ledger.change_buffers(-instruction.bytes, self.env.now, instruction.label)

    def _copy(self, rank: int, instruction: Instruction):
        latency, bandwidth = self.comm.host_copy()
        ledger = self.ledgers[rank]
        if instruction.kind is Kind.SWAP_IN:
            ledger.change_activations(instruction.bytes, self.env.now, instruction.label)
        yield self.env.timeout(latency + instruction.bytes / bandwidth)
        if instruction.kind is Kind.SWAP_OUT:
            ledger.change_activations(-instruction.bytes, self.env.now, instruction.label)

    # -- compute -------------------------------------------------------------------------------
    def _compute(self, rank: int, instruction: Instruction):
        kind, ledger = instruction.kind, self.ledgers[rank]
        if kind is Kind.OPTIMIZER_STEP:
            # A step over part of the rank's parameters (sharded embedding tables step on their own,
            # sim.embedding_embrace) says how many bytes it updates.
            duration = self.costs.optimizer_step_s(instruction.bytes or ledger.static["parameters"])
            yield self.env.timeout(duration)
            self.compute_busy[rank] += duration
            return
        # Recompute inside the backward (MemoryPolicy.recompute_in_backward): the RECOMPUTE marks the
        # point; its layers are re-run by the backward, one at a time, just before their own backward.
        in_backward = self.policy.recompute_in_backward and (rank, instruction.stage, instruction.microbatch) \
            in self.recomputed
        if kind is Kind.RECOMPUTE and in_backward:
            return
        layers = [self._layer(layer) for layer in instruction.layers]
        # The first stage has no input gradient to send anywhere, so its split backward does all the
        # work in the W step (as exec.runtime runs it) and its I step is empty.
        whole_backward_in_w = instruction.stage == 0
        phase_time = {
            Kind.FWD: lambda c: c.fwd_s,
            Kind.RECOMPUTE: lambda c: c.recompute_s,
            Kind.BWD: lambda c: c.bwd_input_s + c.bwd_weight_s,
            Kind.BWD_I: (lambda c: 0.0) if whole_backward_in_w else (lambda c: c.bwd_input_s),
            Kind.BWD_W: (lambda c: c.bwd_input_s + c.bwd_weight_s) if whole_backward_in_w
            else (lambda c: c.bwd_weight_s),
        }[kind]
        # A W step alone needs no TP all-reduce (weight gradients of TP shards are local); the
        # input-gradient all-reduces go with whichever step computes the input gradients.
        computes_input_grads = kind is not Kind.BWD_W if not whole_backward_in_w else kind is not Kind.BWD_I
        with_tp = self.program.tp > 1 and computes_input_grads
        backward = kind in (Kind.BWD, Kind.BWD_I, Kind.BWD_W)
        segments = [
            (phase_time(c), self._tp_comm_s(c, rank, backward) if with_tp else 0.0, max(c.tp_allreduces, 1))
            for c in layers
        ]
        slowdown = 1.0 + (self.options.overlap_slowdown if self.comm_active[rank] > 0 else 0.0)
        per_layer = tp_segments_time(segments, self.tp_overlap if with_tp else 0)
        start = self.env.now
        if kind is Kind.FWD or kind is Kind.RECOMPUTE:
            ledger.change_activations(self._activation_delta(rank, instruction, layers), start, instruction.label)
        one_layer = 0  # in-backward recompute: the largest single layer's activations, held at once
        if kind is Kind.BWD and in_backward:
            rerun = set(self.recomputed[(rank, instruction.stage, instruction.microbatch)])
            again = tp_segments_time([(c.recompute_s, self._tp_comm_s(c, rank, False) if self.program.tp > 1 else 0.0,
                                       max(c.tp_allreduces, 1)) if layer in rerun else (0.0, 0.0, 1)
                                      for layer, c in zip(instruction.layers, layers, strict=True)],
                                     self.tp_overlap if self.program.tp > 1 else 0)
            per_layer = [a + b for a, b in zip(per_layer, again, strict=True)]
            one_layer = max((self._recompute_bytes(layer) for layer in rerun), default=0)
            ledger.change_activations(one_layer, start, instruction.label)
        t = start
        for layer_index, layer_time in zip(instruction.layers, per_layer, strict=True):
            if self.options.layer_rows:
                self.rows.append(Row(rank, instruction.index, instruction.kind.value, instruction.stage,
                                     instruction.microbatch, Stream.COMPUTE.value, t, t + layer_time * slowdown, 0,
                                     ledger.in_use, instruction.index, layer_index, f"layer {layer_index}"))
            t += layer_time * slowdown
        yield self.env.timeout(t - start)
        self.compute_busy[rank] += t - start
        if kind is Kind.BWD and in_backward:  # what the forward kept, and the one layer re-run last
            kept = self.policy.forward_kept_bytes(instruction.stage, instruction.layers, False, self._layer,
                                                  self.recomputed[(rank, instruction.stage, instruction.microbatch)])
            ledger.change_activations(-(kept + one_layer), self.env.now, instruction.label)
        elif kind is Kind.BWD or kind is Kind.BWD_W:
            ledger.change_activations(-self._stage_activation_bytes(rank, instruction.stage, instruction.microbatch),
                                      self.env.now, instruction.label)
        if kind is Kind.BWD or kind is Kind.BWD_I:
            received = self.grad_buffers.pop((rank, instruction.stage, instruction.microbatch), 0)
            ledger.change_buffers(-received, self.env.now, instruction.label)

    def _tp_comm_s(self, c: LayerCosts, rank: int, backward: bool) -> float:
        if c.tp_allreduces == 0:
            return 0.0
        group = self._tp_group(rank)
        return tp_comm_s(c, backward, lambda collective, nbytes: self.comm.collective_s(collective, nbytes, group,
                                                                                         self._groups(group)))

    def _tp_group(self, rank: int) -> tuple[int, ...]:
        coords = self.program.coords_of(rank)
        return tuple(self.program.rank_of(coords.dp, coords.pp, t) for t in range(self.program.tp))

    # A node's adapters are shared by the stage peers that send or reduce at the same time (sim.comm).
    def _senders(self, src: int, dst: int) -> int:
        key = (src, dst)
        if key not in self._senders_of:
            self._senders_of[key] = concurrent_senders(self.comm.cluster, self.stage_ranks, src, dst)
        return self._senders_of[key]

    def _groups(self, group: tuple[int, ...]) -> int:
        if group not in self._groups_of:
            self._groups_of[group] = concurrent_groups(self.comm.cluster, self.stage_ranks, group)
        return self._groups_of[group]

    def _stage_activation_bytes(self, rank: int, stage: int, microbatch: int) -> int:
        """Activations of one micro-batch of ``stage`` at their largest (every layer's saved tensors
        back: sim.memory.held_bytes); a swapped-out part was counted back by its SWAP_IN."""
        layers = self.program.stage_layers[stage]
        return held_bytes(layers, self.recomputed.get((rank, stage, microbatch), ()), self._layer)

    def _recompute_bytes(self, layer: int) -> int:
        """What re-running a checkpointed layer brings back beyond its kept input."""
        return self._layer(layer).saved_bytes - checkpoint_bytes(layer, self._layer)

    def _activation_delta(self, rank: int, instruction: Instruction, layers: list[LayerCosts]) -> int:
        if instruction.kind is Kind.RECOMPUTE:
            # The checkpointed layers' activations come back: what the stage holds with every layer
            # saved, less what the checkpointed forward kept.
            stage = instruction.stage
            return self._stage_activation_bytes(rank, stage, instruction.microbatch) - self.policy.forward_kept_bytes(
                stage, self.program.stage_layers[stage], False, self._layer, instruction.layers)
        return self.policy.forward_kept_bytes(instruction.stage, instruction.layers, instruction.save, self._layer,
                                              self.recomputed.get((rank, instruction.stage, instruction.microbatch)))
