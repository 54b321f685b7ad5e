"""Gradient synchronisation across data-parallel replicas: how a bucket of gradients travels.

A plan's ``gradient_sync:`` section names a registered method (``method: allreduce``) and its
settings. Each method is one record here (the simulator's side): its settings, one line of docs,
and one function from a ``SyncContext`` (what a bucket holds: its gradient tensors, their shapes,
which are row-sparse and how many rows a replica touches, the group size, the settings) to the
``Phase``s the bucket goes through: collectives in order (``allreduce``, ``allgather``,
``reducescatter``; bytes in
the nccl-tests convention of ``sim.collectives``) and the bytes its encoding and decoding move
through device memory (``memory``), priced at the device's memory bandwidth or at the rate
profiled for that method on that device (``codec_Bps``). The runtime's side
of a method (the reducer that really sends tensors) is registered under the same name in
``exec.gradient_sync``. Imports neither torch nor simpy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from sim.hardware import ELEMENT_BYTES, DeviceSpec
from traces.commented_csv import read_rows

if TYPE_CHECKING:
    from sim.plan import Plan


class GradientSyncConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str
    bucket_mb: float = Field(25.0, gt=0, description="gradient bytes per bucket (MiB), as in torch DDP")


class DenseAllReduce(GradientSyncConfig):
    """Sum the gradients with an all-reduce in their own dtype, bucket by bucket, and divide by dp."""

    method: Literal["allreduce"] = "allreduce"
    # Megatron-LM 2021's local DDP without contiguous buffers (tag v2.5, megatron/model/distributed.py,
    # allreduce_gradients; --use-contiguous-buffers-in-ddp is off by default and in its GPT-3 175B
    # script): _flatten_dense_tensors copies the gradients into a flat buffer (read + write), the buffer
    # is divided by dp in place (read + write), all-reduced, and copied back (read + write).
    flat_copies: bool = Field(False, description="price the copies into and out of a flat buffer and the "
                              "division by dp (Megatron-LM 2021): 6 bytes moved per gradient byte")
    # The dtype the gradients are accumulated and all-reduced in. Megatron-LM keeps a main_grad buffer
    # per parameter dtype and all-reduces it after the backward: in the parameters' dtype, unless
    # --accumulate-allreduce-grads-in-fp32 (off by default) or bf16, which forces it on ("bfloat16
    # requires gradient accumulation and all-reduce to be done in fp32", megatron/arguments.py,
    # parse_args, at v2.5 e269e20 2021, 739cb43 2022, 23.04 2023 and core_r0.4.0;
    # megatron/model/distributed.py, DistributedDataParallel._grad_buffers, dtype = torch.float if
    # accumulate_allreduce_grads_in_fp32 else param.dtype). ``auto`` is that rule: fp32 for bf16
    # parameters, else their own dtype (fp16 for the A100 data: SC'21, Korthikanti 2022 and vTrain ran
    # --fp16). ``param``: always the parameters' dtype (torch DDP); ``fp32``: always fp32.
    reduce_dtype: Literal["auto", "param", "fp32"] = Field(
        "auto", description="dtype of the gradient all-reduce: auto (Megatron-LM: fp32 for bf16 parameters, "
                            "else theirs), param (the parameters' dtype, as torch DDP), fp32")


def reduces_in_fp32(settings: GradientSyncConfig, dtype: str) -> bool:
    """Whether a dense all-reduce of ``dtype`` gradients is carried out in fp32 (``reduce_dtype``)."""
    choice = getattr(settings, "reduce_dtype", "param")
    if ELEMENT_BYTES.get(dtype, 4) >= 4 or choice == "param":
        return False
    return choice == "fp32" or dtype == "bf16"


def reduced_bytes(ctx: SyncContext) -> int:
    """The bucket's bytes as a dense reduction carries them: in fp32 where ``reduce_dtype`` says so."""
    if reduces_in_fp32(ctx.settings, ctx.dtype):
        return sum(t.numel for t in ctx.tensors) * ELEMENT_BYTES["fp32"]
    return ctx.dense_bytes


def _dense_phases(ctx: SyncContext) -> tuple[Phase, ...]:
    nbytes = reduced_bytes(ctx)
    allreduce = Phase("allreduce", nbytes)
    if not getattr(ctx.settings, "flat_copies", False):
        return (allreduce,)
    return Phase("memory", 4 * nbytes), allreduce, Phase("memory", 2 * nbytes)


@dataclass(frozen=True)
class GradTensor:
    """One gradient tensor of a bucket, seen as a matrix (a vector is one row).

    ``touched_rows`` is set for a row-sparse gradient (an embedding table's): the rows one replica's
    iteration writes, and ``union_rows`` those any replica of the group writes (both means over
    real batches, ``sim.gradient_sync_rows``)."""

    rows: int
    cols: int
    element_bytes: int
    touched_rows: float | None = None
    union_rows: float | None = None

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_bytes

    @property
    def row_sparse(self) -> bool:
        return self.touched_rows is not None


@dataclass(frozen=True)
class SyncContext:
    """Everything a bucket's cost depends on."""

    tensors: tuple[GradTensor, ...]
    world: int  # replicas in the data-parallel group
    settings: GradientSyncConfig
    dtype: str = ""  # the gradients' dtype (the plan's), where a method's bytes depend on more than its size

    @property
    def dense_bytes(self) -> int:
        """The bucket's gradient bytes, as dense all-reduce sends them."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def sparse(self) -> tuple[GradTensor, ...]:
        return tuple(t for t in self.tensors if t.row_sparse)

    @property
    def dense_part_bytes(self) -> int:
        """Bytes of the gradients that are not row-sparse (a sparse method all-reduces them)."""
        return sum(t.nbytes for t in self.tensors if not t.row_sparse)


Collective = Literal["allreduce", "allgather", "reducescatter", "memory"]


@dataclass(frozen=True)
class Phase:
    """One step of a bucket's sync: a collective of ``nbytes`` (all-gather: its output), or
    ``memory``: bytes that encoding or decoding reads and writes on the device."""

    kind: Collective
    nbytes: int


@dataclass(frozen=True)
class GradientSyncMethod:
    name: str
    config: type[GradientSyncConfig]
    phases: Callable[[SyncContext], tuple[Phase, ...]]
    doc: str
    check: Callable[[Plan], None] | None = None  # raise ConfigError when the plan cannot use it
    # The replicas end with the gradients' exact mean (up to summation order): False for a method that
    # changes what training computes (rounding, sparsification, sketching, low rank). The plan search
    # leaves lossy methods out unless asked (sim.search.SearchSpace.lossy_gradient_sync).
    exact: bool = True
    # Each replica holds and steps 1/dp of the optimizer state and all-gathers the parameters after
    # its step (sim.gradient_sync_distopt; sim.model_state.optimizer_share).
    shards_optimizer: bool = False

    def plan(self, context: SyncContext) -> tuple[Phase, ...]:
        """The bucket's phases; a bucket with no bytes has none."""
        return self.phases(context) if context.dense_bytes else ()


class CommPricer(Protocol):
    cluster: object

    def collective_s(self, primitive: str, nbytes: int, ranks: Sequence[int], concurrent: int = 1) -> float: ...


def wire_bytes(phases: Sequence[Phase]) -> int:
    """Bytes the bucket's collectives carry (and the buffers they hold)."""
    return sum(p.nbytes for p in phases if p.kind != "memory")


def vector_bucket(settings: GradientSyncConfig, dense: int, dp: int, dtype: str) -> SyncContext:
    """A bucket of ``dense`` gradient bytes as one gradient vector: what a caller that knows bytes
    per stage, not tensor shapes or row sparsity (the memory planners' one bucket buffer), prices.
    Row-sparse methods and PowerSGD are then priced as their dense part (the engine and the fast
    estimate price the real buckets, ``sim.gradient_sync_context``)."""
    element = ELEMENT_BYTES.get(dtype, 1)
    if dense % element:
        element = 1
    return SyncContext((GradTensor(1, dense // element, element),), dp, settings, dtype)


def vector_wire_bytes(settings: GradientSyncConfig, dense: int, dp: int, dtype: str) -> int:
    """The bytes one such bucket holds while it travels (its buffer)."""
    return wire_bytes(GRADIENT_SYNC[settings.method].plan(vector_bucket(settings, dense, dp, dtype)))


def bucket_buffer_bytes(settings: GradientSyncConfig, bucket_mb: float, grad_bytes: int, dp: int, dtype: str) -> int:
    """The buffer of the largest gradient bucket a rank holding ``grad_bytes`` of synced gradients has in
    flight: ``bucket_mb`` of them, clipped to the rank's gradients (a bucket closes once it holds
    ``bucket_mb``, as torch DDP's ``bucket_cap_mb`` does, and never holds more than there is:
    ``sim.gradient_sync_context.bucket_layers``, the runtime's DDP reducer). 0 without replicas."""
    if dp <= 1 or grad_bytes <= 0:
        return 0
    return vector_wire_bytes(settings, min(int(bucket_mb * 2**20), grad_bytes), dp, dtype)


CODEC_FILE = Path(__file__).parent / "data" / "codec_rates.csv"


@lru_cache(maxsize=1)
def measured_codec_rates() -> dict[tuple[str, str], float]:
    """(device name, method) -> bytes per second of the method's memory phase, as profiled on that
    device (``analysis.compression_codec``)."""
    return {(r["device"], r["method"]): float(r["rate_Bps"]) for r in read_rows(CODEC_FILE)}


def codec_Bps(device: DeviceSpec, method: str) -> float:
    """The rate a method's encoding and decoding move bytes at on ``device``: profiled if it has
    been, else the device's memory bandwidth (they are elementwise passes, gathers and scatters;
    for hashing and top-k selection that is a lower bound on the time)."""
    return measured_codec_rates().get((device.name, method), device.memory_bandwidth_Bps)


def phases_s(phases: Sequence[Phase], group: Sequence[int], comm: CommPricer, device: DeviceSpec,
             method: str = "", concurrent: int = 1) -> float:
    """Seconds of a bucket's phases, in order on one collective stream: each collective as the
    cluster prices it (``concurrent`` groups like this one sharing the nodes' adapters,
    sim.comm.concurrent_groups), each memory phase at ``codec_Bps``."""
    return sum(comm.collective_s(p.kind, p.nbytes, group, concurrent) if p.kind != "memory"
               else p.nbytes / codec_Bps(device, method) for p in phases)


GRADIENT_SYNC: dict[str, GradientSyncMethod] = {}


def register_gradient_sync(name: str, config: type[GradientSyncConfig],
                           phases: Callable[[SyncContext], tuple[Phase, ...]], *, exact: bool,
                           check: Callable[[Plan], None] | None = None,
                           shards_optimizer: bool = False) -> GradientSyncMethod:
    if name in GRADIENT_SYNC:
        raise ValueError(f"gradient-sync method {name!r} is registered twice")
    doc = " ".join((config.__doc__ or "").split("\n\n")[0].split())
    GRADIENT_SYNC[name] = method = GradientSyncMethod(name, config, phases, doc, check, exact, shards_optimizer)
    return method


register_gradient_sync("allreduce", DenseAllReduce, _dense_phases, exact=True)

# Every other method lives in a module of its own and registers itself on import (docs/extending.md).
from sim import gradient_sync_distopt, gradient_sync_fp16, gradient_sync_lowrank, gradient_sync_sparse  # noqa: E402, F401, I001
