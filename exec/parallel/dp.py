"""Data-parallel gradient reduction in the Program's ALLREDUCE buckets.

A bucket names model layers; its gradients are flattened into one buffer, all-reduced (summed)
over the data-parallel group asynchronously, and on completion divided by the group size and
copied back, so every replica holds the mean gradient (gloo has no AVG reduction, hence the
division). Missing gradients count as zeros; sparse ones are densified first, and the rows they
touch are kept (``rows``) for the gradient-sync methods that send only those.

A method with several collectives (``exec.gradient_sync``) issues the ones whose result it needs
before the next synchronously in ``start`` and only the last asynchronously: every collective is
issued by the main thread in program order, so every rank issues them in the same order (a
collective issued from a completion callback or a watcher thread could interleave with the next
bucket's differently on different ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from sim.gradient_sync import reduces_in_fp32

# State that a method keeps across iterations (error-feedback residuals, PowerSGD's Q), per
# bucket: keyed by the identities of the bucket's parameters, which live as long as the run.
_STATE: dict[tuple[int, ...], dict[str, Any]] = {}


class Works:
    """Several asynchronous collectives waited for as one."""

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = list(works)

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class BucketReduce:
    """One in-flight bucket all-reduce: ``wait()`` finishes it and writes the means back.

    Dense: the flattened gradients themselves are summed. A gradient-sync method that compresses
    (``exec.gradient_sync``) overrides ``encode`` (what is sent) and ``decode`` (sum -> mean), or,
    for several collectives, ``start`` and ``finish``."""

    def __init__(self, params: Sequence[nn.Parameter], group: object, size: int, settings: Any = None) -> None:
        params = [p for p in params if p.requires_grad]
        rows: list[torch.Tensor | None] = []
        grads: list[torch.Tensor] = []
        for p in params:
            touched = None
            main = getattr(p, "main_grad", None)  # Megatron's fp32 buffer (exec.main_grad): reduced in place
            if main is not None:
                grads.append(main)
                rows.append(touched)
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                touched = p.grad.coalesce().indices()[0]
                p.grad = p.grad.to_dense()
            grads.append(p.grad)
            rows.append(touched)
        state = _STATE.setdefault(tuple(id(p) for p in params), {})
        self._setup(grads, rows, group, size, settings, state)

    @classmethod
    def from_grads(cls, grads: Sequence[torch.Tensor], rows: Sequence[torch.Tensor | None], group: object,
                   size: int, settings: Any, state: dict[str, Any]) -> BucketReduce:
        """A reducer over plain tensors (a DDP hook's bucket); ``rows``: the touched rows of each
        row-sparse one, None for dense ones."""
        reducer = cls.__new__(cls)
        reducer._setup(list(grads), list(rows), group, size, settings, state)
        return reducer

    def _setup(self, grads: list[torch.Tensor], rows: list[torch.Tensor | None], group: object, size: int,
               settings: Any, state: dict[str, Any]) -> None:
        self.grads, self.rows = grads, rows
        self.group, self.size, self.settings, self.state = group, size, settings, state
        self.works: list[Any] = []
        self.sent = 0
        self.done = False
        if self.grads:
            self.start()

    # -- collectives, counted in the nccl-tests convention of sim.collectives ----------------------
    def all_reduce(self, tensor: torch.Tensor, wait: bool = False, op: Any = None) -> torch.Tensor:
        self.sent += tensor.numel() * tensor.element_size()
        work = dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._keep(work, wait)
        return tensor

    def all_gather(self, tensor: torch.Tensor, wait: bool = False) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self.sent += self.size * tensor.numel() * tensor.element_size()
        work = dist.all_gather(out, tensor, group=self.group, async_op=True)
        self._keep(work, wait)
        return out

    def _keep(self, work: Any, wait: bool) -> None:
        if wait:
            work.wait()
        else:
            self.works.append(work)

    # -- dense all-reduce ---------------------------------------------------------------------------
    def start(self) -> None:
        self.flat = _flatten_dense_tensors(self.grads)
        self.wire = self.all_reduce(self.encode(self.flat))

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        # ``reduce_dtype`` (sim.gradient_sync.DenseAllReduce): 16-bit gradients summed in fp32 where the
        # settings say so (Megatron-LM's rule for bf16); write_back casts the mean back.
        if self.settings is not None and reduces_in_fp32(self.settings, _DTYPE_NAMES.get(flat.dtype, "")):
            return flat.float()
        return flat

    def decode(self, summed: torch.Tensor) -> torch.Tensor:
        return summed.div_(self.size)

    def finish(self) -> None:
        self.write_back(self.grads, self.decode(self.wire))

    @staticmethod
    def write_back(grads: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
        for grad, value in zip(grads, _unflatten_dense_tensors(flat, list(grads)), strict=True):
            grad.copy_(value)

    # -- what the runtime sees ------------------------------------------------------------------------
    @property
    def work(self) -> Works | None:
        return Works(self.works) if self.works else None

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (all-gather: its output), all collectives of the bucket together."""
        return self.sent

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        if self.done:
            return
        for work in self.works:
            work.wait()
        if self.grads:
            self.finish()
        self.done = True
