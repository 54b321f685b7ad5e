"""The per-layer profiler on tiny real models: positive, consistent and exactly known numbers."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from exec.profiler import _capture_weight_edges, _LayerProbe, profile_workload
from exec.workloads import Batch, Workload, get_workload, run_layers
from sim.workloads import transformer_config, transformer_layers
from traces.bundle import ProfileBundle, read_bundle, write_bundle
from traces.errors import ConfigError
from traces.schema import LAYER_TABLE, OP_TABLE

torch.set_num_threads(1)
MB = 2
FP32 = 4


@pytest.fixture(scope="module")
def gpt_tiny() -> ProfileBundle:
    return profile_workload("gpt-tiny", micro_batch=MB, warmup=1, repeats=3)


class TwoLinears(Workload):
    """A real two-layer workload whose first layer is one nn.Linear: every number is known."""

    name = "two-linears"

    def __init__(self, d_in: int = 48, d_out: int = 40) -> None:
        self.d_in, self.d_out = d_in, d_out

    def layer_names(self) -> list[str]:
        return ["fc0", "fc1"]

    def build_layer(self, index: int) -> nn.Module:
        return nn.Linear(self.d_in, self.d_out) if index == 0 else nn.Linear(self.d_out, 1)

    def make_batch(self, micro_batch: int, seed: int = 0, device: str | torch.device = "cpu") -> Batch:
        gen = torch.Generator().manual_seed(seed)
        return Batch(torch.randn(micro_batch, self.d_in, generator=gen).to(device),
                     torch.randn(micro_batch, 1, generator=gen).to(device))

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, targets)


def test_tables_follow_their_schemas(gpt_tiny: ProfileBundle) -> None:
    assert list(gpt_tiny.layers.columns[: len(LAYER_TABLE.columns)]) == LAYER_TABLE.column_names
    assert list(gpt_tiny.ops.columns[: len(OP_TABLE.columns)]) == OP_TABLE.column_names
    assert list(gpt_tiny.layers["name"]) == get_workload("gpt-tiny").layer_names()
    assert list(gpt_tiny.layers["kind"]) == ["embedding", "block", "block", "block", "block", "head"]


def test_times_are_positive_and_backward_splits_into_b_and_w(gpt_tiny: ProfileBundle) -> None:
    layers = gpt_tiny.layers
    for col in ("fwd_s", "bwd_s", "recompute_s", "bwd_weight_s"):
        assert (layers[col] > 0).all(), col
    assert layers.loc[0, "bwd_input_s"] == 0  # token ids have no gradient
    rest = layers.iloc[1:]
    assert (rest["bwd_input_s"] > 0).all()
    # B and W together redo the backward once; tiny layers pay autograd's per-call overhead
    # several times in W (one call per parameter-owning module), hence the loose band.
    ratio = (rest["bwd_input_s"] + rest["bwd_weight_s"]) / rest["bwd_s"]
    assert ((ratio > 0.4) & (ratio < 5)).all(), ratio.tolist()
    assert (layers.filter(like="_spread") >= 0).all().all()


def test_bytes_match_the_closed_forms(gpt_tiny: ProfileBundle) -> None:
    cfg = transformer_config("gpt-tiny")
    specs = transformer_layers(cfg)
    layers = gpt_tiny.layers
    assert list(layers["param_bytes"]) == [s.params * FP32 for s in specs]
    assert (layers["grad_bytes"] == layers["param_bytes"]).all()
    assert list(layers["optimizer_bytes"]) == [2 * s.params * FP32 for s in specs]
    # Output: the activation [b, s, h] between layers; the last layer ends in the scalar loss.
    assert list(layers["output_bytes"]) == [MB * cfg.seq * cfg.hidden * FP32] * (cfg.num_layers + 1) + [FP32]
    for i in range(1, cfg.num_layers + 1):
        expected = specs[i].saved_elems * FP32 * MB
        assert abs(layers.loc[i, "saved_bytes"] / expected - 1) < 0.05
        # the block's input is saved (by LN1) and counted; its output is not saved by the block
        assert layers.loc[i, "saved_input_bytes"] == MB * cfg.seq * cfg.hidden * FP32
        assert layers.loc[i, "saved_output_bytes"] == 0
    head = specs[-1].saved_elems * FP32 * MB
    assert abs(layers.iloc[-1]["saved_bytes"] / head - 1) < 0.05
    assert (layers.iloc[1:]["peak_transient_bytes"] > 0).all()


def test_flops_of_blocks_match_the_closed_form(gpt_tiny: ProfileBundle) -> None:
    specs = transformer_layers(transformer_config("gpt-tiny"))
    layers = gpt_tiny.layers
    assert list(layers["flops_fwd"]) == [s.flops_fwd * MB for s in specs]
    # backward: two matmuls per forward matmul, and 5 instead of 2 for attention (it recomputes scores)
    assert (layers["flops_bwd"] >= 2 * layers["flops_fwd"]).all()


def test_a_linear_layer_is_measured_exactly() -> None:
    wl = TwoLinears()
    bundle = profile_workload(wl, micro_batch=5, layers=range(0, 1), warmup=0, repeats=2, with_ops=False)
    row = bundle.layers.iloc[0]
    b, i, o = 5, wl.d_in, wl.d_out
    assert row["flops_fwd"] == 2 * b * i * o
    assert row["flops_bwd"] == 2 * (2 * b * i * o)  # input gradient and weight gradient
    assert row["param_bytes"] == (i * o + o) * FP32
    assert row["output_bytes"] == b * o * FP32
    assert row["saved_bytes"] == row["saved_input_bytes"] == b * i * FP32  # Linear keeps its input only


def test_the_last_layer_includes_the_loss() -> None:
    bundle = profile_workload(TwoLinears(), micro_batch=3, layers=range(1, 2), warmup=0, repeats=1)
    row = bundle.layers.iloc[0]
    assert row["output_bytes"] == FP32 and row["flops_fwd"] == 2 * 3 * 40


@pytest.mark.parametrize(("name", "index"), [("gpt-tiny", 1), ("resnet-tiny", 2), ("resnet-tiny", 0)])
def test_b_captures_the_gradient_of_every_parameter_owning_module(name: str, index: int) -> None:
    # W must not fall back to a whole backward: every module's output gradient is seen during B,
    # also where ResNet's in-place ReLU rewrites a BatchNorm output after it was recorded.
    wl = get_workload(name)
    x = wl.make_batch(2).inputs
    with torch.no_grad():
        x = run_layers(wl.build_layers(0, index), x) if index else x
    probe = _LayerProbe(index, wl.build_layers(index, index + 1)[0], x, None, wl.loss, 0)
    with _capture_weight_edges(probe.layer) as captures:
        y = probe.forward()
    probe.backward_input(y)
    owners = [m for m in probe.layer.modules() if list(m.parameters(recurse=False))]
    assert len(captures) == len(owners) and all(c.grad is not None for c in captures)
    # W from the captured gradients gives the same parameter gradients as a whole backward.
    for c in captures:
        c.handle.remove()
    weight_grads = {}
    for c in captures:
        grads = torch.autograd.grad([c.edge], c.params, [c.grad], retain_graph=True)
        weight_grads.update({id(p): g for p, g in zip(c.params, grads, strict=True)})
    full = torch.autograd.grad(y, probe.params, probe.grad_out(y))
    for p, g in zip(probe.params, full, strict=True):
        torch.testing.assert_close(weight_grads[id(p)], g)


def test_op_table_attributes_ops_to_layers_and_phases(gpt_tiny: ProfileBundle) -> None:
    ops = gpt_tiny.ops
    assert set(ops["layer"]) == set(range(6))
    for layer, group in ops.groupby("layer"):
        assert {"fwd", "bwd"} <= set(group["phase"]), layer
    block_ops = set(ops.loc[ops["layer"] == 1, "name"])
    assert block_ops & {"aten::addmm", "aten::mm", "aten::linear"}
    assert any("scaled_dot_product" in name for name in block_ops)
    ends = ops.groupby("layer").apply(lambda g: (g["start_us"] + g["dur_us"]).max(), include_groups=False)
    starts = ops.groupby("layer")["start_us"].min()
    assert all(starts[i + 1] >= ends[i] for i in range(5))  # layers laid end to end


def test_meta_and_bundle_round_trip(gpt_tiny: ProfileBundle, tmp_path: Path) -> None:
    meta = gpt_tiny.meta
    assert meta["workload"]["name"] == "gpt-tiny"
    assert meta["settings"]["micro_batch"] == MB and meta["settings"]["device"] == "cpu"
    assert meta["hardware"]["cpu_cores"] and meta["software"]["torch"] == torch.__version__
    back = read_bundle(write_bundle(gpt_tiny, tmp_path / "bundle"))
    columns = LAYER_TABLE.column_names
    pd.testing.assert_frame_equal(back.layers[columns], gpt_tiny.layers[columns])
    assert len(back.ops) == len(gpt_tiny.ops)


def test_lstm_and_resnet_profile() -> None:
    for name in ("lstm-tiny", "resnet-tiny"):
        layers = profile_workload(name, micro_batch=2, warmup=0, repeats=1, with_ops=False).layers
        assert (layers["fwd_s"] > 0).all() and (layers["saved_bytes"] > 0).all()
        assert (layers["flops_fwd"].iloc[1:] > 0).all()
    cfg = get_workload("lstm-tiny").cfg
    lstm0 = profile_workload("lstm-tiny", 2, warmup=0, repeats=1, with_ops=False, layers=range(1, 2)).layers
    # per step: [b, E] x [E, 4H] and [b, H] x [H, 4H]
    assert lstm0.loc[0, "flops_fwd"] == 2 * 2 * cfg.seq * 4 * cfg.hidden * (cfg.embed + cfg.hidden)


def test_bad_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        profile_workload("gpt-tiny", 1, dtype="float8")
    with pytest.raises(ConfigError, match="layers"):
        profile_workload("gpt-tiny", 1, layers=range(3, 9))
    with pytest.raises(ConfigError, match="seq"):
        profile_workload(get_workload("gpt-tiny"), 1, seq=16)
    with pytest.raises(ConfigError, match="micro_batch"):
        profile_workload("gpt-tiny", 0)
    with pytest.raises(ConfigError, match="device"):
        profile_workload("gpt-tiny", 1, device="tpu")
