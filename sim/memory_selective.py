"""PyTorch's selective activation checkpointing as a memory policy (``memory: {policy: selective}``):
a baseline beside DELTA and the optimal per-layer policy.

Every layer runs under ``torch.utils.checkpoint`` with torch's own selective-checkpoint contexts
and the policy of torch's examples: keep the outputs of matmul, attention and convolution
operators, recompute everything else inside the backward (``exec.selective``, which the runtime
runs for real). In the simulator a layer then keeps ``LayerCosts.selective_saved_bytes`` (the
profiler and the structural model measure it with torch's own SAC; the analytic model has the
closed form of ``sim.workloads.transformer_layers``) and its input-gradient step takes
``selective_recompute_s`` longer (the layer's memory-bound forward kernels: the analytic kernel
model's, or the profile's recompute time times the measured pointwise share of its forward).
``MemoryPolicy.layer_view`` applies that wherever a layer is priced: the lowering, the engine and
the fast estimate, so the plan search enumerates it like any other policy.

No budget: torch's policy is fixed, so the plan fits or does not (the engine's ledger and the
estimate say which). Imports neither torch nor simpy.
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


class SelectiveCheckpoint(MemoryConfig):
    """PyTorch's selective activation checkpointing: every layer keeps its matmul and attention
    outputs and recomputes its other operators (norms, activations, adds) in the backward."""

    policy: Literal["selective"] = "selective"


def build_selective(plan: Plan, stage_layers: Sequence[Sequence[int]], costs: CostModel,
                    capacity_bytes: int) -> MemoryPolicy:
    stages_n = plan.num_stages
    none = ((),) * stages_n
    policy = MemoryPolicy(none, (0.0,) * stages_n, view="selective")
    info = SCHEDULES[plan.schedule.name]
    if info.recompute_is_schedule:
        return _refused(policy, f"schedule {plan.schedule.name} fixes its own recomputation; selective "
                        "checkpointing decides per operator")
    if info.split_backward:
        # torch raises "Trying to backward an extra time" on a second backward through a SAC region.
        return _refused(policy, f"schedule {plan.schedule.name} splits the backward (BWD_I then BWD_W), and "
                        "torch allows one backward through a selectively checkpointed layer")
    if plan.memory.swap is not None:
        return _refused(policy, "selective checkpointing keeps its tensors in torch's own cache, out of reach "
                        "of swapping: drop memory.swap")
    unknown = [layer for layers in stage_layers for layer in layers
               if not costs.layer_costs(layer, plan.micro_batch, plan.tp).knows_selective]
    if unknown:
        return _refused(policy, f"the cost model does not know what layers {unknown[:5]} keep under selective "
                        "checkpointing (a profile taken before it was measured, or a layer with no per-operator "
                        "model): re-profile with paratwin profile")
    return policy


def _refused(policy: MemoryPolicy, problem: str) -> MemoryPolicy:
    return replace(policy, problem=problem)


register_memory_policy("selective", SelectiveCheckpoint, build_selective)
