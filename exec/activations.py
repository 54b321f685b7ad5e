"""What a rank holds for one (stage, micro-batch) between its forward and its backward: the stage
input, the tensors autograd saves (behind ``saved_tensors_hooks``, so they can be swapped to host
memory and back) and the segments of the stage's autograd graph."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from exec.selective import SelectiveRecord


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def unique_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen[storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


class SavedStore:
    """The tensors autograd saves for one (stage, micro-batch), reachable for swapping. Each is
    tagged with the model layer that saved it (``layer``, set by the forward as it walks its
    layers), so a per-layer memory policy can swap exactly the tensors of its swapped layers.
    Under selective checkpointing torch keeps the kept operator outputs in its own cache, out of
    these hooks' reach; ``selective`` records them so they are counted (never swapped)."""

    def __init__(self, param_storages: set[int]) -> None:
        self.param_storages = param_storages
        # None: dropped (exec.delta_runtime); a weakref: released by a freeing backward (``releasing``)
        self.tensors: list[torch.Tensor | weakref.ref | None] = []
        self.layers: list[int] = []  # position -> the layer that saved it
        self.host: dict[int, torch.Tensor] = {}  # position -> host copy while swapped out
        self.layer = -1
        self.selective = SelectiveRecord()
        # Set by a backward that frees its graph (no retain_graph): each tensor is then held only
        # weakly once autograd has unpacked it, so it dies when autograd lets go of it, as it
        # would without hooks. Holding every saved tensor to the end of the backward (the logits'
        # log-softmax of a 33,278-word head: 17 MB per micro-batch) made the backward's own
        # temporaries take fresh pages: 3,100 more minor faults per backward than the profile
        # (scripts/probe_faults.py, docs/embrace.md).
        self.releasing = False

    def pack(self, t: torch.Tensor) -> Any:
        if storage_key(t) in self.param_storages:
            return t  # a parameter (e.g. a weight saved by matmul): not an activation
        self.tensors.append(t)
        self.layers.append(self.layer)
        return len(self.tensors) - 1

    def unpack(self, handle: Any) -> torch.Tensor:
        if isinstance(handle, torch.Tensor):
            return handle
        held = self.tensors[handle]
        assert held is not None, "a dropped layer's saved tensor was used before its re-run"
        if isinstance(held, weakref.ref):  # unpacked before in this backward (the node still runs)
            return held()
        if self.releasing:
            self.tensors[handle] = weakref.ref(held)
        return held

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def held(self, skip: Any = ()) -> list[torch.Tensor]:
        """The saved tensors still alive (a released one lives while autograd holds it), but the
        positions in ``skip``."""
        out = [t() if isinstance(t, weakref.ref) else t for i, t in enumerate(self.tensors) if i not in skip]
        return [t for t in out if t is not None]

    def device_tensors(self) -> list[torch.Tensor]:
        return [*self.held(skip=self.host), *self.selective.kept]

    def all_tensors(self) -> list[torch.Tensor]:
        """Every tensor held for the backward, on the device or on the host."""
        return [*self.held(), *self.selective.kept]

    def release(self) -> None:
        """Drop the saved tensors. The graph's unpack hooks reference this store and the store
        references tensors whose ``grad_fn`` is that graph: a cycle through C++ that Python's
        garbage collector cannot see. A backward without ``retain_graph`` frees the saved
        variables (and hooks) itself; a graph kept by the split backward would leak every
        micro-batch's activations without this."""
        self.tensors.clear()
        self.layers.clear()
        self.host.clear()
        self.selective.clear()


@dataclass
class Segment:
    """Part of a stage's autograd graph: from a leaf input to an output (or the loss)."""

    inp: torch.Tensor
    out: torch.Tensor
    captures: list[tuple[nn.Module, list[torch.Tensor]]] = field(default_factory=list)
    grad_out: torch.Tensor | None = None  # gradient entering the segment (set by BWD_I)
    captured_grads: dict[int, torch.Tensor] = field(default_factory=dict)  # id(tensor) -> grad
    deferred: bool = False  # BWD_I could not split it (input needs no grad): BWD_W does it all
    rng: RngState | None = None  # its forward's RNG state, where a run-time policy may re-run it (Run.rng)

    @property
    def identity(self) -> bool:
        return self.out is self.inp


@dataclass
class Run:
    """Consecutive layers of a stage (positions ``start:end`` in it) that a checkpointed forward ran
    without saving; ``inp`` is their kept input (a leaf), ``segment`` their place in the slot's
    segments, filled by the RECOMPUTE."""

    start: int
    end: int
    inp: torch.Tensor
    segment: int
    # The last stage's last run: the loss is part of it (the profiled last layer includes the loss),
    # so the forward computes it without grad and the RECOMPUTE computes it again with grad.
    loss: bool = False
    # The RNG state its forward began with, for a workload with dropout (exec.workloads.base.Workload.
    # stochastic): the RECOMPUTE draws the same masks, as torch.utils.checkpoint's preserve_rng_state.
    rng: RngState | None = None


@dataclass(frozen=True)
class RngState:
    cpu: torch.Tensor
    cuda: torch.Tensor | None  # the device's generator, on a CUDA device
    # the sequence-parallel region's per-TP-rank generator and its state (exec.parallel.sequence)
    region: Any = None
    region_state: Any = None

    @staticmethod
    def take(device: torch.device, region: Any = None) -> RngState:
        return RngState(torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                        region, region.state() if region is not None else None)

    @contextlib.contextmanager
    def replayed(self, device: torch.device) -> Iterator[None]:
        """Run the body from this state and leave the generators as they were before it."""
        after = self.region.state() if self.region is not None else None
        with torch.random.fork_rng(devices=[device] if self.cuda is not None else []):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, device)
            if self.region is not None:
                self.region.restore(self.region_state)
            try:
                yield
            finally:
                if self.region is not None:
                    self.region.restore(after)


def runs_of(flags: list[bool]) -> list[tuple[int, int, bool]]:
    """Maximal runs of unflagged layers, and every flagged (checkpointed) layer a run of its own:
    (start, end, flag). A checkpointed layer keeps its own input, as Megatron-LM's per-layer
    checkpointing does and as the simulator's ledger counts it (``sim.memory.checkpoint_bytes`` per
    recomputed layer); one checkpoint over several layers would keep less than the ledger says."""
    runs: list[tuple[int, int, bool]] = []
    for i, flag in enumerate(flags):
        if runs and runs[-1][2] == flag and not flag:
            runs[-1] = (runs[-1][0], i + 1, flag)
        else:
            runs.append((i, i + 1, flag))
    return runs


@dataclass
class Slot:
    """Everything the rank holds for one (stage, micro-batch) between its forward and backward.
    ``segments`` are in forward order; a checkpointed run's entry is None until its RECOMPUTE."""

    inp: torch.Tensor
    store: SavedStore
    checkpointed: list[Run] = field(default_factory=list)
    segments: list[Segment | None] = field(default_factory=list)
    resident: int = 0  # bytes counted in the memory tracker
    # Per segment: how many tensors the store held when its forward began. A backward that recomputes
    # one layer at a time lets each segment's saved tensors go once its own backward is done.
    saved_at: list[int] = field(default_factory=list)

    def kept_inputs(self) -> list[torch.Tensor]:
        return [self.inp, *(run.inp for run in self.checkpointed)]
