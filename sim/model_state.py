"""The gradient buffer a rank holds, as Megatron-LM holds it: the one rule the memory ledger, the fast
estimate and the memory planners (the MILP, DELTA) all apply to a layer's gradient bytes.

``LayerCosts.grad_bytes`` is the gradient in the parameters' dtype (what a gradient-sync method
sends unless told otherwise). Megatron-LM's local DDP accumulates every gradient into a ``main_grad``
buffer that lives all iteration; its dtype is fp32 when ``--accumulate-allreduce-grads-in-fp32``,
which bf16 forces on, else the parameters' (megatron/model/distributed.py, ``_grad_buffers``,
``torch.float if accumulate_allreduce_grads_in_fp32 else param.dtype``, lines 124-130 at v2.5 e269e20
and 739cb43; megatron/arguments.py lines 136-155 at v2.5: bf16 forces it). The dtype of that buffer is
the dtype of the all-reduce, so the plan's ``gradient_sync.reduce_dtype`` (``sim.gradient_sync.
reduces_in_fp32``) decides both. Per parameter, with the optimizer state of ``sim.analytic.STATE_BYTES``
(fp32 master weights and two fp32 Adam moments, 12 B), a Megatron bf16 model holds 2 + 4 + 12 = 18 B and
an fp16 one 2 + 2 + 12 = 16 B, Megatron's own table (docs/distrib_optimizer.md at 23.04: 18 and 20,
the 20 counting the fp32 copy of the gradients the fp16 optimizer makes at its step: ``step_copy_bytes``,
which the ledger holds during the step; ``step_peak_bytes`` is what a rank holds then, which the
estimate and the memory planners (the MILP, DELTA) count, and ``step_problem`` the planners' refusal
when it exceeds what they plan for; docs/memory.md). Under the distributed optimizer (a gradient-sync
method that ``shards_optimizer``, sim.gradient_sync_distopt) a rank holds 1/dp of the optimizer state
and of the step's copies (``optimizer_share``): 4 + 16/d B per parameter for fp16, 6 + 12/d for bf16,
Megatron's table. Imports neither torch nor simpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sim.gradient_sync import GRADIENT_SYNC, GradientSyncConfig, reduces_in_fp32
from sim.hardware import ELEMENT_BYTES


def gradient_buffer_scale(settings: GradientSyncConfig, dtype: str) -> float:
    """Bytes of the held gradient buffer per byte of ``LayerCosts.grad_bytes``: 4 / (the dtype's bytes)
    where the gradients accumulate and all-reduce in fp32, else 1."""
    if not reduces_in_fp32(settings, dtype):
        return 1.0
    return ELEMENT_BYTES["fp32"] / ELEMENT_BYTES[dtype]


def held_gradient_bytes(grad_bytes: float, settings: GradientSyncConfig, dtype: str) -> int:
    """Bytes of the gradient buffer that holds gradients of ``grad_bytes`` (in the parameters' dtype)."""
    return round(grad_bytes * gradient_buffer_scale(settings, dtype))


def optimizer_share(settings: GradientSyncConfig, dp: int) -> float:
    """The share of its optimizer state (and of the step's gradient copies, and of the parameters it
    steps) a data-parallel replica holds: 1/dp where the gradient-sync method shards it (Megatron-LM's
    distributed optimizer), else 1."""
    return 1.0 / dp if dp > 1 and GRADIENT_SYNC[settings.method].shards_optimizer else 1.0


def held_optimizer_bytes(optimizer_bytes: float, settings: GradientSyncConfig, dp: int) -> int:
    """Bytes of optimizer state a replica holds of a model part whose whole state is ``optimizer_bytes``."""
    return round(optimizer_bytes * optimizer_share(settings, dp))


def step_copy_bytes(costs: Any, grad_bytes: int, buffer_scale: float) -> int:
    """Bytes the optimizer step allocates beyond the held state, for gradients of ``grad_bytes`` (the
    parameters' dtype) held at ``buffer_scale``: the cost model's ``step_copy_bytes`` where it models
    an optimizer that copies (sim.analytic: Megatron-LM's fp16 optimizer), else none (a fused step,
    the runtime's torch Adam and measured profiles allocate no copies)."""
    rule = getattr(costs, "step_copy_bytes", None)
    return int(rule(grad_bytes, buffer_scale)) if rule is not None else 0


def step_peak_bytes(costs: Any, static_bytes: int, grad_bytes: int, settings: GradientSyncConfig, dtype: str,
                    optimizer_bytes: int = 0, dp: int = 1) -> int:
    """Bytes a pipeline rank holds while its optimizer steps. ``static_bytes``: its parameters, optimizer
    state (``optimizer_bytes`` of it, counted whole) and gradients, these counted in the parameters' dtype
    (``grad_bytes`` of them, the sum of ``LayerCosts.grad_bytes``); the gradients are held as
    ``held_gradient_bytes`` says, the optimizer state as ``held_optimizer_bytes`` says (``dp`` replicas),
    and the step adds its copies (``step_copy_bytes``) of the gradients it steps (all, or its 1/dp
    shard). Nothing else is alive then: the step follows the last backward (which frees the activations
    and the received gradient) and the gradient sync (its buckets), as the engine's ledger runs it
    (sim.engine, OPTIMIZER_STEP)."""
    held = held_gradient_bytes(grad_bytes, settings, dtype)
    unheld_state = optimizer_bytes - held_optimizer_bytes(optimizer_bytes, settings, dp)
    copies = step_copy_bytes(costs, grad_bytes, gradient_buffer_scale(settings, dtype))
    return static_bytes - unheld_state - grad_bytes + held + round(copies * optimizer_share(settings, dp))


def step_problem(at_step: Sequence[int], capacity: int) -> str:
    """The memory planners' refusal when a rank's ``step_peak_bytes`` exceed the bytes they plan for
    (``capacity``), else "". No choice of theirs (keep, recompute, swap, release) changes the step:
    it holds no activations."""
    if not at_step:
        return ""
    worst = max(range(len(at_step)), key=at_step.__getitem__)
    if at_step[worst] <= capacity:
        return ""
    return (f"no per-layer choice fits {capacity / 2**30:.3g} GiB per device: pipeline rank {worst} holds "
            f"{at_step[worst] / 2**30:.3g} GiB during the optimizer step, with no activations (parameters, "
            "gradients, optimizer state, and the optimizer's copies of the gradients where it makes them); spread "
            "the model over more pipeline or tensor-parallel ranks, or raise the budget")
