"""BLOOM-176B's training logs (BigScience 2022; sim/data/bloom_176b.md): every row's logged TFLOPs is
eq. 3 at its logged iteration time, the plans carry the run's configuration (Megatron-DeepSpeed's
embedding-as-a-unit partition, Jean Zay's Omni-Path nodes, bf16, Megatron's dropout), and the benchmark's
row function runs."""

from __future__ import annotations

import math

import pytest

from tests.script_module import load_script

bench = load_script("benchmarks/megatron_at_scale.py")
ROWS = bench.load_named("bloom").to_dict("records")


def test_every_logged_tflops_is_eq3_at_the_logged_time() -> None:
    """Megatron-DeepSpeed's throughput_calculator is eq. 3 with the checkpointing factor and V = 250,880:
    the log lines' TFLOPs follow from their iteration times (the production row's is computed at its median)."""
    assert len(ROWS) == 6
    for row in ROWS:
        implied = bench.paper_flops(row) / (row["iteration_s"] * row["gpus"]) / 1e12
        assert math.isclose(implied, row["tflops_per_gpu"], abs_tol=0.011), row["name"]
        assert row["gpus"] == 8 * row["nodes"] and row["global_batch"] == 2048


def test_the_plans_carry_the_runs_configuration() -> None:
    by_name = {row["name"]: row for row in ROWS}
    production = bench.plan_for(by_name["bloom-48n-tp4-pp12-mb2"])
    assert (production.tp, production.pp, production.dp, production.micro_batch) == (4, 12, 8, 2)
    assert production.schedule.name == "1f1b" and production.schedule.microbatches == 128
    # type:transformer|embedding: 72 units, 6 per stage; the embedding and the head take a layer's place
    partition = production.parallelism.partition
    assert partition[0] == [0, 6] and partition[1] == [6, 12] and partition[-1] == [66, 72]
    assert (production.dtype, production.workload_options["vocab"], production.workload_options["dropout"]) == (
        "bf16", 250880, 0.1)
    cluster = production.cluster
    assert (cluster["name"], cluster["nodes"], cluster["device"], cluster["inter_node_link"],
            cluster["nics_per_node"]) == ("jean-zay-a100", 48, "A100-80GB", "opa-100", 4)
    assert production.schedule.p2p == "blocking" and production.memory.in_backward
    assert (production.gradient_sync.method, production.gradient_sync.reduce_dtype) == ("allreduce", "param")
    deepest = bench.plan_for(by_name["bloom-36n-tp1-pp72-mb1"])
    assert (deepest.tp, deepest.pp, deepest.dp, deepest.schedule.microbatches) == (1, 72, 4, 512)
    assert deepest.parallelism.partition[0] == [0, 1] and deepest.parallelism.partition[-1] == [71, 72]


def test_a_partition_into_unequal_units_names_the_counts() -> None:
    with pytest.raises(ValueError, match="70 blocks and 2 embedding layers do not split into 10 equal stages"):
        bench.units_partition(70, 10)


def test_the_row_function_runs() -> None:
    row = ROWS[0]
    r = bench.simulate_row(row, "interleaved-1f1b", None)
    assert r["predicted_tflops"] == pytest.approx(bench.paper_flops(row) / (r["iteration_s"] * row["gpus"]) / 1e12)
    assert r["iteration_error"] == pytest.approx(r["iteration_s"] / row["iteration_s"] - 1)
    assert not r["oom"]
