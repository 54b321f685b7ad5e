"""Megatron-LM's distributed optimizer (``--use-distributed-optimizer``; ZeRO stage 1): the fp32 master
weights and the Adam moments are sharded over the data-parallel group, so each replica holds and
steps 1/d of them.

What Megatron-LM 23.04 (2360d73) does, per iteration (megatron/training.py l.439 ``reduce_model_grads``,
l.449 ``optimizer.step``, l.454 ``gather_model_params``): the gradient buffer is divided by d and
reduce-scattered, each rank receiving the sum of its own 1/d (megatron/optimizer/distrib_optimizer.py
l.540-586, ``_reduce_scatter_base`` per gradient buffer); the optimizer steps its shard; the updated
16-bit parameters are all-gathered back into every replica (l.589-627, ``_all_gather_base`` of the
parameter buffer, a view of the gradient buffer's storage in the parameters' dtype: no buffer is
allocated). The flag is off by default (megatron/arguments.py l.983, store_true). Bytes per
parameter (docs/distrib_optimizer.md l.13-15 at 23.04): 4 + 16/d (fp16 parameters and gradients),
6 + 12/d (16-bit parameters, fp32 gradients), against 20 and 18 without it.

Here it is a gradient-sync method (``method: distopt``): what changes first is how a bucket of
gradients travels (a reduce-scatter where the dense method all-reduces), and it combines with none of
the other methods (they each decide how the bucket travels), so it is one more choice of that
dimension. Its settings extend the dense method's (``reduce_dtype``: bf16 gradients reduce-scatter in
fp32, as Megatron's fp32 gradient buffer does), one home for that rule. The rest follows from the
record's ``shards_optimizer``: the optimizer state a rank holds and the step's gradient copies
(``sim.model_state.optimizer_share``: 1/d), the step over 1/d of the parameters (the engine, the fast
estimate), and one parameter all-gather per bucket after the step (``param_gather_phases``: lowered
as an ALLREDUCE instruction tagged ``PARAM_GATHER_TAG`` that depends on the step). The runtime's side
is ``exec.distributed_optimizer``. Megatron pads each buffer to a multiple of d; the simulator does
not count that padding (under d elements per buffer). Imports neither torch nor simpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from sim.gradient_sync import DenseAllReduce, Phase, SyncContext, reduced_bytes, register_gradient_sync
from traces.errors import ConfigError

if TYPE_CHECKING:
    from sim.plan import Plan

# The tag prefix of the parameter all-gather that follows the step (one instruction per pipeline rank).
PARAM_GATHER_TAG = "dp-params"


class DistributedOptimizer(DenseAllReduce):  # type: ignore[override]
    """Megatron-LM's distributed optimizer (ZeRO-1): reduce-scatter the gradients, step 1/d of the
    optimizer state, all-gather the updated parameters."""

    method: Literal["distopt"] = "distopt"  # type: ignore[assignment]


def _phases(ctx: SyncContext) -> tuple[Phase, ...]:
    return (Phase("reducescatter", reduced_bytes(ctx)),)  # its input, as nccl-tests counts a reduce-scatter


def param_gather_phases(bucket_param_bytes: Sequence[int]) -> tuple[Phase, ...]:
    """The all-gathers after the step: one per bucket, of its parameters in their own dtype (its
    output, as nccl-tests counts an all-gather)."""
    return tuple(Phase("allgather", b) for b in bucket_param_bytes if b > 0)


def _contiguous_buffers(plan: Plan) -> None:
    if getattr(plan.gradient_sync, "flat_copies", False):
        raise ConfigError("gradient_sync.flat_copies", "the distributed optimizer reduce-scatters Megatron-LM's "
                          "contiguous gradient buffer; flat_copies prices the 2021 copies into a flat buffer",
                          "drop flat_copies, or use method: allreduce")


register_gradient_sync("distopt", DistributedOptimizer, _phases, exact=True, check=_contiguous_buffers,
                       shards_optimizer=True)
