"""One interface for what a layer costs, whether measured (a trace bundle) or analytic.

Both the lowering (message and bucket sizes) and the engine (durations, memory) ask a
``CostModel`` for ``LayerCosts`` of one layer at a micro-batch size and TP degree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class LayerCosts:
    """Costs of one layer for one micro-batch on one rank (already divided by the TP degree)."""

    fwd_s: float
    bwd_input_s: float
    bwd_weight_s: float
    recompute_s: float
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    saved_bytes: int
    output_bytes: int
    tp_allreduces: int = 0  # TP collectives of tp_comm_bytes per forward, and as many per backward
    tp_comm_bytes: int = 0
    # Which collective that is, and whether the backward has them too: Megatron's layers all-reduce
    # both ways; a sharded embedding table under TP all-gathers its columns forward and keeps its
    # own columns of the gradient backward (sim.embedding.table_tp_costs, exec.parallel.tp).
    tp_collective: str = "allreduce"
    tp_in_backward: bool = True
    # A backward whose collectives differ from the forward's (-1: as many as the forward, of the same
    # size, where tp_in_backward): Megatron's LM head all-reduces three b x s fp32 loss tensors forward
    # and its b x s x h input gradient backward (sim.analytic.megatron_head_tp).
    tp_bwd_allreduces: int = -1
    tp_bwd_comm_bytes: int = -1
    # Megatron-LM's sequence parallelism (sim.workloads.TransformerConfig.sequence_parallel): each of
    # the layer's all-reduces runs as a reduce-scatter and an all-gather of the same tensor (the same
    # total volume; tp_comm_s prices both), and the backward hides its reduce-scatter, not a whole
    # all-reduce, behind the weight-gradient GEMM in ``tp_bwd_overlap_s``.
    tp_sequence_parallel: bool = False
    # Under sequence parallelism a column-parallel linear keeps only its 1/t of its all-gathered input
    # and all-gathers it again in the backward for its weight gradient (Korthikanti et al. 2022,
    # section 4.2.2; Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication.backward): that many
    # extra all-gathers of tp_comm_bytes per backward, and the input-gradient GEMM seconds each can hide
    # behind (empty: none hidden; the same switch as tp_bwd_overlap_s).
    tp_bwd_regathers: int = 0
    tp_bwd_regather_overlap_s: tuple[float, ...] = ()
    # Under sequence parallelism the layer's parameters that see only the rank's 1/t of the sequence
    # (the split region's LayerNorms, the row-parallel linears' replicated biases) get partial
    # gradients: their gradient bytes (in the parameters' dtype, as grad_bytes), which the step sums
    # over the TP group (sequence_parallel_grads_s).
    sp_grad_bytes: int = 0
    flops_fwd: float = 0.0
    # Under PyTorch's selective checkpointing (``memory: {policy: selective}``, exec.selective): the
    # bytes the layer keeps (its input plus the outputs of its matmul / attention / convolution
    # operators) and the seconds its backward spends recomputing the rest. -1: the cost model does
    # not know (a profile taken before these were measured, or a layer with no per-operator model).
    selective_saved_bytes: int = -1
    selective_recompute_s: float = -1.0
    # Under Korthikanti et al.'s selective recomputation (``memory: {policy: selective-attention}``,
    # sim.memory_attention): the bytes of the attention core the layer then does not keep (the softmax
    # output, the attention dropout's mask and output: 5 a s^2 b / t at fp16 with dropout) and the
    # seconds its backward spends re-running that core (Q K^T, softmax, dropout, the product with V).
    # 0 and 0 for a layer without such a core (flash attention keeps none); -1: the model does not know.
    attention_core_bytes: int = -1
    attention_core_recompute_s: float = -1.0
    # Bytes of this layer's saved input that the previous layer also saves (as its output, e.g. a
    # ReLU's result that the next convolution saves as its input): one storage, counted in both
    # layers' saved_bytes, that a forward keeping both holds once (sim.memory.kept_saved_bytes).
    shared_input_bytes: int = 0
    # Bytes of its input this layer does not save (a pooling that keeps only shapes, a head whose
    # linear saves the pooled tensor): checkpointed, it keeps that input anyway (its checkpoint),
    # so while its re-run's tensors are back the input is held beside them (sim.memory.held_bytes).
    unsaved_input_bytes: int = 0
    # Bytes of its output this layer saves itself (a ReLU's result; an embedding or a linear saves
    # none): whether a next layer that does not save its input shares its checkpoint with this layer
    # (sim.memory.input_saved_by_previous). -1: the model does not know.
    saved_output_bytes: int = -1
    # Megatron-LM's asynchronous TP all-reduce in the backward (2021-09 on, not v2.5): the compute
    # seconds each backward collective can hide behind (the weight-gradient GEMM of the column-parallel
    # linear whose input gradient it reduces, running meanwhile), one per collective; empty: none.
    tp_bwd_overlap_s: tuple[float, ...] = ()
    # The share of each such collective (and of each sequence-parallel re-gather) that runs under its
    # GEMM, in [0, 1]: the collective's first ``share`` of its seconds proceeds beside the GEMM, the
    # rest after it, so a backward hides min(share x collective, GEMM). 1 is the ideal two-stream overlap
    # (no contention); the measured 2022 runs hid less (docs/accuracy.md sections 6 and 14). It scales
    # the seconds hidden, never the collective's own price, so the same plan at share 0 prices as with
    # no overlap at all.
    tp_bwd_overlap_share: float = 1.0
    # Seconds of one pass that adds a backward's weight gradients into those accumulated over the
    # iteration's earlier micro-batches (PyTorch autograd's in-place ``.grad +=``, as Megatron-LM v2.5
    # and Megatron-DeepSpeed ran it): paid by every backward of the layer but its first; 0 where the
    # accumulation is fused into the weight-gradient GEMM or not modelled (docs/accuracy.md, section 17).
    grad_accumulate_s: float = 0.0
    # Standard deviations of the phases' times (s) where the cost model measured them (a profile's
    # per-layer spread, sim.bundle_costs); 0: no variance known. The engine and the estimate turn
    # them into the expected wait at a collective for the latest member (sim.meeting).
    fwd_sd_s: float = 0.0
    bwd_sd_s: float = 0.0  # the whole backward (BWD)
    bwd_input_sd_s: float = 0.0
    bwd_weight_sd_s: float = 0.0
    recompute_sd_s: float = 0.0
    # Each co-located profiling process's time of the phase minus the profile's (the median over the
    # processes), where the profile kept them (bundle process_layers): a systematic per-process
    # offset, which adds up over the layers a rank runs between meetings (sim.meeting); (): unknown.
    fwd_offsets_s: tuple[float, ...] = ()
    bwd_offsets_s: tuple[float, ...] = ()
    bwd_input_offsets_s: tuple[float, ...] = ()
    bwd_weight_offsets_s: tuple[float, ...] = ()
    recompute_offsets_s: tuple[float, ...] = ()

    @property
    def bwd_s(self) -> float:
        return self.bwd_input_s + self.bwd_weight_s

    @property
    def knows_selective(self) -> bool:
        return self.selective_saved_bytes >= 0 and self.selective_recompute_s >= 0

    @property
    def knows_attention_core(self) -> bool:
        return self.attention_core_bytes >= 0 and self.attention_core_recompute_s >= 0


def tp_comm_s(c: LayerCosts, backward: bool, price: Callable[[str, int], float],
              with_weight_grads: bool = True) -> float:
    """Exposed seconds of the layer's TP communication in a forward (or a backward, ``backward``), with
    ``price(collective, bytes)`` the seconds of one collective over the layer's TP group. The one
    rule the engine and the estimate share. A backward that computes the weight gradients with the
    input gradients (``with_weight_grads``) hides min(share x collective, GEMM) of each collective that
    has a GEMM in ``tp_bwd_overlap_s`` (what the two streams' overlap saves, ``tp_bwd_overlap_share``
    of the collective at most; a split backward's input-gradient step has no weight-gradient GEMM to
    hide behind)."""
    if c.tp_allreduces == 0 or (backward and not c.tp_in_backward):
        return 0.0
    count, nbytes = c.tp_allreduces, c.tp_comm_bytes
    if backward and c.tp_bwd_allreduces >= 0:
        count, nbytes = c.tp_bwd_allreduces, c.tp_bwd_comm_bytes
        if count == 0:
            return 0.0
    if c.tp_sequence_parallel:
        # Each all-reduce is a reduce-scatter plus an all-gather; Megatron-LM's sequence-parallel
        # column-parallel linear (739cb43, megatron/mpu/layers.py, LinearWithGradAccumulationAndAsync-
        # Communication.backward) reduce-scatters its input gradient while its weight-gradient GEMM runs.
        hideable = price("reduce_scatter", nbytes)
        one = hideable + price("all_gather", nbytes)
    else:
        one = hideable = price(c.tp_collective, nbytes)
    share = c.tp_bwd_overlap_share
    hidden = sum(min(share * hideable, gemm) for gemm in c.tp_bwd_overlap_s) \
        if backward and with_weight_grads else 0.0
    regather = 0.0
    if backward and c.tp_bwd_regathers:
        gather = price("all_gather", nbytes)
        regather = c.tp_bwd_regathers * gather - sum(min(share * gather, gemm) for gemm in c.tp_bwd_regather_overlap_s)
    return count * one - hidden + regather


def sequence_parallel_grads_s(costs: Iterable[LayerCosts], buffer_scale: float,
                              price: Callable[[str, int], float]) -> float:
    """Seconds of sequence parallelism's TP all-reduce of a rank's partial gradients (``sp_grad_bytes``
    of its layers, in the gradient buffer's dtype: ``buffer_scale``, sim.model_state), one flat
    all-reduce over the TP group after the data-parallel sync and before the optimizer step, as the
    runtime runs it (exec.parallel.sequence.allreduce_sequence_parallel_grads) and Megatron-LM's
    ``finalize_model_grads`` (``_allreduce_layernorm_grads`` / ``_allreduce_non_tensor_model_parallel_grads``:
    coalesced, after ``finish_grad_sync``). ``price(collective, bytes)``: one collective over the TP
    group. The one rule the engine and the estimate share."""
    nbytes = round(sum(c.sp_grad_bytes for c in costs) * buffer_scale)
    return price("allreduce", nbytes) if nbytes else 0.0


class CostModel(Protocol):
    """What the simulator needs to know about compute and memory."""

    num_layers: int

    def layer_costs(self, layer: int, micro_batch: int, tp: int) -> LayerCosts: ...

    def optimizer_step_s(self, param_bytes: int) -> float: ...

    def layer_weights(self, by: str) -> list[float]:
        """Per-layer weights for balanced partitioning: "parameters" or "time"."""
        ...


@dataclass
class UniformCosts:
    """Every layer costs the same: for schedule studies and closed-form checks.

    ``bwd_input_s`` + ``bwd_weight_s`` is the whole backward; memory figures are per layer and
    per micro-batch of size one (they scale with the micro-batch).
    """

    num_layers: int
    fwd_s: float = 1.0
    bwd_input_s: float = 1.0
    bwd_weight_s: float = 1.0
    recompute_s: float | None = None  # default: a recompute costs a forward
    saved_bytes: int = 0
    output_bytes: int = 0
    param_bytes: int = 0
    # Under selective checkpointing (per micro-batch of one; -1: unknown, the policy is refused).
    selective_saved_bytes: int = -1
    selective_recompute_s: float = -1.0

    def layer_costs(self, layer: int, micro_batch: int, tp: int) -> LayerCosts:
        recompute = self.fwd_s if self.recompute_s is None else self.recompute_s
        return LayerCosts(
            fwd_s=self.fwd_s, bwd_input_s=self.bwd_input_s, bwd_weight_s=self.bwd_weight_s, recompute_s=recompute,
            param_bytes=self.param_bytes, grad_bytes=self.param_bytes, optimizer_bytes=2 * self.param_bytes,
            saved_bytes=self.saved_bytes * micro_batch, output_bytes=self.output_bytes * micro_batch,
            selective_saved_bytes=self.selective_saved_bytes * micro_batch if self.selective_saved_bytes >= 0 else -1,
            selective_recompute_s=self.selective_recompute_s,
        )

    def optimizer_step_s(self, param_bytes: int) -> float:
        return 0.0

    def layer_weights(self, by: str) -> list[float]:
        return [1.0] * self.num_layers
