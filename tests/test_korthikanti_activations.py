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

The paper's selective recomputation (eq. 5/6: recompute the attention core, keep 34 sbh / t) is not
a memory policy here: the ``selective`` policy is torch's (keep matmul and attention outputs,
recompute the memory-bound operators), a different set, so it is not compared.
"""

from __future__ import annotations

import pytest

import benchmarks.korthikanti_layers as korth
from benchmarks.megatron_at_scale import curve_of
from sim.analytic_costs import AnalyticCosts
from sim.calibration import MEGATRON_ATTENTION
from sim.cluster import load_cluster
from sim.memory import checkpoint_bytes, forward_bytes
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


def ledger(row: dict, t: int, dropout: float = 0.1) -> tuple[int, int, int]:
    """(bytes the ledger holds per layer over a run of middle blocks under no recomputation, the
    layernorm statistics it counts among them, its checkpoint bytes of one block) for the row's model."""
    plan = korth.row_plan(row, "none")
    options = {**plan.workload_options, "dropout": dropout}
    costs = AnalyticCosts(transformer_layers(transformer_config(plan.workload, **options)),
                          load_cluster(plan.cluster).device, "fp16", load_cluster(plan.cluster),
                          curve_of("default"), attention=MEGATRON_ATTENTION)
    b = int(row["micro_batch"])
    blocks = [2, 3, 4, 5]  # middle blocks (layer 0 is the embedding)
    held = forward_bytes(blocks, (), lambda layer: costs.layer_costs(layer, b, t))
    ln_stats = 2 * 2 * SEQ * b * 2  # two layernorms x (mean, rstd) x s b, at the activation's 2 bytes
    return held // len(blocks), ln_stats, checkpoint_bytes(2, lambda layer: costs.layer_costs(layer, b, t))


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
