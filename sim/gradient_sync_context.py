"""What a data-parallel bucket holds, for pricing its gradient sync (``sim.gradient_sync.SyncContext``):
the shape of every gradient tensor of its layers, which are row-sparse, and how many rows a
replica (and the whole group) touches in one iteration.

Shapes are known for the LSTM and GPT families at tp 1 (``exec.workloads.lstm`` and ``.gpt``
build exactly these tensors); any other workload's layer is one gradient vector of its bytes,
with no row-sparse part. Their (token) embedding gradient is row-sparse when the workload says so
(``workload_options: {sparse: true}``, as the runtime then sees a sparse gradient). Rows touched per iteration come
from ``sim.gradient_sync_rows`` (measured on the workload's real batches, or exact for uniform
synthetic tokens).

The same functions serve the lowering (a ``Plan``) and the fast estimate (``sim.estimate``, a
``BucketPlan`` of the fields they read), and both cut buckets with ``bucket_layers``: the estimate
prices a candidate's real buckets through the method's own phase function, never a second formula.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sim.analytic import padded_vocab
from sim.gradient_sync import GradientSyncConfig, GradTensor, SyncContext
from sim.gradient_sync_rows import rows_touched
from sim.hardware import ELEMENT_BYTES
from sim.workloads import workload_config, workload_family


class BucketSource(Protocol):
    """The fields of a plan that a bucket's tensors depend on (a ``sim.plan.Plan`` has them)."""

    @property
    def workload(self) -> str: ...
    @property
    def workload_options(self) -> Mapping[str, Any]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def dp(self) -> int: ...
    @property
    def tp(self) -> int: ...
    @property
    def micro_batch(self) -> int: ...
    @property
    def microbatches(self) -> int: ...
    @property
    def gradient_sync(self) -> GradientSyncConfig: ...


@dataclass(frozen=True, eq=False)
class BucketPlan:
    """A ``BucketSource`` without a whole plan: what the fast estimate knows of a candidate."""

    workload: str
    workload_options: Mapping[str, Any]
    dtype: str
    dp: int
    tp: int
    micro_batch: int
    microbatches: int
    gradient_sync: GradientSyncConfig


def bucket_layers(layers: Sequence[int], grad_bytes: Callable[[int], int], limit_bytes: float) -> list[tuple[int, ...]]:
    """A rank's layers (in the order their gradients are written: last layers first) cut into
    buckets as torch DDP fills them: a bucket closes once it holds ``limit_bytes``; layers with no
    gradient bytes to sync are left out."""
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    size = 0
    for layer in layers:
        grad = grad_bytes(layer)
        if grad <= 0:
            continue
        current.append(layer)
        size += grad
        if size >= limit_bytes:
            buckets.append(tuple(current))
            current, size = [], 0
    if current:
        buckets.append(tuple(current))
    return buckets

def _lstm_shapes(cfg: dict, layer: int) -> list[tuple[int, int]]:
    """(rows, cols) of each parameter of an LSTM LM layer, in module order (exec.workloads.lstm)."""
    vocab, embed, hidden, layers = cfg["vocab"], cfg["embed"], cfg["hidden"], cfg["num_layers"]
    if layer == 0:
        return [(vocab, embed)]  # nn.Embedding.weight
    if layer == layers + 1:
        return [(vocab, hidden), (1, vocab)]  # nn.Linear weight, bias
    inputs = embed if layer == 1 else hidden
    # nn.LSTM: weight_ih [4h, in], weight_hh [4h, h], bias_ih [4h], bias_hh [4h]
    return [(4 * hidden, inputs), (4 * hidden, hidden), (1, 4 * hidden), (1, 4 * hidden)]


def _gpt_shapes(cfg: dict, layer: int) -> list[tuple[int, int]]:
    """(rows, cols) of each parameter of a GPT layer, in module order (exec.workloads.gpt)."""
    vocab, h, seq, blocks = cfg["vocab"], cfg["hidden"], cfg["seq"], cfg["num_layers"]
    f = cfg["ffn_mult"] * h
    if layer == 0:
        return [(vocab, h), (seq, h)]  # token table, position table
    if layer == blocks + 1:
        return [(1, h), (1, h), (vocab, h)]  # LayerNorm weight, bias; the head (no bias)
    # ln1, qkv (weight, bias), proj, ln2, fc1, fc2
    return [(1, h), (1, h), (3 * h, h), (1, 3 * h), (h, h), (1, h), (1, h), (1, h), (f, h), (1, f), (h, f), (1, h)]


# Families whose parameter shapes the simulator knows (at tp 1), and whose ``sparse`` option makes
# the token table's gradient row-sparse (its first tensor of layer 0; inputs are a window's first
# seq tokens, as analysis.compression_sparsity counts them).
SHAPES: dict[str, Callable[[dict, int], list[tuple[int, int]]]] = {"lstm": _lstm_shapes, "gpt": _gpt_shapes}


def row_sparse_workload(plan: BucketSource) -> bool:
    """Whether the plan's workload produces a row-sparse (embedding) gradient."""
    return workload_family(plan.workload) in SHAPES and bool(plan.workload_options.get("sparse", False))


def layer_tensors(plan: BucketSource, layer: int, grad_bytes: int) -> list[GradTensor]:
    """The gradient tensors of one layer, as this rank holds them (``grad_bytes`` from the costs)."""
    element = ELEMENT_BYTES[plan.dtype]
    family = workload_family(plan.workload) or ""
    if family in SHAPES and plan.tp == 1:
        cfg = workload_config(plan.workload, plan.workload_options)
        assert cfg is not None
        # the runtime's tables have the vocabulary's rows; the closed-form GPU costs pad it as Megatron
        # does (sim.analytic.padded_vocab): the shapes are those whose bytes are the costs'
        padded = {**cfg, "vocab": padded_vocab(cfg["vocab"], 1)}
        candidates = (SHAPES[family](cfg, layer), SHAPES[family](padded, layer))
        shapes = next((c for c in candidates if sum(r * col for r, col in c) * element == grad_bytes), None)
        if shapes is not None:
            tensors = [GradTensor(r, c, element) for r, c in shapes]
            if layer == 0 and row_sparse_workload(plan):
                windows = plan.micro_batch * plan.microbatches  # one replica's windows per iteration
                data = str(plan.workload_options.get("data", "synthetic"))
                rows, cols = shapes[0]
                vocab = cfg["vocab"]  # the ids drawn (padding rows are never touched)
                tensors[0] = GradTensor(rows, cols, element,
                                        touched_rows=rows_touched(data, vocab, cfg["seq"], windows),
                                        union_rows=rows_touched(data, vocab, cfg["seq"], windows * plan.dp))
            return tensors
    # Shapes unknown (or sharded): one vector of the layer's gradient elements.
    if grad_bytes % element:
        element = 1
    return [GradTensor(1, grad_bytes // element, element)] if grad_bytes else []


def bucket_context(plan: BucketSource, layers: Sequence[int], grad_bytes: Callable[[int], int]) -> SyncContext:
    """The context of a bucket holding ``layers`` (``grad_bytes(layer)``: that layer's gradient bytes)."""
    tensors = tuple(t for layer in layers for t in layer_tensors(plan, layer, grad_bytes(layer)))
    return SyncContext(tensors=tensors, world=plan.dp, settings=plan.gradient_sync, dtype=plan.dtype)
