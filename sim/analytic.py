"""Analytic compute and memory costs of a layer on a device we may not have (roofline + efficiency).

time = max(flops / (peak(dtype) * eff(flops)),  bytes_moved / (memory_bandwidth * mem_eff))

with the saturating efficiency curve eff(x) = eff_max * x / (x + x_half), x the FLOPs of one call
(one layer, one micro-batch, one TP shard). The curve is monotone, tends to eff_max for large work
and has an exact physical reading: x / (peak * eff(x)) = x / (eff_max * peak) + x_half / (eff_max *
peak), i.e. a fixed per-call overhead (kernel launches, tails, small-GEMM waste) plus the large-GEMM
throughput. Both parameters are calibrated from measurements (``sim.calibration.fit_efficiency``).

Under tensor parallelism of degree t (Megatron-LM, Shoeybi et al. 2019): matmul FLOPs, parameters
and the sharded part of the saved activations divide by t, and each forward and each backward
all-reduces ``tp_allreduces`` tensors of the layer's output size over the t ranks. Compute times
here exclude that communication: the engine schedules it on its own stream (``tp_comm_times``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from sim.cluster import ClusterSpec
from sim.collectives import collective_time
from sim.hardware import ELEMENT_BYTES, DeviceSpec, normalize_dtype
from sim.workloads import ATTENTION_IMPLEMENTATIONS, GRAD_ACCUMULATIONS, LayerSpec, tp_rank_params
from traces.errors import ConfigError

# Bytes of one activation element, by compute dtype. tf32 computes on fp32 storage; fp8 training
# (NVIDIA Transformer Engine) keeps activations between layers in bf16.
ACTIVATION_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 2}

# Model-state bytes per parameter (param, grad, optimizer). Mixed precision with Adam: fp16/bf16
# parameters and gradients (2 + 2) and an fp32 master copy plus two fp32 Adam moments (4 + 4 + 4),
# 16 bytes per parameter as in ZeRO (Rajbhandari et al., SC 2020, section 3.1). Gradients are kept
# in 16 bits here as ZeRO counts them; Megatron-LM's fp32 gradient accumulation would add 2 bytes.
# Pure fp32 with Adam: 4 + 4 + 8 (the fp32 parameter is its own master copy).
STATE_BYTES = {
    "fp32": (4, 4, 8), "tf32": (4, 4, 8),
    "fp16": (2, 2, 12), "bf16": (2, 2, 12), "fp8": (2, 2, 12),
}

# Defaults before calibration. eff_max: an 8192^3 bf16 matmul on this project's H200 ran at
# 769-798 TFLOP/s of the 989.5 dense peak, 0.78-0.81 (read on the borrowed H200, 2026-10/11), so 0.8 for
# GPUs; the local-cpu peak is itself a measured matmul rate, so 1.0 there. mem_eff: a device-to-device
# copy on the same H200 moved 4.3 of 4.8 TB/s, 0.9. CALL_OVERHEAD_S: an uncalibrated guess of a few
# kernel launches of ~5 us per layer call; fit it (it becomes x_half) on real data.
GPU_EFF_MAX = 0.8
# Where a public per-layer data set pins a device family's large-GEMM efficiency, that instead (the
# device name starts with the family). A100: Korthikanti et al. 2022 (arXiv:2205.05198) Table 4, the
# forward and backward times of one 22B GPT layer (hidden 6,144, micro-batch 4, tp 8) on Selene's
# A100s, fitted as the engine prices them (benchmarks/korthikanti_layers.py --fit, "all"; data and
# provenance in sim/data/korthikanti2022.md; tests/test_korthikanti_data.py recomputes it): 0.791.
# Chosen as the default because it is no worse on the single-node held-out splits and better on both
# at-scale tables than 0.8 (docs/accuracy.md, section 5).
GPU_EFF_MAX_BY_FAMILY = {"A100": 0.791}
CPU_EFF_MAX = 1.0
MEM_EFF = 0.9
# Where a public data set pins a device family's unfused-attention elementwise rate
# (``EfficiencyCurve.attn_mem_eff``), that; elsewhere None, i.e. MEM_EFF (a copy's rate).
# A100: measured, not fitted to any training figure. Dao et al. 2022 (FlashAttention, arXiv:2205.14135)
# Appendix E.6, Tables 10-11: Megatron's attention alone on one A100 40 GB (fp16, dropout 0.1,
# padding mask, seq 512-2,048); each row's time less the bmms and the context copy as this module prices
# them, over the softmax and dropout bytes it counts, at 1,555 GB/s: the median of the six rows' rates,
# 0.534 (0.454-0.742); rule declared in sim/data/flashattention_e6_a100.md before any test figure,
# recomputed by benchmarks/flashattention_e6.py and tests/test_flashattention_e6.py. Carried as a
# fraction of the datasheet bandwidth to the A100 80 GB (2,039 GB/s). Adopted by the rule of
# docs/accuracy.md section 13 (SC'21 10.0 -> 5.1% MAPE; Table 5 and vTrain within noise or better).
GPU_ATTN_MEM_EFF_BY_FAMILY: dict[str, float] = {"A100": 0.534}
# No fixed cost per layer call by default: the host enqueues kernels asynchronously and runs ahead of
# the GPU (Megatron-LM's training loop synchronises once per iteration), so launch latency overlaps
# GPU time instead of adding to it. Small work is priced by what it really costs on the device:
# wave-quantised GEMM tiles and the bytes of memory-bound kernels (``transformer_layer_times``).
CALL_OVERHEAD_S = 0.0

# The host launch path (issue 9): the host issues each kernel after a CPU cost per launch (Python and
# the framework's dispatch, autograd bookkeeping, cudaLaunchKernel); the GPU runs kernel i at
# max(its launch time, the end of kernel i - 1). Between two points where the host waits for the
# device (Megatron-LM v2.5 synchronises at both ends of every forward_step and backward_step: its
# _Timer.start/stop call torch.cuda.synchronize(), megatron/global_vars.py, megatron/schedules.py;
# and after every pipeline exchange, megatron/p2p_communication.py), a run of kernels takes about
# max(GPU time, launches x host cost): the host hides under long kernels and the GPU idles behind a
# slow host. ``transformer_layer_times`` prices it per layer call (the forward; the backward, both
# gradient sides together) in that closed form, which both the engine and the fast estimate read through
# ``LayerCosts``; per layer it is an upper bound of the max over a whole stage (a host-bound layer
# cannot borrow the lead a GPU-bound one built), exact when the stage's layers are alike.
#
# Kernels Megatron-LM v2.5 (tag v2.5, e269e20) launches per layer call, counted from its code with the
# default fusions on (--masked-softmax-fusion, --bias-gelu-fusion, --bias-dropout-fusion, apex
# FusedLayerNorm), fp16, local DDP without contiguous buffers (autograd accumulates each parameter's
# .grad: one add per parameter tensor per micro-batch). The tensor-parallel all-reduces of a layer's
# activations (megatron/mpu/mappings.py) are left out of the count, and their GPU time (which the
# engine prices on its own) out of the comparison: each occupies the stream for longer than the
# host takes to issue it (a layer output over NVLink is tens of microseconds or more), so it adds
# to the host's lead rather than taking from it. The cross-entropy's three scalar-sized all-reduces
# are counted (latency-sized, priced nowhere else).
# - block forward (megatron/model/transformer.py, ParallelTransformerLayer and ParallelAttention,
#   megatron/mpu/layers.py): LN 1, QKV linear with bias on a 3-D input (matmul + bias add) 2, baddbmm 1,
#   fused scale-mask-softmax 1, dropout 1, context bmm 1, permute-contiguous copy 1, proj GEMM 1,
#   bias-dropout-add (TorchScript; add-and-dropout, residual add) 2, LN 1, fc1 GEMM 1, fused bias-GELU
#   1, fc2 GEMM 1, bias-dropout-add 2: 17.
# - block backward, input gradients: two bias-dropout-adds 2 x 1, fc2 / fc1 / proj / QKV input-gradient
#   GEMMs 4, GELU backward 1, two LN input gradients 2, two residual-gradient sums 2, context-copy
#   gradient 1, context bmm 2, dropout 1, softmax 1, score baddbmm 2 + its alpha scaling 2, the QKV
#   split's gradient gathered into one tensor 1: 21.
# - block backward, weight gradients: 4 weight-gradient GEMMs, 4 bias-gradient sums, 2 LN x 2
#   gamma/beta kernels, 12 .grad accumulations: 24.
# - embedding (megatron/model/language_model.py Embedding, mpu/layers.py VocabParallelEmbedding; the
#   first stage's get_batch in pretrain_gpt.py: broadcast, .cuda() copies, causal mask and position
#   ids): word and position lookups 2, add 1, dropout 1, get_batch 10: 14 forward; + 7 masking
#   kernels of the vocabulary-parallel lookup when tp > 1. Backward: dropout 1 (input side), two
#   embedding_dense_backward (sort, segment sums: 6 each) 12 and two .grad accumulations 2 (weight side).
# - LM head and loss (megatron/model/gpt_model.py post_language_model_processing, mpu/cross_entropy.py,
#   pretrain_gpt.py loss_func, megatron/utils.py average_losses_across_data_parallel_group): final LN
#   1, logits GEMM 1, .float() 1, vocabulary-parallel cross-entropy 20 (max, sub, masks, gather,
#   exp, sum, log, div; its three NCCL all-reduces run even on one TP rank) + 3, loss mask and mean 5,
#   loss cat, all-reduce, divide 3: 34 forward. Backward, input side: cross-entropy 6, cast 1, loss 3,
#   logits input-gradient GEMM 1, LN input gradient 1 (12); weight side: logits weight-gradient GEMM
#   1, LN gamma/beta 2, the tied weight's .grad accumulation 1 (4).
MEGATRON_LAUNCHES = {  # kind: ((forward, input gradient, weight gradient), (the same, added when tp > 1))
    "block": ((17, 21, 24), (0, 0, 0)),
    "embedding": ((14, 1, 14), (7, 0, 0)),
    "head": ((34, 12, 4), (0, 0, 0)),
}
# Of those, the launches that exist only with dropout (p > 0; Megatron's default 0.1,
# sim.workloads.TransformerConfig.dropout): a block's attention dropout forward and backward and its two
# bias-dropout-adds' backward mask multiplies (without dropout, the gradient of a sum is its input's
# and nothing is launched; the forward's bias add and residual add stay), the embedding's dropout
# forward and backward. A p 0 workload does not launch them.
DROPOUT_LAUNCHES = {"block": (1, 3, 0), "embedding": (1, 1, 0), "head": (0, 0, 0)}
# Host seconds per counted kernel launch. Public figures bound it from below: a torch function on a
# plain tensor costs ~2 us in the framework alone (pytorch/pytorch benchmarks/overrides_benchmark/
# README.md), and cudaLaunchKernel adds a few us; a Megatron layer's Python between launches (nn.Module
# calls, custom autograd Functions, the RNG tracker's state save and restore, views, splits and
# transposes that launch nothing) comes on top and is charged to the launches here. No public
# measurement of a Megatron-LM step's per-launch host time was found, so this ONE scalar is fitted:
# ``analysis.calibrate`` (fit ``sim_host``: the physical prior, no per-call cost, only this free) on the
# vTrain single-node data, 240 rows drawn from all 1,440, with the rows' recompute as Megatron runs it
# (the transformer layers re-run inside the backward, the LM head not; session 20): 41.6 us; fitted on
# hidden 2,048 alone 41.6, on hidden 1,024 alone 41.9, on layers 12-16 42.1, on 20-24 41.6 us (each
# tested on the rows it did not see: 3.9-5.7% median error; docs/accuracy.md, sections 4 and 27; 40 us
# before the rows stopped re-running the head). GPU_HOST_LAUNCH_S is that fit, rounded; ``default_for``
# puts it on a GPU's uncalibrated curve. An EfficiencyCurve built by hand has none.
HOST_LAUNCH_S = 0.0
GPU_HOST_LAUNCH_S = 42e-6

# Attention implementations (``AnalyticCostModel(attention=...)``, ``sim.workloads.ATTENTION_IMPLEMENTATIONS``;
# a plan chooses with ``workload_options: {attention: unfused}``, or implementation: megatron-lm):
# - "unfused": Megatron-LM's CoreAttention as its 2021-2023 code ran it (megatron/model/transformer.py:
#   baddbmm of Q K^T into a [b x heads/t, s, s] score tensor, FusedScaleMaskSoftmax (the
#   scaled_upper_triang_masked_softmax CUDA kernel, megatron/model/fused_softmax.py), dropout on
#   the probabilities, bmm with V, then a permute + contiguous copy of the context); the score and
#   probability tensors go through memory, and the probabilities and the dropout mask are saved.
# - "flash": FlashAttention-style fused attention (Dao et al. 2022; FlashAttention-2, Dao 2023):
#   no s x s tensor in memory, a causal kernel skips the masked half; FlashAttention-2 reaches
#   50-73% of A100 peak (Dao 2023, abstract and section 4.1): 0.70 forward, 0.50 backward here.
#   What exec.workloads runs (torch SDPA) and the default.
FLASH_EFF_FWD = 0.70
FLASH_EFF_BWD = 0.50
# GEMM tiles cuBLAS/CUTLASS use for large fp16/bf16 GEMMs on Ampere and Hopper (CUTLASS's default
# threadblock shapes 256x128, 128x256 and 128x128; NVIDIA "Matrix Multiplication Background User's
# Guide", sections on tile and wave quantization, which works its example on A100's 108 SMs). A GEMM's
# output tiles run in waves of one tile per SM; the last, partial wave costs a full one.
GEMM_TILES = ((256, 128), (128, 256), (128, 128))
# Bytes an optimizer step moves through device memory per parameter (``AnalyticCostModel(optimizer=...)``):
# - "adam": one fused pass over fp16/bf16 parameter (read + write), gradient (read) and fp32 master
#   copy and moments (read + write): 2 x 2 + 2 + 2 x 12 = 30 B in mixed precision (STATE_BYTES).
# - "megatron-fp16": what Megatron-LM's Float16OptimizerWithFloat16Params.step does (tag v2.5,
#   megatron/optimizer/optimizer.py; clip_grads.py), kernel by kernel: copy the fp16 gradients to
#   fp32 main gradients (read 2, write 4), unscale and check for inf/nan
#   (torch._amp_foreach_non_finite_check_and_unscale_: read 4, write 4), the gradient norm for
#   --clip-grad (amp_C.multi_tensor_l2norm: read 4; the rescale that follows runs only when the norm
#   exceeds the clip value and is not counted), apex FusedAdam (read gradient, parameter and two
#   moments, write parameter and moments: 7 x 4), copy the fp32 parameters back to the fp16 model
#   (read 4, write 2): 6 + 8 + 4 + 28 + 6 = 52 B. Its two scalar all-reduces over the model-parallel
#   group (found_inf, the norm) are latency only and not counted.
OPTIMIZER_TRAFFIC = {"megatron-fp16": 52.0}
OPTIMIZERS = ("adam", *OPTIMIZER_TRAFFIC)
# Megatron-LM pads the vocabulary to a multiple of make-vocab-size-divisible-by (128) x tp
# (megatron/tokenizer/tokenizer.py, _vocab_size_with_padding).
VOCAB_PAD = 128


@dataclass(frozen=True)
class EfficiencyCurve:
    eff_max: float
    flops_half: float  # FLOPs of one call at which efficiency is eff_max / 2
    mem_eff: float = MEM_EFF
    # Host seconds per kernel launch (HOST_LAUNCH_S); the kernel model runs a layer's phase in
    # max(GPU time, launches x this). It lives on the curve because calibration fits it alongside.
    host_launch_s: float = HOST_LAUNCH_S
    # CUDA_LAUNCH_BLOCKING=1 (BLOOM-176B's run set it): every launch returns only when its kernel has
    # finished, so the host never runs ahead and a phase takes GPU time + launches x host_launch_s
    # instead of the max of the two. A what-if bound, never a default.
    host_launch_blocking: bool = False
    # Bandwidth efficiency of unfused attention's own elementwise kernels (the masked softmax and the
    # attention dropout, forward and backward), which may run below a copy's rate: the softmax makes
    # max / exp / sum passes, the dropout draws a Philox random number per element of b a s^2 / t.
    # None: ``mem_eff``, as every other memory-bound kernel (``attention_mem_eff``). The score and
    # context bmms stay on the GEMM roofline and the context's permute copy at ``mem_eff`` (a copy).
    attn_mem_eff: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.eff_max <= 1 or not 0 < self.mem_eff <= 1 or self.flops_half < 0 or self.host_launch_s < 0:
            raise ConfigError("efficiency", f"invalid curve {self}",
                              "need 0 < eff_max <= 1, 0 < mem_eff <= 1, flops_half >= 0, host_launch_s >= 0")
        if self.attn_mem_eff is not None and not 0 < self.attn_mem_eff <= 1:
            raise ConfigError("attn_mem_eff", f"must be in (0, 1], got {self.attn_mem_eff}",
                              "use a fraction of the device's memory bandwidth, or None for mem_eff's")

    @property
    def attention_mem_eff(self) -> float:
        """The bandwidth efficiency the attention core's softmax and dropout kernels run at."""
        return self.mem_eff if self.attn_mem_eff is None else self.attn_mem_eff

    def __call__(self, flops: float) -> float:
        return self.eff_max * flops / (flops + self.flops_half) if flops > 0 else 0.0

    def compute_time(self, flops: float, peak_flops: float) -> float:
        # The closed form of flops / (peak * eff(flops)); zero work costs no compute time.
        return (flops + self.flops_half) / (self.eff_max * peak_flops) if flops > 0 else 0.0

    def to_dict(self) -> dict[str, float | None]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> EfficiencyCurve:
        """The curve ``to_dict`` wrote (or a calibration record's ``efficiency_curve``): absent optional
        fields take their defaults, mem_eff included (0.9)."""
        attn = values.get("attn_mem_eff")
        return cls(eff_max=float(values["eff_max"]), flops_half=float(values["flops_half"]),
                   mem_eff=float(values.get("mem_eff", MEM_EFF)), host_launch_s=float(values.get("host_launch_s", 0.0)),
                   host_launch_blocking=bool(values.get("host_launch_blocking", False)),
                   attn_mem_eff=None if attn is None else float(attn))


# Curves fitted by ``paratwin calibrate`` on measured data (one half of it; the file records the error
# on the other half), used by default for that device family and 16-bit training.
CALIBRATED_CURVES = {"A100": Path(__file__).parent / "data" / "a100_calibration.json"}


def default_for(device: DeviceSpec, dtype: str | None = None) -> EfficiencyCurve:
    """The calibrated curve where one exists for the device, else an uncalibrated one: eff_max from a
    large-GEMM measurement, x_half from a per-call overhead."""
    if dtype is None:
        dtype = max(device.peak_flops, key=lambda k: device.peak_flops[k] if k != "fp8" else 0.0)
    calibrated = calibrated_curve(device, dtype)
    if calibrated is not None:
        return calibrated
    curve = uncalibrated_curve(device, dtype)
    # The host launch path (GPU_HOST_LAUNCH_S) applies where the kernel model does: GPUs.
    return replace(curve, host_launch_s=GPU_HOST_LAUNCH_S) if device.kind == "gpu" else curve


def uncalibrated_curve(device: DeviceSpec, dtype: str) -> EfficiencyCurve:
    """The physical prior before any fit: large-GEMM efficiency, copy bandwidth, no per-call cost, no
    host launch cost (calibrations start here; ``default_for`` adds the fitted host cost for GPUs)."""
    eff_max = CPU_EFF_MAX if device.kind == "cpu" else gpu_eff_max(device)
    return EfficiencyCurve(eff_max=eff_max, flops_half=CALL_OVERHEAD_S * eff_max * device.peak(dtype),
                           attn_mem_eff=None if device.kind == "cpu" else gpu_attn_mem_eff(device))


def gpu_eff_max(device: DeviceSpec) -> float:
    """A GPU's large-GEMM efficiency before any fit: its family's per-layer value if there is one
    (GPU_EFF_MAX_BY_FAMILY), else GPU_EFF_MAX."""
    return next((e for family, e in GPU_EFF_MAX_BY_FAMILY.items() if device.name.startswith(family)), GPU_EFF_MAX)


def gpu_attn_mem_eff(device: DeviceSpec) -> float | None:
    """A GPU's unfused-attention elementwise rate before any fit: its family's value
    (GPU_ATTN_MEM_EFF_BY_FAMILY), else None (the copy rate, mem_eff)."""
    return next((e for family, e in GPU_ATTN_MEM_EFF_BY_FAMILY.items() if device.name.startswith(family)), None)


def calibrated_curve(device: DeviceSpec, dtype: str) -> EfficiencyCurve | None:
    path = next((p for family, p in CALIBRATED_CURVES.items() if device.name.startswith(family)), None)
    if path is None or normalize_dtype(dtype) not in ("fp16", "bf16") or not path.is_file():
        return None
    record = json.loads(path.read_text())
    if not record.get("use_as_default", True):  # a fit recorded for reference, not shipped as default
        return None
    return EfficiencyCurve.from_dict(record["efficiency_curve"])


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary as Megatron-LM allocates it: rounded up to a multiple of 128 x tp."""
    unit = VOCAB_PAD * tp
    return -(-int(vocab) // unit) * unit


def gemm_time(m: float, n: float, k: float, batch: float, peak: float, eff_max: float, bandwidth: float,
              act_bytes: int, sm_count: int | None) -> float:
    """Seconds of ``batch`` GEMMs C[m, n] = A[m, k] B[k, n]: the larger of the tensor-core time and the
    time to read A and B and write C at ``bandwidth``. With ``sm_count``, the m x n output is cut into
    tiles (GEMM_TILES, the fastest choice), the tiles run in waves of ``sm_count`` and every wave costs
    a full one (a tile computes at eff_max x peak / sm_count); without it the work is continuous."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    if sm_count:
        per_sm = eff_max * peak / sm_count
        compute = min(math.ceil(math.ceil(m / tm) * math.ceil(n / tn) * batch / sm_count) * 2.0 * tm * tn * k / per_sm
                      for tm, tn in GEMM_TILES)
    else:
        compute = 2.0 * m * n * k * batch / (eff_max * peak)
    memory = act_bytes * batch * (m * k + k * n + m * n) / bandwidth
    return max(compute, memory)


@dataclass(frozen=True)
class KernelTimes:
    """One layer, one micro-batch, one TP rank: seconds by phase, and the bytes of the memory-bound
    kernels (for tests and reports)."""

    fwd_s: float
    bwd_input_s: float
    bwd_weight_s: float
    elementwise_bytes_fwd: float
    elementwise_bytes_bwd: float
    # Bytes kept beyond LayerSpec's count (which is flash attention's without dropout): unfused attention's
    # softmax output (and with dropout its mask and output; less flash's log-sum-exp), dropout masks.
    extra_saved_bytes: float
    # Seconds by kind of work, (forward, input gradient, weight gradient) each; they sum to the three
    # times above. Kinds: "gemm" (the weight GEMMs of a block), "attention" (score and context bmms,
    # softmax, dropout and the context copy; a flash kernel), "memory" (a block's layernorms,
    # bias-dropout-adds, GELU, residual sums), "lm_head_loss", "embedding", "per_call" (a fitted cost),
    # "host" (what the host launch path adds beyond the GPU's time: see HOST_LAUNCH_S).
    parts: tuple[tuple[str, tuple[float, float, float]], ...] = ()
    # Seconds a backward under selective checkpointing spends recomputing the layer's memory-bound
    # forward kernels (every one inside the layer; the matmuls and attention kernels are kept).
    selective_recompute_s: float = 0.0
    # Seconds of the weight-gradient GEMM of each column-parallel linear of a block (QKV, then fc1):
    # what Megatron-LM's asynchronous TP all-reduce of that linear's input gradient can hide behind
    # (``AnalyticCostModel(tp_backward_overlap=True)``, ``sim.costs.tp_comm_s``). Empty elsewhere.
    column_wgrad_s: tuple[float, ...] = ()
    # Seconds of the input-gradient GEMM of the same linears (QKV, fc1): what the sequence-parallel
    # backward's re-gather of their inputs can hide behind (sim.costs.LayerCosts.tp_bwd_regathers).
    column_dgrad_s: tuple[float, ...] = ()
    # Korthikanti et al.'s selective recomputation (sim.memory_attention): the bytes of the unfused
    # attention core it drops (softmax output, dropout mask and output) and the seconds re-running the
    # core costs in the backward (both bmms, softmax, dropout, the context copy: the "attention" part's
    # forward). 0 and 0 with flash attention (no s x s tensor is kept) and for other layers.
    attention_core_bytes: float = 0.0
    attention_core_recompute_s: float = 0.0
    sequence_parallel: bool = False  # whether the layer ran its hidden-size region sequence-parallel


def transformer_layer_times(layer: LayerSpec, b: int, t: int, device: DeviceSpec, dtype: str,
                            curve: EfficiencyCurve, attention: str = "flash") -> KernelTimes:
    """Kernel-by-kernel times of a transformer layer (``sim.workloads.transformer_layers`` shape in
    ``layer.extra``) for micro-batch ``b`` under TP degree ``t``, as Megatron-LM runs it.

    GEMMs at their per-GPU shapes after the TP split (column-parallel QKV and fc1, row-parallel proj
    and fc2, vocabulary-parallel head) through ``gemm_time``; a GEMM's backward is its input-gradient
    GEMM (m x k output, reduction over n) and its weight-gradient GEMM (k x n output, reduction over
    the m tokens). Memory-bound kernels priced by the bytes they move at memory bandwidth x mem_eff
    (unfused attention's softmax and dropout at x ``curve.attention_mem_eff``);
    tensors of the hidden size are replicated on every TP rank (no sequence parallelism in
    Megatron-LM 2021-2023), so their kernels do not shrink with t. Element size e, masks 1 byte.
    X = b s h, F = b s f / t, S = b (a / t) s^2 (elements):

    With sequence parallelism (``layer.extra["sequence_parallel"]``, t > 1; Korthikanti et al. 2022,
    section 4.2.2) a block's layernorms, bias-dropout-adds, residual sums and their masks run on the
    local 1/t of the sequence: X below is b s h / t for those kernels (the GEMMs and attention are
    unchanged: the all-gathered input feeds them whole). So do the region's two edges (Korthikanti
    et al. section 4.2.2; exec.parallel.sequence and exec.workloads.gpt run them so): the embedding's
    output dropout, after the scatter (its lookup and position add stay whole), and the head's final
    LN, before the gather (the logits GEMM and the loss run on the gathered sequence).

    block, forward: LN1 (read X, write X), attention (unfused: fused scale-mask-softmax read S write S,
      dropout read S write S + mask S, context permute copy read + write X / t; flash: none),
      bias-dropout-add after proj (read 2X + bias, write X + mask X), LN2 (2X), bias-GELU (read F,
      write F), bias-dropout-add after fc2 (as the first);
    block, backward: LN1, LN2 (read dy, x, write dx: 3X each), softmax (read dy, y, write dx: 3S),
      dropout (read dy, mask, write dx: 2S e + S), context copy (2X / t), each dropout-add (read dy,
      mask, write dx, and dy again for the bias gradient: 3X e + X), GELU (read dy, x, write dx: 3F),
      the residual-gradient sums (2 x (read 2X, write X));
    without dropout (``layer.extra["dropout"]`` 0, the default) no dropout kernel runs and no mask is
      written or read: the attention dropout's forward and backward and the masks' X bytes of the
      bias-dropout-adds go (the bias and residual adds stay), and the embedding's dropout;
    head: final LN (2X / 3X), logits GEMM [b s, h] x [h, V/t], vocabulary-parallel cross-entropy on the
      [b s, V/t] logits in fp32 (megatron/core/tensor_parallel/cross_entropy.py: cast, max, subtract,
      exp, sum, divide: 38 bytes per logit forward; gradient and cast back: 14 bytes backward);
    embedding: lookup (read + write X), position add (read 2X, write X), dropout (read X, write X +
      mask); backward: dropout, then the scatter-add of the word and position gradients (3X).
    The small per-rank cross-entropy all-reduces and the tensor-parallel all-reduces are not here
    (``tp_comm_times`` and the engine price the latter).
    """
    if attention not in ATTENTION_IMPLEMENTATIONS:
        raise ConfigError("attention", f"unknown attention implementation {attention!r}",
                          f"use one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
    x = layer.extra
    s, h, a, f = int(x["seq"]), int(x["hidden"]), int(x["heads"]), int(x["ffn"])
    drop = 1.0 if x.get("dropout", 0.0) > 0 else 0.0  # whether the dropout kernels run (TransformerConfig.dropout)
    split = bool(x.get("sequence_parallel", 0.0)) and t > 1  # the layer's hidden-size region on 1/t
    sp = split and layer.kind == "block"  # its TP all-reduces become reduce-scatters and all-gathers
    e = ACTIVATION_BYTES[normalize_dtype(dtype)]
    peak = device.peak(dtype)
    bw = device.memory_bandwidth_Bps * curve.mem_eff
    eff = curve.eff_max
    sms = device.sm_count

    def gemm(m: float, n: float, k: float, batch: float = 1) -> tuple[float, float, float]:
        """(forward, input-gradient, weight-gradient) seconds of a weight GEMM."""
        return (gemm_time(m, n, k, batch, peak, eff, bw, e, sms), gemm_time(m, k, n, batch, peak, eff, bw, e, sms),
                gemm_time(k, n, m, batch, peak, eff, bw, e, sms))

    T = b * s
    X = float(T * h)
    parts: dict[str, list[float]] = {}

    def add(kind: str, fwd: float = 0.0, bi: float = 0.0, bw_: float = 0.0) -> None:
        part = parts.setdefault(kind, [0.0, 0.0, 0.0])
        part[0], part[1], part[2] = part[0] + fwd, part[1] + bi, part[2] + bw_

    mem_f = mem_b = 0.0  # bytes of every memory-bound kernel, for the report
    saved_extra = 0.0
    column_wgrad: tuple[float, ...] = ()
    column_dgrad: tuple[float, ...] = ()
    core_bytes = core_s = 0.0
    # Bytes and seconds of unfused attention's softmax and dropout kernels (forward), the one place
    # they are priced (unfused_attention_core_times); their bytes are inside pointwise_f too, so selective_recompute_s
    # below takes them out and adds these seconds back.
    attn_elem_f = attn_elem_f_s = 0.0
    if layer.kind == "block":
        F = float(T * f / t)
        shapes = {"qkv": (T, 3 * h / t, h), "proj": (T, h, h / t), "fc1": (T, f / t, h), "fc2": (T, h, f / t)}
        weight_gemms = {name: gemm(m, n, k) for name, (m, n, k) in shapes.items()}
        for times in weight_gemms.values():
            add("gemm", *times)
        column_wgrad = (weight_gemms["qkv"][2], weight_gemms["fc1"][2])  # the column-parallel ones
        column_dgrad = (weight_gemms["qkv"][1], weight_gemms["fc1"][1])
        heads, d = b * a / t, h / a
        if attention == "unfused":
            S = float(heads * s * s)
            core = unfused_attention_core_times(heads, s, d, device, dtype, curve, dropout=bool(drop))
            add("attention", core.fwd_s, core.bwd_s)
            attn_elem_f, attn_elem_f_s = core.elementwise_bytes_fwd, core.elementwise_fwd_s
            mem_f = mem_f + core.elementwise_bytes_fwd + core.copy_bytes
            mem_b = mem_b + core.elementwise_bytes_bwd + core.copy_bytes
            saved_extra = unfused_attention_saved_bytes(b, t, s, a, e, drop)
            core_bytes, core_s = e * S + drop * (S + e * S), parts["attention"][0]
        else:
            causal = 0.5 if x.get("causal", 1.0) else 1.0
            flops = 4.0 * heads * s * s * d * causal
            add("attention", flops / (FLASH_EFF_FWD * peak), 2.5 * flops / (FLASH_EFF_BWD * peak))
        R = X / t if sp else X  # the layernorm / dropout / residual region: sequence-parallel or replicated
        blk_f = e * 2 * R + (e * 3 * R + drop * R) + e * 2 * R + e * 2 * F + (e * 3 * R + drop * R)
        blk_b = e * 3 * R * 2 + 2 * (e * 3 * R + drop * R) + e * 3 * F + 2 * e * 3 * R
        add("memory", blk_f / bw, blk_b / bw)
        mem_f, mem_b = mem_f + blk_f, mem_b + blk_b
        saved_extra += drop * 2 * R  # the two bias-dropout-adds' 1-byte masks (hidden size: split only by SP)
    elif layer.kind == "head":
        v = padded_vocab(int(x["vocab"]), t)
        logits = float(T * v / t)
        L = X / t if split else X  # the final LN, on the sequence shard under sequence parallelism
        mem_f, mem_b = e * 2 * L + 38 * logits, e * 3 * L + 14 * logits
        g = gemm(T, v / t, h)
        add("lm_head_loss", g[0] + mem_f / bw, g[1] + mem_b / bw, g[2])
        pointwise_f = e * 2 * L  # the final LN; the cross-entropy runs outside the checkpointed layer
    elif layer.kind == "embedding":
        D = X / t if split else X  # the output dropout, after the sequence scatter under sequence parallelism
        mem_f = e * 2 * X + e * 3 * X + drop * (e * 2 * D + D)
        mem_b = drop * (e * 2 * D + D) + e * 3 * X
        add("embedding", mem_f / bw, mem_b / bw)
        saved_extra = drop * D  # the embedding dropout's mask
    else:
        raise ConfigError("layer", f"no kernel model for a {layer.kind!r} layer", "use a transformer layer")
    if layer.kind != "head":
        pointwise_f = mem_f  # a block's or the embedding's every non-GEMM, non-attention kernel
    overhead = curve.flops_half / (curve.eff_max * peak)  # a fitted per-call cost, if any (0 by default)
    if overhead:
        add("per_call", overhead, overhead, overhead if layer.params else 0.0)
    if curve.host_launch_s:
        # What the host adds: the forward, and the backward as one autograd pass (Megatron runs the
        # input- and weight-gradient kernels interleaved), each take max(GPU, host); the excess is
        # its own kind, the backward's split between its two sides by their launches. Under
        # launch blocking nothing overlaps: every launch's host time adds to the GPU's.
        gpu = [0.0, 0.0, 0.0] if curve.host_launch_blocking else [sum(part[i] for part in parts.values())
                                                                  for i in range(3)]
        n_f, n_bi, n_bw = host_launches(layer.kind, t, dropout=bool(drop))
        c = curve.host_launch_s
        extra_b = max(0.0, (n_bi + n_bw) * c - gpu[1] - gpu[2])
        share = n_bi / (n_bi + n_bw)
        add("host", max(0.0, n_f * c - gpu[0]), extra_b * share, extra_b * (1.0 - share))
    fwd, bi, bw_ = (sum(part[i] for part in parts.values()) for i in range(3))
    return KernelTimes(
        fwd_s=fwd, bwd_input_s=bi, bwd_weight_s=bw_,
        elementwise_bytes_fwd=mem_f, elementwise_bytes_bwd=mem_b, extra_saved_bytes=saved_extra,
        parts=tuple((kind, (part[0], part[1], part[2])) for kind, part in parts.items()),
        selective_recompute_s=(pointwise_f - attn_elem_f) / bw + attn_elem_f_s,
        column_wgrad_s=column_wgrad, column_dgrad_s=column_dgrad,
        attention_core_bytes=core_bytes, attention_core_recompute_s=core_s, sequence_parallel=sp,
    )


@dataclass(frozen=True)
class AttentionCoreTimes:
    """Unfused attention's core (scores, masked softmax, dropout, context, the context's permute copy)
    on ``heads`` (batch x heads per rank) heads: seconds by kind and the bytes of its memory-bound
    kernels. Priced once here for the layer (``transformer_layer_times``) and for the kernel benchmark
    the attention rate is measured on (benchmarks/flashattention_e6.py)."""

    bmm_fwd_s: float  # the score and context bmms, on the GEMM roofline
    bmm_bwd_s: float  # their four backward bmms (each produces one activation operand's gradient)
    elementwise_bytes_fwd: float  # softmax and dropout, at bandwidth x attention_mem_eff
    elementwise_bytes_bwd: float
    elementwise_fwd_s: float
    elementwise_bwd_s: float
    copy_bytes: float  # the context's permute + contiguous copy (each pass), at bandwidth x mem_eff
    copy_s: float

    @property
    def fwd_s(self) -> float:
        return self.bmm_fwd_s + self.elementwise_fwd_s + self.copy_s

    @property
    def bwd_s(self) -> float:
        return self.bmm_bwd_s + self.elementwise_bwd_s + self.copy_s


def unfused_attention_core_times(heads: float, s: int, d: float, device: DeviceSpec, dtype: str,
                                 curve: EfficiencyCurve, dropout: bool) -> AttentionCoreTimes:
    """Megatron-LM's CoreAttention, kernel by kernel, for ``heads`` = b a / t heads of dimension ``d`` at
    sequence ``s``: S = heads s^2 score elements of e bytes (``dtype``'s activation size). Scores Q K^T
    ([s, d] x [d, s] per head) and context P V ([s, s] x [s, d]) through ``gemm_time``; backward, the
    gradient of each operand. Fused scale-mask-softmax: read S, write S (forward), read dy and y, write
    dx (backward); dropout: read S, write S and a 1-byte mask (forward), read dy and the mask, write dx
    (backward); both at memory bandwidth x ``curve.attention_mem_eff``. The context's permute copy
    (read and write heads s d elements, each pass) at x ``curve.mem_eff``, as every copy."""
    e = ACTIVATION_BYTES[normalize_dtype(dtype)]
    peak, eff, sms = device.peak(dtype), curve.eff_max, device.sm_count
    bw = device.memory_bandwidth_Bps * curve.mem_eff
    bw_attn = device.memory_bandwidth_Bps * curve.attention_mem_eff
    drop = 1.0 if dropout else 0.0
    S = float(heads * s * s)
    bmm_f = bmm_b = 0.0
    for m, n, k in ((s, s, d), (s, d, s)):
        bmm_f += gemm_time(m, n, k, heads, peak, eff, bw, e, sms)
        bmm_b += gemm_time(m, k, n, heads, peak, eff, bw, e, sms) + gemm_time(k, n, m, heads, peak, eff, bw, e, sms)
    elem_f, elem_b = e * 2 * S + drop * (e * 2 * S + S), e * 3 * S + drop * (e * 2 * S + S)
    copy = e * 2 * heads * s * d
    return AttentionCoreTimes(bmm_fwd_s=bmm_f, bmm_bwd_s=bmm_b, elementwise_bytes_fwd=elem_f,
                              elementwise_bytes_bwd=elem_b, elementwise_fwd_s=elem_f / bw_attn,
                              elementwise_bwd_s=elem_b / bw_attn, copy_bytes=copy, copy_s=copy / bw)


def host_launches(kind: str, tp: int, dropout: bool = True) -> tuple[int, int, int]:
    """Kernel launches of one layer call (forward, input gradient, weight gradient) as Megatron-LM v2.5
    issues them (MEGATRON_LAUNCHES), less its dropout kernels where the workload has no dropout
    (DROPOUT_LAUNCHES)."""
    base, with_tp = MEGATRON_LAUNCHES[kind]
    gone = (0, 0, 0) if dropout else DROPOUT_LAUNCHES[kind]
    return tuple(b + (x if tp > 1 else 0) - g for b, x, g in zip(base, with_tp, gone, strict=True))  # type: ignore[return-value]


def unfused_attention_saved_bytes(b: int, t: int, s: int, a: int, e: int, dropout: float) -> float:
    """Bytes unfused attention keeps beyond ``sim.workloads.transformer_layers``' count (which is flash
    attention's) on one TP rank, S = b (a / t) s^2: the softmax output (e S; its backward's input and,
    without dropout, the context bmm's), and with dropout its 1-byte mask (S) and its output (e S, the
    context bmm's input), as Korthikanti et al. 2022 section 4.1 itemise them (2as^2b + as^2b +
    2as^2b at fp16); less the flash kernel's log-sum-exp (b (a / t) s elements), which unfused
    attention does not have."""
    S = b * a / t * s * s
    return e * S + (S + e * S if dropout else 0.0) - b * a / t * s * e


_KERNEL_KEYS = ("seq", "hidden", "heads", "ffn", "vocab")


def has_kernel_shape(layer: LayerSpec) -> bool:
    return layer.kind in ("block", "head", "embedding") and all(k in layer.extra for k in _KERNEL_KEYS)


@dataclass(frozen=True)
class LayerCosts:
    """One layer, one micro-batch, one TP rank. Times in seconds, sizes in bytes."""

    fwd_s: float
    bwd_input_s: float
    bwd_weight_s: float
    recompute_s: float  # the forward re-run by activation checkpointing
    tp_comm_bytes_fwd: int  # total bytes all-reduced over the TP group per forward
    tp_comm_bytes_bwd: int
    tp_allreduces_fwd: int
    tp_allreduces_bwd: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    saved_bytes: int
    output_bytes: int
    flops_fwd: float = 0.0
    selective_saved_bytes: int = -1  # sim.costs.LayerCosts: -1 where not modelled
    selective_recompute_s: float = -1.0
    shared_input_bytes: int = 0
    unsaved_input_bytes: int = 0
    saved_output_bytes: int = -1  # sim.costs.LayerCosts.saved_output_bytes
    tp_bwd_overlap_s: tuple[float, ...] = ()  # sim.costs.LayerCosts.tp_bwd_overlap_s
    tp_bwd_overlap_share: float = 1.0  # sim.costs.LayerCosts.tp_bwd_overlap_share
    tp_sequence_parallel: bool = False  # sim.costs.LayerCosts.tp_sequence_parallel
    tp_bwd_regathers: int = 0  # sim.costs.LayerCosts.tp_bwd_regathers
    tp_bwd_regather_overlap_s: tuple[float, ...] = ()
    attention_core_bytes: int = -1  # sim.costs.LayerCosts.attention_core_bytes
    attention_core_recompute_s: float = -1.0
    sp_grad_bytes: int = 0  # sim.costs.LayerCosts.sp_grad_bytes
    grad_accumulate_s: float = 0.0  # sim.costs.LayerCosts.grad_accumulate_s

    @property
    def bwd_s(self) -> float:
        return self.bwd_input_s + self.bwd_weight_s

    @property
    def tp_message_bytes(self) -> int:
        """Size of one forward TP all-reduce (the layer output, but for the LM head's loss)."""
        return self.tp_comm_bytes_fwd // self.tp_allreduces_fwd if self.tp_allreduces_fwd else 0

    @property
    def tp_bwd_message_bytes(self) -> int:
        """Size of one backward TP all-reduce (the LM head's: its input gradient)."""
        return self.tp_comm_bytes_bwd // self.tp_allreduces_bwd if self.tp_allreduces_bwd else 0


def grad_accumulation_s(grad_bytes: int, mode: str, device: DeviceSpec, mem_eff: float) -> float:
    """Seconds of one accumulation pass over ``grad_bytes`` of weight gradients (GRAD_ACCUMULATIONS): 0
    where it is fused into the weight-gradient GEMM; under autograd read the sum and the new gradient and
    write the sum at the memory-bound kernels' rate (``mem_eff`` x the device's bandwidth). One rule for
    the analytic model and for profiled costs (``sim.bundle_costs``: a profile's backward never accumulates)."""
    if mode == "fused":
        return 0.0
    return 3 * grad_bytes / (device.memory_bandwidth_Bps * mem_eff)


class AnalyticCostModel:
    def __init__(self, device: DeviceSpec, dtype: str, efficiency: EfficiencyCurve | None = None,
                 attention: str = "flash", kernels: bool = True, optimizer: str = "adam",
                 tp_backward_overlap: bool | float = False, grad_accumulation: str = "fused") -> None:
        self.device = device
        self.dtype = normalize_dtype(dtype)
        self.peak = device.peak(self.dtype)  # raises a ConfigError for a dtype the device lacks
        self.efficiency = efficiency if efficiency is not None else default_for(device, self.dtype)
        if attention not in ATTENTION_IMPLEMENTATIONS:
            raise ConfigError("attention", f"unknown attention implementation {attention!r}",
                              f"use one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
        self.attention = attention
        if optimizer not in OPTIMIZERS:
            raise ConfigError("optimizer", f"unknown optimizer step {optimizer!r}",
                              f"use one of {', '.join(OPTIMIZERS)}")
        self.optimizer = optimizer
        # kernels=False: the earlier per-layer roofline (layer FLOPs over the efficiency curve), kept
        # for comparison (the accuracy report prints both).
        self.kernels = kernels
        # Megatron-LM's asynchronous TP all-reduce (added in commit 16c9044, on by default from 3f65246,
        # both 2021-09-02; not in v2.5, which SC'21 ran): a column-parallel linear's backward launches the
        # all-reduce of its input gradient asynchronously and runs its weight-gradient GEMM meanwhile
        # (megatron/mpu/layers.py, LinearWithGradAccumulationAndAsyncCommunication.backward). Off by
        # default: every golden and the v2.5 benchmark assume the all-reduces run after the compute.
        # A number in [0, 1] is the share of each overlappable collective that runs under its GEMM
        # (sim.costs.LayerCosts.tp_bwd_overlap_share): False is 0, True is 1 (the ideal overlap).
        self.tp_backward_overlap = overlap_share(tp_backward_overlap)
        if grad_accumulation not in GRAD_ACCUMULATIONS:
            raise ConfigError("grad_accumulation", f"unknown gradient accumulation {grad_accumulation!r}",
                              f"use one of {', '.join(GRAD_ACCUMULATIONS)}")
        self.grad_accumulation = grad_accumulation

    def grad_accumulate_s(self, grad_bytes: int) -> float:
        """Seconds of one accumulation pass over ``grad_bytes`` of weight gradients (``grad_accumulation_s``)."""
        return grad_accumulation_s(grad_bytes, self.grad_accumulation, self.device, self.efficiency.mem_eff)

    def _time(self, flops: float, nbytes: float) -> float:
        compute = self.efficiency.compute_time(flops, self.peak)
        memory = nbytes / (self.device.memory_bandwidth_Bps * self.efficiency.mem_eff)
        return max(compute, memory)

    def layer_costs(self, layer: LayerSpec, micro_batch: int, tp: int = 1) -> LayerCosts:
        if micro_batch < 1:
            raise ConfigError("micro_batch", f"must be >= 1, got {micro_batch}", "use a positive micro-batch")
        if tp < 1:
            raise ConfigError("tp", f"must be >= 1, got {tp}", "use a positive TP degree")
        b, t = micro_batch, tp
        act = ACTIVATION_BYTES[self.dtype]
        p_b, g_b, o_b = STATE_BYTES[self.dtype]
        params = tp_rank_params(layer, t)
        saved = (layer.saved_elems - layer.saved_elems_sharded) + layer.saved_elems_sharded / t
        out = b * layer.output_elems
        # Under sequence parallelism an embedding's or a block's output lives in the sequence-split region:
        # each TP rank holds (and a pipeline stage sends) its 1/t of the sequence (Megatron-LM's p2p
        # shape is seq / tp: megatron/core/pipeline_parallel/schedules.py, get_tensor_shapes), so a
        # checkpointed layer keeps 2 s b h / t (Korthikanti et al. 2022, eq. 5). Its TP collectives
        # still move the whole tensor (``out`` below). check_tp makes t divide the sequence.
        split_region = bool(layer.extra.get("sequence_parallel", 0.0)) and t > 1
        sequence_split = t if split_region and layer.kind in ("embedding", "block") else 1

        flops_fwd = b * layer.flops_fwd / t
        f_bi, f_bw = self._backward_split(layer)
        # Memory traffic, a lower-bound estimate: weights read once, input and output once, saved
        # activations written in forward and read in backward. An embedding reads only its rows.
        weights_read = min(params, out) if layer.kind == "embedding" else params
        bytes_fwd = act * (weights_read + 2 * out + b * saved)
        bytes_bi = act * (weights_read + 2 * out + b * saved)
        bytes_bw = act * (params + out + b * saved) if layer.params else 0.0

        fwd = self._time(flops_fwd, bytes_fwd)
        bwd_i = self._time(b * f_bi / t, bytes_bi)
        bwd_w = self._time(b * f_bw / t, bytes_bw) if layer.params else 0.0
        saved_bytes = b * saved * act
        selective_bytes, selective_s = -1.0, -1.0
        column_wgrad: tuple[float, ...] = ()  # known only to the kernel model
        column_dgrad: tuple[float, ...] = ()
        sequence_parallel, core_bytes, core_s = False, -1.0, -1.0
        if layer.selective_elems >= 0:
            # Roofline of what selective checkpointing recomputes, for layers without a kernel model
            # (e.g. a ResNet's BatchNorms and ReLUs): memory-bound operators that write, once more,
            # every saved byte the policy does not keep and read it once in the backward.
            selective_bytes = b * layer.selective_elems * act
            selective_s = 2 * max(saved_bytes - selective_bytes, 0.0) / (
                self.device.memory_bandwidth_Bps * self.efficiency.mem_eff)
        if self.kernels and has_kernel_shape(layer) and self.device.kind == "gpu":
            k = transformer_layer_times(layer, b, t, self.device, self.dtype, self.efficiency, self.attention)
            fwd, bwd_i, bwd_w = k.fwd_s, k.bwd_input_s, k.bwd_weight_s
            column_wgrad, column_dgrad = k.column_wgrad_s, k.column_dgrad_s
            sequence_parallel = k.sequence_parallel
            core_bytes, core_s = k.attention_core_bytes, k.attention_core_recompute_s
            if sequence_parallel:  # every saved tensor of the block is sharded: the hidden-size ones by sequence
                saved_bytes = b * layer.saved_elems / t * act
            elif split_region:  # an edge of the region (the head's final LayerNorm: its input and statistics)
                saved_bytes -= b * layer.sequence_split_elems * (1 - 1 / t) * act
            saved_bytes += k.extra_saved_bytes
            if layer.selective_elems >= 0:
                kept = (layer.selective_elems - layer.selective_elems_sharded) + layer.selective_elems_sharded / t
                if sequence_parallel:  # its hidden-size tensors (input, proj and fc2 outputs) split by sequence
                    kept = layer.selective_elems / t
                # Unfused attention keeps its score matmul's output too (b a/t s^2: the bmm is kept).
                scores = b * layer.extra["heads"] / t * layer.extra["seq"] ** 2 \
                    if self.attention == "unfused" and layer.kind == "block" else 0.0
                selective_bytes, selective_s = (b * kept + scores) * act, k.selective_recompute_s
            if layer.kind in ("head", "embedding"):  # the vocabulary as Megatron pads and splits it
                v = padded_vocab(int(layer.extra["vocab"]), t)
                params = v // t * int(layer.extra["hidden"]) + layer.params_replicated
        n_ar = layer.tp_allreduces if t > 1 else 0
        n_ar_bwd = n_ar if layer.tp_in_backward else 0
        comm_fwd, comm_bwd = n_ar * out * act, n_ar_bwd * out * act
        if layer.kind == "head" and n_ar and "vocab" in layer.extra:
            n_ar, n_ar_bwd, comm_fwd, comm_bwd = megatron_head_tp(b, layer, act)
        # a block's two backward all-reduces, one behind each column-parallel linear's weight gradient;
        # under sequence parallelism the reduce-scatter of that input gradient (sim.costs.tp_comm_s).
        # Megatron-LM's sequence-parallel code always runs that overlap; it is priced only with
        # tp_backward_overlap all the same, so that one switch says whether the backward's GEMM rate is
        # the one the A100 default was fitted with (overlap off: docs/sequence-parallel.md).
        overlap = column_wgrad if self.tp_backward_overlap and n_ar_bwd else ()
        regathers = len(column_dgrad) if sequence_parallel and n_ar_bwd else 0
        regather_overlap = column_dgrad if regathers and self.tp_backward_overlap else ()
        # Parameters that see only the rank's 1/t of the sequence (sim.costs.LayerCosts.sp_grad_bytes): the
        # ones TP holds whole in the sequence-parallel region, a block's two LayerNorms and its two
        # row-parallel biases (sim.workloads.block_replicated_params); the LM head's final LayerNorm, which
        # runs on the shard before the gather. (Not the embedding's position table: it runs before the scatter.)
        sp_elems = layer.params_replicated if split_region and layer.kind in ("block", "head") else 0
        return LayerCosts(
            fwd_s=fwd,
            bwd_input_s=bwd_i,
            bwd_weight_s=bwd_w,
            recompute_s=fwd,
            tp_comm_bytes_fwd=comm_fwd,
            tp_comm_bytes_bwd=comm_bwd,
            tp_allreduces_fwd=n_ar,
            tp_allreduces_bwd=n_ar_bwd,
            param_bytes=params * p_b,
            grad_bytes=params * g_b,
            optimizer_bytes=params * o_b,
            saved_bytes=int(round(saved_bytes)),
            output_bytes=out * act // sequence_split,
            flops_fwd=flops_fwd,
            selective_saved_bytes=int(round(selective_bytes)),
            selective_recompute_s=selective_s,
            shared_input_bytes=b * layer.shared_input_elems * act,
            unsaved_input_bytes=b * layer.unsaved_input_elems * act,
            saved_output_bytes=b * layer.saved_output_elems * act if layer.saved_output_elems >= 0 else -1,
            tp_bwd_overlap_s=overlap,
            tp_bwd_overlap_share=self.tp_backward_overlap if overlap or regather_overlap else 1.0,
            tp_sequence_parallel=sequence_parallel,
            tp_bwd_regathers=regathers, tp_bwd_regather_overlap_s=regather_overlap,
            attention_core_bytes=int(round(core_bytes)),
            attention_core_recompute_s=core_s,
            sp_grad_bytes=sp_elems * g_b,
            grad_accumulate_s=self.grad_accumulate_s(params * g_b),
        )

    @staticmethod
    def _backward_split(layer: LayerSpec) -> tuple[float, float]:
        """FLOPs of backward-input and backward-weight (per sample, before TP)."""
        if "flops_bwd_input" in layer.extra and "flops_bwd_weight" in layer.extra:
            return layer.extra["flops_bwd_input"], layer.extra["flops_bwd_weight"]
        if layer.params == 0:
            return float(layer.flops_bwd), 0.0
        # A matmul's backward is two matmuls of its forward's size: one for the input gradient, one
        # for the weight gradient (LayerSpec.flops_bwd = 2 x flops_fwd).
        return layer.flops_bwd / 2, layer.flops_bwd / 2

    def step_copy_bytes(self, grad_bytes: int, buffer_scale: float) -> int:
        """Bytes the optimizer step allocates for the gradients held in ``grad_bytes`` (the parameters'
        dtype; ``buffer_scale``: sim.model_state). Megatron-LM's fp16 optimizer copies 16-bit main
        gradients to fp32 (``main_param.grad = model_param.main_grad.float()``, megatron/optimizer/
        optimizer.py line 309 at v2.5, 311 at 739cb43, 611 at 23.04), freed by the next iteration's
        ``zero_grad(set_to_none=True)``; an fp32 main-grad buffer is used as it is (``.float()`` of an
        fp32 tensor is that tensor). The fused "adam" step allocates nothing."""
        grad_element = STATE_BYTES[self.dtype][1]
        if self.optimizer != "megatron-fp16" or buffer_scale != 1.0 or grad_element >= 4:
            return 0
        return grad_bytes * 4 // grad_element

    def optimizer_step_s(self, param_bytes: int) -> float:
        """Adam step: memory-bound, reads and writes parameters, gradients and optimizer state
        (OPTIMIZER_TRAFFIC: as one fused pass, or kernel by kernel as Megatron-LM ran it)."""
        p_b, g_b, o_b = STATE_BYTES[self.dtype]
        params = param_bytes / p_b
        traffic = params * OPTIMIZER_TRAFFIC.get(self.optimizer, 2 * p_b + g_b + 2 * o_b)
        return traffic / (self.device.memory_bandwidth_Bps * self.efficiency.mem_eff)


def overlap_share(value: bool | float) -> float:
    """``tp_backward_overlap`` as the share of each overlappable backward collective that runs under its
    GEMM: False 0.0, True 1.0, a number in [0, 1] itself; anything else a ConfigError."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    try:
        share = float(value)
    except (TypeError, ValueError):
        share = float("nan")
    if not 0.0 <= share <= 1.0:  # also refuses nan
        raise ConfigError("tp_backward_overlap", f"must be a bool or a share in [0, 1], got {value!r}",
                          "use False (no overlap), True (the ideal overlap) or a fraction such as 0.5")
    return share


def megatron_head_tp(micro_batch: int, layer: LayerSpec, act: int) -> tuple[int, int, int, int]:
    """(forward all-reduces, backward all-reduces, forward bytes, backward bytes) of Megatron-LM's
    vocabulary-parallel LM head and loss over the TP group, for ``micro_batch`` sequences. Forward:
    ``vocab_parallel_cross_entropy`` all-reduces three b x s fp32 tensors (the logits' max, the
    target's logit, the sum of exponentials; the logits are cast to fp32 first unless
    --fp16-lm-cross-entropy); backward: ``parallel_lm_logits`` takes its input through
    ``copy_to_tensor_model_parallel_region``, whose backward all-reduces the b x s x h input gradient
    in the activation dtype (megatron/mpu/cross_entropy.py, megatron/model/language_model.py and
    gpt_model.py at v2.5 e269e20; the same at 739cb43, 2022)."""
    tokens = micro_batch * int(layer.extra["seq"])
    return 3, 1, 3 * tokens * ELEMENT_BYTES["fp32"], tokens * int(layer.extra["hidden"]) * act


def tp_comm_times(costs: LayerCosts, ranks: Sequence[int], cluster: ClusterSpec,
                  algorithm: str = "auto") -> tuple[float, float]:
    """Seconds of the layer's TP all-reduces per forward and per backward over the TP group ``ranks``."""
    times = []
    for count, nbytes in ((costs.tp_allreduces_fwd, costs.tp_comm_bytes_fwd),
                          (costs.tp_allreduces_bwd, costs.tp_comm_bytes_bwd)):
        times.append(count * collective_time("all_reduce", nbytes // count, ranks, cluster, algorithm)
                     if count else 0.0)
    return times[0], times[1]
