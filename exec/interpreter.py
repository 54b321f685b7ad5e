"""The per-rank interpreter: runs this rank's part of a Program with real tensors (``RankRuntime``).

Every rank builds only its pipeline stages (``Workload.build_layers`` seeds each layer, so any
partition holds the whole model's weights), shards transformer blocks over its TP group
(``exec.parallel.tp``), and executes ``compile_plan(plan, ...).program.ranks[rank]`` (the very Program the
simulator interprets) instruction by instruction, in program order, one handler per kind:

- FWD: a forward with ``save=False`` runs the stage's recompute layers (any subset of the stage,
  ``policy.recompute_layers``) under ``no_grad``, each one keeping its input (per-layer
  checkpointing), the rest with grad. RECOMPUTE re-runs them with grad. The last stage adds the
  loss / micro-batches (recomputed with its last layer when that one is checkpointed).
- BWD: full backward. BWD_I: input gradient only (``autograd.grad`` with ``retain_graph``),
  capturing the gradients of the outputs of every parameter-holding module; BWD_W: the weight
  gradients from those captured gradients (each module's own small backward).
- SEND_* / RECV_*: ``isend`` / ``irecv`` (tagged, so gloo matches them exactly); a receive is
  posted when reached and waited on by the instruction that depends on it. With
  ``schedule.p2p_scatter_gather`` and tp > 1 (Megatron-LM's default, megatron/p2p_communication.py
  at v2.5: split_tensor_into_1d_equal_chunks, gather_split_1d_tensor) each TP rank sends its 1/tp
  slice of the flattened tensor to the same TP rank of the peer stage, and the receiver all-gathers
  the slices over its TP group when the receive is waited on. That all-gather is a TP-group
  collective, so such receives are finished only by the instruction that needs them (program
  order, the same on every TP rank of a stage), never early by the completion poll.
- SWAP_OUT / SWAP_IN: the saved activations of (stage, micro-batch) live in a store behind
  ``saved_tensors_hooks`` (``exec.activations``); swapping moves a fraction of them, or those of
  the policy's swapped layers, to host memory and back.
- ALLREDUCE: an asynchronous bucket all-reduce over the data-parallel group (``exec.parallel.dp``);
  under the distributed optimizer a bucket's reduce-scatter, or the parameter all-gather after the
  step (``exec.distributed_optimizer``); a tied embedding's gradient summed between the first and the
  last stage (``sim.tied_embedding``).
- ALLTOALL: a sharded embedding table's ids, rows or row gradients to their owners (``exec.embedding``).
- OPTIMIZER_STEP: Adam.

Every instruction is timed against a clock shared by the ranks (``exec.clock``: a barrier, then
offsets from ``perf_counter``; CUDA events on GPUs). ``run_iteration`` returns one iteration's
rows, losses and memory; ``exec.rank`` writes them down.
"""

from __future__ import annotations

import contextlib
import socket
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from exec.activations import RngState, Run, SavedStore, Segment, Slot, runs_of, storage_key, unique_bytes
from exec.clock import Clock, Pending
from exec.contract import ExecutablePlan, batch_seed, make_optimizer
from exec.delta_runtime import RuntimeDelta
from exec.distributed_optimizer import DistributedOptimizer
from exec.embedding import EMBEDDING_RUNTIMES, is_sharded
from exec.faults import Fault
from exec.gradient_sync import REDUCERS
from exec.host_memory import thread_faults
from exec.main_grad import MainGrads, accumulate_main
from exec.parallel.sequence import SEQUENCE_RNG_SEED, SequenceParallelRng, allreduce_sequence_parallel_grads
from exec.parallel.tp import apply_tensor_parallel
from exec.selective import checkpoint_attention_cores
from exec.structure import inverse_order, torch_dtype
from sim.gradient_sync import GRADIENT_SYNC
from sim.lower import MemoryPolicy
from sim.program import Instruction, Kind, RankProgram
from sim.tied_embedding import TIED_TAG
from traces.errors import ConfigError

_P2P = frozenset({Kind.SEND_ACT, Kind.SEND_GRAD, Kind.RECV_ACT, Kind.RECV_GRAD})


class RankRuntime:
    def __init__(self, run: ExecutablePlan, rank: int, device: torch.device,
                 tp_group: object = None, dp_group: object = None, tied_group: object = None) -> None:
        self.plan, self.workload, self.rank, self.device = run.plan, run.workload, rank, device
        self.program: RankProgram = run.program.ranks[rank]
        self.program_gathers = run.program.p2p_gather_tp
        self.policy: MemoryPolicy = run.resolved.policy
        self.stage_layers = run.program.stage_layers
        self.num_stages = len(self.stage_layers)
        self.coords = self.program.coords
        self.tp_group, self.dp_group = tp_group, dp_group
        self.tied_group = tied_group  # this rank's first/last-stage pair of a tied embedding (sim.tied_embedding)
        self.dtype = torch_dtype(self.plan.dtype)
        self.clock = Clock(device)
        # Completion watchers of asynchronous instructions (CPU only, see Pending).
        self.watchers = ThreadPoolExecutor(max_workers=32, thread_name_prefix="paratwin-watch") \
            if device.type != "cuda" else None
        self.fault = Fault.from_env()
        self.structure = run.structure

        # The sequence-parallel region's dropout draws from a per-TP-rank generator (Megatron-LM's
        # model-parallel RNG): its shards' masks differ (exec.parallel.sequence.SequenceParallelRng).
        self.sequence_rng = SequenceParallelRng(SEQUENCE_RNG_SEED, self.coords.tp, device) \
            if self.workload.sequence_parallel and self.workload.stochastic and self.plan.tp > 1 else None
        # This rank's stages, built from the seeded full weights, then TP-sharded.
        self.stages: dict[int, nn.ModuleList] = {}
        self.layer_modules: dict[int, nn.Module] = {}
        for s in self.program.stages:
            layers = self.stage_layers[s]
            modules = self.workload.build_layers(layers[0], layers[-1] + 1, device=device, dtype=self.dtype)
            apply_tensor_parallel(modules, self.coords.tp, self.plan.tp, tp_group,
                                  sequence_parallel=self.workload.sequence_parallel, rng=self.sequence_rng)
            modules.train()
            if self.policy.view == "selective-attention":  # the attention cores keep nothing (exec.selective)
                checkpoint_attention_cores(modules)
            self.stages[s] = modules
            self.layer_modules.update(zip(layers, modules, strict=True))
        # Sharded embedding tables (exec.embedding) replace their dense modules before anything
        # collects parameters; they keep their own optimizer.
        runtime = EMBEDDING_RUNTIMES.get(self.plan.embedding.method)
        self.embedding = runtime(self) if runtime is not None else None
        # What a checkpointed forward of (stage, micro-batch) leaves to its RECOMPUTE: that
        # instruction's layers (a per-micro-batch memory policy, DELTA, chooses them per micro-batch).
        self.recomputed = {(i.stage, i.microbatch): set(i.layers) for i in self.program.instructions
                           if i.kind is Kind.RECOMPUTE}
        # DELTA deciding at run time (exec.delta_runtime): every layer runs as a segment of its own,
        # so any one can be dropped after its forward and re-run from its input.
        self.delta = RuntimeDelta(self) if self.policy.delta is not None and self.policy.delta.decide == "runtime" \
            else None
        self.costs, self.micro_batch_tp = run.resolved.costs, (self.plan.micro_batch, self.plan.tp)
        self.params = [p for s in self.program.stages for p in self.stages[s].parameters()]
        # The distributed optimizer (exec.distributed_optimizer) moves each bucket's parameters into
        # one flat buffer: before anything records where parameters live.
        self.distributed = DistributedOptimizer(
            self.program, self._bucket_params, dp_group, self.plan.dp, self.coords.dp, self.plan.gradient_sync) \
            if self.plan.dp > 1 and GRADIENT_SYNC[self.plan.gradient_sync.method].shards_optimizer else None
        self.param_storages = {storage_key(p) for p in self.params}
        # Every SavedStore still alive (weakly held): what they hold at an iteration's end is
        # the per-rank record ``saved_bytes`` (0 unless a store outlives its backward).
        self.stores: weakref.WeakSet[SavedStore] = weakref.WeakSet()
        self.optimizer = self.distributed or make_optimizer([p for p in self.params if not is_sharded(p)])
        # Parameters that saw only this rank's sequence shard (exec.parallel.sequence): their gradients
        # are summed over the TP group before the step.
        self.sequence_parallel_params = [p for p in self.params if getattr(p, "sequence_parallel", False)]
        # fp32 main-grad buffers where the Program holds gradients in fp32 (exec.main_grad)
        self.main_grads = MainGrads([p for p in self.params if not is_sharded(p)]) \
            if run.program.grad_buffer_scale > 1 else None
        self.gradient_bytes = 0  # gradient buffers held at the last optimizer step
        self.optimizer_bytes = 0  # the optimizer's state after the last step (its moments: _optimizer_bytes)

        # Split backward needs the outputs of every parameter-holding module (see _backward_input).
        self.split = any(i.kind is Kind.BWD_I for i in self.program.instructions)
        self._capture: list[tuple[nn.Module, list[torch.Tensor]]] | None = None
        if self.split:
            for modules in self.stages.values():
                for module in modules.modules():
                    if any(True for _ in module.parameters(recurse=False)):
                        module.register_forward_hook(self._capture_hook)

        # Heartbeat state, read by the heartbeat thread.
        self.iteration = -1
        self.current: Instruction | None = None
        self.done_count = 0
        self.since = time.time()

    # -- helpers ---------------------------------------------------------------------------------
    def _capture_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._capture is None or not torch.is_grad_enabled():
            return
        outs = [output] if isinstance(output, torch.Tensor) else list(output)
        outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        if outs:
            self._capture.append((module, outs))

    @contextlib.contextmanager
    def _capturing(self, captures: list) -> Iterator[None]:
        self._capture = captures if self.split else None
        try:
            yield
        finally:
            self._capture = None

    @contextlib.contextmanager
    def _recording(self, slot: Slot, captures: list) -> Iterator[None]:
        with self._capturing(captures), slot.store.hooks():
            yield

    def _batch(self, mb: int) -> Any:
        key = (self.iteration, mb)
        if key not in self._batches:
            seed = batch_seed(self.iteration, self.coords.dp, mb, self.plan.dp, self.plan.microbatches)
            self._batches[key] = self.workload.make_batch(self.plan.micro_batch, seed=seed,
                                                          device=self.device)
        return self._batches[key]

    def _shape(self, layer: int) -> tuple[tuple[int, ...], torch.dtype]:
        return self.structure.output_shape(layer)

    def _tag(self, tag: str) -> int:
        kind, stage, mb = tag.split(":")
        return ((0 if kind == "act" else 1) * self.num_stages + int(stage)) * self.plan.microbatches + int(mb)

    def _memory(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self.static_bytes + self._gradient_bytes() + self.activation_bytes + self.buffer_bytes

    def _track(self, slot: Slot) -> None:
        """Recount what ``slot`` keeps alive on the device."""
        tensors = [*slot.kept_inputs(), *slot.store.device_tensors()]
        now = unique_bytes(tensors)
        self.activation_bytes += now - slot.resident
        slot.resident = now
        self.activation_peak = max(self.activation_peak, self.activation_bytes)

    def saved_bytes(self) -> int:
        """Bytes of saved-for-backward tensors (device or host) still held by any live store."""
        return unique_bytes([t for store in list(self.stores) for t in store.all_tensors()])

    def _free(self, key: tuple[int, int]) -> None:
        slot = self.slots.pop(key)
        self.activation_bytes -= slot.resident
        slot.store.release()

    # -- one iteration ---------------------------------------------------------------------------
    def run_iteration(self, iteration: int) -> dict:
        self.iteration = iteration
        self._batches: dict[tuple[int, int], Any] = {}
        self.slots: dict[tuple[int, int], Slot] = {}
        self.acts: dict[tuple[int, int], Any] = {}  # activation entering (stage, mb)
        self.grads: dict[tuple[int, int], Any] = {}  # gradient of (stage, mb)'s output
        self.pending: dict[int, Pending] = {}
        self.gathered: set[int] = set()  # scatter/gather receives: finished by their consumer only
        self.rows: list[dict] = []
        self.losses: list[float] = []
        self.loss_tensors: list[torch.Tensor] = []
        self.optimizer.zero_grad(set_to_none=True)
        if self.main_grads is not None:
            self.main_grads.zero()
        if self.embedding is not None:
            self.embedding.start_iteration(iteration)
        if self.delta is not None:
            self.delta.start_iteration()
        self.static_bytes = self._static_bytes()
        self.activation_bytes = self.buffer_bytes = 0
        self.activation_peak = 0  # the most bytes the slots held at once (compare: MemoryLedger.activation_peak)
        self.peak = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

        dist.barrier()
        t0_wall = time.time()
        self.clock.start()
        for instruction in self.program.instructions:
            self.current, self.since = instruction, time.time()
            if self.fault is not None:
                self.fault.before(self.rank, iteration, instruction)
            for dep in instruction.deps:
                self._finish(dep)
            self._execute(instruction)
            self._poll()
            self.done_count += 1
        for index in list(self.pending):
            self._finish(index)
        end = self.clock.mark()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        for row in self.rows:
            row["start_s"] = self.clock.seconds(row["start_s"])
            row["end_s"] = self.clock.seconds(row["end_s"])
        self.losses = [float(t) * self.plan.microbatches for t in self.loss_tensors]
        self.current = None
        return {"rank": self.rank, "iteration": iteration, "t0_wall": t0_wall, "t0_mono": self.clock.t0,
                "host": socket.gethostname(),
                "iteration_s": self.clock.seconds(end), "rows": self.rows, "losses": self.losses,
                "peak_memory": self.peak, "saved_bytes": self.saved_bytes(), "activation_peak": self.activation_peak,
                "gradient_bytes": self.gradient_bytes, "optimizer_bytes": self.optimizer_bytes}

    def _row(self, instruction: Instruction, start: Any, end: Any, nbytes: int, faults: int = -1) -> None:
        memory = self._memory()
        self.peak = max(self.peak, memory)
        self.rows.append({
            "rank": self.rank, "index": instruction.index, "kind": instruction.kind.value,
            "stage": instruction.stage, "microbatch": instruction.microbatch,
            "stream": instruction.stream.value, "start_s": start, "end_s": end, "bytes": nbytes,
            "mem_after": memory, "parent": -1, "layer": -1, "name": instruction.label,
            "iteration": self.iteration,
            # this thread's minor page faults during a compute instruction (-1: not a compute one, or
            # not countable here): memory the kernel handed out afresh (exec.host_memory)
            "minor_faults": faults,
        })

    # The handler of every instruction kind (tests/test_engines_agree.py: every Kind has one).
    HANDLERS: dict[Kind, str] = {
        Kind.FWD: "_forward", Kind.RECOMPUTE: "_recompute", Kind.BWD: "_backward",
        Kind.BWD_I: "_backward_input", Kind.BWD_W: "_backward_weight", Kind.OPTIMIZER_STEP: "_step",
        Kind.SEND_ACT: "_send", Kind.SEND_GRAD: "_send", Kind.RECV_ACT: "_recv", Kind.RECV_GRAD: "_recv",
        Kind.ALLREDUCE: "_allreduce", Kind.ALLTOALL: "_alltoall", Kind.SWAP_OUT: "_swap_out", Kind.SWAP_IN: "_swap_in",
        Kind.DECIDE: "_decide",
    }

    def _execute(self, ins: Instruction) -> None:
        handler = getattr(self, self.HANDLERS[ins.kind])
        if ins.kind.is_compute:
            faults = thread_faults()
            start = self.clock.mark()
            handler(ins)
            end = self.clock.mark()
            # the instruction's own size, as the simulator's row records it (an optimizer step's
            # parameter bytes, a DECIDE's budget; zero for the passes)
            self._row(ins, start, end, ins.bytes, thread_faults() - faults if faults >= 0 else -1)
        else:
            handler(ins)

    # -- asynchronous instructions ---------------------------------------------------------------
    def _launch(self, ins: Instruction, start: Any, work: Any, nbytes: int,
                tensor: torch.Tensor | None = None, then: Any = None) -> Pending:
        pending = Pending(ins, start, work, nbytes, tensor, then, self.clock, self.watchers)
        self.pending[ins.index] = pending
        if ins.kind in _P2P:
            self.buffer_bytes += nbytes
        return pending

    def _finish(self, index: int) -> None:
        pending = self.pending.pop(index, None)
        if pending is None:
            return
        end = pending.finish()
        if pending.instruction.kind in _P2P:
            self.buffer_bytes -= pending.nbytes
        self._row(pending.instruction, pending.start, end, pending.nbytes)

    def _poll(self) -> None:
        """Retire every asynchronous instruction whose watcher has seen it complete (a scatter/gather
        receive waits for its consumer: its all-gather must run in program order)."""
        for index in [i for i, p in self.pending.items() if i not in self.gathered
                      and (p.work is None or (p.future is not None and p.future.done()))]:
            self._finish(index)

    def _scatter_gather(self) -> bool:
        return self.program_gathers  # sim.lower.p2p_gather_tp: not under sequence parallelism

    def _slice(self, flat: torch.Tensor) -> torch.Tensor:
        """This TP rank's 1/tp of a flattened tensor (Megatron's split_tensor_into_1d_equal_chunks)."""
        if flat.numel() % self.plan.tp:
            raise ConfigError("schedule.p2p_scatter_gather", f"a {flat.numel()}-element stage boundary tensor "
                              f"does not split into {self.plan.tp} equal slices",
                              "use a TP degree that divides micro_batch x seq x hidden, or turn it off")
        n = flat.numel() // self.plan.tp
        return flat[self.coords.tp * n:(self.coords.tp + 1) * n]

    def _send(self, ins: Instruction) -> None:
        store = self.acts if ins.kind is Kind.SEND_ACT else self.grads
        kind, stage, mb = ins.tag.split(":")
        tensor = store.pop((int(stage), int(mb)))
        if kind == "act":  # stage's input, in its storage's order, so the receiver gets that layout (_recv)
            tensor = tensor.permute(self.structure.output_order(self.stage_layers[int(stage)][0] - 1))
        tensor = tensor.contiguous()
        if self._scatter_gather():
            tensor = self._slice(tensor.reshape(-1)).clone()
        start = self.clock.mark()
        work = dist.isend(tensor, dst=ins.peer, tag=self._tag(ins.tag))
        self._launch(ins, start, work, tensor.numel() * tensor.element_size(), tensor)

    def _recv(self, ins: Instruction) -> None:
        kind, stage, mb = ins.tag.split(":")
        s, m = int(stage), int(mb)
        # An activation entering stage s is the output of the layer before it; a gradient of
        # stage s's output has the shape of its last layer's output.
        layer = self.stage_layers[s][0] - 1 if kind == "act" else self.stage_layers[s][-1]
        shape, dtype = self._shape(layer)
        # An activation arrives in the layout its layer made it (_send), as in one process: a layer
        # that saves its input as it is handed over (a batch-first LSTM handed the previous LSTM's
        # time-major output) saves the received tensor, not a copy of it (docs/memory.md).
        order = self.structure.output_order(layer) if kind == "act" else tuple(range(len(shape)))
        buffer = torch.empty([shape[d] for d in order], dtype=dtype, device=self.device)
        start = self.clock.mark()
        (self.acts if kind == "act" else self.grads)[(s, m)] = buffer.permute(inverse_order(order))
        if self._scatter_gather():
            flat = buffer.view(-1)
            part = torch.empty_like(self._slice(flat))
            work = dist.irecv(part, src=ins.peer, tag=self._tag(ins.tag))
            slices = list(flat.chunk(self.plan.tp))

            def gather() -> None:  # the whole tensor from the TP group's slices, into the buffer's storage
                dist.all_gather(slices, part, group=self.tp_group)

            self.gathered.add(ins.index)
            self._launch(ins, start, work, part.numel() * part.element_size(), part, then=gather)
            return
        work = dist.irecv(buffer, src=ins.peer, tag=self._tag(ins.tag))
        self._launch(ins, start, work, buffer.numel() * buffer.element_size(), buffer)

    def _bucket_params(self, layers: tuple[int, ...]) -> list[nn.Parameter]:
        return [p for layer in layers for p in self.layer_modules[layer].parameters() if not is_sharded(p)]

    def _allreduce(self, ins: Instruction) -> None:
        start = self.clock.mark()
        if ins.tag.startswith(TIED_TAG):  # the tied embedding's gradient, summed with the other stage's copy
            weight = self.workload.tied_weight(self.layer_modules[ins.layers[0]])
            grad = getattr(weight, "main_grad", None)
            if grad is None:
                weight.grad = grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
            work = dist.all_reduce(grad, group=self.tied_group, async_op=True)
            self._launch(ins, start, work, grad.numel() * grad.element_size())
            return
        if self.distributed is not None:  # a bucket's reduce-scatter, or the parameter all-gather after the step
            work, nbytes, then = self.distributed.execute(ins)
            self._launch(ins, start, work, nbytes, then=then)
            return
        params = self._bucket_params(ins.layers)
        bucket = REDUCERS[ins.method](params, self.dp_group, self.plan.dp, self.plan.gradient_sync)
        self._launch(ins, start, bucket.work, bucket.nbytes, then=bucket.wait)

    def _alltoall(self, ins: Instruction) -> None:
        start = self.clock.mark()
        work, nbytes, then = self.embedding.execute(ins)
        self._launch(ins, start, work, nbytes, then=then)

    def _swap_out(self, ins: Instruction) -> None:
        """Move the chosen saved tensors to host memory (``move_out``)."""
        slot = self.slots[(ins.stage, ins.microbatch)]
        start = self.clock.mark()
        moved, _ = self.move_out(slot.store, self._to_swap(slot, ins))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._track(slot)
        self._launch(ins, start, None, moved)

    def move_out(self, store: SavedStore, groups: list[list[int]],
                 stream: Any = None) -> tuple[int, list[torch.UntypedStorage]]:
        """Copy each group of store positions (the views of one storage) to one host buffer, one copy
        per storage: views sharing a storage (q, k and v of one QKV output; a tensor two operators
        save) are rebuilt on the host copy, so the bytes moved are the storages' (what the cost model
        counts) and moving back restores one storage, not a copy per view. On CUDA into pinned
        memory, on ``stream`` when given (after the compute stream's work); returns the bytes moved
        and the device storages, which the caller keeps until the copy is done."""
        cuda = self.device.type == "cuda"
        moved, sources = 0, []
        with _on_copy_stream(stream, self.device):
            for positions in groups:
                source = store.tensors[positions[0]].untyped_storage()
                host = torch.empty(source.nbytes(), dtype=torch.uint8, pin_memory=cuda).untyped_storage()
                host.copy_(source, non_blocking=cuda)
                for position in positions:
                    store.host[position] = _on_storage(host, store.tensors[position])
                    store.tensors[position] = store.host[position]  # the device copy is released
                moved += source.nbytes()
                sources.append(source)
        return moved, sources

    def _to_swap(self, slot: Slot, ins: Instruction) -> list[list[int]]:
        """Positions in the store to move to host, grouped by the storage they share: the storages
        saved by the instruction's layers (a per-layer policy names them), or the first ones up to
        the policy's fraction of the swappable bytes; never a kept input (the slot holds it on the
        device for the backward, so the lowering does not count it either)."""
        store = slot.store
        keep = {storage_key(t) for t in slot.kept_inputs()}
        groups: dict[int, list[int]] = {}
        for p, t in enumerate(store.tensors):
            if p not in store.host and storage_key(t) not in keep:
                groups.setdefault(storage_key(t), []).append(p)
        if ins.layers:
            chosen = set(ins.layers)
            return [g for g in groups.values() if any(store.layers[p] in chosen for p in g)]
        size = {key: store.tensors[g[0]].untyped_storage().nbytes() for key, g in groups.items()}
        target = self.policy.swap_fraction[ins.stage] * sum(size.values())
        picked, moved = [], 0
        for key, g in groups.items():
            if moved >= target:
                break
            picked.append(g)
            moved += size[key]
        return picked

    def _swap_in(self, ins: Instruction) -> None:
        slot = self.slots[(ins.stage, ins.microbatch)]
        start = self.clock.mark()
        moved = self.move_in(slot.store)
        self._track(slot)
        self._launch(ins, start, None, moved)

    def move_in(self, store: SavedStore, stream: Any = None) -> int:
        """Bring every host copy of ``store`` back to the device, one device storage per host one
        (on CUDA on ``stream`` when given: the caller orders the compute stream after it)."""
        cuda = self.device.type == "cuda"
        moved = 0
        groups: dict[int, list[int]] = {}
        for position, host in store.host.items():
            groups.setdefault(storage_key(host), []).append(position)
        compute = torch.cuda.current_stream(self.device) if stream is not None else None
        with _on_copy_stream(stream, self.device):
            for positions in groups.values():
                source = store.host[positions[0]].untyped_storage()
                device = torch.empty(source.nbytes(), dtype=torch.uint8, device=self.device)
                if compute is not None:  # allocated on the copy stream, used on the compute stream
                    device.record_stream(compute)
                device = device.untyped_storage()
                device.copy_(source, non_blocking=cuda)
                for position in positions:
                    store.tensors[position] = _on_storage(device, store.host[position])
                moved += source.nbytes()
        store.host.clear()
        return moved

    def _decide(self, ins: Instruction) -> None:
        """A run-time memory decision point (exec.delta_runtime); its row's bytes are the activation
        bytes held after it, its actions are child rows."""
        assert self.delta is not None, "a DECIDE instruction needs memory.decide: runtime"
        start = self.clock.mark()
        held = self.delta.decide(ins)
        self._row(ins, start, self.clock.mark(), held)

    def layer_recompute_s(self, layer: int) -> float:
        micro_batch, tp = self.micro_batch_tp
        return self.policy.layer_view(self.costs.layer_costs(layer, micro_batch, tp)).recompute_s

    # -- compute ---------------------------------------------------------------------------------
    def _stage_input(self, s: int, mb: int) -> torch.Tensor:
        if s == 0:
            return self._batch(mb).inputs
        x = self.acts.pop((s, mb)).detach()
        return x.requires_grad_(x.is_floating_point())

    def _forward(self, ins: Instruction) -> None:
        s, mb = ins.stage, ins.microbatch
        x = self._stage_input(s, mb)
        if self.embedding is not None:  # its tables read the rows this micro-batch's lookup brought
            self.embedding.enter(self.iteration, mb)
        slot = Slot(inp=x, store=SavedStore(self.param_storages))
        self.stores.add(slot.store)
        self.slots[(s, mb)] = slot
        last_stage = s == self.num_stages - 1
        recomputed = set() if ins.save else self.recomputed[(s, mb)]
        layers = self.stage_layers[s]
        # DELTA at run time may drop any layer after the forward: each layer is a segment of its own.
        runs = [(p, p + 1, False) for p in range(len(layers))] if self.delta is not None \
            else runs_of([layer in recomputed for layer in layers])
        h = x
        with slot.store.hooks():
            for start, end, checkpointed in runs:
                slot.saved_at.append(len(slot.store.tensors))
                inp = h if h is x else h.detach().requires_grad_(h.is_floating_point())
                if checkpointed:  # keep only the run's input (a leaf); RECOMPUTE fills its segment
                    rng = RngState.take(self.device, self.sequence_rng) if self.workload.stochastic else None
                    with torch.no_grad():
                        out = self._walk(slot, s, start, end, inp)
                    slot.checkpointed.append(Run(start, end, inp, len(slot.segments), rng=rng))
                    slot.segments.append(None)
                    h = out.detach().requires_grad_(out.is_floating_point())
                else:
                    if self.delta is None:  # consecutive kept layers: one graph from the run's input
                        inp = h
                    captures: list = []
                    # DELTA may drop this layer and re-run it: the re-run draws the forward's masks
                    rng = RngState.take(self.device, self.sequence_rng) \
                        if self.delta is not None and self.workload.stochastic else None
                    with self._capturing(captures):
                        out = self._walk(slot, s, start, end, inp)
                    slot.segments.append(Segment(inp, out, captures, rng=rng))
                    h = out
                    if self.delta is not None:  # the last stage's last layer releases once its loss is on
                        self.delta.forward_layer(ins, layers[start], release=not (last_stage and end == len(layers)))
            if last_stage:
                last = slot.segments[-1]
                # A checkpointed last layer keeps only its input: its loss, too, waits for the RECOMPUTE.
                with torch.no_grad() if last is None else contextlib.nullcontext():
                    loss = self._loss(h, mb)
                self.loss_tensors.append(loss.detach())
                if last is None:
                    slot.checkpointed[-1].loss = True
                else:
                    last.out = loss
                h = loss
        if s < self.num_stages - 1:
            self.acts[(s + 1, mb)] = h.detach()
        self._track(slot)
        if self.delta is not None and last_stage:
            self.delta.release(ins)

    def _loss(self, h: torch.Tensor, mb: int) -> torch.Tensor:
        return self.workload.loss(h, self._batch(mb).targets) / self.plan.microbatches

    def _walk(self, slot: Slot, s: int, start: int, end: int, h: torch.Tensor) -> torch.Tensor:
        """Layers ``start:end`` of stage ``s``, tagging what each saves with its layer index; under
        the selective policy each layer runs in torch's selective checkpointing (exec.selective)."""
        selective = self.policy.selective and torch.is_grad_enabled()
        for position in range(start, end):
            slot.store.layer = self.stage_layers[s][position]
            layer = self.stages[s][position]
            h = slot.store.selective.run(layer, h) if selective else layer(h)
        return h

    def _recompute(self, ins: Instruction) -> None:
        if self.policy.recompute_in_backward:
            return  # a marker: the backward re-runs each checkpointed layer just before its own backward
        s, mb = ins.stage, ins.microbatch
        slot = self.slots[(s, mb)]
        if self.embedding is not None:  # the recomputed tables read this micro-batch's rows again
            self.embedding.enter(self.iteration, mb)
        for run in slot.checkpointed:
            self._rerun(slot, s, run, mb)
        self._track(slot)

    def _rerun(self, slot: Slot, s: int, run: Run, mb: int) -> None:
        """Re-run a checkpointed layer with grad (and the loss after it, where it is the last stage's
        last layer): its segment of the stage's graph."""
        captures: list = []
        replay = run.rng.replayed(self.device) if run.rng is not None else contextlib.nullcontext()
        with self._recording(slot, captures), torch.enable_grad(), replay:
            out = self._walk(slot, s, run.start, run.end, run.inp)
            if run.loss:
                out = self._loss(out, mb)
        slot.segments[run.segment] = Segment(run.inp, out, captures)

    def _grad_in(self, s: int, mb: int) -> torch.Tensor | None:
        return None if s == self.num_stages - 1 else self.grads.pop((s, mb))

    def _hand_back(self, s: int, mb: int, grad: torch.Tensor | None) -> None:
        if s > 0:
            if grad is None:
                raise RuntimeError(f"stage {s} micro-batch {mb}: no gradient reached the stage input")
            self.grads[(s - 1, mb)] = grad

    def _check_recomputed(self, slot: Slot, s: int, mb: int) -> None:
        if any(seg is None for seg in slot.segments):
            raise RuntimeError(f"stage {s} micro-batch {mb}: backward of a checkpointed forward "
                               "before its RECOMPUTE")

    def _backward(self, ins: Instruction) -> None:
        s, mb = ins.stage, ins.microbatch
        slot = self.slots[(s, mb)]
        in_backward = self.policy.recompute_in_backward
        if not in_backward:
            self._check_recomputed(slot, s, mb)
        runs = {run.segment: run for run in slot.checkpointed}
        if in_backward and runs and self.embedding is not None:  # re-run tables read this micro-batch's rows
            self.embedding.enter(self.iteration, mb)
        grad = self._grad_in(s, mb)
        slot.store.releasing = True  # this backward frees its graph: let autograd free what it saved
        for position in reversed(range(len(slot.segments))):
            if slot.segments[position] is None and in_backward:
                # One layer at a time: its activations live only until its own backward is done.
                self._rerun(slot, s, runs[position], mb)
                self._track(slot)
            seg = slot.segments[position]
            assert seg is not None
            if seg.identity:
                continue
            torch.autograd.backward(seg.out, grad)
            grad = seg.inp.grad if seg.inp.requires_grad else None
            if in_backward:  # this segment's saved tensors (and any re-run's, stored after) are spent
                del slot.store.tensors[slot.saved_at[position]:], slot.store.layers[slot.saved_at[position]:]
                self._track(slot)
        self._hand_back(s, mb, grad)
        self._free((s, mb))
        if self.delta is not None:
            self.delta.backward_done(s, mb)

    def _backward_input(self, ins: Instruction) -> None:
        """Input gradient only; keeps the graph and the gradients every weight gradient needs:
        those of the outputs of each parameter-holding module on the way (their own backward
        then needs nothing else, so BWD_W does not repeat the input-gradient work)."""
        s, mb = ins.stage, ins.microbatch
        slot = self.slots[(s, mb)]
        self._check_recomputed(slot, s, mb)
        grad = self._grad_in(s, mb)
        for seg in reversed(slot.segments):
            seg.grad_out = grad
            if seg.identity:
                continue
            if not seg.inp.requires_grad:
                seg.deferred, grad = True, None
                continue
            handles = []
            for _, outs in seg.captures:
                for t in outs:
                    handles.append(t.register_hook(
                        lambda g, key=id(t), store=seg.captured_grads: store.__setitem__(key, g)))
            try:
                (grad,) = torch.autograd.grad(seg.out, seg.inp, grad, retain_graph=True)
            finally:
                for h in handles:
                    h.remove()
        self._hand_back(s, mb, grad)

    def _backward_weight(self, ins: Instruction) -> None:
        s, mb = ins.stage, ins.microbatch
        slot = self.slots[(s, mb)]
        for seg in slot.segments:
            if seg.identity:
                continue
            if seg.deferred:
                torch.autograd.backward(seg.out, seg.grad_out)
                continue
            missed: list[nn.Parameter] = []
            for module, outs in seg.captures:
                params = [p for p in module.parameters(recurse=False) if p.requires_grad]
                fired = [(t, seg.captured_grads[id(t)]) for t in outs if id(t) in seg.captured_grads]
                if not fired:
                    missed += params  # not on the path to the input: from the segment output below
                    continue
                weights = torch.autograd.grad([t for t, _ in fired], params, [g for _, g in fired],
                                              retain_graph=True, allow_unused=True)
                _accumulate(params, weights)
            if missed:
                _accumulate(missed, torch.autograd.grad(seg.out, missed, seg.grad_out, retain_graph=True,
                                                        allow_unused=True))
        self._free((s, mb))

    def _step(self, ins: Instruction) -> None:
        if ins.method:  # a sharded embedding's own step (sim.embedding_embrace, 2D schedule)
            self.embedding.step()
        else:
            self.gradient_bytes = self._gradient_bytes()
            if self.distributed is not None:  # on the gradients it reduce-scattered (the owned chunk's sum)
                self.distributed.sum_sequence_parallel(self.tp_group)
            else:
                allreduce_sequence_parallel_grads(self.sequence_parallel_params, self.tp_group)
            if self.main_grads is not None:
                self.main_grads.to_grads()
            self.optimizer.step()
            self.optimizer_bytes = self._optimizer_bytes()
            if self.embedding is not None and not self.embedding.own_step:
                self.embedding.step()
        self.static_bytes = self._static_bytes()

    def _gradient_bytes(self) -> int:
        """Bytes of the gradient buffers the rank holds: ``.grad`` and fp32 main gradients."""
        grads = sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        return grads + (self.main_grads.nbytes() if self.main_grads is not None else 0)

    def _optimizer_bytes(self) -> int:
        """Bytes of the dense optimizer's moments (Adam's two per element; its one-element step counters
        are left out, as the ledger's costs leave them: exec.structure)."""
        return sum(t.numel() * t.element_size() for state in self.optimizer.state.values()
                   for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)

    def _static_bytes(self) -> int:
        optimizers = [self.optimizer, *([self.embedding.optimizer] if self.embedding and self.embedding.optimizer
                                         else [])]
        return sum(p.numel() * p.element_size() for p in self.params) + sum(
            t.numel() * t.element_size() for optimizer in optimizers for state in optimizer.state.values()
            for t in state.values() if isinstance(t, torch.Tensor))

    # -- results ---------------------------------------------------------------------------------
    def parameters_by_name(self) -> dict[str, torch.Tensor]:
        """This rank's parameters as ``"<layer>.<name>"`` (TP shards under their shard names)."""
        return {f"{layer}.{name}": p.detach().cpu().clone()
                for layer, module in sorted(self.layer_modules.items())
                for name, p in module.named_parameters()}


@contextlib.contextmanager
def _on_copy_stream(stream: Any, device: torch.device) -> Iterator[None]:
    """Run the enclosed copies on ``stream`` after the compute stream's work so far (CUDA), or inline."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield


def _on_storage(storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    """A tensor viewing ``storage`` exactly as ``like`` views its own (offset, shape, strides)."""
    return torch.empty(0, dtype=like.dtype, device=storage.device).set_(
        storage, like.storage_offset(), like.size(), like.stride())


def _accumulate(params: list[nn.Parameter], grads: tuple[torch.Tensor | None, ...]) -> None:
    for p, g in zip(params, grads, strict=True):
        if g is None or accumulate_main(p, g):
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad += g

