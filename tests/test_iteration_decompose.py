"""The at-scale decomposition (analysis.iteration_decompose) and the figures docs/accuracy.md
section 3 quotes from benchmarks/megatron_at_scale.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis.iteration_decompose import KINDS, decompose_rank
from sim.analytic_costs import AnalyticCosts
from sim.cluster import load_cluster
from sim.compile import compile_plan
from sim.engine import Engine
from sim.plan import Plan
from sim.workloads import transformer_config, transformer_layers
from tests.script_module import load_script

ROOT = Path(__file__).resolve().parent.parent


def test_the_parts_sum_to_the_iteration_on_every_rank() -> None:
    plan = Plan.from_dict({"workload": "gpt2-small", "workload_options": {"attention": "unfused"},
                           "cluster": {"preset": "dgx-a100-8"}, "dtype": "fp16",
                           "parallelism": {"tp": 2, "pp": 2, "dp": 2},
                           "schedule": {"name": "1f1b", "micro_batch": 2, "microbatches": 4},
                           "memory": {"policy": "full"}})
    cluster = load_cluster(plan.cluster)
    layers = transformer_layers(transformer_config(plan.workload, **plan.workload_options))
    costs = AnalyticCosts(layers, cluster.device, plan.dtype, cluster, attention="unfused")
    compiled = compile_plan(plan, costs)
    engine = Engine(compiled.program, compiled.resolved.costs, compiled.resolved.comm, compiled.resolved.policy,
                    plan.micro_batch, 0)
    iteration = engine.run()
    for rank in compiled.program.ranks:
        parts = decompose_rank(engine, costs, rank)
        assert all(parts[k] >= -1e-12 for k in KINDS), parts
        assert sum(parts[k] for k in KINDS if k != "p2p_transfer") == pytest.approx(iteration, rel=1e-9)
        for kind in ("gemm", "attention", "memory", "recompute", "tp_allreduce", "optimizer"):
            assert parts[kind] > 0, (rank, kind)
        # Recompute re-runs every forward: as long as the forward's kernels (all kinds) of the rank.
        forward = sum(r.end_s - r.start_s for r in engine.rows
                      if r.rank == rank and r.parent < 0 and r.kind == "RECOMPUTE")
        assert parts["recompute"] + 1e-12 >= 0.5 * forward


def test_the_documented_at_scale_figures_are_what_the_benchmark_computes() -> None:
    bench = load_script("benchmarks/megatron_at_scale.py")
    rows = bench.load_table().to_dict("records")
    recorded = json.loads((ROOT / "docs" / "results" / "megatron_sc21_megatron2021.json").read_text())["rows"]
    as_simulated = json.loads((ROOT / "docs" / "results" / "megatron_sc21_as_simulated.json").read_text())["rows"]
    for i in (0, 4):  # 1.7B (pp 1) and 39.1B (pp 2): quick rows
        now = bench.simulate_row(rows[i], "interleaved-1f1b", None, decompose=True)
        assert now["predicted_tflops"] == pytest.approx(recorded[i]["predicted_tflops"], rel=1e-6)
        assert now["peak_GiB"] == pytest.approx(recorded[i]["peak_GiB"], rel=1e-6)
        before = bench.simulate_row(rows[i], "interleaved-1f1b", None, megatron_2021=False)
        assert before["predicted_tflops"] == pytest.approx(as_simulated[i]["predicted_tflops"], rel=1e-6)
