"""A pipeline stage's input arrives in the layout its layer made it, so a layer saves what it saves in
one process (docs/memory.md, "An LSTM's received input"): torch's batch-first LSTM / GRU / RNN saves
its input as it is only when the input's storage is time-major (or the batch or the sequence is 1),
and a copy of it otherwise; the runtime now receives a batch-first LSTM's output time-major, as the
previous LSTM made it, and the ledger, from the one-process measurement, equals its peak."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from exec.structure import StructuralCosts, inverse_order, measured_layer_specs, storage_order
from exec.workloads import get_workload


def _saves_input_as_is(module: nn.Module, x: torch.Tensor) -> bool:
    saved: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return x.untyped_storage().data_ptr() in saved


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize(("batch", "seq", "copies"), [(1, 16, False), (2, 1, False), (2, 16, True), (4, 3, True)])
def test_batch_first_rnn_copies_a_batch_first_storage(kind: type[nn.Module], batch: int, seq: int,
                                                      copies: bool) -> None:
    """What the runtime used to receive (a contiguous batch-first buffer) is copied and the copy saved
    wherever batch and sequence are both over 1; the previous LSTM's output (a view of a time-major
    storage) is saved as it is at every size. The rule the measurement and the runtime rely on."""
    module = kind(8, 8, batch_first=True)
    received = torch.randn(batch, seq, 8, requires_grad=True)
    time_major = torch.randn(seq, batch, 8).transpose(0, 1).detach().requires_grad_(True)
    assert _saves_input_as_is(module, received) is not copies
    assert _saves_input_as_is(module, time_major)


def test_storage_order_of_an_lstm_output() -> None:
    """lstm-tiny's LSTMs hand over a time-major storage, the embedding a batch-first one; sending
    ``out.permute(order)`` and receiving into that shape, permuted back, gives the tensor back."""
    costs = StructuralCosts(get_workload("lstm-tiny"), 2, "fp32")
    assert [costs.output_order(layer) for layer in range(4)] == [(0, 1, 2), (1, 0, 2), (1, 0, 2), (0, 1, 2)]
    out = torch.randn(16, 2, 32).transpose(0, 1)
    order = storage_order(out)
    sent = out.permute(order)
    assert sent.is_contiguous()
    received = sent.clone().permute(inverse_order(order))
    assert torch.equal(received, out) and received.stride() == out.stride()


@pytest.mark.parametrize("workload", ["lstm-tiny", "resnet-tiny"])
def test_measured_specs_share_storages_as_larger_batches_do(workload: str) -> None:
    """``measured_layer_specs`` takes what a layer shares with its neighbours at micro-batch 2, so the
    analytic costs built from it say what torch does at 2 and 4: lstm-tiny's first LSTM does not save
    its input (the embedding's batch-first output; a copy), nor does the head (a view of the LSTM's
    time-major output). At micro-batch 1 it saved both as they are, so the specs had missed the copy."""
    from sim.analytic_costs import AnalyticCosts
    from sim.cluster import load_cluster
    from tests.test_received_gradients import cluster

    wl = get_workload(workload)
    analytic = AnalyticCosts(tuple(measured_layer_specs(wl)), load_cluster(cluster(2)).device, "fp32")
    for micro_batch in (2, 4):
        measured = StructuralCosts(wl, micro_batch, "fp32")
        for layer in range(wl.num_layers):
            a, m = analytic.layer_costs(layer, micro_batch, 1), measured.layer_costs(layer, micro_batch, 1)
            assert (a.shared_input_bytes, a.unsaved_input_bytes, a.saved_output_bytes) == \
                (m.shared_input_bytes, m.unsaved_input_bytes, m.saved_output_bytes), (micro_batch, layer)


@pytest.mark.slow
@pytest.mark.parametrize(("layers", "micro_batch"), [([], 1), ([], 2), ([2], 2)])
def test_lstm_stage_after_a_boundary_runs_at_the_ledger(layers: list[int], micro_batch: int) -> None:
    """lstm-tiny pp 2 (GPipe, four micro-batches, fp32, 2 gloo ranks): rank 1's first layer is the
    second LSTM, whose input comes from rank 0. Every rank's runtime activation peak equals the
    ledger's, the stage kept or its first layer recomputed. Before the runtime received the input
    batch-first, rank 1 held 4 x 4,096 B more at micro-batch 2 (the LSTM's copy beside the
    received tensor: 910,352 B against 893,968)."""
    from tests.kept_run_subprocess import run_recompute_after_kept

    result = run_recompute_after_kept("lstm-tiny", layers, micro_batch)
    assert result["stage_layers"] == [[0, 1], [2, 3]]
    assert result["recompute_layers"] == [[], layers]
    assert result["runtime"] == result["ledger"]


@pytest.mark.slow
def test_lstm_pp2_trains_as_one_process(tmp_path: Path) -> None:
    """The activation sent in its storage's order and received permuted back is the same tensor:
    lstm-tiny pp 2 (GPipe, 2 gloo ranks) trains as one process does (losses and parameters)."""
    from tests.test_runtime import check_against_reference, plan_of

    check_against_reference(plan_of(workload="lstm-tiny", pp=2, schedule="gpipe"), tmp_path)
