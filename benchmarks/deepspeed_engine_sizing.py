"""What DeepSpeed's 2021 pipeline engine does beyond Megatron-LM v2.5, priced with the project's own cost
model, per 1F1B slot of the two public runs that used it (docs/accuracy.md, "The DeepSpeed pipeline
engine's mechanics"): GPT-NeoX-20B (EleutherAI's DeeperSpeed at eb7f5cff) and MT-NLG 530B
(microsoft/DeepSpeed of October 2021, 1fc74cb9c).

    python benchmarks/deepspeed_engine_sizing.py [--run neox|mtnlg|both]

Nothing here is fitted. GPU times are ``sim.analytic.transformer_layer_times`` (unfused attention, the
plans' kernel model), launches ``sim.analytic.host_launches`` at ``GPU_HOST_LAUNCH_S`` (42 us each since
session 20, 40 us when section 21's table was made; the project's one fitted host constant, sections 4
and 27), collectives and sends ``sim.collectives`` on the runs'
clusters, copies at memory bandwidth x ``mem_eff``. Each mechanism is sized beyond what the simulator
already prices for these rows (blocking sends of 1/tp, one all-gather after every receive, autograd's
gradient accumulation, the data-parallel step): only the difference is counted.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from sim.analytic import ACTIVATION_BYTES, GPU_HOST_LAUNCH_S, default_for, host_launches, transformer_layer_times
from sim.cluster import load_cluster
from sim.collectives import collective_time, p2p_time
from sim.comm import concurrent_senders
from sim.implementations import MEGATRON_LM, implementation_options
from sim.workloads import TransformerConfig, transformer_layers


@dataclass(frozen=True)
class Run:
    """One public run's shape and what its engine version does (file and line: the docs' table)."""

    name: str
    device: str
    dtype: str
    hidden: int
    heads: int
    layers: int
    seq: int
    micro_batch: int
    tp: int
    pp: int
    dp: int
    dropout: float
    nics_per_node: int
    predicted_slot_s: float  # the simulator's iteration / (m + pp - 1), current defaults
    gap_slot_s: float  # the reported iteration's slot minus that
    grads_partitioned: bool  # pipe/engine.py is_grad_partitioned: the gradient leaves as 1/tp pieces
    mask_pipelined: bool  # the s x s attention mask travels with the activation, cast to fp16
    regathers: int  # all-gathers per micro-batch on the compute path that the simulator does not price
    sync_each_layer: bool  # whether the run states checkpointing's synchronize option (default off)
    engine_launches: int  # the engine's own launches per slot outside the layers (counted: the docs' table)

    @property
    def layers_per_stage(self) -> int:
        return self.layers // self.pp


# GPT-NeoX-20B: configs/20B.yml at c560814b (tp 2, pp 4, mb 4, dropout 0, "synchronize-each-layer": true),
# A100-40GB, 12 nodes with 4 HDR adapters (sim/data/neox_20b.md); slot times from accuracy
# section 19: 34.77 s / 35 predicted, 43.85 s / 35 implied by 117 TFLOP/s. DeeperSpeed eb7f5cff:
# is_grad_partitioned = False (pipe/engine.py l. 122), the mask is sent (has_attention_mask for
# 'GPT2ModelPipe', l. 185; cast to half, l. 948), the output is re-gathered in _exec_recv_grads (l. 1085)
# where the simulator gathers the received gradient instead: no extra gather.
NEOX = Run("GPT-NeoX-20B", "A100-40GB", "fp16", 6144, 64, 44, 2048, 4, 2, 4, 12, 0.0, 4,
           predicted_slot_s=34.77 / 35, gap_slot_s=(43.85 - 34.77) / 35, grads_partitioned=False,
           mask_pipelined=True, regathers=0, sync_each_layer=True,
           # middle stage, eb7f5cff pipe/engine.py: _exec_recv_activations 3 receives + 3 clones + bool (7),
           # _exec_forward_pass 3 input clones + the gather's copy and all-gather (5), the output's partition
           # (narrow + clone, zeros: 2), _exec_send_activations half + 3 sends + bool (5), _exec_recv_grads
           # the gather (2) + 1 receive, _exec_send_grads 1 send
           engine_launches=23)
# MT-NLG 530B, 280 nodes (sim/data/mtnlg_530b.md; docs/accuracy.md sections 15, 17, 18: 47.60 s / 274
# predicted, 60.1 s / 274 reported). microsoft/DeepSpeed 1fc74cb9c: is_grad_partitioned = True (l. 132);
# _exec_backward_pass re-gathers the output (l. 711) besides the gradient's gather (l. 725): one gather
# more than the simulator prices. Megatron-DeepSpeed keeps the mask out of the pipeline (args.attn_mask).
MTNLG = Run("MT-NLG 530B (280 nodes)", "A100-80GB", "bf16", 20480, 128, 105, 2048, 1, 8, 35, 8, 0.1, 8,
            predicted_slot_s=47.60 / 274, gap_slot_s=(60.1 - 47.60) / 274, grads_partitioned=True,
            mask_pipelined=False, regathers=1, sync_each_layer=False,
            # the same count at 1fc74cb9c without the mask: receives 2 + clones 2, input clones 2 + gather 2,
            # partition 2, sends 2, gradient receives 2, the backward's two gathers 4, gradient sends 2
            engine_launches=20)
RUNS = {"neox": NEOX, "mtnlg": MTNLG}


@dataclass(frozen=True)
class Sizing:
    """Seconds per 1F1B slot (one forward and one backward of a micro-batch on one stage) by mechanism."""

    layer_gpu_s: float  # one layer, forward + recompute + backward, the kernel model
    launches_per_layer: int  # forward + recompute + backward
    sync_low_s: float  # synchronize per layer: the first launch after each drain exposed
    sync_high_s: float  # every launch exposed (the host never ahead of the GPU)
    whole_grad_send_s: float  # the gradient's extra (1 - 1/tp) over the network
    mask_s: float  # the fp16 mask's send plus its two casts
    regather_s: float  # all-gathers the simulator does not price
    clones_s: float  # the engine's .clone() of the received piece, twice
    engine_launches: int  # the engine's own per-slot launches (exposed only when the host waits)

    def rows(self, synchronized: bool) -> list[tuple[str, float, float]]:
        """(mechanism, low, high) seconds per slot that the run's code and configuration state. With
        synchronize on, the engine's own launches between layers are exposed; without, the host runs
        ahead and they may hide (0) or not (their launch time)."""
        engine = self.engine_launches * GPU_HOST_LAUNCH_S
        return [*((("synchronize each layer", self.sync_low_s, self.sync_high_s),) if synchronized else ()),
                ("gradient sent whole", self.whole_grad_send_s, self.whole_grad_send_s),
                ("attention mask sent", self.mask_s, self.mask_s),
                ("all-gathers not priced", self.regather_s, self.regather_s),
                (".clone() of the received piece", self.clones_s, self.clones_s),
                ("engine launches", engine if synchronized else 0.0, engine)]

    def total(self, synchronized: bool) -> tuple[float, float]:
        rows = self.rows(synchronized)
        return sum(lo for _, lo, _ in rows), sum(hi for _, _, hi in rows)


def size(run: Run) -> Sizing:
    cluster = load_cluster({"name": run.name, "nodes": run.tp * run.pp * run.dp // 8, "devices_per_node": 8,
                            "device": run.device, "intra_node_link": "nvlink3", "inter_node_link": "ib-hdr",
                            "nics_per_node": run.nics_per_node, "source": "docs/accuracy.md, the runs' data notes"})
    device, e = cluster.device, ACTIVATION_BYTES[run.dtype]
    curve = default_for(device, run.dtype)
    options = {**implementation_options(MEGATRON_LM, "gpt"), "dropout": run.dropout}  # Megatron's model code
    cfg = TransformerConfig(family="gpt", vocab=51200, hidden=run.hidden, heads=run.heads, num_layers=1,
                            seq=run.seq, **options)
    block = next(spec for spec in transformer_layers(cfg) if spec.kind == "block")
    kt = transformer_layer_times(block, run.micro_batch, run.tp, device, run.dtype, curve, attention=cfg.attention)
    n_f, n_bi, n_bw = host_launches("block", run.tp, dropout=run.dropout > 0)
    launches = 2 * n_f + n_bi + n_bw  # forward, recompute, backward
    c = GPU_HOST_LAUNCH_S
    lps = run.layers_per_stage
    # Two drains per layer and micro-batch: the forward's, and the backward's (recompute + backward).
    sync_low, sync_high = 2 * c * lps, launches * c * lps
    message = run.micro_batch * run.seq * run.hidden * e  # the activation leaving a stage, whole
    stage_ranks = run.tp * run.dp
    src, dst = 0, stage_ranks  # first stage's first rank to its peer on the next stage
    senders = concurrent_senders(cluster, stage_ranks, src, dst)
    grad_extra = 0.0 if run.grads_partitioned else (
        p2p_time(message, src, dst, cluster, senders) - p2p_time(message / run.tp, src, dst, cluster, senders))
    bw = device.memory_bandwidth_Bps * curve.mem_eff
    mask = run.seq * run.seq
    mask_s = (p2p_time(2 * mask, src, dst, cluster, senders) + 2 * (mask * 3) / bw) if run.mask_pipelined else 0.0
    regather = run.regathers * collective_time("all_gather", message, list(range(run.tp)), cluster)
    clones = 2 * 2 * (message / run.tp) / bw  # read + write, in _exec_recv_activations and _exec_forward_pass
    return Sizing(layer_gpu_s=kt.fwd_s * 2 + kt.bwd_input_s + kt.bwd_weight_s, launches_per_layer=launches,
                  sync_low_s=sync_low, sync_high_s=sync_high, whole_grad_send_s=grad_extra, mask_s=mask_s,
                  regather_s=regather, clones_s=clones, engine_launches=run.engine_launches)


def report(run: Run) -> None:
    z = size(run)
    print(f"== {run.name}: tp {run.tp}, pp {run.pp}, mb {run.micro_batch}, {run.layers_per_stage} layers per stage; "
          f"predicted slot {run.predicted_slot_s * 1e3:.1f} ms, gap {run.gap_slot_s * 1e3:.1f} ms "
          f"({run.gap_slot_s / run.layers_per_stage * 1e3:.2f} ms per layer and micro-batch)")
    print(f"   layer (fwd + recompute + bwd) GPU {z.layer_gpu_s * 1e3:.2f} ms, {z.launches_per_layer} launches "
          f"= {z.launches_per_layer * GPU_HOST_LAUNCH_S * 1e3:.2f} ms of host")
    for synchronized in sorted({run.sync_each_layer, True}, reverse=True):
        tag = "as stated" if synchronized == run.sync_each_layer else "what-if, not stated: synchronize on"
        print(f"   -- {tag}")
        for label, lo, hi in z.rows(synchronized):
            print(f"   {label:<32} {lo * 1e3:8.2f} - {hi * 1e3:8.2f} ms/slot")
        low, high = z.total(synchronized)
        print(f"   sum {low * 1e3:.2f} - {high * 1e3:.2f} ms/slot = {low / run.gap_slot_s:.1%} - "
              f"{high / run.gap_slot_s:.1%} of the gap")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", choices=(*RUNS, "both"), default="both")
    a = p.parse_args()
    for key in RUNS if a.run == "both" else (a.run,):
        report(RUNS[key])


if __name__ == "__main__":
    main()
