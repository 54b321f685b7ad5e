"""Sequence parallelism (``workload_options: {sequence_parallel: true}``; Korthikanti et al. 2022, section
4.2.2) as the kernel model and the shared TP-communication rule price it: the layernorm / dropout /
residual kernels of a block on 1/t of the sequence, each TP all-reduce a reduce-scatter plus an
all-gather of the same tensor, and the backward's re-gather of the column-parallel linears' inputs
(Megatron-LM keeps 1/t of them). The bytes are tests/test_korthikanti_activations.py's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sim.analytic_costs import AnalyticCosts
from sim.cluster import load_cluster
from sim.collectives import collective_time
from sim.costs import tp_comm_s
from sim.workloads import transformer_config, transformer_layers

T, B = 4, 2


def costs(sp: bool, overlap: bool = False, dropout: float = 0.1) -> AnalyticCosts:
    cluster = load_cluster("dgx-a100-8")
    cfg = transformer_config("gpt2-medium", attention="unfused", dropout=dropout, sequence_parallel=sp)
    return AnalyticCosts(transformer_layers(cfg), cluster.device, "fp16", cluster, tp_backward_overlap=overlap)


def ring_price(collective: str, nbytes: int) -> float:
    return collective_time(collective, nbytes, list(range(T)), load_cluster("dgx-a100-8"), algorithm="ring")


def test_each_all_reduce_becomes_a_reduce_scatter_and_an_all_gather_of_the_same_volume():
    plain, sp = costs(False).layer_costs(3, B, T), costs(True).layer_costs(3, B, T)
    assert sp.tp_sequence_parallel and not plain.tp_sequence_parallel
    assert (sp.tp_allreduces, sp.tp_comm_bytes) == (plain.tp_allreduces, plain.tp_comm_bytes) == (2, plain.output_bytes)
    one = plain.tp_comm_bytes
    rs_ag = ring_price("reduce_scatter", one) + ring_price("all_gather", one)
    assert rs_ag == pytest.approx(ring_price("all_reduce", one), rel=1e-12)  # a ring all-reduce is exactly that
    assert tp_comm_s(sp, False, ring_price) == pytest.approx(2 * rs_ag, rel=1e-12)
    assert tp_comm_s(plain, False, ring_price) == pytest.approx(2 * ring_price("all_reduce", one), rel=1e-12)
    # The backward all-gathers each column-parallel linear's input again (QKV, fc1): two more.
    assert sp.tp_bwd_regathers == 2 and plain.tp_bwd_regathers == 0
    assert tp_comm_s(sp, True, ring_price) == pytest.approx(2 * rs_ag + 2 * ring_price("all_gather", one), rel=1e-12)


def test_with_the_backward_overlap_the_reduce_scatters_and_re_gathers_hide_behind_gemms():
    sp = costs(True, overlap=True).layer_costs(3, B, T)
    assert len(sp.tp_bwd_overlap_s) == 2 and len(sp.tp_bwd_regather_overlap_s) == 2
    one = sp.tp_comm_bytes
    rs, ag = ring_price("reduce_scatter", one), ring_price("all_gather", one)
    hidden = sum(min(rs, g) for g in sp.tp_bwd_overlap_s) + sum(min(ag, g) for g in sp.tp_bwd_regather_overlap_s)
    assert hidden > 0
    assert tp_comm_s(sp, True, ring_price) == pytest.approx(2 * (rs + ag) + 2 * ag - hidden, rel=1e-12)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_hidden_size_kernels_run_on_one_tp_th_of_the_sequence(dropout):
    from sim.analytic import transformer_layer_times

    cluster = load_cluster("dgx-a100-8")
    layer = {sp: transformer_layers(transformer_config("gpt2-medium", attention="unfused", dropout=dropout,
                                                      sequence_parallel=sp))[3] for sp in (False, True)}
    plain, sp = (transformer_layer_times(layer[s], B, T, cluster.device, "fp16",
                                         costs(s).model.efficiency, "unfused") for s in (False, True))
    s_, h = int(layer[False].extra["seq"]), int(layer[False].extra["hidden"])
    X, e, drop, gone = B * s_ * h, 2, 1 if dropout else 0, 1 - 1 / T
    # Forward: LN1 2eX, bias-dropout-add (3e + drop) X, LN2 2eX, bias-dropout-add (3e + drop) X.
    assert plain.elementwise_bytes_fwd - sp.elementwise_bytes_fwd == pytest.approx((10 * e + 2 * drop) * X * gone)
    # Backward: two LNs 3eX each, two dropout-adds (3e + drop) X, two residual sums 3eX.
    assert plain.elementwise_bytes_bwd - sp.elementwise_bytes_bwd == pytest.approx((18 * e + 2 * drop) * X * gone)
    assert dict(plain.parts)["gemm"] == dict(sp.parts)["gemm"]  # the GEMMs run on the all-gathered input, whole
    assert dict(sp.parts)["memory"][0] < dict(plain.parts)["memory"][0]  # (this small layer is host-bound in all)


def test_tp_1_layers_are_unchanged_by_the_flag():
    # At tp 1 there is nothing to split (the plan is refused by sim.compile.check_tp; the costs agree).
    a, b = costs(False).layer_costs(3, B, 1), costs(True).layer_costs(3, B, 1)
    assert replace(b, tp_sequence_parallel=False) == a


def test_the_search_enumerates_sequence_parallel_plans_with_tp_above_1_and_selective_attention():
    # Sequence parallelism is a workload option (the search keeps it fixed, like attention and dropout):
    # the search resolves its shared models at the smallest tp it allows and prunes tp 1 naming the field.
    from sim.search import SearchSpace, search

    space = SearchSpace("gpt2-small", "dgx-a100-8", global_batch=16, dtype="fp16", max_micro_batch=2, fractions=(),
                        tp_overlaps=(0,), bucket_mbs=(25.0,), max_chunks=1,
                        workload_options={"attention": "unfused", "dropout": 0.1, "sequence_parallel": True})
    result = search(space, top_k=3, sample=0)
    assert result.pruned["workload_options.sequence_parallel"] > 0
    assert result.ranked and all(r.candidate.tp > 1 for r in result.ranked)
    assert "selective-attention" in {dict(r.candidate.memory)["policy"] for r in result.ranked}
    assert result.best.simulated.iteration_s == pytest.approx(result.best.estimate.iteration_s, rel=0.02)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_regions_edges_run_on_one_tp_th_of_the_sequence(dropout):
    """The embedding's output dropout runs after the sequence scatter, the head's final LayerNorm before
    the gather (exec.workloads.gpt, exec.parallel.sequence; Korthikanti et al. 2022 section 4.2.2): their
    bytes, the dropout's mask and the LayerNorm's saved input and statistics are 1/t; the lookups, the
    position add, the logits GEMM and the loss are not."""
    from sim.analytic import transformer_layer_times

    cluster = load_cluster("dgx-a100-8")
    shaped = {sp: transformer_layers(transformer_config("gpt2-medium", attention="unfused", dropout=dropout,
                                                       sequence_parallel=sp)) for sp in (False, True)}
    s_, h = int(shaped[False][0].extra["seq"]), int(shaped[False][0].extra["hidden"])
    X, e, drop, gone = B * s_ * h, 2, 1 if dropout else 0, 1 - 1 / T
    curve = costs(False).model.efficiency
    bandwidth = cluster.device.memory_bandwidth_Bps * curve.mem_eff
    # (layer index, kernel kind, forward bytes saved, backward bytes saved, saved bytes saved)
    edges = ((0, "embedding", drop * (2 * e + 1) * X, drop * (2 * e + 1) * X, drop * X),  # dropout, 1-byte mask
             (-1, "lm_head_loss", 2 * e * X, 3 * e * X, e * B * (s_ * h + 2 * s_)))  # LN; its input and stats
    for index, kind, fwd, bwd, saved in edges:
        plain, sp = (transformer_layer_times(shaped[s][index], B, T, cluster.device, "fp16", curve, "unfused")
                     for s in (False, True))
        assert plain.elementwise_bytes_fwd - sp.elementwise_bytes_fwd == pytest.approx(fwd * gone)
        assert plain.elementwise_bytes_bwd - sp.elementwise_bytes_bwd == pytest.approx(bwd * gone)
        part_plain, part_sp = dict(plain.parts)[kind], dict(sp.parts)[kind]
        assert part_plain[0] - part_sp[0] == pytest.approx(fwd * gone / bandwidth, rel=1e-9, abs=1e-18)
        assert part_plain[1] - part_sp[1] == pytest.approx(bwd * gone / bandwidth, rel=1e-9, abs=1e-18)
        assert part_plain[2] == part_sp[2]  # the weight side (lookup gradients, logits wgrad) is whole
        ledger = [c.layer_costs(index % len(shaped[False]), B, T).saved_bytes for c in (costs(False, dropout=dropout),
                                                                                        costs(True, dropout=dropout))]
        assert ledger[0] - ledger[1] == pytest.approx(saved * gone, abs=1)
