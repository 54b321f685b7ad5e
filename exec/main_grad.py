"""Megatron-LM's main-grad buffer in the runtime: where the Program says gradients are held in fp32
(``Program.grad_buffer_scale`` > 1, sim.model_state: 16-bit parameters whose dense all-reduce runs in
fp32, Megatron's rule for bf16), every gradient is added into an fp32 ``main_grad`` tensor per
parameter that lives all run, and the 16-bit ``.grad`` is freed right after (Megatron-LM's DDP hook,
megatron/model/distributed.py ``param_hook``, lines 171-176 at v2.5). The data-parallel reducer
all-reduces ``main_grad`` (exec.parallel.dp.BucketReduce), and the step sees it cast back to the
parameters' dtype (this runtime's optimizer is torch's Adam on the parameters themselves).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def _into_main_grad(p: nn.Parameter) -> None:
    p.main_grad.add_(p.grad)
    p.grad = None


class MainGrads:
    """The fp32 main-grad buffers of ``params``."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        for p in self.params:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            # autograd's own accumulation (full backward, deferred segments) lands here
            p.register_post_accumulate_grad_hook(_into_main_grad)

    def zero(self) -> None:
        for p in self.params:
            p.main_grad.zero_()

    def to_grads(self) -> None:
        """Hand the (reduced) main gradients to the optimizer, in the parameters' dtype."""
        for p in self.params:
            p.grad = p.main_grad.to(p.dtype)

    def nbytes(self) -> int:
        return sum(p.main_grad.numel() * p.main_grad.element_size() for p in self.params)


def accumulate_main(p: nn.Parameter, g: torch.Tensor) -> bool:
    """Add ``g`` to ``p``'s main gradient where it has one (an explicit ``autograd.grad`` result, which
    no hook sees); False where it has none."""
    main = getattr(p, "main_grad", None)
    if main is None:
        return False
    main.add_(g)
    return True
