"""The runtime's side of each gradient-sync method: the reducer that sends a bucket of gradients
and writes their mean back. ``sim.gradient_sync`` registers the simulator's side under the same
names; lowering writes the name into every ``ALLREDUCE`` instruction (``Instruction.method``)."""

from __future__ import annotations

import torch

from exec.parallel.dp import BucketReduce


class Fp16BucketReduce(BucketReduce):
    """fp16 compression (``sim.gradient_sync_fp16``): each replica's share, grad / dp, is cast to
    fp16 and summed; the sum is cast back to the gradients' dtype. Dividing first keeps the fp16
    sum within range wherever the fp32 mean is (as DDP's fp16_compress_hook does)."""

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        return (flat / self.size).to(torch.float16)

    def decode(self, summed: torch.Tensor) -> torch.Tensor:
        return summed.to(self.flat.dtype)


REDUCERS: dict[str, type[BucketReduce]] = {"allreduce": BucketReduce, "fp16": Fp16BucketReduce}
