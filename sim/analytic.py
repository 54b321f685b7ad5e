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
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from sim.cluster import ClusterSpec
from sim.collectives import collective_time
from sim.hardware import DeviceSpec, normalize_dtype
from sim.workloads import LayerSpec
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
# 769-798 TFLOP/s of the 989.5 dense peak, 0.78-0.81 (/work/.library/device/KINDS.md), so 0.8 for
# GPUs; the local-cpu peak is itself a measured matmul rate, so 1.0 there. mem_eff: a device-to-device
# copy on the same H200 moved 4.3 of 4.8 TB/s, 0.9. CALL_OVERHEAD_S: an uncalibrated guess of a few
# kernel launches of ~5 us per layer call; fit it (it becomes x_half) on real data.
GPU_EFF_MAX = 0.8
CPU_EFF_MAX = 1.0
MEM_EFF = 0.9
CALL_OVERHEAD_S = 20e-6


@dataclass(frozen=True)
class EfficiencyCurve:
    eff_max: float
    flops_half: float  # FLOPs of one call at which efficiency is eff_max / 2
    mem_eff: float = MEM_EFF

    def __post_init__(self) -> None:
        if not 0 < self.eff_max <= 1 or not 0 < self.mem_eff <= 1 or self.flops_half < 0:
            raise ConfigError("efficiency", f"invalid curve {self}",
                              "need 0 < eff_max <= 1, 0 < mem_eff <= 1, flops_half >= 0")

    def __call__(self, flops: float) -> float:
        return self.eff_max * flops / (flops + self.flops_half) if flops > 0 else 0.0

    def compute_time(self, flops: float, peak_flops: float) -> float:
        # The closed form of flops / (peak * eff(flops)); zero work costs no compute time.
        return (flops + self.flops_half) / (self.eff_max * peak_flops) if flops > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


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
    return uncalibrated_curve(device, dtype)


def uncalibrated_curve(device: DeviceSpec, dtype: str) -> EfficiencyCurve:
    eff_max = CPU_EFF_MAX if device.kind == "cpu" else GPU_EFF_MAX
    return EfficiencyCurve(eff_max=eff_max, flops_half=CALL_OVERHEAD_S * eff_max * device.peak(dtype))


def calibrated_curve(device: DeviceSpec, dtype: str) -> EfficiencyCurve | None:
    path = next((p for family, p in CALIBRATED_CURVES.items() if device.name.startswith(family)), None)
    if path is None or normalize_dtype(dtype) not in ("fp16", "bf16") or not path.is_file():
        return None
    curve = json.loads(path.read_text())["efficiency_curve"]
    return EfficiencyCurve(curve["eff_max"], curve["flops_half"], curve["mem_eff"])


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

    @property
    def bwd_s(self) -> float:
        return self.bwd_input_s + self.bwd_weight_s

    @property
    def tp_message_bytes(self) -> int:
        """Size of one TP all-reduce (the layer output)."""
        return self.tp_comm_bytes_fwd // self.tp_allreduces_fwd if self.tp_allreduces_fwd else 0


class AnalyticCostModel:
    def __init__(self, device: DeviceSpec, dtype: str, efficiency: EfficiencyCurve | None = None) -> None:
        self.device = device
        self.dtype = normalize_dtype(dtype)
        self.peak = device.peak(self.dtype)  # raises a ConfigError for a dtype the device lacks
        self.efficiency = efficiency if efficiency is not None else default_for(device, self.dtype)

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
        params = math.ceil(layer.params / t)
        saved = (layer.saved_elems - layer.saved_elems_sharded) + layer.saved_elems_sharded / t
        out = b * layer.output_elems

        flops_fwd = b * layer.flops_fwd / t
        f_bi, f_bw = self._backward_split(layer)
        # Memory traffic, a lower-bound estimate: weights read once, input and output once, saved
        # activations written in forward and read in backward. An embedding reads only its rows.
        weights_read = min(params, out) if layer.kind == "embedding" else params
        bytes_fwd = act * (weights_read + 2 * out + b * saved)
        bytes_bi = act * (weights_read + 2 * out + b * saved)
        bytes_bw = act * (params + out + b * saved) if layer.params else 0.0

        fwd = self._time(flops_fwd, bytes_fwd)
        n_ar = layer.tp_allreduces if t > 1 else 0
        return LayerCosts(
            fwd_s=fwd,
            bwd_input_s=self._time(b * f_bi / t, bytes_bi),
            bwd_weight_s=self._time(b * f_bw / t, bytes_bw) if layer.params else 0.0,
            recompute_s=fwd,
            tp_comm_bytes_fwd=n_ar * out * act,
            tp_comm_bytes_bwd=n_ar * out * act,
            tp_allreduces_fwd=n_ar,
            tp_allreduces_bwd=n_ar,
            param_bytes=params * p_b,
            grad_bytes=params * g_b,
            optimizer_bytes=params * o_b,
            saved_bytes=int(round(b * saved * act)),
            output_bytes=out * act,
            flops_fwd=flops_fwd,
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

    def optimizer_step_s(self, param_bytes: int) -> float:
        """Adam step: memory-bound, reads and writes parameters, gradients and optimizer state."""
        p_b, g_b, o_b = STATE_BYTES[self.dtype]
        params = param_bytes / p_b
        traffic = params * (2 * p_b + g_b + 2 * o_b)
        return traffic / (self.device.memory_bandwidth_Bps * self.efficiency.mem_eff)


def tp_comm_times(costs: LayerCosts, ranks: Sequence[int], cluster: ClusterSpec,
                  algorithm: str = "auto") -> tuple[float, float]:
    """Seconds of the layer's TP all-reduces per forward and per backward over the TP group ``ranks``."""
    if not costs.tp_allreduces_fwd and not costs.tp_allreduces_bwd:
        return 0.0, 0.0
    one = collective_time("all_reduce", costs.tp_message_bytes, ranks, cluster, algorithm)
    return costs.tp_allreduces_fwd * one, costs.tp_allreduces_bwd * one
