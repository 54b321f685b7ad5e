"""Megatron-LM's vocabulary-parallel LM head under tensor parallelism (sim.analytic.megatron_head_tp):
three b x s fp32 all-reduces in the cross-entropy's forward, and the b x s x h input gradient
all-reduced in the backward (copy_to_tensor_model_parallel_region), as the engine and the fast
estimate price them (sim.costs.tp_comm_s, the one rule both call)."""

from __future__ import annotations

import pytest

from sim.analytic import tp_comm_times
from sim.analytic_costs import AnalyticCosts
from sim.cluster import load_cluster
from sim.collectives import collective_time
from sim.costs import tp_comm_s
from sim.workloads import transformer_config, transformer_layers

SEQ, HIDDEN = 2048, 4096


@pytest.mark.parametrize("micro_batch", [1, 4])
def test_the_head_all_reduces_its_loss_forward_and_its_input_gradient_backward(micro_batch: int) -> None:
    cluster = load_cluster("dgx-a100-8")
    layers = transformer_layers(transformer_config("gpt2-medium", hidden=HIDDEN, heads=32, num_layers=2,
                                                   seq=SEQ, vocab=51200))
    costs = AnalyticCosts(layers, cluster.device, "fp16", cluster=cluster, attention="unfused")
    head = costs.layer_costs(len(layers) - 1, micro_batch, 8)
    calls: list[tuple[bool, str, int]] = []

    def price(backward: bool):
        def one(collective: str, nbytes: int) -> float:
            calls.append((backward, collective, nbytes))
            return collective_time("all_reduce", nbytes, range(8), cluster)
        return one

    tokens = micro_batch * SEQ
    fwd, bwd = tp_comm_s(head, False, price(False)), tp_comm_s(head, True, price(True))
    assert calls == [(False, "allreduce", tokens * 4), (True, "allreduce", tokens * HIDDEN * 2)]
    assert fwd == pytest.approx(3 * collective_time("all_reduce", tokens * 4, range(8), cluster))
    assert bwd == pytest.approx(collective_time("all_reduce", tokens * HIDDEN * 2, range(8), cluster))
    # The closed form the calibration uses says the same.
    closed = tp_comm_times(costs.model.layer_costs(layers[-1], micro_batch, 8), range(8), cluster)
    assert closed == pytest.approx((fwd, bwd))
    # A block keeps its two all-reduces of its output both ways; without TP the head has none.
    block = costs.layer_costs(1, micro_batch, 8)
    assert tp_comm_s(block, True, price(True)) == pytest.approx(tp_comm_s(block, False, price(False)))
    assert tp_comm_s(costs.layer_costs(len(layers) - 1, micro_batch, 1), True, price(True)) == 0.0
