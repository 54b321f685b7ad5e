"""Megatron rows above 8 GPUs: one 64-GPU "node" (before issue 9m) against 8-GPU nodes over 4 x HDR (after).

    python benchmarks/megatron_rows_across_nodes.py [--out docs/results/megatron_rows_across_nodes.csv]

Until issue 9m, ``analysis.calibrate.row_to_plan`` put a row of N GPUs on one DGX A100 "node" with N GPUs:
every transfer on NVLink. It now places a row above 8 GPUs on N / 8 nodes over the a100-64 preset's network
(``sim.calibration.megatron_cluster``). For each row below this prints the simulated iteration both ways, the
change, and where the "after" iteration's time goes on rank 0 (``analysis.iteration_decompose``): the wait
before the optimizer step (exposed data-parallel gradient all-reduce, which crosses nodes in every row here)
and the compute stream's wait inside the pipeline (bubble plus exposed sends). Curve: what ``paratwin
simulate`` uses for A100 fp16 (``sim.analytic.default_for``), as ``paratwin predict-runs`` does.

The rows: SC'21 Table 1's configurations from 64 to 512 GPUs (``sim/data/megatron_sc21_table1.csv``: GPUs,
batch, tp, pp, model; ``megatron_sc21_run_table_1.csv``: micro-batch; sequence 2,048) on this row format's
plan (plain 1F1B, full recompute, the a100-64 network of 4 x HDR per node, not Selene's 8), and the larger
vTrain model shape (hidden 2,048, 16 heads, 24 layers, sequence 1,024) scaled to 64-512 GPUs, plus GPT-3
175B on 512. No measured time is used: these are shapes in the hidden set's range, not its rows.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.calibrate import row_to_plan
from analysis.iteration_decompose import decompose_rank
from sim.analytic import default_for
from sim.analytic_costs import AnalyticCosts
from sim.calibration import MEGATRON_CLUSTER, MEGATRON_DEVICE, MEGATRON_DTYPE
from sim.cluster import load_cluster
from sim.compile import compile_plan
from sim.engine import Engine, EngineOptions
from sim.hardware import get_device
from sim.workloads import transformer_config, transformer_layers

DATA = Path(__file__).resolve().parent.parent / "sim" / "data"
SC21_SEQ = 2048  # sim/data/megatron_sc21_table1.md: all models sequence 2,048


def sc21_rows() -> list[dict[str, Any]]:
    table = pd.read_csv(DATA / "megatron_sc21_table1.csv").merge(
        pd.read_csv(DATA / "megatron_sc21_run_table_1.csv"), on=["params_b", "global_batch"])
    rows = []
    for r in table[(table["gpus"] >= 64) & (table["gpus"] <= 512)].to_dict("records"):
        rows.append(dict(label=f"SC'21 {r['params_b']}B", gpus=r["gpus"], global_batch=r["global_batch"],
                         micro_batch=r["micro_batch"], hidden=r["hidden"], heads=r["heads"], layers=r["layers"],
                         seq=SC21_SEQ, tp=r["tp"], dp=r["gpus"] // (r["tp"] * r["pp"]), pp=r["pp"]))
    return rows


def vtrain_shaped_rows() -> list[dict[str, Any]]:
    shape = dict(hidden=2048, heads=16, layers=24, seq=1024)  # vTrain's larger model shape
    runs = [(64, 1024, 4, 1, 64, 1), (64, 512, 4, 2, 8, 4), (128, 1024, 4, 1, 32, 4), (256, 1024, 2, 2, 32, 4),
            (512, 1024, 4, 8, 16, 4), (512, 2048, 2, 1, 128, 4)]
    rows = [dict(label="vTrain shape", gpus=g, global_batch=b, micro_batch=mb, tp=tp, dp=dp, pp=pp, **shape)
            for g, b, mb, tp, dp, pp in runs]
    # GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers, hidden 12,288, 96 heads, context 2,048)
    rows.append(dict(label="GPT-3 175B", gpus=512, global_batch=512, micro_batch=1, hidden=12288, heads=96,
                     layers=96, seq=2048, tp=8, dp=8, pp=8))
    return rows


def simulate_on(row: dict[str, Any], cluster: dict[str, Any] | None) -> tuple[float, dict[str, float]]:
    """(iteration seconds, rank 0's decomposition) of the row's plan, on ``cluster`` instead of its own."""
    plan = row_to_plan({**row, "row_id": 0})
    if cluster is not None:
        plan = plan.model_copy(update={"cluster": cluster})
    spec = load_cluster(plan.cluster)
    config = transformer_config(plan.workload, **plan.workload_options)
    costs = AnalyticCosts(transformer_layers(config), spec.device, plan.dtype, spec,
                          default_for(get_device(MEGATRON_DEVICE), MEGATRON_DTYPE), attention=config.attention)
    compiled = compile_plan(plan, costs)
    resolved = compiled.resolved
    engine = Engine(compiled.program, resolved.costs, resolved.comm, resolved.policy, plan.micro_batch,
                    plan.parallelism.tp_overlap, EngineOptions())
    iteration = engine.run()
    return iteration, decompose_rank(engine, costs, compiled.program.rank_of(0, 0, 0))


def measure(row: dict[str, Any]) -> dict[str, Any]:
    one_node = {"preset": MEGATRON_CLUSTER, "devices_per_node": int(row["gpus"])}
    before, _ = simulate_on(row, one_node)
    after, parts = simulate_on(row, None)
    return {**row, "one_node_s": before, "nodes_s": after, "change": after / before - 1,
            **{f"{kind}_share": _share(parts[kind], after) for kind in ("sync_wait", "pipeline_wait", "tp_allreduce")}}


def _share(seconds: float, iteration: float) -> float:
    """seconds / iteration to 4 decimals; + 0.0 turns a rounding's -0.0 (the parts' sum is exact to ~1e-5) into 0."""
    return round(seconds / iteration, 4) + 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the table as CSV here")
    args = parser.parse_args()
    table = pd.DataFrame([measure(r) for r in sc21_rows() + vtrain_shaped_rows()])
    print("| rows | GPUs | tp | dp | pp | micro-batches | one N-GPU node (s) | 8-GPU nodes, 4 x HDR (s) | change "
          "| DP sync wait | pipeline wait | TP all-reduce |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in table.to_dict("records"):
        m = r["global_batch"] // (r["micro_batch"] * r["dp"])
        print(f"| {r['label']} | {r['gpus']} | {r['tp']} | {r['dp']} | {r['pp']} | {m} | {r['one_node_s']:.3f} | "
              f"{r['nodes_s']:.3f} | {r['change']:+.1%} | {r['sync_wait_share']:.1%} | {r['pipeline_wait_share']:.1%} "
              f"| {r['tp_allreduce_share']:.1%} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(args.out, index=False)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
