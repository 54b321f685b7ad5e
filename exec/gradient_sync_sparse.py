"""Reducers for row-sparse (embedding) gradients, S2 Reducer and its baselines, and top-k.

The simulator's side, with the bytes each sends, is ``sim.gradient_sync_sparse``. A bucket's
row-sparse gradients are those whose rows are known (``BucketReduce.rows``: the workload made a
sparse gradient, or a DDP hook was told the parameter is an embedding); every other gradient of
the bucket travels in a dense all-reduce, in the same buffer where the method has one.
Indices travel as int32 bit patterns inside float32 buffers (all-gather copies bytes, so they
arrive intact), which is why these reducers need fp32 gradients. Every buffer lives on the
gradients' device; seeded draws (hash coefficients) are made on the CPU and moved, so every device
hashes alike.
"""

from __future__ import annotations

import math

import torch

from exec.parallel.dp import BucketReduce
from sim.gradient_sync import GradTensor
from sim.gradient_sync_sparse import AllGatherSparse, S2Reducer, TopK, sketch_columns
from sim.gradient_sync_sparse import OmniReduce as OmniReduceConfig
from traces.errors import ConfigError

_PRIME = 2_147_483_647  # 2^31 - 1: hash arithmetic on int64 stays exact for indices below 2^32


def touched_rows(grad: torch.Tensor) -> torch.Tensor:
    """Rows of a dense 2-D gradient with any non-zero entry."""
    return (grad.reshape(grad.shape[0], -1) != 0).any(dim=1).nonzero().flatten()


def _fp32(grads: list[torch.Tensor], method: str) -> None:
    if any(g.dtype != torch.float32 for g in grads):
        raise ConfigError("gradient_sync.method", f"{method} packs int32 indices into fp32 buffers and the "
                          "gradients are not fp32", "use dtype: fp32, or method: allreduce")


class _RowSparse(BucketReduce):
    """Splits a bucket into its row-sparse gradients (as [rows, cols] views) and the rest."""

    def split(self) -> None:
        _fp32(self.grads, type(self).__name__)
        self.device = self.grads[0].device
        self.sparse = [(g.view(g.shape[0], -1), r) for g, r in zip(self.grads, self.rows, strict=True)
                       if r is not None]
        self.dense = [g for g, r in zip(self.grads, self.rows, strict=True) if r is None]

    def dense_flat(self) -> torch.Tensor:
        return torch.cat([g.reshape(-1) for g in self.dense]) if self.dense else torch.zeros(0, device=self.device)

    def write_dense(self, summed: torch.Tensor) -> None:
        if self.dense:
            self.write_back(self.dense, summed / self.size)


class S2Reduce(_RowSparse):
    """S2 Reducer (``sim.gradient_sync_sparse.S2Reducer``): per row-sparse gradient, a count sketch
    of its touched rows' elements (r hash rows x c counters; bucket and sign hashes of the flat
    element index, seeded by ``seed`` on every rank alike) summed with the dense gradients in one
    all-reduce, and a bitmap of its touched rows: packed one bit per row and all-gathered (the
    replicas OR them), or (``bitmap: float``, the authors' variant) one float per row in the
    sketch's all-reduce. Every union row is decoded by the median over the hash rows of sign x
    counter, divided by the group size. With error feedback a replica keeps what its own sketch
    did not recover and adds it next step."""

    def start(self) -> None:
        cfg = self.settings if isinstance(self.settings, S2Reducer) else S2Reducer()
        self.cfg = cfg
        self.split()
        parts, self.plan, packed = [self.dense_flat()], [], []
        for t, (grad, rows) in enumerate(self.sparse):
            residual = self.state.get(("residual", t)) if cfg.error_feedback else None
            if residual is not None:
                rows = torch.unique(torch.cat([rows, self.state[("residual_rows", t)]]))
            values = grad[rows] + (residual[rows] if residual is not None else 0)
            c = sketch_columns(GradTensor(grad.shape[0], grad.shape[1], 4), cfg.width)
            elements = (rows[:, None] * grad.shape[1] + torch.arange(grad.shape[1], device=grad.device)).reshape(-1)
            buckets, signs = self._hashes(t, elements, c)
            sketch = torch.zeros(cfg.hash_rows, c, device=grad.device)
            for h in range(cfg.hash_rows):
                sketch[h].index_add_(0, buckets[h], signs[h] * values.reshape(-1))
            if cfg.error_feedback:
                own = self._median(sketch, buckets, signs).view_as(values)
                self.state[("residual", t)] = kept = torch.zeros_like(grad)
                kept[rows] = values - own
                self.state[("residual_rows", t)] = rows
            self.plan.append((c, sketch.numel()))
            parts.append(sketch.reshape(-1))
            if cfg.bitmap == "float":
                bitmap = torch.zeros(grad.shape[0], device=grad.device)
                bitmap[rows] = 1.0
                parts.append(bitmap)
            else:
                packed.append(pack_rows(rows, grad.shape[0]))
        # the bitmaps first: every rank issues the same collectives in the same order
        self.bitmaps = self.all_gather(torch.cat(packed)) if packed else []
        self.wire = self.all_reduce(torch.cat(parts))

    def _unions(self, offset: int) -> list[torch.Tensor]:
        """Each row-sparse gradient's union of touched rows: the OR of the gathered bit-packed
        bitmaps, or the non-zero entries of the summed float bitmap after each sketch in ``wire``."""
        if not self.sparse:
            return []
        if self.cfg.bitmap != "float":
            either = self.bitmaps[0].clone()
            for other in self.bitmaps[1:]:
                either.bitwise_or_(other)
            unions, start = [], 0
            for grad, _rows in self.sparse:
                size = -(-grad.shape[0] // 8)
                unions.append(unpack_rows(either[start: start + size], grad.shape[0]))
                start += size
            return unions
        unions = []
        for (grad, _rows), (_c, counters) in zip(self.sparse, self.plan, strict=True):
            unions.append(self.wire[offset + counters: offset + counters + grad.shape[0]].nonzero().flatten())
            offset += counters + grad.shape[0]
        return unions

    def _hashes(self, tensor: int, elements: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(bucket, sign) of every element index for every hash row: ((a j + b) mod p) mod c and
        the parity of a second such hash, with (a, b) drawn from the shared seed."""
        generator = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + tensor)
        coeff = torch.randint(1, _PRIME, (self.cfg.hash_rows, 4), generator=generator,
                              dtype=torch.int64).to(elements.device)
        j = elements[None, :]
        buckets = ((coeff[:, :1] * j + coeff[:, 1:2]) % _PRIME) % c
        signs = (((coeff[:, 2:3] * j + coeff[:, 3:4]) % _PRIME) % 2).to(torch.float32) * 2 - 1
        return buckets, signs

    @staticmethod
    def _median(sketch: torch.Tensor, buckets: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
        estimates = torch.stack([signs[h] * sketch[h, buckets[h]] for h in range(sketch.shape[0])])
        return estimates.median(dim=0).values

    def finish(self) -> None:
        offset = sum(g.numel() for g in self.dense)
        self.write_dense(self.wire[:offset])
        unions = self._unions(offset)
        floats = self.cfg.bitmap == "float"
        for t, ((grad, _rows), (c, counters), union) in enumerate(zip(self.sparse, self.plan, unions, strict=True)):
            sketch = self.wire[offset: offset + counters].view(self.cfg.hash_rows, c)
            offset += counters + (grad.shape[0] if floats else 0)
            elements = (union[:, None] * grad.shape[1] + torch.arange(grad.shape[1], device=grad.device)).reshape(-1)
            buckets, signs = self._hashes(t, elements, c)
            grad.zero_()
            grad[union] = self._median(sketch, buckets, signs).view(-1, grad.shape[1]) / self.size


def _bits(device: torch.device) -> torch.Tensor:
    return 2 ** torch.arange(8, dtype=torch.int32, device=device)  # bit i of a byte is row 8 k + i


def pack_rows(rows: torch.Tensor, n: int) -> torch.Tensor:
    """The rows ``rows`` of ``n`` as a bitmap of ceil(n / 8) uint8 bytes (on ``rows``' device)."""
    bits = torch.zeros(-(-n // 8) * 8, dtype=torch.int32, device=rows.device)
    bits[rows] = 1
    return (bits.view(-1, 8) * _bits(rows.device)).sum(dim=1).to(torch.uint8)


def unpack_rows(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The rows set in a ``pack_rows`` bitmap of ``n`` rows, ascending."""
    bits = (packed.to(torch.int32)[:, None] & _bits(packed.device)) != 0
    return bits.reshape(-1)[:n].nonzero().flatten()


class AllGatherSparseReduce(_RowSparse):
    """AGsparse (``sim.gradient_sync_sparse.AllGatherSparse``): all-gather every replica's row
    counts, then (padded to the largest) its touched rows as [int32 index bits, values...]; each
    replica sums them into zeros. Lossless; the dense gradients go in an all-reduce."""

    def start(self) -> None:
        assert self.settings is None or isinstance(self.settings, AllGatherSparse)
        self.split()
        counts = torch.tensor([len(r) for _g, r in self.sparse], dtype=torch.int64, device=self.device)
        self.widths = [g.shape[1] + 1 for g, _r in self.sparse]
        self.most = torch.stack(self.all_gather(counts, wait=True)).max(dim=0).values.tolist() \
            if self.sparse else []
        packed = []
        for (grad, rows), most in zip(self.sparse, self.most, strict=True):
            block = torch.zeros(most, grad.shape[1] + 1, device=grad.device)  # padding: index 0, zero values
            block[: len(rows), 0] = rows.to(torch.int32).view(torch.float32)
            block[: len(rows), 1:] = grad[rows]
            packed.append(block.reshape(-1))
        self.gathered = self.all_gather(torch.cat(packed)) if packed else []
        self.summed = self.all_reduce(self.dense_flat()) if self.dense else None

    def finish(self) -> None:
        if self.summed is not None:
            self.write_dense(self.summed)
        for grad, _rows in self.sparse:
            grad.zero_()
        for buffer in self.gathered:
            offset = 0
            for (grad, _rows), most, width in zip(self.sparse, self.most, self.widths, strict=True):
                block = buffer[offset: offset + most * width].view(most, width)
                offset += most * width
                grad.index_add_(0, block[:, 0].contiguous().view(torch.int32).to(torch.int64), block[:, 1:])
        for grad, _rows in self.sparse:
            grad.div_(self.size)


class OmniReduce(_RowSparse):
    """OmniReduce-style (``sim.gradient_sync_sparse.OmniReduce``): all-reduce a one-byte-per-row
    bitmap of touched rows, then all-reduce the dense gradients and only the union rows in one
    buffer. Lossless."""

    def start(self) -> None:
        assert self.settings is None or isinstance(self.settings, OmniReduceConfig)
        if self.size > 255:
            raise ConfigError("parallelism.dp", f"omnireduce sums a uint8 bitmap over {self.size} replicas",
                              "use dp <= 255")
        self.split()
        parts = [self.dense_flat()]
        if self.sparse:
            bitmap = torch.zeros(sum(g.shape[0] for g, _r in self.sparse), dtype=torch.uint8, device=self.device)
            offset = 0
            for grad, rows in self.sparse:
                bitmap[offset + rows] = 1
                offset += grad.shape[0]
            self.all_reduce(bitmap, wait=True)
            self.unions, offset = [], 0
            for grad, _rows in self.sparse:
                union = bitmap[offset: offset + grad.shape[0]].nonzero().flatten()
                offset += grad.shape[0]
                self.unions.append(union)
                parts.append(grad[union].reshape(-1))
        self.wire = self.all_reduce(torch.cat(parts))

    def finish(self) -> None:
        offset = sum(g.numel() for g in self.dense)
        self.write_dense(self.wire[:offset])
        for (grad, _rows), union in zip(self.sparse, getattr(self, "unions", []), strict=True):
            block = self.wire[offset: offset + len(union) * grad.shape[1]].view(len(union), grad.shape[1])
            offset += block.numel()
            grad.zero_()
            grad[union] = block / self.size


class TopKReduce(BucketReduce):
    """Top-k with error feedback (``sim.gradient_sync_sparse.TopK``): of the whole bucket plus the
    residual, the ratio x N largest magnitudes are all-gathered as (value, int32 index bits); every
    replica sums the n sets into zeros; the unsent rest stays in this replica's residual."""

    def start(self) -> None:
        cfg = self.settings if isinstance(self.settings, TopK) else TopK()
        _fp32(self.grads, "topk")
        self.flat = torch.cat([g.reshape(-1) for g in self.grads])
        values = self.flat + self.state["residual"] if cfg.error_feedback and "residual" in self.state else self.flat
        k = max(1, math.ceil(cfg.ratio * values.numel()))
        chosen = values.abs().topk(k, sorted=False).indices
        if cfg.error_feedback:
            residual = values.clone()
            residual[chosen] = 0
            self.state["residual"] = residual
        self.k = k
        self.gathered = self.all_gather(torch.cat([values[chosen], chosen.to(torch.int32).view(torch.float32)]))

    def finish(self) -> None:
        mean = torch.zeros_like(self.flat)
        for pairs in self.gathered:
            mean.index_add_(0, pairs[self.k:].contiguous().view(torch.int32).to(torch.int64), pairs[: self.k])
        self.write_back(self.grads, mean.div_(self.size))


