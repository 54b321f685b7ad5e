"""PyTorch's selective activation checkpointing (SAC), as the ``selective`` memory policy runs it.

Each layer runs under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
context_fn=create_selective_checkpoint_contexts(policy))`` (torch >= 2.4) with the policy of
torch's own SAC examples (``torch.utils.checkpoint`` docs and the PyTorch blog "Current and New
Activation Checkpointing Techniques in PyTorch", 2025): the outputs of compute-intensive operators
(matrix multiplications, attention kernels, convolutions) are kept (``MUST_SAVE``); everything else
(layer norms, GELU, adds, views, softmax, embedding lookups) is recomputed in the backward
(``PREFER_RECOMPUTE``). Torch does the recomputation itself, inside the backward, when the backward
first needs a tensor of the layer.

What a layer keeps: the checkpoint's saved inputs (they go through any outer
``saved_tensors_hooks``) plus the kept operator outputs, which torch stores in its own cache and
which no saved-tensor hook sees. ``SelectiveRecord`` collects those outputs from the policy
function (``SelectiveCheckpointContext.op_output``, torch >= 2.5) so the runtime can count them.

Torch allows one backward through a SAC region ("Trying to backward an extra time"), so the policy
cannot serve split-backward schedules (BWD_I then BWD_W walk the graph twice).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# Operators whose outputs are kept: the matmul family and the attention and convolution kernels
# (every backend's name for them, so a CUDA run keeps what a CPU run keeps).
_KEPT_NAMES = (
    "mm", "addmm", "bmm", "baddbmm", "convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward",
)
COMPUTE_INTENSIVE = frozenset(getattr(_aten, name).default for name in _KEPT_NAMES if hasattr(_aten, name))


class SelectiveRecord:
    """The kept operator outputs of the SAC regions run while it records (one (stage, micro-batch))."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []

    def policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in COMPUTE_INTENSIVE:
            if not ctx.is_recompute:
                out = getattr(ctx, "op_output", None)
                self.kept.extend(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def contexts(self) -> Any:
        return create_selective_checkpoint_contexts(self.policy)

    def run(self, layer: nn.Module | Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``layer(x)`` under SAC; the backward recomputes what the policy did not keep."""
        return checkpoint(layer, x, use_reentrant=False, context_fn=self.contexts)

    def clear(self) -> None:
        self.kept.clear()


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    # Meta storages have no address; their Python identity is stable while the tensor lives.
    return (storage._cdata if t.device.type == "meta" else storage.data_ptr(), storage.nbytes())


def selective_saved_bytes(layer: nn.Module, x: torch.Tensor, param_keys: set[tuple[int, int]],
                          after: Callable[[torch.Tensor], Any] | None = None) -> int:
    """Bytes one forward of ``layer`` keeps for its backward under SAC: what autograd saves through
    hooks (the checkpoint's inputs; and ``after``'s saves, e.g. the loss on the last layer, which
    runs outside the region) plus the kept operator outputs, each storage once, parameters excluded."""
    saved: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in param_keys:
            saved[key] = key[1]
        return t

    record = SelectiveRecord()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = record.run(layer, x)
        if after is not None:
            after(out)
    for t in record.kept:
        key = storage_key(t)
        if key not in param_keys:
            saved[key] = key[1]
    return sum(saved.values())



def checkpoint_attention_cores(module: nn.Module, on: bool = True) -> int:
    """Korthikanti et al.'s selective recomputation (``memory: {policy: selective-attention}``,
    sim.memory_attention): every attention module that offers it (``checkpoint_core``, the runtime
    GPT's unfused attention) runs its core (scores, softmax, dropout, the product with V) under
    torch's checkpoint, keeping only the core's inputs; returns how many modules it set."""
    count = 0
    for m in module.modules():
        if hasattr(m, "checkpoint_core"):
            m.checkpoint_core = on
            count += 1
    return count
