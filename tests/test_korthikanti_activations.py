"""The ledger's activation bytes of one transformer layer equal Korthikanti et al. 2022's equations
(arXiv:2205.05198, section 4), term by term, for the paper's four models at their tp and micro-batch.

Eq. 1 (no parallelism) s b h (34 + 5 a s / h) and eq. 2 (tensor parallelism t, no sequence
parallelism) s b h (10 + 24/t + 5 a s / (h t)) bytes in fp16, Megatron-LM's GPT with its default
dropout (0.1), unfused attention. Section 4.1 itemises them: attention QKV input 2sbh, Q and K 4sbh,
softmax output 2as^2b, its dropout mask as^2b, the dropout output 2as^2b and V 2sbh, the projection
input 2sbh and its dropout mask sbh; MLP fc1 input 2sbh, GELU input 8sbh, fc2 input 8sbh, dropout
mask sbh; two layernorm inputs 4sbh. The paper leaves out small buffers; the ledger keeps one, the
layernorms' mean and reciprocal standard deviation (sim.workloads.transformer_layers: 4 s elements
per sample), and the test names it. Full recomputation keeps 2sbh (section 4.3).

Sequence parallelism (``workload_options: {sequence_parallel: true}``, section 4.2.2) splits the
replicated 10 sbh over t too: eq. 3, s b h / t (34 + 5 a s / h). The paper's selective recomputation
(section 5; ``memory: {policy: selective-attention}``, sim.memory_attention) drops the attention
core's 5 a s^2 b / t: 34 s b h / t with sequence parallelism (their eq. 6) and s b h (10 + 24 / t)
without. In every case the layernorm statistics (4 s b elements, split by t under sequence
parallelism) come on top. (``selective`` is torch's policy, a different set, not compared.)
"""

from __future__ import annotations

import pytest

import benchmarks.korthikanti_layers as korth
from benchmarks.megatron_at_scale import curve_of
from sim.analytic_costs import AnalyticCosts
from sim.cluster import load_cluster
from sim.implementations import MEGATRON_ATTENTION
from sim.memory import MEMORY_POLICIES, checkpoint_bytes, forward_bytes
from sim.workloads import transformer_config, transformer_layers

SEQ = 2048  # Korthikanti et al. 2022, Table 3: sequence 2,048 for every model
ROWS = korth.load_iterations().to_dict("records")  # 22B, 175B, 530B, 1T with the paper's t and b


def eq2(s: int, b: int, h: int, a: int, t: int) -> int:
    """Korthikanti eq. 2 (eq. 1 at t = 1), summed from section 4.1's terms, in bytes."""
    sbh, as2b = s * b * h, a * s * s * b
    replicated = 2 * sbh + 2 * sbh + 1 * sbh + 2 * sbh + 1 * sbh + 2 * sbh  # LN1 in, QKV in, mask, LN2 in, fc1 in, mask
    split = 4 * sbh + 2 * sbh + 2 * sbh + 8 * sbh + 8 * sbh  # Q K, V, proj in, GELU in, fc2 in
    attention = 2 * as2b + 1 * as2b + 2 * as2b  # softmax output, its dropout mask, the dropout output
    assert replicated == 10 * sbh and split == 24 * sbh
    return replicated + split // t + attention // t


def ledger(row: dict, t: int, dropout: float = 0.1, sequence_parallel: bool = False,
           policy: str = "none") -> tuple[int, int, int]:
    """(bytes the ledger holds per layer over a run of middle blocks under ``policy`` (none, or a
    policy that checkpoints nothing and changes each layer's view: selective-attention), the layernorm
    statistics it counts among them, its checkpoint bytes of one block) for the row's model."""
    plan = korth.row_plan(row, "none")
    options = {**plan.workload_options, "dropout": dropout, "sequence_parallel": sequence_parallel}
    plan = plan.replace(workload_options=options, memory={"policy": policy},
                        parallelism={**plan.parallelism.model_dump(), "tp": t})
    costs = AnalyticCosts(transformer_layers(transformer_config(plan.workload, **options)),
                          load_cluster(plan.cluster).device, "fp16", load_cluster(plan.cluster),
                          curve_of("default"), attention=MEGATRON_ATTENTION)
    b = int(row["micro_batch"])
    blocks = [2, 3, 4, 5]  # middle blocks (layer 0 is the embedding)
    stage_layers = [tuple(range(costs.num_layers))] * plan.num_stages  # the policy's decision is per layer
    policy_ = MEMORY_POLICIES[policy].build(plan, stage_layers, costs, 2**50)
    assert not policy_.problem and not any(policy_.recompute_layers)

    def cost(layer: int):
        return policy_.layer_view(costs.layer_costs(layer, b, t))

    held = forward_bytes(blocks, (), cost)
    ln_stats = 2 * 2 * SEQ * b * 2 // (t if sequence_parallel else 1)  # 2 layernorms x (mean, rstd) x s b, 2 bytes
    return held // len(blocks), ln_stats, checkpoint_bytes(2, cost)


@pytest.mark.parametrize("row", ROWS, ids=[r["model"] for r in ROWS])
def test_no_recompute_layer_is_eq2_at_the_papers_t_and_b(row):
    assert korth.load_iterations()["tp"].eq(8).all()  # the four models' t (Table 3)
    b, h, a, t = int(row["micro_batch"]), int(row["hidden"]), int(row["heads"]), int(row["tp"])
    held, ln_stats, checkpoint = ledger(row, t)
    assert held - ln_stats == eq2(SEQ, b, h, a, t)
    assert checkpoint == 2 * SEQ * b * h  # full recomputation: the layer input only (section 4.3)


@pytest.mark.parametrize("row", ROWS, ids=[r["model"] for r in ROWS])
def test_no_recompute_layer_is_eq1_without_tensor_parallelism(row):
    b, h, a = int(row["micro_batch"]), int(row["hidden"]), int(row["heads"])
    held, ln_stats, _ = ledger(row, 1)
    assert held - ln_stats == 34 * SEQ * b * h + 5 * a * SEQ * SEQ * b == eq2(SEQ, b, h, a, 1)  # s b h (34 + 5as/h)


@pytest.mark.parametrize("row", ROWS, ids=[r["model"] for r in ROWS])
def test_sequence_parallel_layer_is_eq3(row):
    b, h, a, t = int(row["micro_batch"]), int(row["hidden"]), int(row["heads"]), int(row["tp"])
    held, ln_stats, checkpoint = ledger(row, t, sequence_parallel=True)
    sbh = SEQ * b * h
    assert held - ln_stats == 34 * sbh // t + 5 * a * SEQ * SEQ * b // t  # s b h / t (34 + 5 a s / h)
    assert checkpoint == 2 * sbh // t  # the layer input, its sequence shard (eq. 5)


@pytest.mark.parametrize("row", ROWS, ids=[r["model"] for r in ROWS])
def test_full_recompute_with_sequence_parallelism_keeps_eq5(row):
    """Full recomputation keeps each layer's input: 2 s b h per layer (section 4.3), and with sequence
    parallelism its 1/t shard, 2 s b h / t (eq. 5): what a forward of a run of blocks leaves under the
    ``full`` policy, and what a pipeline stage sends."""
    from sim.compile import compile_plan
    from sim.memory import forward_bytes

    b, h, t = int(row["micro_batch"]), int(row["hidden"]), int(row["tp"])
    sbh = SEQ * b * h
    for sequence_parallel, expected in ((False, 2 * sbh), (True, 2 * sbh // t)):
        plan = korth.row_plan(row, "full", sequence_parallel=sequence_parallel)
        plan = plan.replace(workload_options={**plan.workload_options, "dropout": 0.1})
        costs = AnalyticCosts(transformer_layers(transformer_config(plan.workload, **plan.workload_options)),
                              load_cluster(plan.cluster).device, "fp16", load_cluster(plan.cluster),
                              curve_of("default"), attention=MEGATRON_ATTENTION)
        blocks = [2, 3, 4, 5]
        kept = forward_bytes(blocks, blocks, lambda layer, costs=costs: costs.layer_costs(layer, b, t))
        assert kept == len(blocks) * expected
        if plan.pp > 1:  # the Program's stage-boundary messages (these plans set Megatron's scatter/gather)
            program = compile_plan(plan).program
            sends = {i.bytes for rp in program.ranks.values() for i in rp.instructions if i.kind.value == "SEND_ACT"}
            # without: a 1/t slice of the whole tensor, all-gathered by the receivers; with: the shard,
            # whole, no all-gather (Megatron-LM turns its scatter/gather off under sequence parallelism)
            assert sends == {2 * sbh // t} and program.p2p_gather_tp is not sequence_parallel


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("row", ROWS, ids=[r["model"] for r in ROWS])
def test_selective_attention_layer_is_eq6_or_its_tp_analogue(row, sequence_parallel):
    b, h, t = int(row["micro_batch"]), int(row["hidden"]), int(row["tp"])
    held, ln_stats, _ = ledger(row, t, sequence_parallel=sequence_parallel, policy="selective-attention")
    sbh = SEQ * b * h
    assert held - ln_stats == (34 * sbh // t if sequence_parallel else 10 * sbh + 24 * sbh // t)


def test_selective_attention_re_runs_the_attention_core_in_the_backward():
    # The backward grows by the core's forward (both bmms, softmax, dropout, the context copy), the
    # forward does not; flash attention keeps no s x s tensor, so the view changes nothing there and the
    # policy refuses such a plan (it would be ``none`` under another name).
    from sim.memory import attention_core_view

    row = ROWS[0]
    b, t = int(row["micro_batch"]), int(row["tp"])
    for attention, grows in (("unfused", True), ("flash", False)):
        plan = korth.row_plan(row, "none")
        layers = transformer_layers(transformer_config(plan.workload, **{**plan.workload_options, "dropout": 0.1}))
        costs = AnalyticCosts(layers, load_cluster(plan.cluster).device, "fp16", load_cluster(plan.cluster),
                              curve_of("default"), attention=attention)
        c = costs.layer_costs(2, b, t)
        viewed = attention_core_view(c)
        assert viewed.fwd_s == c.fwd_s
        assert (viewed.bwd_input_s > c.bwd_input_s) == grows and (viewed.saved_bytes < c.saved_bytes) == grows
        if grows:  # the re-run is the forward's attention part: more than its two bmms' FLOPs at peak
            s, h = SEQ, int(row["hidden"])
            assert c.attention_core_recompute_s > 4 * b * s * s * h / t / load_cluster(plan.cluster).device.peak("fp16")


def test_selective_attention_is_refused_where_nothing_keeps_an_attention_core():
    from sim.plan import Plan
    from sim.simulate import simulate
    from traces.errors import ConfigError

    plan = Plan.from_dict({"workload": "gpt2-small", "workload_options": {"dropout": 0.1},  # flash attention
                           "cluster": {"preset": "dgx-a100-8"}, "parallelism": {"dp": 8},
                           "memory": {"policy": "selective-attention"}})
    with pytest.raises(ConfigError, match="flash attention keeps no"):
        simulate(plan)
    simulate(plan.replace(workload_options={"dropout": 0.1, "attention": "unfused"}))


def test_sequence_parallelism_needs_tp_and_a_divisible_sequence():
    from exec.workloads import get_workload
    from sim.compile import check_tp
    from traces.errors import ConfigError

    cfg = transformer_config("gpt-tiny", sequence_parallel=True)  # seq 32
    check_tp(2, cfg, "gpt-tiny")
    with pytest.raises(ConfigError, match="workload_options.sequence_parallel"):
        check_tp(1, cfg, "gpt-tiny")
    with pytest.raises(ConfigError, match="workload_options.sequence_parallel"):
        check_tp(4, transformer_config("gpt-tiny", sequence_parallel=True, seq=30), "gpt-tiny")
    assert get_workload("gpt-tiny", sequence_parallel=True).sequence_parallel  # runs: test_runtime_sequence_parallel
    # with dropout too (a per-TP-rank generator for the region's masks: test_runtime_sequence_parallel)
    assert get_workload("gpt-tiny", sequence_parallel=True, dropout=0.1).stochastic


def test_the_runtime_compiles_selective_attention_with_the_measured_core():
    # The runtime runs it (tests/test_runtime_selective_attention.py); exec.structure measures each
    # layer's attention core, so the policy is built from the runtime's own bytes.
    from exec.contract import compile_for_run
    from sim.plan import Plan

    plan = Plan.from_dict({"workload": "gpt-tiny", "workload_options": {"attention": "unfused"},
                           "cluster": {"preset": "local-cpu-2", "devices_per_node": 2},
                           "parallelism": {"dp": 2}, "memory": {"policy": "selective-attention"}})
    run = compile_for_run(plan)
    assert run.resolved.policy.view == "selective-attention" and not run.resolved.policy.problem


def test_without_dropout_the_masks_and_the_dropout_output_are_not_kept():
    # p 0: no mask (2 sbh and as^2b) and no separate dropout output (2 as^2b): s b h (8 + 24/t + 2 a s / (h t)).
    row = ROWS[0]
    b, h, a, t = int(row["micro_batch"]), int(row["hidden"]), int(row["heads"]), int(row["tp"])
    held, ln_stats, _ = ledger(row, t, dropout=0.0)
    sbh = SEQ * b * h
    assert held - ln_stats == 8 * sbh + 24 * sbh // t + 2 * a * SEQ * SEQ * b // t


def test_the_fast_estimate_holds_the_masks_like_the_ledger():
    # Dropout's bytes reach the search's estimate through the same LayerCosts: its peak moves with the
    # engine's, and its time too (the dropout kernels), on a plan without recomputation.
    from sim.compile import compile_plan
    from sim.estimate import Estimator
    from sim.plan import Plan
    from sim.simulate import simulate

    def run(p: float):
        plan = Plan.from_dict({"workload": "gpt2-small", "workload_options": {"attention": "unfused", "dropout": p},
                               "cluster": {"preset": "dgx-a100-8"}, "dtype": "fp16",
                               "parallelism": {"pp": 2, "tp": 2, "dp": 2}, "memory": {"policy": "none"},
                               "schedule": {"name": "1f1b", "micro_batch": 2, "microbatches": 4}})
        resolved = compile_plan(plan).resolved
        fast = Estimator(resolved.costs, resolved.comm, plan.dtype).estimate(
            schedule="1f1b", dp=2, tp=2, pp=2, chunks=1, micro_batch=2, microbatches=4,
            stage_layers=resolved.stage_layers, policy=resolved.policy, tp_overlap=0,
            sync_method=plan.gradient_sync.method, bucket_mb=plan.gradient_sync.bucket_mb)
        engine = simulate(plan)
        return fast, [engine.memory[r].peak_bytes for r in sorted(engine.memory)], engine.iteration_s

    (fast0, ledger0, t0), (fast1, ledger1, t1) = run(0.0), run(0.1)
    grown_ledger = max(ledger1) - max(ledger0)
    grown_fast = max(fast1.peak_bytes) - max(fast0.peak_bytes)
    assert grown_ledger > 0 and grown_fast == pytest.approx(grown_ledger, rel=0.02)
    assert t1 > t0 and fast1.iteration_s > fast0.iteration_s


def test_a_dropout_outside_0_1_is_refused_naming_the_field():
    from sim.plan import Plan
    from sim.simulate import simulate
    from traces.errors import ConfigError

    for bad in (1.0, -0.1, "0.1"):
        with pytest.raises(ConfigError, match="workload_options.dropout"):
            transformer_config("gpt-tiny", dropout=bad)
    plan = Plan.from_dict({"workload": "gpt2-small", "workload_options": {"dropout": 1.5},
                           "cluster": {"preset": "dgx-a100-8"}, "parallelism": {"dp": 8}})
    with pytest.raises(ConfigError, match="workload_options.dropout"):
        simulate(plan)
