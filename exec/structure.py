"""Exact structural costs of a workload: bytes and shapes, no times.

Lowering a Plan to a Program needs only message sizes (a stage's output activation) and gradient
sizes (data-parallel buckets); the runtime needs the shape of every tensor it receives. All of
these follow from the modules themselves, so ``StructuralCosts`` measures them with one forward
pass on the ``meta`` device (no memory, no arithmetic; any model size) and leaves every time at
zero. With it any workload (GPT, LSTM, ResNet, ...) can be lowered and run without a profile:

    resolve_plan(plan, costs=StructuralCosts(workload, plan.micro_batch, plan.dtype, plan.tp))

Per layer it records parameter, gradient and Adam-state bytes of one rank (after TP sharding,
built with ``exec.parallel.tp`` without a process group), the output activation bytes, the bytes
of the tensors autograd saves for backward (each storage counted once, parameters excluded) and
the forward FLOPs (``FlopCounterMode``); the last layer's saved bytes include the loss's.

Saved bytes depend on the kernels (the meta device picks other attention and LSTM kernels than
the CPU), so a model whose layers fit in ``REAL_MEASURE_LIMIT`` bytes is measured again with real
CPU tensors, which is exact for CPU runs; larger models keep the meta numbers. A model the meta
device cannot run is measured on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from exec.parallel.tp import apply_tensor_parallel, sharded_layer
from exec.selective import checkpoint_attention_cores, selective_saved_bytes
from exec.workloads.base import Workload
from sim.costs import LayerCosts
from sim.workloads import LayerSpec
from traces.errors import ConfigError

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# torch.optim.Adam keeps two moments (exp_avg, exp_avg_sq) of each parameter's dtype and size.
ADAM_STATES_PER_PARAM = 2
# Parameters plus saved activations (bytes, one micro-batch) up to which measure with real tensors.
REAL_MEASURE_LIMIT = 256 * 2**20


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError("dtype", f"unknown dtype {name!r}", f"use one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True)
class LayerFacts:
    """What one layer of one rank holds and produces for one micro-batch."""

    param_bytes: int
    saved_bytes: int
    output_bytes: int
    output_shape: tuple[int, ...]
    output_dtype: torch.dtype
    flops_fwd: float
    tp_allreduces: int  # all-reduces of the output per forward (sharded blocks: 2)
    selective_saved_bytes: int = -1  # under torch's selective checkpointing (exec.selective); -1 unknown
    shared_input_bytes: int = 0  # its saved input that the previous layer saves too (sim.costs.LayerCosts)
    unsaved_input_bytes: int = 0  # its input when it does not save it (sim.costs.LayerCosts)
    saved_output_bytes: int = 0  # of its output, what it saves itself (a ReLU's result; sim.costs.LayerCosts)
    tp_comm_bytes: int = 0  # the tensor each TP collective of its forward carries (whole, under sequence parallelism)
    sequence_parallel: bool = False  # its TP collectives are reduce-scatters and all-gathers (sim.costs.LayerCosts)
    attention_core_bytes: int = -1  # what Korthikanti's selective recomputation drops (sim.costs.LayerCosts)
    sp_grad_bytes: int = 0  # its parameters tagged sequence_parallel (summed over TP at the step: sim.costs.LayerCosts)
    # The output's dimensions from the outermost in memory to the innermost (``storage_order``): a
    # batch-first LSTM's output is a view of a time-major storage, (1, 0, 2). () for the identity.
    output_order: tuple[int, ...] = ()


def storage_order(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s dimensions from the largest stride to the smallest (ties, such as size-1
    dimensions, in their order): ``t.permute(storage_order(t))`` is contiguous for any dense
    permuted layout, a plain contiguous tensor gives the identity."""
    return tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))


def inverse_order(order: Sequence[int]) -> tuple[int, ...]:
    """The permutation that undoes ``order``: ``t.permute(order).permute(inverse_order(order))`` is ``t``."""
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return tuple(inverse)


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    # Meta storages have no address; their Python identity is stable while the tensor lives.
    return (storage._cdata if t.device.type == "meta" else storage.data_ptr(), storage.nbytes())


def measure_layers(workload: Workload, micro_batch: int, dtype: torch.dtype, tp: int = 1,
                   device: str = "meta", flops: bool = False) -> list[LayerFacts]:
    """Walk the whole model once on ``device`` and measure every layer (see module docstring).
    FLOPs are counted only with ``flops`` (FlopCounterMode costs seconds on first use)."""
    batch = workload.make_batch(micro_batch, seed=0)
    x = batch.inputs.to(device)
    facts = []
    previous: dict[tuple[int, int], int] = {}
    for index in range(workload.num_layers):
        layer = workload.build_layers(index, index + 1, device=device, dtype=dtype)[0]
        sharded = tp > 1 and sharded_layer(layer)
        if tp > 1:  # shards attention and MLPs; with sequence parallelism also splits the sequence
            apply_tensor_parallel(nn.ModuleList([layer]), tp_rank=0, tp=tp, group=None,
                                  sequence_parallel=workload.sequence_parallel)
        # Under sequence parallelism a sharded layer's output is its 1/tp of the sequence, while each
        # TP collective (a reduce-scatter plus an all-gather in place of an all-reduce) moves the whole.
        sequence_split = tp if tp > 1 and workload.sequence_parallel and sharded else 1
        params = list(layer.parameters())
        param_keys = {_storage_key(p) for p in params}
        saved: dict[tuple[int, int], int] = {}

        def pack(t: torch.Tensor, param_keys: set = param_keys, saved: dict = saved) -> torch.Tensor:
            key = _storage_key(t)
            if key not in param_keys:
                saved[key] = key[1]
            return t

        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        counter = FlopCounterMode(display=False) if flops else None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter or contextlib.nullcontext():
            out = layer(x)
            if index == workload.num_layers - 1:
                # The last stage also computes the loss, which saves (e.g.) the log-probabilities.
                workload.loss(out, batch.targets.to(device))
        loss = None
        if index == workload.num_layers - 1:
            targets = batch.targets.to(device)
            loss = lambda y, targets=targets: workload.loss(y, targets)  # noqa: E731
        x_key = _storage_key(x)
        shared = x_key[1] if x_key in saved and x_key in previous else 0
        # A layer that does not save its (floating) input: checkpointed, it keeps it all the same.
        unsaved = x_key[1] if index > 0 and x.is_floating_point() and x_key not in saved else 0
        facts.append(LayerFacts(
            attention_core_bytes=_attention_core_bytes(layer, x, param_keys, sum(saved.values())),
            shared_input_bytes=shared, unsaved_input_bytes=unsaved,
            saved_output_bytes=saved.get(_storage_key(out), 0),
            selective_saved_bytes=_selective_bytes(layer, x, param_keys, loss),
            param_bytes=sum(p.numel() * p.element_size() for p in params),
            saved_bytes=sum(saved.values()),
            output_bytes=out.numel() * out.element_size(),
            output_shape=tuple(out.shape),
            output_dtype=out.dtype,
            output_order=storage_order(out),
            flops_fwd=float(counter.get_total_flops()) if counter else 0.0,
            tp_allreduces=2 if sharded else 0,
            tp_comm_bytes=out.numel() * out.element_size() * sequence_split if sharded else 0,
            sequence_parallel=sequence_split > 1,
            sp_grad_bytes=sum(p.numel() * p.element_size() for p in params if getattr(p, "sequence_parallel", False)),
        ))
        x = out.detach()
        previous = saved  # what this layer saved, its output among it if it saves it
    return facts


def _attention_core_bytes(layer: nn.Module, x: torch.Tensor, param_keys: set, saved_bytes: int) -> int:
    """What the layer's attention cores keep that Korthikanti's selective recomputation drops: its
    saved bytes less those with the cores checkpointed (exec.selective.checkpoint_attention_cores);
    0 without such a core, -1 where torch cannot run the checkpoint here."""
    if not checkpoint_attention_cores(layer, True):
        return 0
    saved: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in param_keys:
            saved[key] = key[1]
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x)
    except (NotImplementedError, RuntimeError):
        return -1
    finally:
        checkpoint_attention_cores(layer, False)
    return saved_bytes - sum(saved.values())


def _selective_bytes(layer: nn.Module, x: torch.Tensor, param_keys: set, loss: object) -> int:
    """What the layer keeps under torch's selective checkpointing, or -1 where torch cannot run it
    (an operator without a meta kernel inside the checkpoint)."""
    try:
        return selective_saved_bytes(layer, x, param_keys, loss)  # type: ignore[arg-type]
    except (NotImplementedError, RuntimeError):
        return -1


# What ``StructuralCosts`` measured, by (micro_batch, tp): ``measured`` gives it to another process.
Measured = dict[tuple[int, int], list[LayerFacts]]


class StructuralCosts:
    """A ``sim.costs.CostModel`` with exact byte counts and zero times (see module docstring).

    ``measured``: what a ``StructuralCosts`` of the same workload, dtype and ``flops`` measured (its
    ``measured``), taken instead of measuring again: the launcher measures once and hands it to every
    rank, where measuring took most of a small model's launch (docs/runtime.md)."""

    def __init__(self, workload: Workload, micro_batch: int, dtype: str | torch.dtype = "fp32", tp: int = 1,
                 flops: bool = False, measured: Measured | None = None) -> None:
        self.workload = workload
        self.flops = flops
        self.micro_batch = micro_batch
        self.dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
        self.tp = tp
        self.num_layers = workload.num_layers
        self._facts: Measured = dict(measured or {})
        self.facts(micro_batch, tp)  # measure now, so a bad workload fails at construction

    @property
    def measured(self) -> Measured:
        return dict(self._facts)

    def facts(self, micro_batch: int, tp: int) -> list[LayerFacts]:
        key = (micro_batch, tp)
        if key not in self._facts:
            try:
                facts = measure_layers(self.workload, micro_batch, self.dtype, tp, "meta", self.flops)
                total = sum(f.param_bytes + f.saved_bytes + f.output_bytes for f in facts)
                small = total <= REAL_MEASURE_LIMIT
            except (NotImplementedError, RuntimeError):  # an operator without a meta kernel
                small = True
            if small:
                facts = measure_layers(self.workload, micro_batch, self.dtype, tp, "cpu", self.flops)
            self._facts[key] = facts
        return self._facts[key]

    def layer_costs(self, layer: int, micro_batch: int, tp: int) -> LayerCosts:
        f = self.facts(micro_batch, tp)[layer]
        return LayerCosts(
            fwd_s=0.0, bwd_input_s=0.0, bwd_weight_s=0.0, recompute_s=0.0,
            param_bytes=f.param_bytes,
            grad_bytes=f.param_bytes,
            optimizer_bytes=ADAM_STATES_PER_PARAM * f.param_bytes,
            saved_bytes=f.saved_bytes,
            output_bytes=f.output_bytes,
            tp_allreduces=f.tp_allreduces,
            tp_comm_bytes=f.tp_comm_bytes,
            tp_sequence_parallel=f.sequence_parallel,
            sp_grad_bytes=f.sp_grad_bytes,
            attention_core_bytes=f.attention_core_bytes,
            attention_core_recompute_s=0.0 if f.attention_core_bytes >= 0 else -1.0,
            flops_fwd=f.flops_fwd,
            selective_saved_bytes=f.selective_saved_bytes,
            selective_recompute_s=0.0,
            shared_input_bytes=f.shared_input_bytes,
            unsaved_input_bytes=f.unsaved_input_bytes,
            saved_output_bytes=f.saved_output_bytes,
        )

    def optimizer_step_s(self, param_bytes: int) -> float:
        return 0.0

    def layer_weights(self, by: str) -> list[float]:
        """"parameters": parameter bytes. "time": there are no times here, so 3 x forward FLOPs
        (forward plus a backward of twice its work) stands in for them."""
        if by == "parameters":
            return [float(f.param_bytes) for f in self.facts(self.micro_batch, 1)]
        if not self.flops:
            self.flops = True
            self._facts.clear()
        return [3.0 * f.flops_fwd for f in self.facts(self.micro_batch, 1)]

    def output_shape(self, layer: int) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of layer ``layer``'s output for the configured micro-batch on one TP rank
        (its sequence shard under sequence parallelism; the whole tensor otherwise)."""
        f = self.facts(self.micro_batch, self.tp)[layer]
        return f.output_shape, f.output_dtype

    def output_order(self, layer: int) -> tuple[int, ...]:
        """Layer ``layer``'s output dimensions in memory order, outermost first (``storage_order``),
        as measured for the configured micro-batch."""
        f = self.facts(self.micro_batch, self.tp)[layer]
        return f.output_order or tuple(range(len(f.output_shape)))


# Micro-batch at which measured_layer_specs takes which storages a layer shares with its neighbours:
# at 1 a size-1 batch makes every transpose a view, so a batch-first LSTM/GRU/RNN saves its input
# as is there and a copy of it from 2 on (torch folds the time-major view to [seq x batch, features]
# for its input projection, a copy unless the storage is time-major; docs/memory.md).
LAYOUT_MICRO_BATCH = 2


def measured_layer_specs(workload: Workload) -> list[LayerSpec]:
    """Per-sample ``LayerSpec``s of a workload the simulator has no closed form for (a ResNet), from
    real fp32 measurements (``measure_layers`` at micro-batch 1, FLOPs counted): parameters,
    forward FLOPs, output, saved and selectively-kept activation elements; the storages a layer
    shares with its neighbours (boundary-shared input, the input it does not save, the output it
    saves) per sample at ``LAYOUT_MICRO_BATCH``, where layouts are those of any larger batch. Bytes
    do not depend on the device, so ``sim.analytic_costs.AnalyticCosts`` can price these layers on
    any GPU of the catalog by its roofline. Elements are fp32 bytes / 4 (small integer and
    statistics tensors count as elements of the model's dtype, as the transformer closed forms do)."""
    facts = StructuralCosts(workload, 1, "fp32", flops=True).facts(1, 1)
    layout = StructuralCosts(workload, LAYOUT_MICRO_BATCH, "fp32").facts(LAYOUT_MICRO_BATCH, 1)
    per_sample = 4 * LAYOUT_MICRO_BATCH
    names = workload.layer_names()
    return [LayerSpec(names[i], workload.layer_kind(i), params=f.param_bytes // 4, flops_fwd=int(f.flops_fwd),
                      output_elems=f.output_bytes // 4, saved_elems=f.saved_bytes // 4,
                      selective_elems=f.selective_saved_bytes // 4 if f.selective_saved_bytes >= 0 else -1,
                      shared_input_elems=shared.shared_input_bytes // per_sample,
                      unsaved_input_elems=shared.unsaved_input_bytes // per_sample,
                      saved_output_elems=shared.saved_output_bytes // per_sample)
            for i, (f, shared) in enumerate(zip(facts, layout, strict=True))]
