"""Data-parallel gradient reduction in the Program's ALLREDUCE buckets.

A bucket names model layers; its gradients are flattened into one buffer, all-reduced (summed)
over the data-parallel group asynchronously, and on completion divided by the group size and
copied back, so every replica holds the mean gradient (gloo has no AVG reduction, hence the
division). Missing gradients count as zeros; sparse ones are densified first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


class BucketReduce:
    """One in-flight bucket all-reduce: ``wait()`` finishes it and writes the means back.

    Dense: the flattened gradients themselves are summed. A gradient-sync method that compresses
    (``exec.gradient_sync``) overrides ``encode`` (what is sent) and ``decode`` (sum -> mean)."""

    def __init__(self, params: Sequence[nn.Parameter], group: object, size: int) -> None:
        self.params = [p for p in params if p.requires_grad]
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                p.grad = p.grad.to_dense()
        self.grads = [p.grad for p in self.params]
        self.flat = _flatten_dense_tensors(self.grads) if self.grads else torch.zeros(0)
        self.size = size
        self.wire = self.encode(self.flat)
        self.work = dist.all_reduce(self.wire, group=group, async_op=True) if self.grads else None
        self.done = False

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        return flat

    def decode(self, summed: torch.Tensor) -> torch.Tensor:
        return summed.div_(self.size)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (and in the buffer being reduced)."""
        return self.wire.numel() * self.wire.element_size()

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> None:
        if self.done:
            return
        if self.work is not None:
            self.work.wait()
        mean = self.decode(self.wire)
        for grad, value in zip(self.grads, _unflatten_dense_tensors(mean, self.grads), strict=True):
            grad.copy_(value)
        self.done = True
