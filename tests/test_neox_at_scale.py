"""GPT-NeoX-20B's training row (Black et al. 2022; sim/data/neox_20b.md): the plan carries the published
configuration (configs/20B.yml) and the data file's declared assumptions, the row's FLOP convention is
GPT-NeoX's 2022 logger (its parameter count is the model card's), and the benchmark's row function runs."""

from __future__ import annotations

import math

import pytest

from tests.script_module import load_script

bench = load_script("benchmarks/megatron_at_scale.py")
ROW = bench.load_named("neox").to_dict("records")[0]


def test_the_table_is_the_papers_run_with_its_config() -> None:
    assert (ROW["tp"], ROW["pp"], ROW["gpus"], ROW["nodes"], ROW["tflops_per_gpu"]) == (2, 4, 96, 12, 117)
    assert (ROW["layers"], ROW["hidden"], ROW["heads"], ROW["vocab"]) == (44, 6144, 64, 50432)
    # 20B.yml: micro-batch 4 x 32 accumulation steps x dp 12
    assert ROW["global_batch"] == ROW["micro_batch"] * 32 * (ROW["gpus"] // (ROW["tp"] * ROW["pp"])) == 1536
    assert (ROW["dtype"], ROW["dropout"], ROW["flops"], ROW["ddp"]) == ("fp16", 0.0, "neox-2022", "deepspeed-zero1")


def test_the_plan_carries_the_stated_configuration() -> None:
    plan = bench.plan_for(ROW)
    assert (plan.tp, plan.pp, plan.dp) == (2, 4, 12)
    assert plan.micro_batch == 4 and plan.schedule.microbatches == 32
    # DeepSpeed's pipeline engine: plain 1F1B, 11 layers per stage
    assert plan.schedule.name == "1f1b" and plan.chunks == 1
    assert plan.parallelism.partition[1] == [12, 23]
    assert plan.dtype == "fp16" and plan.workload_options["vocab"] == 50432
    assert plan.workload_options["dropout"] == 0.0
    cluster = plan.cluster
    assert (cluster["name"], cluster["nodes"], cluster["device"], cluster["nics_per_node"]) == (
        "neox-coreweave", 12, "A100-40GB", 4)
    assert plan.schedule.p2p == "blocking" and plan.memory.in_backward
    # ZeRO stage 1: reduce-scatter, 1/dp of the step, all-gather, in fp16
    sync = plan.gradient_sync
    assert (sync.method, sync.reduce_dtype) == ("distopt", "param")


def test_the_other_tables_keep_selene_and_megatrons_dropout() -> None:
    for row in (bench.load_named("mtnlg").to_dict("records")[0], bench.load_table().to_dict("records")[0]):
        plan = bench.plan_for(row)
        assert (plan.cluster["device"], plan.cluster["nics_per_node"]) == ("A100-80GB", 8)
        assert plan.workload_options["dropout"] == 0.1
    assert bench.plan_for(ROW, nics_per_node=8).cluster["nics_per_node"] == 8


def test_the_parameter_count_is_the_loggers_and_the_model_cards() -> None:
    """GPT-NeoX's logger counted every tp rank's parameters (get_total_params): the tp-replicated norms
    and row-parallel biases twice. That count is the model card's 20,556,201,984."""
    h, L, V = ROW["hidden"], ROW["layers"], ROW["vocab"]
    once = 12 * L * h * h + 13 * L * h + 2 * V * h + 2 * h  # layers, untied embeddings, final norm
    replicated = 6 * L * h + 2 * h  # two norms (weight, bias) and two row-parallel biases per layer
    assert once + (ROW["tp"] - 1) * replicated == round(ROW["params_b"] * 1e9) == 20_556_201_984


def test_117_is_the_loggers_convention_and_implies_43_85_s() -> None:
    flops = bench.paper_flops(ROW)
    implied = flops / (117e12 * ROW["gpus"])
    assert math.isclose(implied, 43.846, abs_tol=1e-3)
    # the paper's 1,830 hours over 150,000 steps give 117 in this convention, 127 in eq. 3's
    per_step = 1830 * 3600 / 150_000
    assert round(flops / (per_step * 96) / 1e12) == 117
    eq3 = bench.paper_flops({**ROW, "flops": "eq3"})
    assert round(eq3 / (per_step * 96) / 1e12) == 127
    assert math.isclose(eq3 / flops, 1.0869, abs_tol=1e-4)


def test_unknown_convention_and_cluster_name_the_fix() -> None:
    with pytest.raises(ValueError, match="flops 'palm' is not a known FLOP convention; use one of eq3, neox-2022"):
        bench.paper_flops({**ROW, "flops": "palm"})
    with pytest.raises(ValueError, match="cluster .jean-zay. is not one of selene, neox-coreweave, jean-zay-a100"):
        bench.plan_for({**ROW, "cluster": "jean-zay"})


def test_the_row_function_runs() -> None:
    r = bench.simulate_row(ROW, "interleaved-1f1b", None)
    assert r["chunks"] == 1 and r["microbatches"] == 32 and r["dp"] == 12 and not r["oom"]
    # predicted TFLOP/s in the row's own convention: its error is the error in iteration time
    implied = bench.paper_flops(ROW) / (117e12 * 96)
    assert math.isclose(1 + r["error"], implied / r["iteration_s"], rel_tol=1e-9)
