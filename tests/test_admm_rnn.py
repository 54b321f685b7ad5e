"""ADMMiRNN: serial convergence on real digits, SP == serial over real gloo ranks, AP converges,
the what-if's SP/AP throughput, and the RNN workload's layers."""

from __future__ import annotations

import math

import pytest
import torch

from exec.admm.data import load_task
from exec.admm.parallel import run_ap, run_sp
from exec.admm.rnn_admm import ADMMConfig, RNNParams, evaluate, forward, train_admm
from exec.workloads import get_workload, run_layers
from sim.admm_whatif import ring_allreduce_s, simulate_admm_parallel
from traces.errors import ConfigError

HIDDEN = 16
CFG = ADMMConfig()


@pytest.fixture(scope="module")
def digits():
    torch.set_num_threads(1)
    return load_task("digits", seed=0)


@pytest.fixture(scope="module")
def serial_run(digits):
    params, history = train_admm(digits.train, HIDDEN, 30, CFG, seed=0, test=digits.test)
    return params, history


def test_admm_decreases_lagrangian_and_training_loss(serial_run):
    _, history = serial_run
    loss = [row["train_loss"] for row in history]
    for before, after in zip(loss, loss[1:], strict=False):  # every iteration, the weights' loss
        assert after <= before + 1e-9
    assert loss[-1] < loss[0] - 0.5
    # The first iteration pulls o to the labels (the Lagrangian drops), the next few let the duals
    # catch up with the open constraints (dual ascent raises it); after that transient every
    # iteration must lower it.
    lagrangian = [row["lagrangian"] for row in history]
    for before, after in zip(lagrangian[6:], lagrangian[7:], strict=False):
        assert after <= before + 1e-9 * abs(before)
    assert lagrangian[-1] < max(lagrangian) - 0.5


def test_constraint_residuals_shrink(serial_run):
    _, history = serial_run
    for key in ("residual_a", "residual_s", "residual_o"):
        early = max(row[key] for row in history[1:6])
        late = max(row[key] for row in history[-5:])
        assert early > 0 and late < 0.5 * early, key


def test_admm_beats_chance_on_held_out_digits(serial_run, digits):
    params, history = serial_run
    loss, acc = evaluate(params, digits.test)
    assert acc == pytest.approx(history[-1]["test_acc"])
    assert acc > 0.25  # ten balanced classes: chance is 0.10
    assert loss < math.log(10)


def test_sp_two_gloo_ranks_matches_serial(digits):
    iterations = 5
    serial, history = train_admm(digits.train, HIDDEN, iterations, CFG, seed=0)
    sp = run_sp(digits.train, HIDDEN, iterations, CFG, workers=2, seed=0)
    assert len(sp.snapshots) == iterations + 1 and len(sp.compute_s) == 2
    diff = (sp.params.flat() - serial.flat()).abs().max()
    assert float(diff) < 1e-9
    sp_lagrangian = float(sp.sums[-1][0]) / float(sp.sums[-1][4])
    assert sp_lagrangian == pytest.approx(history[-1]["lagrangian"], rel=1e-9)
    # and the weights did move: the equality is not trivial
    assert float((sp.params.flat() - sp.snapshots[0][3]).abs().max()) > 1e-3


def test_ap_runs_within_staleness_and_converges(digits):
    iterations, workers, staleness = 8, 2, 1
    ap = run_ap(digits.train, HIDDEN, iterations, CFG, workers=workers, staleness=staleness, seed=0)
    assert len(ap.snapshots) == iterations * workers + 1  # one weight update per worker message
    # a worker is released at most `staleness` ahead of the slowest, so the statistics in one
    # sum are at most staleness + 1 iterations apart
    assert max(ap.staleness) <= staleness + 1
    loss0, _ = evaluate(ap.params.load_flat(ap.snapshots[0][3]), digits.train)
    loss, acc = evaluate(ap.params, digits.train)
    assert loss < loss0 - 0.02 and acc > 0.15


def test_ap_rejects_negative_staleness(digits):
    with pytest.raises(ConfigError, match="staleness"):
        run_ap(digits.train, HIDDEN, 1, CFG, workers=2, staleness=-1)


def test_whatif_sp_is_max_compute_plus_ring_and_ap_wins_with_stragglers():
    # deterministic compute: SP time is exactly iterations x (compute + two ring all-reduces)
    sp = simulate_admm_parallel(8, 0.01, 2e6, "sp", iterations=20, straggler_cv=0.0)
    ring = ring_allreduce_s(8, 1e6, 30e-6, 1.25e9)
    assert sp["time_s"] == pytest.approx(20 * (0.01 + 2 * ring))
    assert ring == pytest.approx(2 * 7 * 30e-6 + 2 * 7 / 8 * 1e6 / 1.25e9)
    # stragglers: SP waits for the slowest of 16 draws every iteration, AP only within its bound
    kwargs = {"iterations": 100, "straggler_cv": 0.5, "seed": 3}
    sp = simulate_admm_parallel(16, 0.01, 2e5, "sp", **kwargs)
    ap = simulate_admm_parallel(16, 0.01, 2e5, "ap", staleness=2, **kwargs)
    assert ap["iterations_per_s"] > 1.2 * sp["iterations_per_s"]
    assert ap["max_gap"] <= 3


def test_rnn_workload_matches_admm_forward_and_cuts():
    workload = get_workload("rnn-digits", hidden=12)
    layers = workload.build_layers(seed=1)
    batch = workload.make_batch(5, seed=2)
    out = run_layers(layers, batch.inputs)
    assert out.shape == (5, 10)
    # the pipeline cut after the input projection gives the same output
    middle = run_layers(workload.build_layers(0, 1, seed=1), batch.inputs)
    assert torch.equal(run_layers(workload.build_layers(1, 3, seed=1), middle), out)
    # same weights in the ADMM formulation give the same logits
    proj, rec, head = layers
    params = RNNParams(proj.linear.weight.detach(), rec.W.weight.detach(), proj.linear.bias.detach(),
                       head.linear.weight.detach(), head.linear.bias.detach())
    _, _, o = forward(params, batch.inputs.transpose(0, 1))
    torch.testing.assert_close(o[-1], out.detach())
    assert workload.loss(out, batch.targets).ndim == 0
    tiny = get_workload("rnn-tiny")
    tiny_batch = tiny.make_batch(3)
    assert run_layers(tiny.build_layers(), tiny_batch.inputs).shape == (3, 8, 16)
    with pytest.raises(ConfigError, match="hidden"):
        get_workload("rnn-digits", inputs=9)
