"""Gradient sync for row-sparse (embedding) gradients, and top-k sparsification.

Per bucket, with n replicas, a row-sparse gradient of R rows x D columns of e bytes whose one
replica touches k rows (the group u; ``sim.gradient_sync_context``), and P the bytes of the
bucket's other (dense) gradients, which the row-sparse methods all-reduce as dense all-reduce
does:

- ``s2`` (S2 Reducer, Ge et al.): an all-gather of the touched-row bitmap packed one bit per row
  (n x ceil(R / 8) bytes), one all-reduce of P + r x c sketch counters, then every union row
  decoded from the summed sketch by the median over the r hash rows. Lossy where rows collide in
  the sketch. ``bitmap: float`` is the authors' variant (csvec.py): one float per row, summed in
  the same all-reduce as the sketch (one collective, 32 x the bitmap's bytes).
  Why an all-gather: the union of bitmaps is a bitwise OR. A MAX all-reduce over packed words is
  not one (max(01b, 10b) = 10b); a BOR all-reduce is, and gloo has it, but NCCL has no bitwise
  reduction. With B = ceil(R / 8), a ring all-gather moves (n - 1) B per rank and a ring
  all-reduce 2 (n - 1) / n B: the same on 2 ranks, more past that, and below the float bitmap's
  all-reduce (2 (n - 1) / n x 4 R) up to n = 64.
- ``agsparse``: all-gather the touched rows' (index, values), k x (D e + 4) bytes per replica;
  lossless. (The runtime first all-gathers each replica's row count, 8 bytes, to size the buffers.)
- ``omnireduce`` (OmniReduce-style, Fei et al., SIGCOMM'21): all-reduce an R-byte bitmap, then
  all-reduce P + the u union rows (u D e); lossless. Real OmniReduce streams blocks through
  aggregators; this is its two-collective core.
- ``topk`` (with error feedback, Stich et al., NeurIPS'18; Lin et al., ICLR'18): every gradient
  of the bucket, dense or not; the ratio x N largest |g + residual| elements, all-gathered as
  (value, int32 index) pairs.

Encoding and decoding are priced as the bytes they move through device memory (gathers, scatters,
elementwise passes): a lower bound for hashing and top-k selection, whose comparisons are not
counted; docs/compression.md compares it with a profile of the runtime's reducers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from sim.gradient_sync import GradientSyncConfig, GradTensor, Phase, SyncContext, register_gradient_sync
from sim.gradient_sync_context import row_sparse_workload
from traces.errors import ConfigError

if TYPE_CHECKING:
    from sim.plan import Plan

INDEX_BYTES = 4  # int32 row / element indices (tables below 2^31 entries)
COUNT_BYTES = 8  # one int64 row count per replica (agsparse's first all-gather)


class S2Reducer(GradientSyncConfig):
    """S2 Reducer: count-sketch the row-sparse gradients (r hash rows x c counters, seeds shared by
    every rank) plus a bitmap of their non-zero rows, one all-reduce of both; decode union rows by
    the median over hash rows. Dense gradients keep the all-reduce."""

    method: Literal["s2"] = "s2"
    hash_rows: int = Field(1, ge=1, le=15, description="r: independent hash rows (median over them); "
                           "the authors' code uses 1")
    # c as a fraction of the table's elements, as the authors size it (LSTM/gradient_reducers.py:
    # c = n * m * sparsity * rank with sparsity = 0.1 and rank = 1 by default)
    width: float = Field(0.1, gt=0, le=4, description="c per hash row, as a fraction of the embedding "
                         "gradient's elements")
    error_feedback: bool = Field(False, description="keep what the sketch lost locally and add it next step")
    seed: int = Field(0, ge=0, description="hash seed, the same on every rank")
    bitmap: Literal["bits", "float"] = Field("bits", description="touched rows as one bit per row, all-gathered "
                                             "(bits), or one float per row summed with the sketch (float, as the "
                                             "authors' code)")


class AllGatherSparse(GradientSyncConfig):
    """AGsparse: all-gather the (index, values) of every replica's non-zero rows of the row-sparse
    gradients and sum them locally; lossless. Dense gradients keep the all-reduce."""

    method: Literal["agsparse"] = "agsparse"


class OmniReduce(GradientSyncConfig):
    """OmniReduce-style: all-reduce a bitmap of non-zero rows, then all-reduce only the union rows
    of the row-sparse gradients (with the dense gradients); lossless."""

    method: Literal["omnireduce"] = "omnireduce"


class TopK(GradientSyncConfig):
    """Top-k sparsification with error feedback: all-gather the largest |gradient + residual|
    elements of every bucket (values and indices); the rest is kept for the next step."""

    method: Literal["topk"] = "topk"
    ratio: float = Field(0.01, gt=0, le=1, description="share of each bucket's elements sent")
    error_feedback: bool = Field(True, description="carry the unsent remainder to the next step")


def sketch_columns(tensor: GradTensor, width: float) -> int:
    """c for one row-sparse gradient: ``width`` x its elements, rounded down (as the authors' int())."""
    return max(1, int(width * tensor.numel))


def _dense_phase(ctx: SyncContext, extra: int = 0) -> tuple[Phase, ...]:
    total = ctx.dense_part_bytes + extra
    return (Phase("allreduce", total),) if total else ()


def packed_bitmap_bytes(tensor: GradTensor) -> int:
    """One bit per row, each tensor's bitmap padded to whole bytes."""
    return -(-tensor.rows // 8)


def _s2(ctx: SyncContext) -> tuple[Phase, ...]:
    cfg = ctx.settings
    assert isinstance(cfg, S2Reducer)
    r = cfg.hash_rows
    sketch = moved = bits = 0
    for t in ctx.sparse:
        c, e, k, u = sketch_columns(t, cfg.width), t.element_bytes, t.touched_rows or 0, t.union_rows or 0
        sketch += r * c * e  # counters
        if cfg.bitmap == "float":
            sketch += t.rows * e  # the float bitmap, in the sketch's buffer
        else:
            bits += packed_bitmap_bytes(t)
        encode = r * c * e + k * t.cols * e * (1 + 2 * r)  # zero the sketch; read rows, r scatter-adds
        decode = u * t.cols * e * (r + 1) + t.rows * t.cols * e  # r gathers, write; densify the gradient
        feedback = 3 * k * t.cols * e if cfg.error_feedback else 0
        moved += int(encode + decode + feedback)
    gather = (Phase("allgather", ctx.world * bits),) if bits else ()
    return (*gather, *_dense_phase(ctx, sketch), Phase("memory", moved))


def _agsparse(ctx: SyncContext) -> tuple[Phase, ...]:
    n, gathered, moved = ctx.world, 0, 0
    for t in ctx.sparse:
        k = t.touched_rows or 0
        gathered += int(math.ceil(k) * (t.cols * t.element_bytes + INDEX_BYTES)) * n
        moved += int(2 * k * t.cols * t.element_bytes * (1 + n)) + t.nbytes  # pack; scatter-add n; densify
    if not ctx.sparse:
        return _dense_phase(ctx)
    return (Phase("allgather", COUNT_BYTES * len(ctx.sparse) * n), Phase("allgather", gathered),
            *_dense_phase(ctx), Phase("memory", moved))


def _omnireduce(ctx: SyncContext) -> tuple[Phase, ...]:
    if not ctx.sparse:
        return _dense_phase(ctx)
    bitmap = sum(t.rows for t in ctx.sparse)  # one byte per row
    rows = sum(int(math.ceil(t.union_rows or 0)) * t.cols * t.element_bytes for t in ctx.sparse)
    moved = sum(int(3 * (t.union_rows or 0) * t.cols * t.element_bytes) + t.nbytes for t in ctx.sparse)
    return Phase("allreduce", bitmap), *_dense_phase(ctx, rows), Phase("memory", moved)


def _topk(ctx: SyncContext) -> tuple[Phase, ...]:
    cfg = ctx.settings
    assert isinstance(cfg, TopK)
    numel = sum(t.numel for t in ctx.tensors)
    e = max(t.element_bytes for t in ctx.tensors)
    k = max(1, math.ceil(cfg.ratio * numel))
    pair = e + INDEX_BYTES
    # read g (+ residual, write the sum), one selection pass, write the residual, zero-fill and
    # scatter-add the n replicas' pairs
    moved = numel * e * ((3 if cfg.error_feedback else 0) + 1 + (1 if cfg.error_feedback else 0) + 1) \
        + 2 * ctx.world * k * pair
    return Phase("allgather", ctx.world * k * pair), Phase("memory", moved)


def needs_fp32(plan: Plan) -> None:
    if plan.dtype != "fp32":  # the runtime packs int32 indices into fp32 buffers
        raise ConfigError("gradient_sync.method", f"{plan.gradient_sync.method} needs fp32 gradients, not "
                          f"{plan.dtype}", "use dtype: fp32, or method: allreduce")


def needs_row_sparse(plan: Plan) -> None:
    needs_fp32(plan)
    if not row_sparse_workload(plan):
        raise ConfigError("gradient_sync.method", f"{plan.gradient_sync.method} sends row-sparse (embedding) "
                          f"gradients and workload {plan.workload!r} has none",
                          "use an lstm or gpt workload with workload_options: {sparse: true}, or method: "
                          "allreduce")


register_gradient_sync("s2", S2Reducer, _s2, exact=False, check=needs_row_sparse)
register_gradient_sync("agsparse", AllGatherSparse, _agsparse, exact=True, check=needs_row_sparse)
register_gradient_sync("omnireduce", OmniReduce, _omnireduce, exact=True, check=needs_row_sparse)
register_gradient_sync("topk", TopK, _topk, exact=False, check=needs_fp32)
