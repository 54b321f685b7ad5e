"""Korthikanti et al.'s selective activation recomputation as a memory policy
(``memory: {policy: selective-attention}``).

V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (arXiv
2205.05198, 2022), section 5: every transformer layer keeps everything but the attention core's
s x s tensors (the softmax output, the attention dropout's mask and its output: 5 a s^2 b / t bytes
at fp16 with dropout) and re-runs that core (Q K^T, softmax, dropout, the product with V) inside
its backward, as Megatron-LM's ``--recompute-activations`` (``--checkpoint-activations`` with
selective granularity) does by checkpointing ``CoreAttention``. Per layer it then keeps
s b h (10 + 24 / t) bytes without sequence parallelism and 34 s b h / t with it (their eq. 6), plus
the layernorm statistics the paper leaves out (tests/test_korthikanti_activations.py, to the byte).

Distinct from ``selective`` (torch's policy: keep matmul and attention outputs, recompute the
memory-bound operators). A layer's ``LayerCosts.attention_core_bytes`` and ``attention_core_recompute_s``
say what it drops and what the re-run costs (the analytic kernel model knows them; flash attention
keeps no s x s tensor, so the policy is refused there as ``none`` under another name);
``MemoryPolicy.layer_view`` applies them wherever a layer is priced (lowering, engine, fast
estimate), so the plan search enumerates it like any other policy. Not in the ledger: the one
layer's core tensors that exist while its backward runs (a transient of one layer, as for
``selective``). The runtime runs it (exec.selective.checkpoint_attention_cores: the unfused
core under torch's checkpoint; exec.structure measures what it drops). Imports neither torch nor simpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Literal

from sim.costs import CostModel
from sim.memory import MemoryConfig, MemoryPolicy, register_memory_policy
from sim.schedules import SCHEDULES

if TYPE_CHECKING:
    from sim.plan import Plan

NAME = "selective-attention"


class SelectiveAttention(MemoryConfig):
    """Korthikanti et al. 2022's selective recomputation: every layer drops its attention core's
    softmax, dropout-mask and dropout-output tensors and re-runs that core in its backward."""

    policy: Literal["selective-attention"] = "selective-attention"


def build_selective_attention(plan: Plan, stage_layers: Sequence[Sequence[int]], costs: CostModel,
                              capacity_bytes: int) -> MemoryPolicy:
    stages_n = plan.num_stages
    policy = MemoryPolicy(((),) * stages_n, (0.0,) * stages_n, view=NAME)
    info = SCHEDULES[plan.schedule.name]
    if info.recompute_is_schedule:
        return replace(policy, problem=f"schedule {plan.schedule.name} fixes its own recomputation; "
                       "selective-attention recomputes every layer's attention core")
    every = [costs.layer_costs(layer, plan.micro_batch, plan.tp) for layers in stage_layers for layer in layers]
    unknown = [layer for layers in stage_layers for layer in layers
               if not costs.layer_costs(layer, plan.micro_batch, plan.tp).knows_attention_core]
    if not unknown and not any(c.attention_core_bytes for c in every):
        # Flash attention keeps no s x s tensor: the policy would be ``none`` under another name (and the
        # plan search would estimate every plan twice).
        return replace(policy, problem="no layer keeps an attention core to drop (flash attention keeps no "
                       "s x s tensor): use workload_options.attention unfused, or memory.policy none")
    if unknown:
        return replace(policy, problem=f"the cost model does not know the attention core of layers {unknown[:5]} "
                       "(a profile, or the per-layer roofline): use the analytic kernel model of a transformer")
    if plan.memory.swap is not None:
        # What a swap moves is a fraction of what a forward keeps; under this view that is well defined.
        policy = replace(policy, swap_fraction=tuple(plan.memory.swap))
    return policy


register_memory_policy(NAME, SelectiveAttention, build_selective_attention, runtime=True)
