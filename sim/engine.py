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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

import simpy

from sim.channel import SharedChannel
from sim.cluster import ClusterSpec
from sim.comm import concurrent_groups, concurrent_senders
from sim.costs import CostModel, LayerCosts, sequence_parallel_grads_s, tp_comm_s
from sim.delta import choose
from sim.delta_runtime import RankDelta, decision_name
from sim.embedding import exchange_s, ids_request_host_s
from sim.gradient_sync import Phase, phases_s
from sim.host_cpu import Stretch, cores_taken, host_share, overlap_stretch, phases_cpu_s
from sim.meeting import add_offsets, instruction_offsets, instruction_variance, lateness_s, offset_variance
from sim.memory import MemoryPolicy, held_bytes, in_backward_extra_bytes
from sim.model_state import step_copy_bytes
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

    def p2p_weight(self, nbytes: int) -> float:
        """The bytes a message of ``nbytes`` weighs on its route (its measured time alone)."""
        ...

    def collective_s(self, primitive: str, nbytes: int, ranks: Sequence[int], concurrent: int = 1) -> float:
        """Seconds while ``concurrent`` groups like this one share the nodes (sim.comm.concurrent_groups)."""
        ...

    def host_copy(self) -> tuple[float, float]:
        """(latency s, bandwidth B/s) of the device-host link."""
        ...


@dataclass(frozen=True)
class EngineOptions:
    # Compute (forwards, backwards, optimizer steps) progresses 1 / (1 + overlap_slowdown) as fast
    # while the rank moves data (a send, or a collective once its whole group has arrived): on a
    # host whose cores the communication shares, the time the transfer takes from the compute
    # (a what-if on any cluster; the measured alternative is sim.host_cpu's shared slowdown, of
    # which this is the floor for the compute). Waiting for a peer costs no CPU (gloo blocks;
    # docs/embrace.md), so it does not count.
    overlap_slowdown: float = 0.0
    # The runtime's own cost of starting a compute instruction once it may start (Python dispatch,
    # hooks, posting its sends): measured on calibration runs (analysis.validation.runtime_costs).
    dispatch_s: float = 0.0
    layer_rows: bool = False  # emit one child row per layer of each compute instruction
    # A collective starts when its latest member arrives: the expected lateness of the last of the
    # group's ranks, from the variance of each rank's compute since the ranks last met (sim.meeting;
    # measured by the profile, zero for a cost model without spreads).
    meeting_waits: bool = True
    # ... and from the profiling processes' systematic differences (each process's own per-layer
    # medians, where the profile kept them: sim.meeting, "A systematic difference between processes").
    # On by default: a measurement of the profile, not a fit to validation runs (docs/validation.md).
    process_offsets: bool = True


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


def exchange_waits(program: Program) -> dict[tuple[int, int], tuple[int, ...]]:
    """(rank, receive index) -> the instructions its exchange runs after: the compute before it in the
    rank's program and the sends issued since (``Program.gather_after_exchange``)."""
    waits: dict[tuple[int, int], tuple[int, ...]] = {}
    for rank, rp in program.ranks.items():
        previous: list[int] = []  # the last compute, then the sends after it
        for ins in rp.instructions:
            if ins.stream is Stream.COMPUTE:
                previous = [ins.index]
            elif ins.stream is Stream.P2P_SEND and previous:
                previous.append(ins.index)
            elif ins.stream is Stream.P2P_RECV and previous:
                waits[(rank, ins.index)] = tuple(previous)
    return waits


class Engine:
    def __init__(self, program: Program, costs: CostModel, comm: CommModel, policy: MemoryPolicy,
                 micro_batch: int, tp_overlap: int = 0, options: EngineOptions | None = None) -> None:
        self.program, self.costs, self.comm, self.policy = program, costs, comm, policy
        self.micro_batch, self.tp_overlap = micro_batch, tp_overlap
        self.stage_ranks = program.dp * program.tp  # ranks holding one pipeline stage (sim.comm)
        self._senders_of: dict[tuple[int, int], int] = {}
        self._groups_of: dict[tuple[int, ...], int] = {}
        self._in_backward_extra: dict[tuple[int, frozenset[int]], int] = {}  # per stage and re-run set
        self.options = options or EngineOptions()
        self.env = simpy.Environment()
        self.rows: list[Row] = []
        self.finished: dict[int, list[simpy.Event]] = {}
        self.arrivals: dict[tuple[int, str], simpy.Event] = defaultdict(self.env.event)  # (receiver, tag)
        self.collective_arrivals: dict[str, list[int]] = defaultdict(list)
        self.collective_done: dict[str, simpy.Event] = defaultdict(self.env.event)
        self.channels: dict[tuple[int, str], SharedChannel] = {}
        # per rank: transfers moving data now, computes running now, and an event fired when either
        # count changes (the compute and the transfers in progress then re-time their rest: _advance)
        self.moving: dict[int, int] = defaultdict(int)
        self.computing: dict[int, int] = defaultdict(int)
        self.changed: dict[int, simpy.Event] = {}
        self.rank_channels: dict[int, list[SharedChannel]] = defaultdict(list)  # its sends' egress
        # sim.host_cpu: the cores the rank's moving transfers keep busy, on a host whose cores its
        # ranks share (a cluster with host_cores whose benchmark measured the CPU of communicating)
        self.moving_cores: dict[int, float] = defaultdict(float)
        self.ranks_on_host, self.host_cores = host_share(comm, program.world_size, comm.cluster.devices_per_node)
        self._slows = self.options.overlap_slowdown > 0 or self.host_cores is not None
        self._slows_transfers = self.host_cores is not None  # the shared slowdown (sim.host_cpu)
        # sim.meeting: each rank's compute variance since its compute last waited on a collective, and,
        # per (rank, instruction), when a compute instruction ended and that variance at its end
        self.meet_var: dict[int, float] = defaultdict(float)
        self.meet_offsets: dict[int, tuple[float, ...]] = defaultdict(tuple)  # per profiling process
        self.ended: dict[tuple[int, int], tuple[float, float]] = {}
        self.ledgers: dict[int, MemoryLedger] = {}
        self.compute_busy: dict[int, float] = defaultdict(float)
        self.grad_buffers: dict[tuple[int, int, int], int] = {}
        # A received gradient's buffer is held from where the runtime allocates it and posts its
        # irecv (exec.interpreter ``_recv``: at the receive's place in program order, i.e. once the
        # compute instruction before it has run) until its backward has used it; the receive stream
        # may see the data arrive earlier, but the runtime has no buffer for it before that point.
        # (rank, index of the compute instruction the receive follows, or -1) -> its receives
        self._posted_after: dict[tuple[int, int], list[Instruction]] = defaultdict(list)
        for rank, rp in program.ranks.items():
            before = -1
            for i in rp.instructions:
                if i.stream is Stream.COMPUTE:
                    before = i.index
                elif i.kind is Kind.RECV_GRAD:
                    self._posted_after[(rank, before)].append(i)
        self._exchange_waits = exchange_waits(program) if program.gather_after_exchange else {}
        self._layer_cache: dict[int, LayerCosts] = {}
        # (rank, stage, micro-batch) -> the layers its RECOMPUTE re-runs: what its forward does not keep
        self.recomputed = {(rank, i.stage, i.microbatch): i.layers for rank, rp in program.ranks.items()
                           for i in rp.instructions if i.kind is Kind.RECOMPUTE}
        # DELTA deciding at run time (memory.decide: runtime): per rank, what it holds as the ledger
        # counts it, and a copy engine its swaps queue on (sim.delta_runtime).
        self.delta: dict[int, RankDelta] = {}
        self.copy_engines: dict[int, simpy.Resource] = {}
        if policy.delta is not None and policy.delta.decide == "runtime":
            self.delta = {rank: RankDelta(self._layer) for rank in program.ranks}
            # each rank's activation budget, written on its DECIDE instructions by the lowering
            self._activation_budget = {rank: next(i.bytes for i in rp.instructions if i.kind is Kind.DECIDE)
                                       for rank, rp in program.ranks.items()}
            self.copy_engines = {rank: simpy.Resource(self.env, capacity=1) for rank in program.ranks}
        # On a CPU the runtime copies in line (exec.delta_runtime): the compute waits for each copy.
        self._copies_block = comm.cluster.device.kind == "cpu"

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
                # the main-grad buffer in its own dtype (sim.model_state, via the program)
                "gradients": round(sum(c.grad_bytes * h for c, h in zip(costs, held, strict=True))
                                   * self.program.grad_buffer_scale),
                # all of it, or its 1/dp shard under the distributed optimizer (sim.model_state)
                "optimizer": round(sum(c.optimizer_bytes * h for c, h in zip(costs, held, strict=True))
                                   * self.program.optimizer_share),
            },
        )

    def run(self) -> float:
        for rank, rank_program in self.program.ranks.items():
            self.finished[rank] = [self.env.event() for _ in rank_program.instructions]
            ledger = self._ledger_for(rank)
            ledger.change_activations(0, 0.0, "start")
            self.ledgers[rank] = ledger
            self._post_receives(rank, -1)
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
        # The iteration ends with the last instruction (or copy) that ran, not at env.now: a compute
        # re-timed by _progress leaves its superseded timeout in simpy's queue (a timeout cannot be
        # cancelled), and env.run() advances the clock to it after the work is done.
        return max((row.end_s for row in self.rows), default=self.env.now)

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
            if instruction.kind is Kind.DECIDE:
                yield from self._decide(rank, instruction)
                self._post_receives(rank, instruction.index)
                continue  # it records its own row (bytes: what the rank holds after it)
            if stream is Stream.COMPUTE:
                if any(self.program.ranks[rank].instructions[d].stream is Stream.COLLECTIVE for d in instruction.deps):
                    self.meet_var[rank] = 0.0  # it waited on a meeting: the ranks' compute restarts together
                    self.meet_offsets[rank] = ()
                yield from self._compute(rank, instruction)
                self.ended[(rank, instruction.index)] = (self.env.now, self.meet_var[rank]
                                                         + offset_variance(self.meet_offsets[rank]))
            elif stream is Stream.P2P_SEND:
                yield from self._send(rank, instruction)
            elif stream is Stream.P2P_RECV:
                waits = [done[d] for d in self._exchange_waits.get((rank, instruction.index), ())
                         if not done[d].processed]
                if waits:  # a blocking exchange gathers after its compute and sends (Program.gather_after_exchange)
                    yield self.env.all_of(waits)
                arrival = self.arrivals[(rank, instruction.tag)]
                if not arrival.processed:
                    yield arrival
                start = max(start, arrival.value)
                held = instruction.bytes
                if self.program.p2p_gather_tp:  # scatter/gather: the TP group all-gathers the pieces
                    held *= self.program.tp
                    group = self._tp_group(rank)
                    yield self.env.timeout(self.comm.collective_s("all_gather", held, group, self._groups(group)))
            elif stream is Stream.COLLECTIVE:
                if self.options.meeting_waits:
                    yield from self._meet(rank, instruction)
                yield from self._collective(rank, instruction)
            else:
                yield from self._copy(rank, instruction)
            self._record(rank, instruction, start, self.env.now)
            done[instruction.index].succeed()
            if stream is Stream.COMPUTE:
                self._post_receives(rank, instruction.index)

    def _post_receives(self, rank: int, after: int) -> None:
        """Hold the buffers of the gradient receives that follow compute instruction ``after`` in
        program order (see ``_posted_after``), whole even under scatter/gather (the all-gather fills it)."""
        for ins in self._posted_after.get((rank, after), ()):
            held = ins.bytes * (self.program.tp if self.program.p2p_gather_tp else 1)
            self.ledgers[rank].change_buffers(held, self.env.now, ins.label)
            self.grad_buffers[(rank, ins.stage, ins.microbatch)] = held

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
            self.rank_channels[rank].append(channel)
        start = self.env.now
        weight = self.comm.p2p_weight(instruction.bytes)  # its measured time alone, in channel bytes
        cores = cores_taken(phases_cpu_s(self.comm, (("p2p", instruction.bytes),), 2),
                            latency + weight / bandwidth) if self.host_cores else 0.0
        self._moving(rank, +1, cores)
        yield from self._transfer((rank,), latency)
        yield channel.transfer(weight)  # slowed by the channel while the rank computes (_changed)
        self._moving(rank, -1, cores)
        self.arrivals[(instruction.peer, instruction.tag)].succeed(start)

    def _meet(self, rank: int, instruction: Instruction):
        """Wait for the group's expected latest arrival (sim.meeting): this rank's compute that the
        collective follows ended at ``ready``; its peers' ran as long on average, with the variance
        accumulated since the ranks last met. A stream still busy past that point waits no more."""
        computed = [self.ended[(rank, d)] for d in instruction.deps if (rank, d) in self.ended]
        if not computed:
            return
        ready = max(end for end, _ in computed)
        variance = max(var for _, var in computed)
        wait = ready + lateness_s(variance, len(instruction.group)) - self.env.now
        if wait > 0:
            yield self.env.timeout(wait)

    def _collective(self, rank: int, instruction: Instruction):
        """Every member holds its flattened bucket from its arrival; in full mode the collective runs
        once the whole group has arrived, in symmetric mode the identical peers arrive together."""
        ledger = self.ledgers[rank]
        ledger.change_buffers(instruction.bytes, self.env.now, instruction.label)
        sharing = self._groups(instruction.group)
        if instruction.kind is Kind.ALLTOALL:  # sharded embedding rows, ids or gradients (sim.embedding)
            steps = instruction.phases or (("all_to_all", instruction.bytes),)
            duration = exchange_s(self.comm, steps, instruction.group, self.program.alltoall_imbalance, sharing,
                                  ids_request_host_s(self.costs))
        else:
            # A bucket without phases (a Program written by hand) is one all-reduce of its bytes.
            phases = [Phase(kind, nbytes) for kind, nbytes in instruction.phases  # type: ignore[arg-type]
                      ] or [Phase("allreduce", instruction.bytes)]
            duration = phases_s(phases, instruction.group, self.comm, self.comm.cluster.device, instruction.method,
                                sharing)
            steps = tuple((p.kind, p.nbytes) for p in phases)
        cores = cores_taken(phases_cpu_s(self.comm, steps, len(instruction.group)), duration) \
            if self.host_cores else 0.0
        if self.program.symmetric:
            self._moving(rank, +1, cores)
            yield from self._transfer((rank,), duration)
            self._moving(rank, -1, cores)
        else:
            done = self.collective_done[instruction.tag]
            arrived = self.collective_arrivals[instruction.tag]
            arrived.append(rank)
            if len(arrived) == len(instruction.group):  # data moves from the last arrival on
                members = tuple(m for m in instruction.group if m in self.program.ranks)
                for member in members:
                    self._moving(member, +1, cores)

                def move():  # as fast as its slowest member lets it (a ring waits for every hop)
                    yield from self._transfer(members, duration)
                    for member in members:
                        self._moving(member, -1, cores)
                    done.succeed()

                self.env.process(move())
            yield done
        ledger.change_buffers(-instruction.bytes, self.env.now, instruction.label)

    def _moving(self, rank: int, change: int, cores: float = 0.0) -> None:
        self.moving[rank] += change
        self.moving_cores[rank] = self.moving_cores[rank] + change * cores if self.moving[rank] else 0.0
        self._changed(rank)

    def _changed(self, rank: int) -> None:
        """The rank's transfers or computes changed: what is in progress re-times its rest."""
        changed = self.changed.pop(rank, None)
        if changed is not None:
            changed.succeed()
        if self._slows_transfers:
            slowdown = self._transfer_stretch(rank)
            for channel in self.rank_channels[rank]:
                channel.set_slowdown(slowdown)

    def _advance(self, ranks: tuple[int, ...], seconds: float, stretch_of: Callable[[int], float]):
        """Run ``seconds`` of work (of every rank in ``ranks`` at once) at 1 / the largest
        ``stretch_of`` those ranks, re-timed whenever one of them starts or ends a transfer or a
        compute. The one progress loop of the compute and the transfers (sim.host_cpu)."""
        remaining = seconds
        while remaining > 0.0:
            k = max(stretch_of(r) for r in ranks)
            waits = []
            for r in ranks:
                changed = self.changed.get(r)
                if changed is None:
                    changed = self.changed[r] = self.env.event()
                waits.append(changed)
            began = self.env.now
            done = self.env.timeout(remaining * k)
            if done in (yield self.env.any_of([done, *waits])):
                break  # ran to its end (what is left may be below the clock's resolution)
            remaining -= (self.env.now - began) / k

    def _transfer(self, ranks: tuple[int, ...], seconds: float):
        """``seconds`` of a transfer of ``ranks``, slowed while one of them computes (sim.host_cpu)."""
        if self._slows_transfers:
            yield from self._advance(ranks, seconds, self._transfer_stretch)
        else:
            yield self.env.timeout(seconds)

    def _progress(self, rank: int, seconds: float):
        """Run ``seconds`` of compute at full speed, slower while the rank moves data
        (``EngineOptions.overlap_slowdown``, and the shared slowdown on a host whose cores its ranks
        share: ``sim.host_cpu``), which slows the transfers too; the time taken counts as the rank's
        compute (``compute_busy``)."""
        started = self.env.now
        if not self._slows:
            yield self.env.timeout(seconds)
        else:
            self.computing[rank] += 1
            if self._slows_transfers:
                self._changed(rank)
            yield from self._advance((rank,), seconds, self._compute_stretch)
            self.computing[rank] -= 1
            if self._slows_transfers:
                self._changed(rank)
        self.compute_busy[rank] += self.env.now - started

    def _overlap(self, rank: int) -> Stretch:
        return overlap_stretch(self.ranks_on_host, self.host_cores, self.moving_cores[rank],
                               self.options.overlap_slowdown)

    def _compute_stretch(self, rank: int) -> float:
        return self._overlap(rank).compute if self.moving[rank] else 1.0

    def _transfer_stretch(self, rank: int) -> float:
        return self._overlap(rank).transfer if self.computing[rank] and self.moving[rank] else 1.0

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
            # The distributed optimizer steps its 1/dp shard (Program.optimizer_share).
            share = self.program.optimizer_share
            duration = self.costs.optimizer_step_s(instruction.bytes or round(ledger.static["parameters"] * share))
            if not instruction.bytes and self.program.tp > 1:
                # sequence parallelism's partial gradients, summed over the TP group before the step
                group = self._tp_group(rank)
                duration += sequence_parallel_grads_s(
                    [self._layer(layer) for s in self.program.ranks[rank].stages
                     for layer in self.program.stage_layers[s]], self.program.grad_buffer_scale,
                    lambda collective, nbytes: self.comm.collective_s(collective, nbytes, group, self._groups(group)))
            # the optimizer's own copies of the gradients (of its shard), held while it steps (sim.model_state)
            scale = self.program.grad_buffer_scale
            copies = 0 if instruction.bytes else round(
                step_copy_bytes(self.costs, round(ledger.static["gradients"] / scale), scale) * share)
            ledger.change_buffers(copies, self.env.now, instruction.label)
            yield from self._progress(rank, duration)
            ledger.change_buffers(-copies, self.env.now, instruction.label)
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
        self.meet_var[rank] += instruction_variance(kind, layers, whole_backward_in_w)
        if self.options.process_offsets:
            self.meet_offsets[rank] = add_offsets(self.meet_offsets[rank],
                                                  instruction_offsets(kind, layers, whole_backward_in_w))
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
        # An I step alone (split backward) has no weight-gradient GEMM for a backward all-reduce to hide behind.
        with_weight_grads = kind is Kind.BWD or whole_backward_in_w
        # Every backward of a layer but its first of the iteration adds its weight gradients into the
        # earlier micro-batches' (LayerCosts.grad_accumulate_s; 0 unless the cost model prices it).
        accumulates = kind in (Kind.BWD, Kind.BWD_W) and instruction.microbatch > 0
        segments = [
            (phase_time(c) + (c.grad_accumulate_s if accumulates else 0.0),
             self._tp_comm_s(c, rank, backward, with_weight_grads) if with_tp else 0.0, max(c.tp_allreduces, 1))
            for c in layers
        ]
        per_layer = tp_segments_time(segments, self.tp_overlap if with_tp else 0)
        start = self.env.now
        if (kind is Kind.FWD and not self.delta) or kind is Kind.RECOMPUTE:
            ledger.change_activations(self._activation_delta(rank, instruction, layers), start, instruction.label)
        one_layer = 0  # in-backward recompute: the largest single layer's activations, held at once
        if kind is Kind.BWD and in_backward:
            rerun = set(self.recomputed[(rank, instruction.stage, instruction.microbatch)])
            again = tp_segments_time([(c.recompute_s, self._tp_comm_s(c, rank, False) if self.program.tp > 1 else 0.0,
                                       max(c.tp_allreduces, 1)) if layer in rerun else (0.0, 0.0, 1)
                                      for layer, c in zip(instruction.layers, layers, strict=True)],
                                     self.tp_overlap if self.program.tp > 1 else 0)
            per_layer = [a + b for a, b in zip(per_layer, again, strict=True)]
            one_layer = self._extra_in_backward(instruction.stage, rerun)
            self.meet_var[rank] += sum(c.recompute_sd_s ** 2
                                       for layer, c in zip(instruction.layers, layers, strict=True) if layer in rerun)
            if self.options.process_offsets:
                self.meet_offsets[rank] = add_offsets(self.meet_offsets[rank], instruction_offsets(
                    Kind.RECOMPUTE, [c for layer, c in zip(instruction.layers, layers, strict=True) if layer in rerun]))
            ledger.change_activations(one_layer, start, instruction.label)
        if kind is Kind.FWD and self.delta:  # run-time DELTA decides after each layer
            yield from self._delta_forward(rank, instruction, per_layer)
            return
        end = start
        for layer_time in per_layer:  # summed from the start, as the golden predictions were
            end += layer_time
        nominal = end - start
        yield from self._progress(rank, nominal)
        # each layer its share of the time taken (an overlap's slowdown spread evenly)
        self._layer_rows(rank, instruction, start, per_layer, (self.env.now - start) / nominal if nominal else 1.0)
        if kind is Kind.BWD and in_backward:  # what the forward kept, and the one layer re-run last
            kept = self.policy.forward_kept_bytes(instruction.stage, instruction.layers, False, self._layer,
                                                  self.recomputed[(rank, instruction.stage, instruction.microbatch)])
            ledger.change_activations(-(kept + one_layer), self.env.now, instruction.label)
        elif kind is Kind.BWD or kind is Kind.BWD_W:
            ledger.change_activations(-self._stage_activation_bytes(rank, instruction.stage, instruction.microbatch),
                                      self.env.now, instruction.label)
        if kind is Kind.BWD and self.delta:
            self.delta[rank].backward_done((instruction.stage, instruction.microbatch))
        if kind is Kind.BWD or kind is Kind.BWD_I:
            received = self.grad_buffers.pop((rank, instruction.stage, instruction.microbatch), 0)
            ledger.change_buffers(-received, self.env.now, instruction.label)

    def _layer_rows(self, rank: int, instruction: Instruction, start: float, per_layer: list[float],
                    stretch: float, layers: tuple[int, ...] | None = None) -> None:
        """Child rows of ``instruction``'s ``layers`` (default: all), run one after the other from
        ``start``, each ``stretch`` times its nominal time."""
        if not self.options.layer_rows:
            return
        t, in_use = start, self.ledgers[rank].in_use
        for layer_index, layer_time in zip(instruction.layers if layers is None else layers, per_layer, strict=True):
            self.rows.append(Row(rank, instruction.index, instruction.kind.value, instruction.stage,
                                 instruction.microbatch, Stream.COMPUTE.value, t, t + layer_time * stretch, 0,
                                 in_use, instruction.index, layer_index, f"layer {layer_index}"))
            t += layer_time * stretch

    # -- DELTA at run time ------------------------------------------------------------------------
    def _delta_forward(self, rank: int, ins: Instruction, layer_s: list[float]):
        """A forward under run-time DELTA, as exec.interpreter runs it: once a layer has run, its
        saved bytes are counted (where the runtime counts them: ``RuntimeDelta.forward_layer``), its
        tensors' last use is now, and the rank releases while over the activation budget
        (``_release``) at the same instant, so no other stream sees the layer's bytes unreleased."""
        state, ledger = self.delta[rank], self.ledgers[rank]
        key = (ins.stage, ins.microbatch)
        for layer, seconds in zip(ins.layers, layer_s, strict=True):
            began = self.env.now
            yield from self._progress(rank, seconds)  # slowed while the rank moves data, as any compute
            self._layer_rows(rank, ins, began, [seconds], (self.env.now - began) / seconds if seconds else 1.0,
                             (layer,))
            ledger.change_activations(state.layer_start(key, ins.layers), self.env.now, ins.label)
            state.layer_used(key, layer, self.env.now)
            yield from self._release(rank, ins, self._activation_budget[rank])

    def _decide(self, rank: int, ins: Instruction):
        """A decision point (sim.delta_lowering.decision_points), as exec.delta_runtime runs it:
        make room for what comes back (release others while what the rank holds plus what arrives
        is over budget), then ``prefetch`` starts the swap-in of a backward's swapped layers on the
        copy engine, or ``return`` waits for it and re-runs the dropped layers on the compute stream."""
        state, ledger = self.delta[rank], self.ledgers[rank]
        key = (ins.stage, ins.microbatch)
        start = self.env.now
        if key in state.slots:
            slot = state.slots[key]
            rerun = state.claim(key) if ins.tag == "return" else 0
            yield from self._release(rank, ins, ins.bytes, incoming=state.away_bytes(key) + rerun)
            back = state.bring_back(key)
            if back:
                slot.arriving = self._delta_copy(rank, ins, "SWAP_IN", (*key, -1), back)
                if self._copies_block:
                    yield slot.arriving
            if ins.tag == "return":
                if slot.arriving is not None and not slot.arriving.processed:
                    yield slot.arriving
                layers, back = state.recompute(key)
                self.recomputed[(rank, *key)] = layers  # the backward frees what the slot now holds
                ledger.change_activations(back, self.env.now, ins.label)
                # as a RECOMPUTE of these layers: each re-run forward with its TP all-reduces
                tp = self.program.tp > 1
                seconds = tp_segments_time([(self._layer(layer).recompute_s,
                                             self._tp_comm_s(self._layer(layer), rank, False) if tp else 0.0,
                                             max(self._layer(layer).tp_allreduces, 1)) for layer in layers],
                                           self.tp_overlap if tp else 0)
                for layer, duration in zip(layers, seconds, strict=True):
                    began = self.env.now
                    yield from self._progress(rank, duration)
                    self._decision_row(rank, ins, "RECOMPUTE", (*key, layer), began, self.env.now, 0, "compute")
        self.rows.append(Row(rank, ins.index, ins.kind.value, ins.stage, ins.microbatch, ins.stream.value, start,
                             self.env.now, state.resident(), ledger.in_use, name=ins.label))
        self.finished[rank][ins.index].succeed()

    def _release(self, rank: int, ins: Instruction, budget: int, incoming: int = 0):
        """Ask ``sim.delta.choose`` what to release so that what the rank holds, and ``incoming``
        bytes about to arrive, fit: a swap goes out on the copy engine (its bytes leave when the copy
        ends; on a CPU the compute waits for it, as the runtime copies in line), a drop is freed now.
        Each action is a child row of ``ins``."""
        state, ledger = self.delta[rank], self.ledgers[rank]
        settings = replace(self.policy.delta, budget_bytes=budget)
        now = self.env.now
        for victim, action in choose(state.records(now), state.resident() + incoming, now, settings):
            change = state.apply(victim, action)
            if action == "swap":
                copied = self._delta_copy(rank, ins, "SWAP_OUT", victim, -change)
                if self._copies_block:
                    yield copied
            else:
                ledger.change_activations(change, self.env.now, ins.label)
                self._decision_row(rank, ins, "DROP", victim, self.env.now, self.env.now, -change, "compute")

    def _delta_copy(self, rank: int, ins: Instruction, kind: str, victim: tuple[int, int, int],
                    nbytes: int) -> simpy.Event:
        """A decision's copy on the rank's copy engine, in the order decided: a swap-out's bytes leave
        the ledger when it ends, a swap-in's come back when it starts (as ``_copy``), which on one
        copy engine is after every swap-out decided before it."""
        done = self.env.event()
        latency, bandwidth = self.comm.host_copy()

        def run():
            with self.copy_engines[rank].request() as turn:
                yield turn
                began = self.env.now
                if kind == "SWAP_IN":  # on the device from its start (after any swap-out queued before it)
                    self.ledgers[rank].change_activations(nbytes, began, ins.label)
                yield self.env.timeout(latency + nbytes / bandwidth)
            if kind == "SWAP_OUT":
                self.ledgers[rank].change_activations(-nbytes, self.env.now, ins.label)
            self._decision_row(rank, ins, kind, victim, began, self.env.now, nbytes, "copy")
            done.succeed()

        self.env.process(run())
        return done

    def _decision_row(self, rank: int, ins: Instruction, kind: str, victim: tuple[int, int, int], start: float,
                      end: float, nbytes: int, stream: str) -> None:
        s, mb, layer = victim
        self.rows.append(Row(rank, ins.index, kind, s, mb, stream, start, end, nbytes, self.ledgers[rank].in_use,
                             ins.index, layer, decision_name(kind, s, mb, layer)))

    def _tp_comm_s(self, c: LayerCosts, rank: int, backward: bool, with_weight_grads: bool = True) -> float:
        if c.tp_allreduces == 0:
            return 0.0
        group = self._tp_group(rank)
        return tp_comm_s(c, backward, lambda collective, nbytes: self.comm.collective_s(collective, nbytes, group,
                                                                                         self._groups(group)),
                         with_weight_grads)

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

    def _extra_in_backward(self, stage: int, rerun: set[int]) -> int:
        """sim.memory.in_backward_extra_bytes for ``stage``, once per re-run set (it walks the stage's
        layers for every layer; every micro-batch's backward of a stage usually re-runs the same ones)."""
        key = (stage, frozenset(rerun))
        if key not in self._in_backward_extra:
            self._in_backward_extra[key] = in_backward_extra_bytes(self.program.stage_layers[stage], rerun, self._layer)
        return self._in_backward_extra[key]

    def _activation_delta(self, rank: int, instruction: Instruction, layers: list[LayerCosts]) -> int:
        if instruction.kind is Kind.RECOMPUTE:
            # The checkpointed layers' activations come back: what the stage holds with every layer
            # saved, less what the checkpointed forward kept.
            stage = instruction.stage
            return self._stage_activation_bytes(rank, stage, instruction.microbatch) - self.policy.forward_kept_bytes(
                stage, self.program.stage_layers[stage], False, self._layer, instruction.layers)
        return self.policy.forward_kept_bytes(instruction.stage, instruction.layers, instruction.save, self._layer,
                                              self.recomputed.get((rank, instruction.stage, instruction.microbatch)))
