"""What Megatron's unfused softmax fallback would cost against the fused kernel the simulator prices
(docs/accuracy.md section 18): bytes per pass by the kernels ``FusedScaleMaskSoftmax.forward``'s
else-branch launches, timed as sim.analytic times memory-bound work (bytes / (rate x bandwidth)).

    python benchmarks/unfused_softmax_sizing.py [--device A100-80GB] [--heads-per-rank 16] [--seq 2048]
        [--micro-batch 1] [--layers-per-stage 3] [--gap-s 0.05]

No constant here is fitted: the rates are the project's defaults (sim.analytic.default_for), the
device is the hardware catalogue's, the byte counts follow the code path kernel by kernel (below).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from sim.analytic import ACTIVATION_BYTES, default_for
from sim.hardware import get_device

FP32 = 4  # the fallback upcasts to fp32 (softmax_in_fp32, forced on by apply_query_key_layer_scaling)

# Bytes per score element of each kernel the fallback launches (e: the activation size, bf16 = 2), in
# the order megatron/model/fused_softmax.py (Megatron-DeepSpeed 0d887558) runs them; the causal mask
# itself is one [1, 1, s, s] bool tensor broadcast over the heads, left out as the project's count does.
UNFUSED_FWD = (("input.float()", lambda e: e + FP32), ("input * scale", lambda e: 2 * FP32),
               ("masked_fill_", lambda e: 2 * FP32), ("softmax (fp32)", lambda e: 2 * FP32),
               ("probs.bfloat16()", lambda e: FP32 + e))
# Autograd's backward of the same chain, last op first: each reads the incoming gradient (softmax also
# its saved fp32 output) and writes the outgoing one.
UNFUSED_BWD = (("cast back to fp32", lambda e: e + FP32), ("softmax backward", lambda e: 3 * FP32),
               ("masked_fill backward", lambda e: 2 * FP32), ("scale backward", lambda e: 2 * FP32),
               ("cast to bf16", lambda e: FP32 + e))


@dataclass(frozen=True)
class Sizing:
    score_elements: float
    fused_bytes: tuple[float, float]  # forward, backward (the recompute is a forward)
    unfused_bytes: tuple[float, float]
    fused_s: float  # per layer and micro-batch: forward + backward + recompute
    unfused_s_low: float  # every fallback kernel at the copy rate (mem_eff)
    unfused_s_high: float  # every fallback kernel at the measured softmax rate (attention_mem_eff)


def fused_bytes_per_element(e: int) -> tuple[int, int]:
    """sim.analytic.unfused_attention_core_times' fused scale-mask-softmax, dropout left out: forward
    read S write S, backward read dy and y write dx."""
    return 2 * e, 3 * e


def unfused_bytes_per_element(e: int) -> tuple[int, int]:
    return sum(f(e) for _, f in UNFUSED_FWD), sum(f(e) for _, f in UNFUSED_BWD)


def size(device_name: str, heads_per_rank: int, seq: int, micro_batch: int, dtype: str = "bf16") -> Sizing:
    device = get_device(device_name, "--device")
    curve = default_for(device, dtype)
    e = ACTIVATION_BYTES[dtype]
    S = float(micro_batch * heads_per_rank * seq * seq)
    fb = tuple(S * x for x in fused_bytes_per_element(e))
    ub = tuple(S * x for x in unfused_bytes_per_element(e))
    bw = device.memory_bandwidth_Bps
    passes = lambda b: 2 * b[0] + b[1]  # noqa: E731  forward, recompute, backward
    return Sizing(score_elements=S, fused_bytes=fb, unfused_bytes=ub,  # type: ignore[arg-type]
                  fused_s=passes(fb) / (bw * curve.attention_mem_eff),
                  unfused_s_low=passes(ub) / (bw * curve.mem_eff),
                  unfused_s_high=passes(ub) / (bw * curve.attention_mem_eff))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="A100-80GB")
    p.add_argument("--heads-per-rank", type=int, default=16, help="heads / tp (MT-NLG: 128 / 8)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--layers-per-stage", type=int, default=3, help="MT-NLG: 105 layers / pp 35")
    p.add_argument("--gap-s", type=float, default=0.05, help="per-slot gap to compare with (section 15)")
    a = p.parse_args()
    z = size(a.device, a.heads_per_rank, a.seq, a.micro_batch)
    gib = 1e9
    print(f"score elements per layer and micro-batch: {z.score_elements:.4g}")
    print(f"bytes fwd / bwd: fused {z.fused_bytes[0] / gib:.3f} / {z.fused_bytes[1] / gib:.3f} GB, "
          f"unfused fp32 {z.unfused_bytes[0] / gib:.3f} / {z.unfused_bytes[1] / gib:.3f} GB")
    for label, t in (("copy rate (low)", z.unfused_s_low), ("softmax rate (high)", z.unfused_s_high)):
        extra = t - z.fused_s
        slot = extra * a.layers_per_stage
        print(f"{label}: fused {z.fused_s * 1e3:.2f} ms, unfused {t * 1e3:.2f} ms per layer and micro-batch "
              f"(fwd + bwd + recompute); extra {extra * 1e3:.2f} ms/layer, {slot * 1e3:.1f} ms/slot "
              f"= {slot / a.gap_s:.0%} of {a.gap_s} s")


if __name__ == "__main__":
    main()
