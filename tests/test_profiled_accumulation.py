"""``workload_options.grad_accumulation: autograd`` on a profiled plan (docs/inputs.md): the pass is priced on
top of the measured backward, as the analytic model prices it (``sim.analytic.grad_accumulation_s``), because
the profiler's backward (``torch.autograd.grad``) returns fresh gradients and never adds into ``.grad``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sim.analytic import default_for
from sim.cluster import load_cluster
from sim.compile import resolve_plan
from sim.plan import Plan
from traces.bundle import read_bundle

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "tests" / "data" / "comm" / "loopback-2d-run7"  # gpt-wordlm, CPU, fp32, micro-batch 4
PLAN = ROOT / "examples" / "validation" / "embedding" / "emb-dense-dp2.yaml"  # dp 2, micro-batch 4, 2 micro-batches


def _plan_file(tmp_path: Path, mode: str) -> Path:
    sections = yaml.safe_load(PLAN.read_text())
    sections["workload_options"] = {**sections["workload_options"], "grad_accumulation": mode}
    path = tmp_path / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(sections))
    return path


def _simulate_cli(plan: Path, out: Path) -> float:
    done = subprocess.run([sys.executable, "-m", "analysis.cli", "simulate", str(plan), "--profile", str(BUNDLE),
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((out / "summary.json").read_text())["iteration_s"]


def test_a_profiled_plan_prices_the_autograd_pass_as_the_analytic_model_does(tmp_path: Path) -> None:
    """Through the command line a user runs: the stored bundle (profiled before the option existed) takes an
    ``autograd`` plan, and the iteration grows by the one pass of micro-batch 1 (2 micro-batches; each rank
    holds every layer): 3 x each layer's recorded gradient bytes at the plan device's bandwidth x the
    memory-bound rate of its default curve, by hand. The measured backward itself is unchanged."""
    times = {mode: _simulate_cli(_plan_file(tmp_path, mode), tmp_path / mode) for mode in ("fused", "autograd")}
    plan = Plan.load(_plan_file(tmp_path, "autograd"))
    device = load_cluster(plan.cluster).device
    rate = device.memory_bandwidth_Bps * default_for(device, plan.dtype).mem_eff
    grad_bytes = read_bundle(BUNDLE).layers["grad_bytes"].sum()
    microbatches = plan.microbatches
    assert microbatches == 2 and plan.pp == 1
    assert times["autograd"] - times["fused"] == pytest.approx((microbatches - 1) * 3 * grad_bytes / rate, rel=1e-6)
    costs = {mode: resolve_plan(Plan.load(_plan_file(tmp_path, mode)).replace(profile=str(BUNDLE))).costs
             for mode in ("fused", "autograd")}
    for layer in range(costs["fused"].num_layers):
        fused, autograd = (costs[mode].layer_costs(layer, 4, 1) for mode in ("fused", "autograd"))
        assert (autograd.bwd_input_s, autograd.bwd_weight_s) == (fused.bwd_input_s, fused.bwd_weight_s)
        assert fused.grad_accumulate_s == 0 < autograd.grad_accumulate_s


def test_the_profilers_backwards_leave_grad_untouched() -> None:
    """What makes the pass an addition, not a double count: each backward the profiler times (the whole
    backward, B and W, ``exec.profiler._round``) returns fresh gradients (``torch.autograd.grad``) and adds
    nothing into a parameter's ``.grad``, where autograd's accumulation would run."""
    import torch

    from exec.profiler import _capture_weight_edges, _LayerProbe
    from exec.workloads import get_workload

    wl = get_workload("gpt-tiny")
    with torch.no_grad():
        x = wl.build_layers(0, 1)[0](wl.make_batch(2).inputs)
    probe = _LayerProbe(1, wl.build_layers(1, 2)[0], x, None, wl.loss, 0)
    probe.backward(probe.forward())
    with _capture_weight_edges(probe.layer) as captures:
        y = probe.forward()
    probe.backward_input(y)
    probe.backward_weight(y, captures)
    assert probe.params and all(p.grad is None for p in probe.params)
