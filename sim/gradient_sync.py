"""Gradient synchronisation across data-parallel replicas: how a bucket of gradients travels.

A plan's ``gradient_sync:`` section names a registered method (``method: allreduce``) and its
settings. Each method is one record here (the simulator's side): its settings, one line of docs,
the collective that carries it, the bytes a bucket puts on the wire (and holds as a buffer) for
its dense gradient bytes, and the time to encode and decode a bucket on a device. The runtime's
side of a method (the reducer that really sends tensors) is registered under the same name in
``exec.gradient_sync``. Imports neither torch nor simpy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from sim.hardware import DeviceSpec

if TYPE_CHECKING:
    from sim.plan import Plan


class GradientSyncConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str
    bucket_mb: float = Field(25.0, gt=0, description="gradient bytes per bucket (MiB), as in torch DDP")


class DenseAllReduce(GradientSyncConfig):
    """Sum the gradients with an all-reduce in their own dtype, bucket by bucket, and divide by dp."""

    method: Literal["allreduce"] = "allreduce"


@dataclass(frozen=True)
class GradientSyncMethod:
    name: str
    config: type[GradientSyncConfig]
    collective: str  # the primitive the simulator prices ("allreduce")
    wire_bytes: Callable[[int], int]  # dense gradient bytes of a bucket -> bytes sent and buffered
    codec_s: Callable[[int, DeviceSpec], float]  # wire bytes, device -> encode + decode time
    doc: str
    check: Callable[[Plan], None] | None = None  # raise ConfigError when the plan cannot use it


GRADIENT_SYNC: dict[str, GradientSyncMethod] = {}


def register_gradient_sync(name: str, config: type[GradientSyncConfig], collective: str,
                           wire_bytes: Callable[[int], int],
                           codec_s: Callable[[int, DeviceSpec], float],
                           check: Callable[[Plan], None] | None = None) -> GradientSyncMethod:
    if name in GRADIENT_SYNC:
        raise ValueError(f"gradient-sync method {name!r} is registered twice")
    doc = " ".join((config.__doc__ or "").split("\n\n")[0].split())
    GRADIENT_SYNC[name] = method = GradientSyncMethod(name, config, collective, wire_bytes, codec_s, doc, check)
    return method


register_gradient_sync("allreduce", DenseAllReduce, "allreduce", wire_bytes=lambda dense: dense,
                       codec_s=lambda wire, device: 0.0)

# Every other method lives in a module of its own and registers itself on import (docs/extending.md).
from sim import gradient_sync_fp16  # noqa: E402, F401
