"""Public at-scale checks: Megatron-LM's Table 1 (Narayanan et al., SC'21), MT-NLG 530B's throughput
runs (Smith et al. 2022, section 2.4), GPT-NeoX-20B's training run (Black et al. 2022) and BLOOM-176B's
training logs (BigScience 2022) against the simulator.

    python benchmarks/megatron_at_scale.py [--table sc21|mtnlg|neox|bloom] [--assumed]
                                           [--schedule interleaved-1f1b|1f1b]
                                           [--micro-batch N] [--as-simulated] [--zero1]
                                           [--decompose OUT.csv] [--json OUT.json]
                                           [--host-launch-us 37] [--launch-blocking] [--eff-max 0.8]
                                           [--attn-mem-eff 0.6]
                                           [--rows 0,1,2]

``--table mtnlg``: the 530B model (105 layers, hidden 20,480) at tp 8 / pp 35 with batch 1,920 on 280,
350 and 420 DGX A100 nodes of the same Selene, bf16, Megatron-DeepSpeed's plain 1F1B pipeline and
one data-parallel all-reduce after the flush; the settings the paper leaves open are the data file's
declared assumptions (``sim/data/mtnlg_530b.md``). ``--table neox``: GPT-NeoX-20B at tp 2 / pp 4 / dp 12 on
96 A100-40GB (4 HDR adapters per node), fp16, micro-batch 4, DeepSpeed's plain 1F1B and ZeRO stage 1,
no dropout; its 117 TFLOP/s are GPT-NeoX's own FLOP count (no recomputation: ``paper_flops``), so the
predicted TFLOP/s use that count too (``sim/data/neox_20b.md``). ``--table bloom``: BLOOM-176B (70 layers,
hidden 14,336) on Jean Zay's A100 nodes (4 Omni-Path links each), bf16, DeepSpeed's plain 1F1B with the
embedding layers counted as pipeline units, at tp 4 / pp 12 / dp 8 (the production run) and five reshaping
runs at tp 1-4 and pp 24-72; iteration times from the run's own logs (``sim/data/bloom_176b.md``).
The rows below describe Table 1 (``--table sc21``,
the default); both tables share every function here: a row's columns say what differs.

Ten GPT models, 1.7B to 1T parameters, on 32 to 3,072 A100-80GB GPUs of Selene (8 per node,
NVLink3, 8 x HDR InfiniBand per node), sequence 2,048, vocabulary 51,200, full activation
recomputation, each row with the micro-batch, interleaving and data-parallel implementation of the
authors' run script (Megatron-LM ``examples/sc21/run_table_1.sh``; ``--assumed``: the guesses used
before it was read; data and sources: ``sim/data/megatron_sc21_table1.md``).
Each row's configuration is simulated (symmetric mode) with the project's default cost model and
with what Megatron-LM v2.5 ran where the simulator offers a choice (blocking p2p with scatter/gather,
per-layer recompute inside the backward, the flat-buffer gradient all-reduce, the fp16 optimizer's
step; ``--as-simulated``: the simulator's defaults; sources in the data notes);
predicted TFLOP/s per GPU = the paper's FLOP count (appendix, eq. 3)
    F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))
divided by (predicted iteration time x GPUs). Error = predicted / reported TFLOP/s - 1: negative
means the simulator predicts too little throughput (too slow an iteration), positive too much.
Prints every row, then MAPE, median |error|, max |error|, mean signed error and Spearman rank
correlation of predicted vs reported TFLOP/s. Nothing here is fitted to this table.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

import sim.compile
from analysis.iteration_decompose import KINDS, decompose_rank
from analysis.metrics import spearman, spearman_text
from sim.analytic import EfficiencyCurve, default_for, uncalibrated_curve
from sim.analytic_costs import AnalyticCosts
from sim.cluster import load_cluster
from sim.compile import compile_plan
from sim.engine import Engine, EngineOptions
from sim.implementations import MEGATRON_ATTENTION, MEGATRON_LM
from sim.plan import Plan
from sim.workloads import GRAD_ACCUMULATIONS, transformer_config, transformer_layers

TABLE = Path(__file__).resolve().parent.parent / "sim" / "data" / "megatron_sc21_table1.csv"
# The authors' command lines for the same rows (Megatron-LM examples/sc21/run_table_1.sh).
RUN_SCRIPT = TABLE.with_name("megatron_sc21_run_table_1.csv")
# MT-NLG 530B, Smith et al. 2022 section 2.4, with its declared assumptions in the same rows.
MTNLG = TABLE.with_name("mtnlg_530b.csv")
# GPT-NeoX-20B's training run, Black et al. 2022, at tp 2 / pp 4 / dp 12 (sim/data/neox_20b.md).
NEOX = TABLE.with_name("neox_20b.csv")
# BLOOM-176B's production run and five reshaping runs at tp 1-4, from the training logs (sim/data/bloom_176b.md).
BLOOM = TABLE.with_name("bloom_176b.csv")
TABLES = {"sc21": TABLE, "mtnlg": MTNLG, "neox": NEOX, "bloom": BLOOM}
# Sequence and (padded) vocabulary of every SC'21 row; a row's own ``vocab`` column overrides the latter.
SEQ, VOCAB = 2048, 51200
GPUS_PER_NODE = 8
# The clusters the tables ran on, by a row's ``cluster`` column (default: Selene).
CLUSTERS: dict[str, dict[str, Any]] = {
    "selene": {"device": "A100-80GB", "intra_node_link": "nvlink3", "inter_node_link": "ib-hdr",
               "nics_per_node": 8,
               "source": "Selene DGX A100 nodes, 8 x 200 Gbit/s HDR HCAs (Narayanan et al. SC'21, section 5; "
                         "MT-NLG: the same nodes, Smith et al. 2022 section 2.3)"},
    # Black et al. 2022 section 2.3: twelve Supermicro AS-4124GO-NART servers with 8 A100-SXM4-40GB each,
    # "one of four ConnectX-6 HCAs" per GPU, HDR (MQM8700 switches); sim/data/neox_20b.md.
    "neox-coreweave": {"device": "A100-40GB", "intra_node_link": "nvlink3", "inter_node_link": "ib-hdr",
                       "nics_per_node": 4,
                       "source": "GPT-NeoX-20B's cluster: 8 x A100-SXM4-40GB per node, 4 x ConnectX-6 HDR "
                                 "HCAs per node (Black et al. 2022, section 2.3)"},
    # Jean Zay's A100 partition as BLOOM's team describes it: 8 x A100 80GB per node "Using NVLink",
    # "4 OmniPath links" (bigscience-workshop/bigscience jz/hpc-specs.md, train/tr11-176B-ml/README.md);
    # NVSwitch inside the node is assumed (sim/data/bloom_176b.md).
    "jean-zay-a100": {"device": "A100-80GB", "intra_node_link": "nvlink3", "inter_node_link": "opa-100",
                      "nics_per_node": 4,
                      "source": "Jean Zay A100 nodes: 8 x A100 80GB, NVLink, 4 x Omni-Path 100 Gbit/s per node "
                                "(BigScience tr11-176B-ml README, jz/hpc-specs.md)"},
}
# The 1T row lowers ~460k instructions (64 pipeline ranks x 2 virtual stages x 512 micro-batches x 7)
# but sim.compile's up-front estimate counts 10 per micro-batch (655k) against its 500k guard; main()
# raises the guard for this script's own run only (importing the module changes nothing).
INSTRUCTION_LIMIT = 700_000


def load_table(path: Path = TABLE, run_script: bool = True) -> pd.DataFrame:
    """Table 1's rows; ``run_script``: joined with the authors' settings for each (micro_batch,
    layers_per_virtual_stage, ddp), which ``plan_for`` follows. Without them ``plan_for`` falls back
    to the earlier assumptions (micro-batch 1, the smallest interleaving >= 2, the local all-reduce)."""
    table = pd.read_csv(path)
    if not run_script:
        return table
    script = pd.read_csv(RUN_SCRIPT)
    joined = table.merge(script, on="params_b", how="left", suffixes=("", "_script"), validate="one_to_one")
    missing = joined.loc[joined["micro_batch"].isna(), "params_b"].tolist()
    if missing:
        raise ValueError(f"{RUN_SCRIPT.name} lacks the rows of {missing} B parameters")
    return joined


def load_named(table: str, run_script: bool = True) -> pd.DataFrame:
    """One of ``TABLES`` by name; ``run_script`` applies to SC'21 only (the other tables carry their
    settings in their own columns)."""
    if table == "sc21":
        return load_table(run_script=run_script)
    if not run_script:
        raise ValueError(f"--assumed applies to the SC'21 table only, not {table!r}")
    return pd.read_csv(TABLES[table])


def row_vocab(row: dict[str, Any]) -> int:
    """The row's padded vocabulary: its ``vocab`` column where it has one, else SC'21's 51,200."""
    return int(row["vocab"]) if _stated(row, "vocab") else VOCAB


def row_dropout(row: dict[str, Any]) -> dict[str, float]:
    """The row's dropout as a workload option where its ``dropout`` column states one (GPT-NeoX-20B: 0); none
    otherwise, so the plan has Megatron-LM's default (``implementation: megatron-lm``, 0.1)."""
    return {"dropout": float(row["dropout"])} if _stated(row, "dropout") else {}


def row_cluster(row: dict[str, Any], nics_per_node: int | None) -> dict[str, Any]:
    """The row's cluster (``CLUSTERS`` by its ``cluster`` column, else Selene) for ``row["gpus"]``;
    ``nics_per_node``: adapters per node instead of the cluster's own."""
    name = str(row["cluster"]) if _stated(row, "cluster") else "selene"
    if name not in CLUSTERS:
        raise ValueError(f"{row.get('name', row['params_b'])}: cluster {name!r} is not one of {', '.join(CLUSTERS)}; "
                         "add it to CLUSTERS with a source for every figure")
    spec = dict(CLUSTERS[name])
    if nics_per_node is not None:
        spec["nics_per_node"] = nics_per_node
    return {"name": name, "nodes": int(row["gpus"]) // GPUS_PER_NODE, "devices_per_node": GPUS_PER_NODE, **spec}


def row_dtype(row: dict[str, Any]) -> str:
    """The row's training precision: its ``dtype`` column (MT-NLG: bf16), else SC'21's fp16."""
    return str(row["dtype"]) if _stated(row, "dtype") else "fp16"


# How a table's TFLOP/s were counted, by a row's ``flops`` column (default ``eq3``).
FLOP_CONVENTIONS = ("eq3", "neox-2022")


def paper_flops(row: dict[str, Any]) -> float:
    """FLOPs of one iteration as the row's source counts them. ``eq3`` (SC'21, MT-NLG): Narayanan et
    al.'s appendix eq. (3), recomputation counted. ``neox-2022``: GPT-NeoX's logger at the 20B release
    (megatron/logging.py get_flops at c560814b), B s (6 P + 60 s h l) with P the row's parameter count,
    recomputation not counted (sim/data/neox_20b.md)."""
    B, s, L, h, V = row["global_batch"], SEQ, row["layers"], row["hidden"], row_vocab(row)
    convention = str(row["flops"]) if _stated(row, "flops") else "eq3"
    if convention == "eq3":
        return 96.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    if convention == "neox-2022":
        return B * s * (6.0 * row["params_b"] * 1e9 + 60.0 * s * h * L)
    raise ValueError(f"{row.get('name', row['params_b'])}: flops {convention!r} is not a known FLOP convention; "
                     f"use one of {', '.join(FLOP_CONVENTIONS)}")


def _stated(row: dict[str, Any], key: str) -> bool:
    return key in row and row[key] is not None and not pd.isna(row[key])


def chunks_for(row: dict[str, Any], schedule: str) -> int:
    """Virtual stages per pipeline rank: what the row states (a ``chunks`` field, as Korthikanti et al.
    2022 do; the run script's ``layers_per_virtual_stage``, none meaning plain 1F1B), else the earlier
    assumption, the smallest count >= 2 that divides the layers per rank."""
    if schedule != "interleaved-1f1b" or row["pp"] == 1:
        return 1
    per_rank = int(row["layers"]) // int(row["pp"])
    if _stated(row, "chunks"):
        return int(row["chunks"])
    if "layers_per_virtual_stage" in row:
        if not _stated(row, "layers_per_virtual_stage"):
            return 1
        chunks, rest = divmod(per_rank, int(row["layers_per_virtual_stage"]))
        if rest:
            raise ValueError(f"{row['params_b']}B: {per_rank} layers per pipeline rank are not a multiple of "
                             f"{row['layers_per_virtual_stage']} layers per virtual stage")
        return chunks
    return next(v for v in range(2, per_rank + 1) if per_rank % v == 0)


def gradient_sync_for(row: dict[str, Any], megatron_2021: bool, zero1: bool = False) -> dict[str, Any]:
    """How the row's gradients are all-reduced. ``zero1``: the simulator's distributed optimizer instead
    (ZeRO stage 1: reduce-scatter, 1/dp of the step, parameter all-gather), in the row's reduce dtype.
    ``deepspeed`` (MT-NLG): DeepSpeed's pipeline engine, one all-reduce after the last micro-batch
    (``_exec_reduce_grads``) through flattened buckets (``allreduce_bucket``: flatten, all-reduce, copy
    back) in the gradients' own dtype (``fp32_allreduce`` off by default). ``--DDP-impl local`` (and rows
    that do not say):
    Megatron-LM v2.5's one fp16 all-reduce after the pipeline flush (fp16 gradients:
    --accumulate-allreduce-grads-in-fp32 is off by default and in examples/pretrain_gpt3_175B.sh), through a
    flat copy (megatron/model/distributed.py, allreduce_gradients without contiguous buffers).
    ``deepspeed-zero1``: as ``zero1``, the row's own configuration (GPT-NeoX-20B's ZeRO stage 1).
    ``torch``: torch DDP's defaults, 25 MiB buckets in the gradients' own dtype launched as the last
    micro-batch's backward fills them (megatron/schedules.py, forward_backward_no_pipelining: every
    other micro-batch under model.no_sync())."""
    if zero1 or row.get("ddp") == "deepspeed-zero1":
        # reduce-scatters a contiguous buffer: no flat copies (sim/gradient_sync_distopt.py).
        # ``deepspeed-zero1`` (GPT-NeoX-20B): DeepSpeed's ZeRO stage 1 in the gradients' own dtype.
        dtype = {"reduce_dtype": "param"} if row.get("ddp") in ("torch", "deepspeed", "deepspeed-zero1") else {}
        return {"method": "distopt", "bucket_mb": 1e6, **dtype}
    if row.get("ddp") == "torch":
        return {"method": "allreduce", "bucket_mb": 25.0, "reduce_dtype": "param"}
    if row.get("ddp") == "deepspeed":
        return {"method": "allreduce", "bucket_mb": 1e6, "flat_copies": megatron_2021, "reduce_dtype": "param"}
    return {"method": "allreduce", "bucket_mb": 1e6, "flat_copies": megatron_2021}


def units_partition(num_blocks: int, stages: int) -> list[list[int]]:
    """Megatron-DeepSpeed's ``--pp-partition-method 'type:transformer|embedding'`` (BLOOM): the blocks and
    the two embedding layers (input, tied head) as equal units, so the first stage's embedding and the last
    stage's head each take a block's place."""
    per, rest = divmod(num_blocks + 2, stages)
    if rest:
        raise ValueError(f"{num_blocks} blocks and 2 embedding layers do not split into {stages} equal stages")
    return [[per * s, per * (s + 1)] for s in range(stages)]


def megatron_virtual_partition(num_blocks: int, stages: int) -> list[list[int]]:
    """``num_blocks / stages`` blocks per virtual stage; embedding on the first, head on the last."""
    per, rest = divmod(num_blocks, stages)
    assert rest == 0, (num_blocks, stages)
    cuts = [0] + [1 + per * s for s in range(1, stages)] + [num_blocks + 2]
    return [[cuts[s], cuts[s + 1]] for s in range(stages)]


# What Megatron-LM ran in 2021 (tag v2.5, e269e20, Aug 2021; the paper's code), as plan options:
# - megatron/p2p_communication.py, _communicate: batch_isend_irecv, req.wait() on every request, then
#   torch.cuda.synchronize(): blocking exchanges between pipeline stages (schedule.p2p: blocking);
# - the same function splits each tensor into tp equal chunks (mpu.split_tensor_into_1d_equal_chunks),
#   sends one per TP rank and all-gathers after (mpu.gather_split_1d_tensor), on by default
#   (megatron/arguments.py: --no-scatter-gather-tensors-in-pipeline turns it off), and the paper's
#   runs used it (SC'21 section 4.1): schedule.p2p_scatter_gather.
MEGATRON_2021_P2P = {"p2p": "blocking", "p2p_scatter_gather": True}
ASYNC_P2P = {"p2p": "async", "p2p_scatter_gather": False}


def plan_for(row: dict[str, Any], schedule: str = "interleaved-1f1b", micro_batch: int | None = None,
             megatron_2021: bool = True, nics_per_node: int | None = None, zero1: bool = False) -> Plan:
    """The row's plan; ``micro_batch``: the row's own (the run script's) unless given, else 1;
    ``megatron_2021``: with what Megatron-LM v2.5 ran (blocking p2p with scatter/gather, per-layer
    recompute inside the backward, the row's data-parallel implementation), else with the simulator's
    defaults for those choices. ``nics_per_node``: HDR adapters per node instead of the row's cluster's
    (Selene's 8; vTrain's configurations state 800 Gbit/s per node, 4). The row's own ``name``, ``vocab``,
    ``dtype``, ``dropout`` and ``cluster`` columns where it has them (MT-NLG, GPT-NeoX-20B); ``zero1``:
    ``gradient_sync_for``'s distributed optimizer."""
    tp, pp, gpus = int(row["tp"]), int(row["pp"]), int(row["gpus"])
    dp = gpus // (tp * pp)
    if micro_batch is None:
        micro_batch = int(row["micro_batch"]) if _stated(row, "micro_batch") else 1
    chunks = chunks_for(row, schedule)
    m, rest = divmod(int(row["global_batch"]), micro_batch * dp)
    if rest:
        raise ValueError(f"{row['params_b']}B: global batch {row['global_batch']} is not a multiple of "
                         f"micro-batch {micro_batch} x dp {dp}")
    name = schedule if pp > 1 else "1f1b"
    if name == "interleaved-1f1b" and chunks < 2:
        name = "1f1b"
    cluster = row_cluster(row, nics_per_node)
    return Plan.from_dict(dict(
        name=str(row["name"]) if _stated(row, "name") else f"megatron-sc21-{row['params_b']}b", workload="gpt2-medium",
        workload_options={"hidden": int(row["hidden"]), "heads": int(row["heads"]),
                          "num_layers": int(row["layers"]), "seq": SEQ, "vocab": row_vocab(row),
                          "implementation": MEGATRON_LM, **row_dropout(row)},
        cluster=cluster, dtype=row_dtype(row),
        parallelism={"tp": tp, "pp": pp, "dp": dp, "chunks": chunks if name == "interleaved-1f1b" else 1,
                     "partition": partition_for(row, pp * (chunks if name == "interleaved-1f1b" else 1))},
        schedule={"name": name, "micro_batch": micro_batch, "microbatches": m,
                  **(MEGATRON_2021_P2P if megatron_2021 else ASYNC_P2P)},
        # --checkpoint-activations with --checkpoint-num-layers 1 (the default at v2.5, megatron/arguments.py):
        # one mpu.checkpoint per transformer layer (megatron/model/transformer.py, _checkpointed_forward),
        # so each layer is re-run inside the backward, one at a time. Megatron-DeepSpeed (MT-NLG) passes the
        # same flag to DeepSpeed's PipelineModule as activation_checkpoint_interval (GPTModelPipe).
        memory={"policy": "full", "in_backward": megatron_2021},
        gradient_sync=gradient_sync_for(row, megatron_2021, zero1),
    ))


def partition_for(row: dict[str, Any], stages: int) -> list[list[int]]:
    """The row's pipeline partition: its ``partition`` column's method (``units``: BLOOM's), else
    Megatron-LM's equal blocks with the embedding and head beside the first and last."""
    if _stated(row, "partition") and row["partition"] == "units":
        return units_partition(int(row["layers"]), stages)
    return megatron_virtual_partition(int(row["layers"]), stages)


def curve_of(name: str, host_launch_us: float | None = None) -> EfficiencyCurve:
    """``default``: what sim.analytic.default_for gives A100 fp16; ``physical``: the uncalibrated
    prior (large-GEMM efficiency and copy bandwidth measured on a GPU, no per-call overhead).
    ``host_launch_us``: the host launch path's cost per kernel launch instead of the curve's own."""
    device = load_cluster("dgx-a100-8").device
    curve = default_for(device, "fp16") if name == "default" else uncalibrated_curve(device, "fp16")
    return curve if host_launch_us is None else replace(curve, host_launch_s=host_launch_us * 1e-6)


def run_plan(plan: Plan, curve: EfficiencyCurve, attention: str | None = None, kernels: bool = True,
             megatron_2021: bool = True, layer_rows: bool = False,
             tp_backward_overlap: bool | float = False,
             grad_accumulation: str = "fused") -> tuple[Engine, AnalyticCosts, Any, float]:
    """Simulate ``plan`` (symmetric engine) with the kernel model on ``curve``: (engine, costs, the
    compiled plan, iteration seconds). ``attention``: instead of the plan's own (its workload option).
    ``megatron_2021``: the fp16 optimizer's step as Megatron ran it.
    ``tp_backward_overlap``: the backward's TP all-reduces hidden behind weight-gradient GEMMs as
    Megatron-LM did from 2021-09 (``AnalyticCostModel``); v2.5, which Table 1 ran, did not.
    ``grad_accumulation``: how weight gradients accumulate over micro-batches (sim.analytic.GRAD_ACCUMULATIONS:
    ``fused`` into the GEMM as Megatron-LM from 2022, Korthikanti et al.'s code, runs it; ``autograd``, a
    pass of its own per backward after the first, as v2.5 and Megatron-DeepSpeed ran it: simulate_row)."""
    if attention is not None:  # the plan says what the costs price
        plan = plan.replace(workload_options={**plan.workload_options, "attention": attention})
    cluster = load_cluster(plan.cluster)
    config = transformer_config(plan.workload, **plan.workload_options)
    costs = AnalyticCosts(transformer_layers(config), cluster.device, plan.dtype, cluster, curve,
                          attention=config.attention,
                          kernels=kernels, optimizer="megatron-fp16" if megatron_2021 else "adam",
                          tp_backward_overlap=tp_backward_overlap, grad_accumulation=grad_accumulation)
    compiled = compile_plan(plan, costs)
    resolved = compiled.resolved
    engine = Engine(compiled.program, resolved.costs, resolved.comm, resolved.policy, plan.micro_batch,
                    plan.parallelism.tp_overlap, EngineOptions(layer_rows=layer_rows))
    return engine, costs, compiled, engine.run()


def simulate_row(row: dict[str, Any], schedule: str, micro_batch: int | None, curve: str | EfficiencyCurve = "default",
                 attention: str | None = None, kernels: bool = True,
                 decompose: bool = False, megatron_2021: bool = True,
                 host_launch_us: float | None = None, zero1: bool = False,
                 grad_accumulation: str | None = None) -> dict[str, Any]:
    """One row of either table; ``curve``: a name for ``curve_of`` or a curve itself (A100 fp16 and bf16
    share one curve: the same tensor-core peak and calibration). ``grad_accumulation``: ``run_plan``'s;
    by default ``autograd`` with ``megatron_2021`` (v2.5's local DDP without contiguous buffers, torch
    DDP, DeepSpeed's engine: docs/accuracy.md section 17), else the simulator's ``fused``."""
    plan = plan_for(row, schedule, micro_batch, megatron_2021, zero1=zero1)
    started = time.perf_counter()
    if not isinstance(curve, EfficiencyCurve):
        curve = curve_of(curve, host_launch_us)
    if grad_accumulation is None:
        grad_accumulation = "autograd" if megatron_2021 else "fused"
    engine, costs, compiled, iteration = run_plan(plan, curve, attention, kernels, megatron_2021,
                                                  grad_accumulation=grad_accumulation)
    peak = max(ledger.peak for ledger in engine.ledgers.values())
    oom = any(ledger.oom_at_s is not None for ledger in engine.ledgers.values())
    predicted = paper_flops(row) / (iteration * row["gpus"]) / 1e12
    parts = {}
    if decompose:  # the first and the last pipeline rank (dp 0, tp 0)
        for where, pp_rank in (("first", 0), ("last", plan.pp - 1)):
            rank = compiled.program.rank_of(0, pp_rank, 0)
            parts[where] = decompose_rank(engine, costs, rank)
    return {"params_b": row["params_b"], "gpus": int(row["gpus"]), "tp": int(row["tp"]), "pp": int(row["pp"]),
            "dp": plan.dp, "chunks": plan.chunks, "micro_batch": plan.micro_batch,
            "grad_accumulation": grad_accumulation,
            "microbatches": plan.schedule.microbatches, "ddp": row.get("ddp", "local"),
            "iteration_s": iteration, "reported_tflops": float(row["tflops_per_gpu"]),
            "predicted_tflops": predicted, "error": predicted / float(row["tflops_per_gpu"]) - 1,
            "peak_GiB": peak / 2**30, "oom": oom, "wall_s": time.perf_counter() - started, "decomposition": parts,
            **iteration_error(row, iteration)}


def iteration_error(row: dict[str, Any], iteration: float) -> dict[str, float]:
    """Where the table prints the iteration time (MT-NLG), the error in time too: predicted / reported
    - 1 (positive: predicted too slow). Empty for tables that print TFLOP/s only."""
    if not _stated(row, "iteration_s"):
        return {}
    reported = float(row["iteration_s"])
    return {"reported_iteration_s": reported, "iteration_error": iteration / reported - 1}


def scaling_trend(results: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per-GPU throughput of each row relative to the first, reported and predicted: the data-parallel
    scaling trend of one model (MT-NLG: 280 -> 350 -> 420 nodes), a check that three rows' rank
    correlation cannot give."""
    first = results[0]
    return [{"gpus": r["gpus"], "reported": r["reported_tflops"] / first["reported_tflops"],
             "predicted": r["predicted_tflops"] / first["predicted_tflops"]} for r in results]


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    err = np.array([r["error"] for r in results])
    pred = [r["predicted_tflops"] for r in results]
    rep = [r["reported_tflops"] for r in results]
    return {"rows": len(results), "mape": float(np.mean(np.abs(err))),
            "median_abs_error": float(np.median(np.abs(err))),
            "max_abs_error": float(np.max(np.abs(err))), "mean_signed_error": float(np.mean(err)),
            "spearman": spearman(pred, rep), "spearman_text": spearman_text(pred, rep)}


def write_decomposition(results: list[dict[str, Any]], path: Path) -> None:
    """One CSV line per (row, first or last pipeline rank): seconds by kind, and each kind's share of
    the iteration; printed as shares."""
    lines = []
    for r in results:
        for where, parts in r["decomposition"].items():
            lines.append({"params_b": r["params_b"], "tp": r["tp"], "pp": r["pp"], "rank": where,
                          "iteration_s": r["iteration_s"], **{k: parts[k] for k in KINDS}})
    frame = pd.DataFrame(lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False, float_format="%.5g")
    shares = frame.copy()
    for k in KINDS:
        shares[k] = (100 * frame[k] / frame["iteration_s"]).round(1)
    print("\nIteration by kind, % of the iteration (p2p_transfer: sends' duration, overlapped or not):")
    print(shares.to_string(index=False))


def _time_column(r: dict[str, Any]) -> str:
    """The reported iteration time and the error in time, for tables that print it."""
    if "iteration_error" not in r:
        return ""
    return f"   reported {r['reported_iteration_s']:.1f} s, time error {r['iteration_error']:+.1%}"


def main() -> None:
    sim.compile.MAX_INSTRUCTIONS = max(sim.compile.MAX_INSTRUCTIONS, INSTRUCTION_LIMIT)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", default="sc21", choices=sorted(TABLES),
                        help="sc21: Narayanan et al. SC'21 Table 1; mtnlg: MT-NLG 530B, Smith et al. 2022 section 2.4; "
                             "neox: GPT-NeoX-20B, Black et al. 2022 (tp 2); bloom: BLOOM-176B's training logs (tp 1-4)")
    parser.add_argument("--zero1", action="store_true",
                        help="every row's data parallelism as the simulator's distributed optimizer (ZeRO stage 1: "
                             "reduce-scatter, 1/dp of the step, all-gather) instead of the row's all-reduce")
    parser.add_argument("--schedule", default="interleaved-1f1b", choices=["interleaved-1f1b", "1f1b"])
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="every row's micro-batch (default: the row's, from the authors' run script)")
    parser.add_argument("--assumed", action="store_true",
                        help="the settings guessed before the run script was read (sessions 4-8): micro-batch 1, "
                             "the smallest interleaving >= 2, the local flat all-reduce on every row")
    parser.add_argument("--curve", default="default", choices=["default", "physical"],
                        help="default: sim.analytic.default_for(A100, fp16); physical: the uncalibrated prior")
    parser.add_argument("--host-launch-us", type=float, default=None,
                        help="host seconds per kernel launch, in us (sim.analytic.HOST_LAUNCH_S; default: the curve's)")
    parser.add_argument("--launch-blocking", action="store_true",
                        help="CUDA_LAUNCH_BLOCKING=1 as a bound: every launch's host time added to the GPU's "
                             "instead of overlapping it (EfficiencyCurve.host_launch_blocking; a what-if)")
    parser.add_argument("--eff-max", type=float, default=None,
                        help="large-GEMM efficiency instead of the curve's (e.g. a fit on Korthikanti et al. 2022 "
                             "Table 4: benchmarks/korthikanti_layers.py --fit)")
    parser.add_argument("--attn-mem-eff", type=float, default=None,
                        help="bandwidth efficiency of unfused attention's softmax and dropout kernels instead of "
                             "the curve's (EfficiencyCurve.attn_mem_eff; e.g. the joint fit of "
                             "benchmarks/korthikanti_layers.py --fit-attention)")
    parser.add_argument("--attention", default=MEGATRON_ATTENTION, choices=["unfused", "flash"])
    parser.add_argument("--layer-roofline", action="store_true",
                        help="the earlier per-layer roofline instead of the kernel-by-kernel model")
    parser.add_argument("--as-simulated", action="store_true",
                        help="the simulator's defaults instead of what Megatron-LM v2.5 ran: asynchronous whole-"
                             "tensor p2p, a stage's recompute at once, one fused Adam pass, no flat-buffer copies")
    parser.add_argument("--grad-accumulation", default=None, choices=GRAD_ACCUMULATIONS,
                        help="how weight gradients accumulate over micro-batches (default: autograd, as v2.5 and "
                             "Megatron-DeepSpeed ran it; fused with --as-simulated; docs/accuracy.md section 17)")
    parser.add_argument("--rows", default="", help="comma-separated row indices (default: all)")
    parser.add_argument("--decompose", type=Path, default=None, metavar="CSV",
                        help="write each row's iteration split by kind (first and last pipeline rank) here "
                             "and print it (analysis.iteration_decompose)")
    parser.add_argument("--json", type=Path, default=None, help="write rows and summary here")
    args = parser.parse_args()
    table = load_named(args.table, run_script=not args.assumed)
    records = table.to_dict("records")
    indices = [int(i) for i in args.rows.split(",")] if args.rows else list(range(len(table)))
    print(f"{'params':>8} {'GPUs':>5} {'tp':>3} {'pp':>3} {'dp':>3} {'v':>2} {'mb':>3} {'m':>4} {'iter s':>8} "
          f"{'reported':>8} {'predicted':>9} {'error':>7} {'peak GiB':>8} {'wall s':>6}")
    curve = curve_of(args.curve, args.host_launch_us)
    if args.launch_blocking:
        curve = replace(curve, host_launch_blocking=True)
    if args.eff_max is not None:
        curve = replace(curve, eff_max=args.eff_max)
    if args.attn_mem_eff is not None:
        curve = replace(curve, attn_mem_eff=args.attn_mem_eff)
    results = []
    for i in indices:
        r = simulate_row(records[i], args.schedule, args.micro_batch, curve, args.attention,
                         not args.layer_roofline, decompose=args.decompose is not None,
                         megatron_2021=not args.as_simulated, zero1=args.zero1,
                         grad_accumulation=args.grad_accumulation)
        results.append(r)
        print(f"{r['params_b']:>7.1f}B {r['gpus']:>5} {r['tp']:>3} {r['pp']:>3} {r['dp']:>3} {r['chunks']:>2} "
              f"{r['micro_batch']:>3} {r['microbatches']:>4} {r['iteration_s']:>8.2f} {r['reported_tflops']:>8.0f} "
              f"{r['predicted_tflops']:>9.1f} {r['error']:>+7.1%} {r['peak_GiB']:>8.1f}{'*' if r['oom'] else ' '}"
              f"{r['wall_s']:>6.1f}" + _time_column(r), flush=True)
    s = summarise(results)
    print(f"MAPE {s['mape']:.1%}  median |err| {s['median_abs_error']:.1%}  max |err| {s['max_abs_error']:.1%}  "
          f"mean err {s['mean_signed_error']:+.1%}  {s['spearman_text']}  (* = over the GPU's memory in the ledger)")
    print(f"Peak memory {min(r['peak_GiB'] for r in results):.1f}-{max(r['peak_GiB'] for r in results):.1f} GiB; "
          f"{sum(not r['oom'] for r in results)} of {len(results)} rows fit in their GPUs' memory")
    trend = scaling_trend(results) if args.table == "mtnlg" else []
    if trend:
        print("Per-GPU throughput relative to the first row (reported / predicted): "
              + ", ".join(f"{t['gpus']} GPUs {t['reported']:.3f} / {t['predicted']:.3f}" for t in trend))
    if args.decompose:
        write_decomposition(results, args.decompose)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"table": args.table, "zero1": args.zero1,
                                         "schedule": args.schedule, "micro_batch": args.micro_batch,
                                         "settings": "assumed" if args.assumed else "run script",
                                         "curve": curve.to_dict(),
                                         "attention": args.attention,
                                         "kernels": not args.layer_roofline,
                                         "megatron_2021": not args.as_simulated,
                                         "rows": results, "summary": s, "scaling_trend": trend}, indent=1))


if __name__ == "__main__":
    main()
