"""The runtime's side of each gradient-sync method: the reducer that sends a bucket of gradients
and writes their mean back. ``sim.gradient_sync`` registers the simulator's side under the same
names; lowering writes the name into every ``ALLREDUCE`` instruction (``Instruction.method``).

``ddp_hook`` turns any of them into a plain torch DDP communication hook."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from exec.gradient_sync_lowrank import PowerSGDReduce
from exec.gradient_sync_sparse import AllGatherSparseReduce, OmniReduce, S2Reduce, TopKReduce, touched_rows
from exec.parallel.dp import BucketReduce
from sim.gradient_sync import GRADIENT_SYNC
from traces.errors import ConfigError


class Fp16BucketReduce(BucketReduce):
    """fp16 compression (``sim.gradient_sync_fp16``): each replica's share, grad / dp, is cast to
    fp16 and summed; the sum is cast back to the gradients' dtype. Dividing first keeps the fp16
    sum within range wherever the fp32 mean is (as DDP's fp16_compress_hook does)."""

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        return (flat / self.size).to(torch.float16)

    def decode(self, summed: torch.Tensor) -> torch.Tensor:
        return summed.to(self.flat.dtype)


REDUCERS: dict[str, type[BucketReduce]] = {
    "allreduce": BucketReduce, "fp16": Fp16BucketReduce, "s2": S2Reduce, "agsparse": AllGatherSparseReduce,
    "omnireduce": OmniReduce, "topk": TopKReduce, "powersgd": PowerSGDReduce,
}


@dataclass
class HookState:
    """What a DDP hook keeps: the method, its settings, the row-sparse parameters, and per bucket
    the method's own state (residuals, Q) across iterations."""

    method: str
    settings: Any
    group: Any
    row_sparse: set[int]  # id() of the parameters whose gradients are row-sparse (embeddings)
    buckets: dict[int, dict[str, Any]] = field(default_factory=dict)


def ddp_hook(method: str, settings: dict[str, Any] | None = None, row_sparse: Collection[nn.Parameter] = (),
             group: Any = None) -> tuple[HookState, Callable[[HookState, Any], torch.futures.Future]]:
    """(state, hook) for ``DistributedDataParallel.register_comm_hook(state, hook)``.

    DDP hands a hook dense gradients, so the parameters whose rows a method may send sparsely
    (embedding tables) are named in ``row_sparse``; their touched rows are the non-zero ones. The
    hook reduces the bucket synchronously (its collectives run on the calling thread, in bucket
    order on every rank) and returns a completed future of the bucket's mean."""
    if method not in REDUCERS:  # distopt: an optimizer, not a bucket reducer (exec.distributed_optimizer)
        raise ConfigError("gradient_sync.method", f"{method} has no DDP communication hook",
                          f"use one of {', '.join(REDUCERS)}")
    config = GRADIENT_SYNC[method].config.model_validate({"method": method, **(settings or {})})
    state = HookState(method, config, group or dist.group.WORLD, {id(p) for p in row_sparse})

    def hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        grads = [g.clone() for g in bucket.gradients()]
        rows = [touched_rows(g) if id(p) in state.row_sparse else None
                for p, g in zip(bucket.parameters(), grads, strict=True)]
        size = dist.get_world_size(state.group)
        reducer = REDUCERS[state.method].from_grads(grads, rows, state.group, size, state.settings,
                                                    state.buckets.setdefault(bucket.index(), {}))
        reducer.wait()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(torch.cat([g.reshape(-1) for g in grads]).to(bucket.buffer().dtype))
        return future

    # DDP checks the hook's annotations as objects (this module's are strings: postponed evaluation).
    hook.__annotations__ = {"state": HookState, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return state, hook
