"""Megatron-style tensor parallelism of transformer blocks, applied from outside the model.

A block's attention is sharded by heads and its MLP by hidden units over ``tp`` ranks:

    x -> f -> qkv (column-parallel) -> attention on heads/tp heads -> proj (row-parallel) -> g -> + b
    x -> f -> fc1 (column-parallel) -> GELU                         -> fc2  (row-parallel) -> g -> + b

``f`` is the identity forward and an all-reduce of the input gradient backward; ``g`` all-reduces
the partial outputs forward and is the identity backward (Shoeybi et al. 2019, Megatron-LM, Sec. 3).
Shards are cut from the full, seeded weights, so a TP run computes what one process computes.
Row-parallel biases are kept whole on every rank and added after the all-reduce (once, not tp
times). Embedding and head layers stay replicated, as the simulator's cost models assume (a table
sharded by an embedding method takes its TP rank's columns instead, ``gather_columns_from_tp``).
With ``sequence_parallel`` (Megatron-LM's sequence parallelism, exec.parallel.sequence) f and g become
an all-gather and a reduce-scatter along the sequence, and the replicated region runs on 1/tp of it.

Modules are found by attribute, not by class: an attention module has ``qkv``, ``proj`` (nn.Linear)
and ``heads``; an MLP has ``fc1`` and ``fc2`` (nn.Linear). With ``group=None`` no communication
happens (used to measure the shapes and bytes of one shard).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from exec.parallel.sequence import (
    SequenceGather,
    SequenceParallelRng,
    SequenceScatter,
    gather_linear,
    mark_sequence_parallel,
    reduce_scatter_to_sequence,
)
from traces.errors import ConfigError


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        if ctx.group is not None:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object) -> torch.Tensor:  # type: ignore[override]
        out = x.contiguous().clone()
        if group is not None:
            dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


class _GatherColumnsFromTP(torch.autograd.Function):
    """All-gather of each TP rank's columns forward (rank order), this rank's columns of the gradient
    backward: exact when the gradient is the same on every TP rank, as it is for a layer feeding the
    blocks (their ``f`` all-reduces the input gradient). A sharded embedding table's rows under TP
    (exec.embedding) use it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp_rank: int, tp: int, group: object) -> torch.Tensor:  # type: ignore[override]
        ctx.tp_rank, ctx.width = tp_rank, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(tp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return grad[..., ctx.tp_rank * ctx.width:(ctx.tp_rank + 1) * ctx.width].contiguous(), None, None, None


def gather_columns_from_tp(x: torch.Tensor, tp_rank: int, tp: int, group: object) -> torch.Tensor:
    return x if tp == 1 else _GatherColumnsFromTP.apply(x, tp_rank, tp, group)


def copy_to_tp(x: torch.Tensor, group: object) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: object) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding copies of ``weight`` and ``bias`` (built on meta: no throwaway init)."""
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.detach().clone())
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().clone())
    return linear


class ColumnParallelLinear(nn.Module):
    """Rows ``[r*n/t, (r+1)*n/t)`` of a Linear's weight and bias; input through f, or, under sequence
    parallelism, all-gathered along the sequence (exec.parallel.sequence.gather_linear)."""

    def __init__(self, full: nn.Linear, tp_rank: int, tp: int, group: object, sequence_parallel: bool = False) -> None:
        super().__init__()
        bias = full.bias.chunk(tp, dim=0)[tp_rank] if full.bias is not None else None
        self.linear = _linear(full.weight.chunk(tp, dim=0)[tp_rank], bias)
        self.group = group
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            gather_linear(self.linear, tp_rank, tp, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) if self.sequence_parallel else self.linear(copy_to_tp(x, self.group))


class RowParallelLinear(nn.Module):
    """Columns ``[r*n/t, (r+1)*n/t)`` of a Linear's weight; partial outputs summed by g, then + bias.
    Under sequence parallelism the sum is reduce-scattered along the sequence and the (replicated)
    bias is added to this rank's shard only, so its gradient is partial: tagged for the TP all-reduce."""

    def __init__(self, full: nn.Linear, tp_rank: int, tp: int, group: object, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.linear = _linear(full.weight.chunk(tp, dim=1)[tp_rank], None)
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None
        self.group = group
        self.tp_rank, self.tp, self.sequence_parallel = tp_rank, tp, sequence_parallel
        if sequence_parallel:
            mark_sequence_parallel(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence(self.linear(x), self.tp_rank, self.tp, self.group)
        else:
            out = reduce_from_tp(self.linear(x), self.group)
        return out + self.bias if self.bias is not None else out


def _is_attention(m: nn.Module) -> bool:
    linears = all(isinstance(getattr(m, name, None), nn.Linear) for name in ("qkv", "proj"))
    return linears and hasattr(m, "heads")


def _is_mlp(m: nn.Module) -> bool:
    return isinstance(getattr(m, "fc1", None), nn.Linear) and isinstance(getattr(m, "fc2", None), nn.Linear)


def sharded_layer(layer: nn.Module) -> bool:
    """Whether TP shards this layer (it holds an attention or an MLP)."""
    return any(_is_attention(m) or _is_mlp(m) for m in layer.modules())


def apply_tensor_parallel(layers: nn.ModuleList, tp_rank: int, tp: int, group: object,
                          sequence_parallel: bool = False, rng: SequenceParallelRng | None = None) -> nn.ModuleList:
    """Shard every attention and MLP inside ``layers`` in place for TP rank ``tp_rank`` of ``tp``.

    ``sequence_parallel`` (exec.parallel.sequence): the linears gather / reduce-scatter along the
    sequence; a module's ``sequence_scatter`` / ``sequence_gather`` placeholder (an ``nn.Identity``
    where a workload's replicated part meets the sequence-parallel region) becomes the scatter or
    gather; every LayerNorm of a layer that has either, or that TP shards, runs on the sequence shard
    and is tagged for the TP all-reduce of its gradients; a module with a ``sequence_rng`` slot in such a
    layer draws its dropout masks from ``rng`` (this TP rank's generator; None: the shared one)."""
    if tp == 1:
        return layers
    if sequence_parallel:
        _apply_sequence_regions(layers, tp_rank, tp, group, rng)
    for module in list(layers.modules()):
        if _is_attention(module):
            if module.heads % tp:
                raise ConfigError("tp", f"tp={tp} does not divide the {module.heads} attention heads",
                                  "choose tp dividing the head count")
            module.qkv = ColumnParallelLinear(module.qkv, tp_rank, tp, group, sequence_parallel)
            module.proj = RowParallelLinear(module.proj, tp_rank, tp, group, sequence_parallel)
            module.heads //= tp
        elif _is_mlp(module):
            if module.fc1.out_features % tp:
                raise ConfigError("tp", f"tp={tp} does not divide the MLP width {module.fc1.out_features}",
                                  "choose tp dividing the MLP width")
            module.fc1 = ColumnParallelLinear(module.fc1, tp_rank, tp, group, sequence_parallel)
            module.fc2 = RowParallelLinear(module.fc2, tp_rank, tp, group, sequence_parallel)
    return layers


def _apply_sequence_regions(layers: nn.ModuleList, tp_rank: int, tp: int, group: object,
                            rng: SequenceParallelRng | None) -> None:
    for layer in layers:
        edges = False
        for module in list(layer.modules()):
            for name, cls in (("sequence_scatter", SequenceScatter), ("sequence_gather", SequenceGather)):
                if isinstance(getattr(module, name, None), nn.Identity):
                    setattr(module, name, cls(tp_rank, tp, group))
                    edges = True
        if edges or sharded_layer(layer):
            for module in layer.modules():
                if isinstance(module, nn.LayerNorm):
                    mark_sequence_parallel(module)
                if hasattr(module, "sequence_rng"):
                    module.sequence_rng = rng
