"""fp16 gradient compression: every fp32 bucket is cast to 16 bits for its all-reduce and back after.

Half the bytes on the wire and in the bucket buffer, for two memory-bound casts per bucket and fp16
rounding of the averaged gradient (unit roundoff 2^-11, IEEE 754 binary16). The same idea as
PyTorch DDP's ``fp16_compress_hook`` (torch.distributed.algorithms.ddp_comm_hooks.default_hooks):
divide by the group size first, so the fp16 sum of dp shares cannot overflow where the fp32 mean
would not. The runtime's reducer is ``exec.gradient_sync.Fp16BucketReduce``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from sim.gradient_sync import GradientSyncConfig, Phase, SyncContext, register_gradient_sync
from traces.errors import ConfigError

if TYPE_CHECKING:
    from sim.plan import Plan


class Fp16Compression(GradientSyncConfig):
    """Cast each fp32 gradient bucket to fp16 for its all-reduce (half the bytes), and back."""

    method: Literal["fp16"] = "fp16"


def _phases(ctx: SyncContext) -> tuple[Phase, ...]:
    wire = ctx.dense_bytes // 2
    # Encoding reads 4 B and writes 2 B per element, decoding reads 2 B and writes 4 B: 6 B per
    # element, 3x the 2 B on the wire, moved at the device's memory bandwidth (a cast is memory-bound).
    return Phase("allreduce", wire), Phase("memory", 3 * wire)


def _needs_fp32_gradients(plan: Plan) -> None:
    if plan.dtype != "fp32":
        raise ConfigError("gradient_sync.method", f"fp16 compression casts fp32 gradients; this plan's are "
                          f"already {plan.dtype}", "use method: allreduce, or dtype: fp32")


register_gradient_sync("fp16", Fp16Compression, _phases, exact=False, check=_needs_fp32_gradients)
