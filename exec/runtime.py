"""The per-rank interpreter: runs this rank's part of a Program with real tensors.

Every rank builds only its pipeline stages (``Workload.build_layers`` seeds each layer, so any
partition holds the whole model's weights), shards transformer blocks over its TP group
(``exec.parallel.tp``), and executes ``compile_plan(plan, ...).program.ranks[rank]`` (the very Program the
simulator interprets) instruction by instruction, in program order:

- FWD: a forward with ``save=False`` runs the stage's recompute layers (a prefix of the stage,
  ``policy.recompute_layers``) under ``no_grad`` keeping only their input, the rest with grad.
  RECOMPUTE re-runs that prefix with grad. The last stage adds the loss / micro-batches.
- BWD: full backward. BWD_I: input gradient only (``autograd.grad`` with ``retain_graph``),
  capturing the gradients of the outputs of every parameter-holding module; BWD_W: the weight
  gradients from those captured gradients (each module's own small backward).
- SEND_* / RECV_*: ``isend`` / ``irecv`` (tagged, so gloo matches them exactly); a receive is
  posted when reached and waited on by the instruction that depends on it.
- SWAP_OUT / SWAP_IN: the saved activations of (stage, micro-batch) live in a store behind
  ``saved_tensors_hooks``; swapping moves a fraction of them to host memory and back.
- ALLREDUCE: an asynchronous bucket all-reduce over the data-parallel group (``exec.parallel.dp``).
- OPTIMIZER_STEP: Adam.

Every instruction is timed against a clock shared by the ranks (a barrier, then offsets from
``perf_counter``; CUDA events on GPUs); each iteration's rows, losses and memory are appended to
``<out>/ranks/rank<r>.jsonl`` as soon as the iteration ends, and a heartbeat file names the
current instruction, so a failed or hung run keeps what it measured and says where it stopped.

Run it under torchrun or SLURM as ``python -m exec.runtime plan.yaml --out DIR`` (reads RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT or SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID), or
through ``exec.launcher.run_plan``, which spawns the ranks itself.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from exec.parallel.dp import BucketReduce
from exec.parallel.tp import apply_tensor_parallel
from exec.records import write_record
from exec.structure import StructuralCosts, torch_dtype
from exec.workloads import Workload, get_workload
from sim.compile import ResolvedPlan, compile_plan
from sim.lower import MemoryPolicy
from sim.plan import Plan
from sim.program import Instruction, Kind, Program, RankProgram
from traces.errors import ConfigError

# Adam's learning rate: a constant of the runtime (a Plan has no optimizer settings yet); the
# single-process reference of the tests uses the same through ``make_optimizer``.
LEARNING_RATE = 1e-3
# Environment variable for fault testing only: "rank=R,index=I[,iteration=N][,mode=raise|hang|exit]"
# makes rank R fail (raise), stop making progress (hang) or die (exit) before instruction I.
FAULT_ENV = "PARATWIN_FAULT"
HEARTBEAT_PERIOD_S = 0.2
ERROR_CHARS = 500  # an error file keeps this much of the error's first line (and the whole traceback)
MEMORY_NOTE_CPU = ("tracked bytes: parameters + gradients + Adam state + activations held by the runtime "
                   "(stage inputs, tensors saved for backward with each storage counted once, parameters "
                   "excluded, swapped-out ones not counted) + message buffers in flight; sampled at "
                   "instruction ends")
MEMORY_NOTE_CUDA = "torch.cuda.memory_allocated / max_memory_allocated of the rank's device"


# ------------------------------------------------------------------------------------------------
# What every rank (and the single-process reference) must agree on


def batch_seed(iteration: int, replica: int, microbatch: int, dp: int, microbatches: int) -> int:
    """Seed of the micro-batch ``microbatch`` of data-parallel replica ``replica`` in ``iteration``."""
    return (iteration * dp + replica) * microbatches + microbatch


def make_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LEARNING_RATE)


def load_workload(plan: Plan) -> Workload:
    return get_workload(plan.workload, **plan.workload_options)


@dataclass
class ExecutablePlan:
    """A compiled plan (every rank) with the real workload it runs and that workload's exact costs."""

    plan: Plan
    resolved: ResolvedPlan
    workload: Workload
    structure: StructuralCosts
    program: Program


def compile_for_run(plan: Plan) -> ExecutablePlan:
    """Compile ``plan`` exactly as the simulator does, lowered for every rank.

    With ``profile`` set the costs are the profile's (the simulator's own); otherwise the exact
    structural costs, which give the same partition for ``uniform`` and ``parameters`` and exact
    message and bucket bytes.
    """
    workload = load_workload(plan)
    structure = StructuralCosts(workload, plan.micro_batch, plan.dtype, plan.tp)
    compiled = compile_plan(plan, costs=None if plan.profile else structure, symmetric=False)
    return ExecutablePlan(plan, compiled.resolved, workload, structure, compiled.program)


@dataclass(frozen=True)
class Fault:
    rank: int
    index: int
    iteration: int = 0
    mode: str = "raise"
    phase: str = ""  # with phase=P (a key of PHASES) the rank raises on entering that phase instead

    @classmethod
    def from_env(cls) -> Fault | None:
        text = os.environ.get(FAULT_ENV, "").strip()
        if not text:
            return None
        try:
            fields = dict(item.split("=", 1) for item in text.split(","))
            phase = fields.get("phase", "")
            fault = cls(int(fields["rank"]), int(fields.get("index", -1) if phase else fields["index"]),
                        int(fields.get("iteration", 0)), fields.get("mode", "raise"), phase)
        except (KeyError, ValueError):
            raise ConfigError(FAULT_ENV, f"cannot read {text[:200]!r}",
                              "use rank=R,index=I[,iteration=N][,mode=raise|hang|exit] or rank=R,phase=P") from None
        if fault.mode not in ("raise", "hang", "exit"):
            raise ConfigError(FAULT_ENV, f"unknown mode {fault.mode[:50]!r}", "use raise, hang or exit")
        if fault.phase and fault.phase not in PHASES:
            raise ConfigError(FAULT_ENV, f"unknown phase {fault.phase[:50]!r}", f"use one of {', '.join(PHASES)}")
        return fault


# ------------------------------------------------------------------------------------------------
# Clocks, memory, saved activations


class Clock:
    """Offsets from the start of the iteration (taken right after a barrier on every rank)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.t0 = 0.0
        self.base: Any = None

    def start(self) -> None:
        self.t0 = time.perf_counter()
        if self.cuda:
            self.base = torch.cuda.Event(enable_timing=True)
            self.base.record()

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter() - self.t0

    def seconds(self, mark: Any) -> float:
        return self.base.elapsed_time(mark) / 1e3 if self.cuda else float(mark)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen[_storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


class SavedStore:
    """The tensors autograd saves for one (stage, micro-batch), reachable for swapping."""

    def __init__(self, param_storages: set[int]) -> None:
        self.param_storages = param_storages
        self.tensors: list[torch.Tensor] = []
        self.host: dict[int, torch.Tensor] = {}  # position -> host copy while swapped out

    def pack(self, t: torch.Tensor) -> Any:
        if _storage_key(t) in self.param_storages:
            return t  # a parameter (e.g. a weight saved by matmul): not an activation
        self.tensors.append(t)
        return len(self.tensors) - 1

    def unpack(self, handle: Any) -> torch.Tensor:
        return handle if isinstance(handle, torch.Tensor) else self.tensors[handle]

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def device_tensors(self) -> list[torch.Tensor]:
        return [t for i, t in enumerate(self.tensors) if i not in self.host]

    def release(self) -> None:
        """Drop the saved tensors. The graph's unpack hooks reference this store and the store
        references tensors whose ``grad_fn`` is that graph: a cycle through C++ that Python's
        garbage collector cannot see. A backward without ``retain_graph`` frees the saved
        variables (and hooks) itself; a graph kept by the split backward would leak every
        micro-batch's activations without this."""
        self.tensors.clear()
        self.host.clear()


@dataclass
class Segment:
    """Part of a stage's autograd graph: from a leaf input to an output (or the loss)."""

    inp: torch.Tensor
    out: torch.Tensor
    captures: list[tuple[nn.Module, list[torch.Tensor]]] = field(default_factory=list)
    grad_out: torch.Tensor | None = None  # gradient entering the segment (set by BWD_I)
    captured_grads: dict[int, torch.Tensor] = field(default_factory=dict)  # id(tensor) -> grad
    deferred: bool = False  # BWD_I could not split it (input needs no grad): BWD_W does it all

    @property
    def identity(self) -> bool:
        return self.out is self.inp


@dataclass
class Slot:
    """Everything the rank holds for one (stage, micro-batch) between its forward and backward."""

    inp: torch.Tensor
    store: SavedStore
    prefix: int = 0  # number of checkpointed layers (run without saving, recomputed later)
    segments: list[Segment] = field(default_factory=list)
    resident: int = 0  # bytes counted in the memory tracker


class Pending:
    """An asynchronous instruction in flight (send, receive, bucket all-reduce, swap).

    gloo's send and receive handles report completion only from ``wait()``, so on CPUs a watcher
    thread waits for each handle and stamps its end (the waiting releases the GIL); the main
    thread only waits for the watcher. On GPUs the end is an event recorded when waited for."""

    def __init__(self, instruction: Instruction, start: Any, work: Any, nbytes: int,
                 tensor: torch.Tensor | None, then: Any, clock: Clock,
                 watchers: ThreadPoolExecutor | None) -> None:
        self.instruction, self.start, self.work, self.nbytes = instruction, start, work, nbytes
        self.tensor, self.then, self.clock = tensor, then, clock
        self.end: Any = None
        self.future = watchers.submit(self._watch) if watchers is not None and work is not None else None

    def _watch(self) -> Any:
        self.work.wait()
        return self.clock.mark()

    def finish(self) -> Any:
        """Wait for completion; return the end mark."""
        if self.future is not None:
            end = self.future.result()  # re-raises a failed wait (e.g. the process-group timeout)
        else:
            if self.work is not None:
                self.work.wait()
            end = self.clock.mark()
        if self.then is not None:
            self.then()
        return end


# ------------------------------------------------------------------------------------------------
# The interpreter

_P2P = frozenset({Kind.SEND_ACT, Kind.SEND_GRAD, Kind.RECV_ACT, Kind.RECV_GRAD})


class RankRuntime:
    def __init__(self, run: ExecutablePlan, rank: int, device: torch.device,
                 tp_group: object = None, dp_group: object = None) -> None:
        self.plan, self.workload, self.rank, self.device = run.plan, run.workload, rank, device
        self.program: RankProgram = run.program.ranks[rank]
        self.policy: MemoryPolicy = run.resolved.policy
        self.stage_layers = run.program.stage_layers
        self.num_stages = len(self.stage_layers)
        self.coords = self.program.coords
        self.tp_group, self.dp_group = tp_group, dp_group
        self.dtype = torch_dtype(self.plan.dtype)
        self.clock = Clock(device)
        # Completion watchers of asynchronous instructions (CPU only, see Pending).
        self.watchers = ThreadPoolExecutor(max_workers=32, thread_name_prefix="paratwin-watch") \
            if device.type != "cuda" else None
        self.fault = Fault.from_env()
        self.structure = run.structure

        # This rank's stages, built from the seeded full weights, then TP-sharded.
        self.stages: dict[int, nn.ModuleList] = {}
        self.layer_modules: dict[int, nn.Module] = {}
        for s in self.program.stages:
            layers = self.stage_layers[s]
            modules = self.workload.build_layers(layers[0], layers[-1] + 1, device=device, dtype=self.dtype)
            apply_tensor_parallel(modules, self.coords.tp, self.plan.tp, tp_group)
            modules.train()
            self.stages[s] = modules
            self.layer_modules.update(zip(layers, modules, strict=True))
        self.params = [p for s in self.program.stages for p in self.stages[s].parameters()]
        self.param_storages = {_storage_key(p) for p in self.params}
        # Every SavedStore still alive (weakly held): what they hold at an iteration's end is
        # the per-rank record ``saved_bytes`` (0 unless a store outlives its backward).
        self.stores: weakref.WeakSet[SavedStore] = weakref.WeakSet()
        self.optimizer = make_optimizer(self.params)

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
    def _recording(self, slot: Slot, captures: list) -> Iterator[None]:
        self._capture = captures if self.split else None
        try:
            with slot.store.hooks():
                yield
        finally:
            self._capture = None

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
        grads = sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        return self.static_bytes + grads + self.activation_bytes + self.buffer_bytes

    def _track(self, slot: Slot) -> None:
        """Recount what ``slot`` keeps alive on the device."""
        tensors = [slot.inp, *slot.store.device_tensors()]
        now = _unique_bytes(tensors)
        self.activation_bytes += now - slot.resident
        slot.resident = now

    def saved_bytes(self) -> int:
        """Bytes of saved-for-backward tensors (device or host) still held by any live store."""
        return _unique_bytes([t for store in list(self.stores) for t in store.tensors])

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
        self.rows: list[dict] = []
        self.losses: list[float] = []
        self.loss_tensors: list[torch.Tensor] = []
        self.optimizer.zero_grad(set_to_none=True)
        self.static_bytes = sum(p.numel() * p.element_size() for p in self.params) + sum(
            t.numel() * t.element_size() for state in self.optimizer.state.values()
            for t in state.values() if isinstance(t, torch.Tensor))
        self.activation_bytes = self.buffer_bytes = 0
        self.peak = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

        dist.barrier()
        t0_wall = time.time()
        self.clock.start()
        for instruction in self.program.instructions:
            self.current, self.since = instruction, time.time()
            self._maybe_fail(instruction)
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
                "peak_memory": self.peak, "saved_bytes": self.saved_bytes()}

    def _maybe_fail(self, instruction: Instruction) -> None:
        f = self.fault
        if f is None or f.rank != self.rank or f.index != instruction.index or f.iteration != self.iteration:
            return
        if f.mode == "exit":
            os._exit(17)
        if f.mode == "hang":
            while True:
                time.sleep(1.0)
        raise RuntimeError(f"injected fault ({FAULT_ENV}) at {instruction.label}")

    def _row(self, instruction: Instruction, start: Any, end: Any, nbytes: int) -> None:
        memory = self._memory()
        self.peak = max(self.peak, memory)
        self.rows.append({
            "rank": self.rank, "index": instruction.index, "kind": instruction.kind.value,
            "stage": instruction.stage, "microbatch": instruction.microbatch,
            "stream": instruction.stream.value, "start_s": start, "end_s": end, "bytes": nbytes,
            "mem_after": memory, "parent": -1, "layer": -1, "name": instruction.label,
            "iteration": self.iteration,
        })

    def _execute(self, ins: Instruction) -> None:
        handler = {
            Kind.FWD: self._forward, Kind.RECOMPUTE: self._recompute, Kind.BWD: self._backward,
            Kind.BWD_I: self._backward_input, Kind.BWD_W: self._backward_weight,
            Kind.OPTIMIZER_STEP: self._step, Kind.SEND_ACT: self._send, Kind.SEND_GRAD: self._send,
            Kind.RECV_ACT: self._recv, Kind.RECV_GRAD: self._recv, Kind.ALLREDUCE: self._allreduce,
            Kind.SWAP_OUT: self._swap_out, Kind.SWAP_IN: self._swap_in,
        }.get(ins.kind)
        if handler is None:
            raise NotImplementedError(f"the runtime does not execute {ins.kind.value} instructions yet")
        if ins.kind.is_compute:
            start = self.clock.mark()
            handler(ins)
            self._row(ins, start, self.clock.mark(), 0)
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
        """Retire every asynchronous instruction whose watcher has seen it complete."""
        for index in [i for i, p in self.pending.items()
                      if p.work is None or (p.future is not None and p.future.done())]:
            self._finish(index)

    def _send(self, ins: Instruction) -> None:
        store = self.acts if ins.kind is Kind.SEND_ACT else self.grads
        kind, stage, mb = ins.tag.split(":")
        tensor = store.pop((int(stage), int(mb))).contiguous()
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
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        start = self.clock.mark()
        work = dist.irecv(buffer, src=ins.peer, tag=self._tag(ins.tag))
        (self.acts if kind == "act" else self.grads)[(s, m)] = buffer
        self._launch(ins, start, work, buffer.numel() * buffer.element_size(), buffer)

    def _allreduce(self, ins: Instruction) -> None:
        params = [p for layer in ins.layers for p in self.layer_modules[layer].parameters()]
        start = self.clock.mark()
        bucket = BucketReduce(params, self.dp_group, self.plan.dp)
        self._launch(ins, start, bucket.work, bucket.nbytes, then=bucket.wait)

    def _swap_out(self, ins: Instruction) -> None:
        slot = self.slots[(ins.stage, ins.microbatch)]
        store = slot.store
        start = self.clock.mark()
        target = self.policy.swap_fraction[ins.stage] * _unique_bytes(store.device_tensors())
        keep = _storage_key(slot.inp)
        moved = 0
        for position, t in enumerate(store.tensors):
            if moved >= target:
                break
            if position in store.host or _storage_key(t) == keep:
                continue
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda).copy_(t, non_blocking=t.is_cuda)
            store.host[position] = host
            moved += t.numel() * t.element_size()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        for position in store.host:
            store.tensors[position] = store.host[position]  # the device copy is released
        self._track(slot)
        self._launch(ins, start, None, moved)

    def _swap_in(self, ins: Instruction) -> None:
        slot = self.slots[(ins.stage, ins.microbatch)]
        store = slot.store
        start = self.clock.mark()
        moved = 0
        for position, host in store.host.items():
            store.tensors[position] = host.to(self.device, non_blocking=True) if self.device.type == "cuda" \
                else host.clone()
            moved += host.numel() * host.element_size()
        store.host.clear()
        self._track(slot)
        self._launch(ins, start, None, moved)

    # -- compute ---------------------------------------------------------------------------------
    def _stage_input(self, s: int, mb: int) -> torch.Tensor:
        if s == 0:
            return self._batch(mb).inputs
        x = self.acts.pop((s, mb)).detach()
        return x.requires_grad_(x.is_floating_point())

    def _forward(self, ins: Instruction) -> None:
        s, mb = ins.stage, ins.microbatch
        layers = self.stages[s]
        x = self._stage_input(s, mb)
        slot = Slot(inp=x, store=SavedStore(self.param_storages))
        self.stores.add(slot.store)
        slot.prefix = 0 if ins.save else len(self.policy.recompute_layers[s])
        captures: list = []
        with self._recording(slot, captures):
            mid = x
            if slot.prefix:
                with torch.no_grad():
                    for layer in layers[:slot.prefix]:
                        mid = layer(mid)
                mid = mid.detach().requires_grad_(mid.is_floating_point())
            out = mid
            for layer in layers[slot.prefix:]:
                out = layer(out)
            if s == self.num_stages - 1:
                loss = self.workload.loss(out, self._batch(mb).targets) / self.plan.microbatches
                self.loss_tensors.append(loss.detach())
                out = loss
        slot.segments = [Segment(mid, out, captures)]
        if s < self.num_stages - 1:
            self.acts[(s + 1, mb)] = out.detach()
        self.slots[(s, mb)] = slot
        self._track(slot)

    def _recompute(self, ins: Instruction) -> None:
        s, mb = ins.stage, ins.microbatch
        slot = self.slots[(s, mb)]
        captures: list = []
        with self._recording(slot, captures), torch.enable_grad():
            mid = slot.inp
            for layer in self.stages[s][:slot.prefix]:
                mid = layer(mid)
        slot.segments.insert(0, Segment(slot.inp, mid, captures))
        self._track(slot)

    def _grad_in(self, s: int, mb: int) -> torch.Tensor | None:
        return None if s == self.num_stages - 1 else self.grads.pop((s, mb))

    def _hand_back(self, s: int, mb: int, grad: torch.Tensor | None) -> None:
        if s > 0:
            if grad is None:
                raise RuntimeError(f"stage {s} micro-batch {mb}: no gradient reached the stage input")
            self.grads[(s - 1, mb)] = grad

    def _check_recomputed(self, slot: Slot, s: int, mb: int) -> None:
        if slot.prefix and len(slot.segments) < 2:
            raise RuntimeError(f"stage {s} micro-batch {mb}: backward of a checkpointed forward "
                               "before its RECOMPUTE")

    def _backward(self, ins: Instruction) -> None:
        s, mb = ins.stage, ins.microbatch
        slot = self.slots[(s, mb)]
        self._check_recomputed(slot, s, mb)
        grad = self._grad_in(s, mb)
        for seg in reversed(slot.segments):
            if seg.identity:
                continue
            torch.autograd.backward(seg.out, grad)
            grad = seg.inp.grad if seg.inp.requires_grad else None
        self._hand_back(s, mb, grad)
        self._free((s, mb))

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
        self.optimizer.step()
        self.static_bytes = sum(p.numel() * p.element_size() for p in self.params) + sum(
            t.numel() * t.element_size() for state in self.optimizer.state.values()
            for t in state.values() if isinstance(t, torch.Tensor))

    # -- results ---------------------------------------------------------------------------------
    def parameters_by_name(self) -> dict[str, torch.Tensor]:
        """This rank's parameters as ``"<layer>.<name>"`` (TP shards under their shard names)."""
        return {f"{layer}.{name}": p.detach().cpu().clone()
                for layer, module in sorted(self.layer_modules.items())
                for name, p in module.named_parameters()}


def _accumulate(params: list[nn.Parameter], grads: tuple[torch.Tensor | None, ...]) -> None:
    for p, g in zip(params, grads, strict=True):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad += g


# ------------------------------------------------------------------------------------------------
# One rank's whole run: process groups, heartbeat, iterations, results


@dataclass
class RunOptions:
    iterations: int = 5
    warmup: int = 1
    backend: str | None = None
    timeout_s: float = 300.0
    save_params: bool = False
    threads: int = 1


BACKENDS = ("gloo", "nccl")


def pick_backend(requested: str | None) -> str:
    """``requested`` checked against this machine, or nccl with CUDA and gloo without."""
    if not requested:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested not in BACKENDS:
        raise ConfigError("--backend", f"unknown backend {str(requested)[:50]!r}", "use gloo or nccl")
    if requested == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--backend", "nccl needs CUDA GPUs and torch sees none on this machine",
                          "use --backend gloo (the default without CUDA), or run on a machine with GPUs")
    return requested


# What a rank does outside its instructions; errors there are labelled with the phase.
PHASES = {
    "setup": "setting up (process groups, stages)",
    "iterations": "running iterations",
    "params": "saving parameters",
    "gather": "gathering results to rank 0",
    "record": "writing the run record",
    "finish": "at the final barrier",
}


class Phase:
    """The phase a rank is in (for its error file), and the fault injected there, if any."""

    def __init__(self, rank: int) -> None:
        self.rank, self.key = rank, "setup"
        self.fault: Fault | None = None

    @property
    def description(self) -> str:
        return PHASES[self.key]

    def enter(self, key: str) -> None:
        self.key = key
        if key == "setup" and "phase=" in os.environ.get(FAULT_ENV, ""):
            self.fault = Fault.from_env()  # here, so that a malformed value is reported as an error
        f = self.fault
        if f is not None and f.rank == self.rank and f.phase == key:
            raise RuntimeError(f"injected fault ({FAULT_ENV}) while {self.description}")


class Heartbeat(threading.Thread):
    """Writes ``heartbeat/rank<r>.json`` (current iteration and instruction) every 0.2 s."""

    def __init__(self, runtime_ref: Any, path: Path, rank: int) -> None:
        super().__init__(daemon=True)
        self.ref, self.path, self.rank = runtime_ref, path, rank
        self.stopped = threading.Event()

    def state(self) -> dict:
        rt = self.ref()
        current = getattr(rt, "current", None) if rt is not None else None
        return {
            "rank": self.rank, "pid": os.getpid(), "time": time.time(),
            "iteration": getattr(rt, "iteration", -1), "done": getattr(rt, "done_count", 0),
            "index": current.index if current is not None else -1,
            "instruction": current.label if current is not None else "(between instructions)",
            "since": getattr(rt, "since", time.time()),
        }

    def run(self) -> None:
        while not self.stopped.wait(HEARTBEAT_PERIOD_S):
            _write_json(self.path, self.state())


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def run_rank(plan: Plan, rank: int, world_size: int, local_rank: int, out_dir: Path, options: RunOptions,
             init_method: str = "env://") -> None:
    """Everything one rank does; results go to ``out_dir`` (rank 0 also writes the run record)."""
    out_dir = Path(out_dir)
    for sub in ("ranks", "heartbeat", "errors"):
        (out_dir / sub).mkdir(parents=True, exist_ok=True)
    runtime: RankRuntime | None = None
    heartbeat = Heartbeat(lambda: runtime, out_dir / "heartbeat" / f"rank{rank}.json", rank)
    heartbeat.start()
    phase = Phase(rank)
    try:
        phase.enter("setup")
        backend = pick_backend(options.backend)
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(options.threads)
        timeout = dt.timedelta(seconds=options.timeout_s)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timeout)
        run = compile_for_run(plan)
        if run.program.world_size != world_size:
            raise ConfigError("world size", f"the plan needs {run.program.world_size} ranks, "
                              f"{world_size} were launched", "launch dp x tp x pp ranks")
        tp_group, dp_group = _groups(run.program, rank, timeout)
        runtime = RankRuntime(run, rank, device, tp_group, dp_group)
        results_path = out_dir / "ranks" / f"rank{rank}.jsonl"
        results_path.write_text("")
        results = []
        phase.enter("iterations")
        for iteration in range(options.warmup + options.iterations):
            result = runtime.run_iteration(iteration)
            result["warmup"] = iteration < options.warmup
            with results_path.open("a") as fh:  # kept even if a later iteration fails
                fh.write(json.dumps(result) + "\n")
            results.append(result)
        if options.save_params:
            phase.enter("params")
            (out_dir / "params").mkdir(exist_ok=True)
            torch.save(runtime.parameters_by_name(), out_dir / "params" / f"rank{rank}.pt")
        phase.enter("gather")
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, results)
        if rank == 0:
            phase.enter("record")
            everything = [r for per_rank in gathered for r in per_rank]
            write_record(out_dir, plan, everything, run_meta(run, backend, device))
        phase.enter("finish")
        dist.barrier()
    except BaseException as exc:
        write_error(out_dir, rank, exc, runtime, phase.description)
        raise
    finally:
        heartbeat.stopped.set()
        heartbeat.join(1.0)
        if runtime is not None and runtime.watchers is not None:
            runtime.watchers.shutdown(wait=False, cancel_futures=True)
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def write_error(out_dir: Path, rank: int, exc: BaseException, runtime: RankRuntime | None = None,
                phase: str = PHASES["setup"]) -> None:
    """``errors/rank<r>.json``: the error, where the rank was (instruction, or else phase), and the traceback."""
    current = runtime.current if runtime is not None else None
    text = str(exc).strip()
    first_line = text.splitlines()[0] if text else ""
    (Path(out_dir) / "errors").mkdir(parents=True, exist_ok=True)
    _write_json(Path(out_dir) / "errors" / f"rank{rank}.json", {
        "rank": rank, "time": time.time(),
        "iteration": runtime.iteration if runtime is not None else -1,
        "index": current.index if current is not None else -1,
        "instruction": current.label if current is not None else f"({phase})",
        "phase": phase,
        "error": f"{type(exc).__name__}: {first_line[:ERROR_CHARS]}",
        "traceback": traceback.format_exc(),
    })


def _groups(program: Program, rank: int, timeout: dt.timedelta) -> tuple[object, object]:
    """TP and DP process groups; every rank creates every group, in the same order."""
    tp_groups = [[program.rank_of(d, p, t) for t in range(program.tp)]
                 for d in range(program.dp) for p in range(program.pp)] if program.tp > 1 else []
    dp_groups = [[program.rank_of(d, p, t) for d in range(program.dp)]
                 for p in range(program.pp) for t in range(program.tp)] if program.dp > 1 else []
    return _own_group(tp_groups, rank, timeout), _own_group(dp_groups, rank, timeout)


def _own_group(all_ranks: list[list[int]], rank: int, timeout: dt.timedelta) -> object:
    """Create every group (a collective call on all ranks) and return the one holding ``rank``."""
    own = None
    for ranks in all_ranks:
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            own = group
    return own


def run_meta(run: ExecutablePlan, backend: str, device: torch.device) -> dict:
    return {
        "backend": backend, "device": str(device), "torch": torch.__version__,
        "stage_layers": [list(layers) for layers in run.program.stage_layers],
        "recompute_layers": [list(layers) for layers in run.resolved.policy.recompute_layers],
        "swap_fraction": list(run.resolved.policy.swap_fraction),
        "memory": MEMORY_NOTE_CUDA if device.type == "cuda" else MEMORY_NOTE_CPU,
        "learning_rate": LEARNING_RATE,
        "costs": "profile" if run.plan.profile else "structural (exec.structure.StructuralCosts)",
    }


# ------------------------------------------------------------------------------------------------
# ``python -m exec.runtime plan.yaml``: one rank under torchrun, SLURM or any launcher that sets
# the usual variables


def _launch_env() -> tuple[int, int, int]:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    raise ConfigError("environment", "neither RANK/WORLD_SIZE (torchrun) nor SLURM_PROCID/SLURM_NTASKS set",
                      "launch with torchrun --nproc-per-node N -m exec.runtime plan.yaml, or srun, "
                      "or use `paratwin run plan.yaml` on one machine")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exec.runtime", description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--out", type=Path, default=Path("runs/run"))
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    parser.add_argument("--timeout", type=float, default=300.0, help="process-group timeout, seconds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank on CPU")
    parser.add_argument("--save-params", action="store_true")
    args = parser.parse_args(argv)
    try:
        plan = Plan.load(args.plan)
        rank, world, local = _launch_env()
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise ConfigError("environment", "MASTER_ADDR and MASTER_PORT must be set",
                              "torchrun sets them; under SLURM export the first node's name and a free port")
        options = RunOptions(args.iterations, args.warmup, args.backend, args.timeout, args.save_params,
                             args.threads)
        run_rank(plan, rank, world, local, args.out, options)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if rank == 0:
        print(f"run record: {args.out / 'record'}; Chrome trace: {args.out / 'trace.json'}")
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without interpreter teardown: destroying torch.distributed's C++ state there
    # occasionally aborted a finished rank here ("terminate called without an active exception"),
    # which torchrun reports as a failed run. Everything is written and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
