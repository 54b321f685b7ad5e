"""Megatron-LM's sequence parallelism (Korthikanti et al. 2022, section 4.2.2) for ``exec.parallel.tp``.

Under tensor parallelism t the layernorm / dropout / residual region of a block is replicated: every
TP rank holds the whole [b, s, h] tensor. Sequence parallelism splits that region along the sequence:
TP rank r holds positions ``[r s/t, (r+1) s/t)``. The transitions (activations are [b, s, h] here,
so the sequence is dim 1; Megatron-LM's are [s, b, h] and split dim 0):

- into a column-parallel linear: all-gather the sequence (``gather_linear``). Like Megatron-LM's
  ``LinearWithGradAccumulationAndAsyncCommunication`` with ``sequence_parallel`` it saves only the
  local shard and all-gathers it again in the backward for the weight gradient; the input gradient
  is reduce-scattered back to the shards.
- out of a row-parallel linear: reduce-scatter the partial outputs (``reduce_scatter_to_sequence``);
  its backward all-gathers the gradient.
- after the (replicated) embedding: keep this rank's slice (``scatter_to_sequence``); its backward
  all-gathers the slices' gradients, so the table sees the whole gradient on every rank.
- into the (replicated) LM head's projection: all-gather (``gather_from_sequence``); every rank then
  computes the same head and loss, so its backward keeps this rank's slice of the (identical)
  gradient, Megatron-LM's ``gather_from_sequence_parallel_region(..., tensor_parallel_output_grad=False)``.

Collectives: ``dist.all_gather`` and ``dist.reduce_scatter`` (list forms). Gloo runs reduce_scatter in
torch 2.13 (checked with two gloo processes: each rank gets its chunk of the sum), so no
all-reduce-and-slice stand-in is needed; a reduce-scatter moves half an all-reduce's bytes.

With ``group=None`` nothing is communicated and the shapes are kept (``exec.structure`` measures one
rank's shapes and saved bytes that way): a gather repeats the shard t times, a reduce-scatter or a
scatter keeps the first slice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

SEQ_DIM = 1  # [b, s, h]


def _gather(x: torch.Tensor, tp: int, group: object) -> torch.Tensor:
    x = x.contiguous()
    if group is None:
        return torch.cat([x] * tp, dim=SEQ_DIM)
    parts = [torch.empty_like(x) for _ in range(tp)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=SEQ_DIM)


def _reduce_scatter(x: torch.Tensor, tp_rank: int, tp: int, group: object) -> torch.Tensor:
    chunks = [c.contiguous() for c in x.chunk(tp, dim=SEQ_DIM)]
    if group is None:
        return chunks[0]
    out = torch.empty_like(chunks[tp_rank])
    dist.reduce_scatter(out, chunks, group=group)
    return out


def _split(x: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    return x.chunk(tp, dim=SEQ_DIM)[tp_rank].contiguous()


class _ScatterToSequence(torch.autograd.Function):
    """Forward: this rank's slice of a replicated tensor; backward: all-gather of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp_rank: int, tp: int, group: object) -> torch.Tensor:  # type: ignore[override]
        ctx.tp, ctx.group = tp, group
        return _split(x, tp_rank, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return _gather(grad, ctx.tp, ctx.group), None, None, None


class _GatherFromSequence(torch.autograd.Function):
    """Forward: all-gather into a tensor every rank then uses alike; backward: this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp_rank: int, tp: int, group: object) -> torch.Tensor:  # type: ignore[override]
        ctx.tp_rank, ctx.tp = tp_rank, tp
        return _gather(x, tp, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return _split(grad, ctx.tp_rank, ctx.tp), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Forward: reduce-scatter of partial sums; backward: all-gather of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp_rank: int, tp: int, group: object) -> torch.Tensor:  # type: ignore[override]
        ctx.tp, ctx.group = tp, group
        return _reduce_scatter(x, tp_rank, tp, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return _gather(grad, ctx.tp, ctx.group), None, None, None


class _GatherLinear(torch.autograd.Function):
    """y = all_gather(x) W^T + b, saving x's shard only (see module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                tp_rank: int, tp: int, group: object) -> torch.Tensor:
        ctx.tp_rank, ctx.tp, ctx.group, ctx.has_bias = tp_rank, tp, group, bias is not None
        x = x.contiguous()
        ctx.save_for_backward(x, weight)
        return F.linear(_gather(x, tp, group), weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        needs_x, needs_w, needs_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if needs_x:  # the full-sequence input gradient of this rank's columns, summed into the shards
            grad_x = _reduce_scatter(grad.matmul(weight), ctx.tp_rank, ctx.tp, ctx.group)
        if needs_w:  # re-gathered: the forward kept only the shard (Megatron-LM does the same)
            full = _gather(x, ctx.tp, ctx.group)
            grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(full.reshape(-1, full.shape[-1]))
        if needs_b and ctx.has_bias:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b, None, None, None


class SequenceGatherLinear(nn.Linear):
    """An nn.Linear (so hooks and parameter names stay those of one) whose input is this rank's
    sequence shard: ``_GatherLinear``."""

    tp_rank: int
    tp: int
    group: object

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherLinear.apply(x, self.weight, self.bias, self.tp_rank, self.tp, self.group)


def gather_linear(linear: nn.Linear, tp_rank: int, tp: int, group: object) -> SequenceGatherLinear:
    """``linear`` (its parameters, not copies) as a ``SequenceGatherLinear``."""
    linear.__class__ = SequenceGatherLinear
    linear.tp_rank, linear.tp, linear.group = tp_rank, tp, group
    return linear  # type: ignore[return-value]


class SequenceScatter(nn.Module):
    """Where a replicated tensor enters the sequence-parallel region (after the embedding)."""

    def __init__(self, tp_rank: int, tp: int, group: object) -> None:
        super().__init__()
        self.tp_rank, self.tp, self.group = tp_rank, tp, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScatterToSequence.apply(x, self.tp_rank, self.tp, self.group)


class SequenceGather(SequenceScatter):
    """Where the sequence-parallel region ends before replicated work (the LM head's projection)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherFromSequence.apply(x, self.tp_rank, self.tp, self.group)


def reduce_scatter_to_sequence(x: torch.Tensor, tp_rank: int, tp: int, group: object) -> torch.Tensor:
    return _ReduceScatterToSequence.apply(x, tp_rank, tp, group)


def mark_sequence_parallel(module: nn.Module) -> None:
    """Tag parameters that see only this rank's part of the sequence (layernorms, row-parallel biases):
    their gradients are partial sums, all-reduced over the TP group before the step (Megatron-LM tags
    them ``sequence_parallel`` and all-reduces them in ``finalize_model_grads``)."""
    for p in module.parameters(recurse=False):
        p.sequence_parallel = True  # type: ignore[attr-defined]


def allreduce_sequence_parallel_grads(params: list[nn.Parameter], group: object) -> int:
    """Sum the tagged parameters' gradients (their fp32 main gradients where they have them) over the
    TP group, in one flat buffer; returns its bytes."""
    grads = [getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
             for p in params]
    grads = [g for g in grads if g is not None]
    if not grads or group is None:
        return 0
    return allreduce_in_place(grads, group)


def allreduce_in_place(tensors: list[torch.Tensor], group: object) -> int:
    """Sum ``tensors`` over ``group`` in one flat all-reduce, each overwritten with its sum; returns
    the flat buffer's bytes."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return flat.numel() * flat.element_size()


# The run's seed for the region's generators: the runtime's layers are built from seed 0
# (exec.workloads.base.Workload.build_layers), as Megatron-LM's default --seed is one number for the run.
SEQUENCE_RNG_SEED = 0


class SequenceParallelRng:
    """A per-TP-rank random generator for the dropouts of the sequence-parallel region (Megatron-LM's
    ``get_cuda_rng_tracker().fork()`` under ``model_parallel_cuda_manual_seed``: the tensor-model-
    parallel seed is the run's seed + 2718 + the TP rank). Each TP rank holds a different slice of the
    sequence, so its masks must differ from its peers'; outside the region (the replicated head) the
    ranks keep drawing from the shared generator. ``fork`` runs its body with the process's generators
    set to this rank's state and keeps what the body drew; ``state``/``restore`` let a recomputed
    forward replay the same masks (exec.activations.RngState)."""

    OFFSET = 2718  # Megatron-LM's offset of the tensor-model-parallel seed (model_parallel_cuda_manual_seed)

    def __init__(self, seed: int, tp_rank: int, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        with torch.random.fork_rng(devices=[device] if self.cuda else []):
            torch.manual_seed(seed + self.OFFSET + tp_rank)
            self._state = self._take()

    def _take(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.cuda else None

    def state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._state

    def restore(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        self._state = state

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=[self.device] if self.cuda else []):
            torch.set_rng_state(self._state[0])
            if self.cuda:
                torch.cuda.set_rng_state(self._state[1], self.device)
            yield
            self._state = self._take()


def forked(rng: SequenceParallelRng | None) -> contextlib.AbstractContextManager:
    """The region's generator where the layer runs sequence-parallel with one, else nothing."""
    return rng.fork() if rng is not None else contextlib.nullcontext()
