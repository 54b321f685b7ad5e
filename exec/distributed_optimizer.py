"""The runtime's distributed optimizer (``gradient_sync: {method: distopt}``, sim.gradient_sync_distopt):
Megatron-LM 23.04's ``--use-distributed-optimizer`` (ZeRO stage 1) on real tensors.

Per gradient bucket of the Program (its ALLREDUCE instructions), the bucket's parameters are moved
into one flat buffer (each parameter a view of it, as Megatron-LM's contiguous buffer holds them),
padded to a multiple of the data-parallel size d and cut into d equal chunks; replica r owns chunk r.
Its optimizer (torch's Adam, ``exec.contract.make_optimizer``, as the dense runtime) holds state for
the owned elements only: the chunk itself is the parameter it steps (a view, so the step updates the
model in place), the padding left out. A bucket instruction reduce-scatters the flattened gradients
(their fp32 main gradients where the Program holds them, summed in fp32 where ``reduce_dtype`` says
so) and divides the owned sum by d; the step updates the chunks; the all-gather instruction after the
step (tagged ``PARAM_GATHER_TAG``) gathers every chunk into every replica's flat buffer in place.
gloo supports both collectives (torch runs its reduce-scatter as an all-reduce plus a copy of the
chunk: exec.commbench, IMPLEMENTATION_NOTES); the result is the dense method's up to summation order.

Not modelled: the owned gradients' 1/d copy the step reads (Megatron's fp32 main-grad shard under
fp16) is an extra tensor here, outside the ledger's runtime costs, which count no step copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors

from exec.contract import make_optimizer
from exec.parallel.dp import Works
from exec.parallel.sequence import allreduce_in_place
from sim.gradient_sync import GradientSyncConfig, reduces_in_fp32
from sim.gradient_sync_distopt import PARAM_GATHER_TAG
from sim.program import Instruction, Kind, RankProgram

BUCKET_TAG = "dp:"  # the data-parallel buckets' tags (sim.lower.gradient_sync_pass)
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    flat: torch.Tensor  # every parameter of the bucket, padded to d equal chunks
    numel: int  # without the padding
    chunk: int  # elements per replica
    owned: nn.Parameter  # this replica's chunk less any padding: a view of ``flat``
    # Sequence parallelism (exec.parallel.sequence): the (offset, numel) in ``flat`` of its parameters
    # tagged ``sequence_parallel``, and, between the bucket's reduce-scatter and the step, their
    # gradients as Megatron-LM's main-grad buffer holds them then (the DP mean in the owned chunk,
    # this rank's own gradient elsewhere), in the reduced dtype.
    sp_ranges: list[tuple[int, int]] = field(default_factory=list)
    sp_grads: torch.Tensor | None = None


class DistributedOptimizer:
    """The sharded optimizer of one rank: ``execute`` runs its bucket and all-gather instructions,
    ``step``/``zero_grad``/``state`` stand where the dense runtime's torch optimizer does."""

    def __init__(self, program: RankProgram, params_of: Callable[[tuple[int, ...]], list[nn.Parameter]],
                 group: Any, size: int, rank: int, settings: GradientSyncConfig) -> None:
        self.group, self.size, self.rank, self.settings = group, size, rank, settings
        self.buckets: dict[tuple[int, ...], _Bucket] = {}
        for ins in program.instructions:
            if ins.kind is Kind.ALLREDUCE and ins.tag.startswith(BUCKET_TAG):
                self.buckets[ins.layers] = self._shard([p for p in params_of(ins.layers) if p.requires_grad])
        self.optimizer = make_optimizer([b.owned for b in self.buckets.values() if b.owned.numel()])

    def _shard(self, params: Sequence[nn.Parameter]) -> _Bucket:
        numel = sum(p.numel() for p in params)
        chunk = -(-numel // self.size)
        device, dtype = params[0].device, params[0].dtype
        flat = torch.zeros(chunk * self.size, dtype=dtype, device=device)
        offset = 0
        with torch.no_grad():
            for p in params:  # each parameter becomes a view of the flat buffer, its values kept
                flat[offset:offset + p.numel()].copy_(p.reshape(-1))
                p.data = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        start = self.rank * chunk
        owned = nn.Parameter(flat[start:min(start + chunk, numel)])
        ranges, offset = [], 0
        for p in params:
            if getattr(p, "sequence_parallel", False):
                ranges.append((offset, p.numel()))
            offset += p.numel()
        return _Bucket(list(params), flat, numel, chunk, owned, ranges)

    # -- the instructions ---------------------------------------------------------------------------
    def execute(self, ins: Instruction) -> tuple[Any, int, Callable[[], None] | None]:
        """(work, bytes in the nccl-tests convention, what to do once it completes) of a bucket's
        reduce-scatter or of the parameter all-gather after the step."""
        if ins.tag.startswith(PARAM_GATHER_TAG):
            return self._gather()
        return self._reduce(self.buckets[ins.layers])

    def _reduce(self, bucket: _Bucket) -> tuple[Any, int, Callable[[], None]]:
        grads = []
        for p in bucket.params:
            main = getattr(p, "main_grad", None)  # Megatron's fp32 buffer (exec.main_grad)
            if main is not None:
                grads.append(main)
            elif p.grad is None:
                grads.append(torch.zeros_like(p))
            else:  # a sparse embedding's gradient goes dense, as the dense all-reduce sends it (exec.parallel.dp)
                grads.append(p.grad.to_dense() if p.grad.is_sparse else p.grad)
        flat = _flatten_dense_tensors(grads)
        if reduces_in_fp32(self.settings, _DTYPE_NAMES.get(flat.dtype, "")):
            flat = flat.float()
        padded = torch.zeros(bucket.chunk * self.size, dtype=flat.dtype, device=flat.device)
        padded[:bucket.numel].copy_(flat)
        out = torch.empty(bucket.chunk, dtype=flat.dtype, device=flat.device)
        work = _reduce_scatter(out, padded, group=self.group, async_op=True)

        def then() -> None:  # the owned elements' mean, in the parameters' dtype
            mean = out[:bucket.owned.numel()].div_(self.size)
            bucket.owned.grad = mean.to(bucket.owned.dtype)
            if bucket.sp_ranges:  # held for sum_sequence_parallel, as the main-grad buffer holds them now
                start = self.rank * bucket.chunk
                padded[start:start + mean.numel()].copy_(mean)
                bucket.sp_grads = torch.cat([padded[o:o + n] for o, n in bucket.sp_ranges])

        return Works([work]), padded.numel() * padded.element_size(), then

    def _gather(self) -> tuple[Any, int, None]:
        works, nbytes = [], 0
        for bucket in self.buckets.values():
            mine = bucket.flat[self.rank * bucket.chunk:(self.rank + 1) * bucket.chunk]
            works.append(_all_gather(bucket.flat, mine, group=self.group, async_op=True))
            nbytes += bucket.flat.numel() * bucket.flat.element_size()
        return Works(works), nbytes, None

    def sum_sequence_parallel(self, tp_group: Any) -> int:
        """Sum sequence parallelism's partial gradients over the TP group after the buckets' reduce-
        scatters and before the step, as Megatron-LM does on its main-grad buffer (``finalize_model_grads``:
        ``finish_grad_sync``, then the layernorm all-reduce over the whole of those parameters' gradients,
        of which the step reads the owned chunk). Sums over DP and over TP commute, so the owned elements
        get the sum the dense method steps with. One flat all-reduce of every bucket's tagged gradients
        (the bytes sim.costs.sequence_parallel_grads_s prices); returns its bytes."""
        pending = [b for b in self.buckets.values() if b.sp_grads is not None]
        if not pending or tp_group is None:
            return 0
        nbytes = allreduce_in_place([b.sp_grads for b in pending], tp_group)
        for b in pending:
            summed = b.sp_grads
            start, end = self.rank * b.chunk, self.rank * b.chunk + b.owned.numel()
            grad, cursor = b.owned.grad.clone(), 0
            for offset, n in b.sp_ranges:  # the owned part of each tagged parameter
                lo, hi = max(offset, start), min(offset + n, end)
                if lo < hi:
                    grad[lo - start:hi - start] = summed[cursor + lo - offset:cursor + hi - offset]
                cursor += n
            b.owned.grad, b.sp_grads = grad, None
        return nbytes

    # -- what the interpreter asks of an optimizer ----------------------------------------------------
    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for bucket in self.buckets.values():
            for p in bucket.params:
                p.grad = None

    @property
    def state(self) -> Any:
        return self.optimizer.state
