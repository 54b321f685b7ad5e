"""ADMMiRNN: serial convergence on real digits, robustness to a x0.01 initialisation, SP == serial
and one-worker AP == serial (local-first order) over real gloo ranks, AP converges, the data
splits, the what-if's SP/AP throughput, and the RNN workload's layers."""

from __future__ import annotations

import math

import pytest
import torch

from exec.admm.data import load_task
from exec.admm.parallel import run_ap, run_sp
from exec.admm.rnn_admm import ADMMConfig, RNNParams, evaluate, forward, init_params, train_admm
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
    params, history = train_admm(digits.train, HIDDEN, 30, CFG, seed=0, validation=digits.validation)
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


def test_constraint_residuals_shrink(digits):
    # Without re-anchoring the auxiliary variables persist across iterations and ADMM must close
    # the constraints. (With it, a, s, o restart at the forward pass every iteration, and the
    # residuals measure one iteration's move instead.)
    _, history = train_admm(digits.train, HIDDEN, 30, ADMMConfig(reanchor=False), seed=0)
    for key in ("residual_a", "residual_s", "residual_o"):
        early = max(row[key] for row in history[1:6])
        late = max(row[key] for row in history[-5:])
        assert early > 0 and late < 0.6 * early, key  # measured 0.54 (r_a) in 30 iterations


def test_admm_beats_chance_on_held_out_digits(serial_run, digits):
    params, history = serial_run
    loss, acc = evaluate(params, digits.validation)
    assert acc == pytest.approx(history[-1]["val_acc"])
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


def test_small_initialisation_no_longer_diverges(digits):
    # Before issue 15 (step 1/Lipschitz, no re-anchoring) a x0.01 start sent V to O(1/|s|) in the
    # first iterations and the weights' loss rose from 2.30 to 30+ while the Lagrangian fell.
    before = ADMMConfig(theta_w=0.0, reanchor=False, sweep="forward")
    _, old = train_admm(digits.train, HIDDEN, 15, before, seed=0, init_scale=0.01)
    assert max(row["train_loss"] for row in old) > 5.0  # the failure this test guards against
    _, new = train_admm(digits.train, HIDDEN, 15, CFG, seed=0, init_scale=0.01)
    assert max(row["train_loss"] for row in new) <= new[0]["train_loss"] + 1e-6


def test_ap_one_worker_no_staleness_equals_serial_local_first(digits):
    # AP's block order is local-first (the worker's a, s, o, duals, then the server's weights);
    # with one worker and staleness 0 nothing is stale, so AP must be that serial algorithm.
    iterations, cfg = 5, ADMMConfig(sweep="local-first")
    serial, _ = train_admm(digits.train, HIDDEN, iterations, cfg, seed=0)
    ap = run_ap(digits.train, HIDDEN, iterations, cfg, workers=1, staleness=0, seed=0)
    assert float((ap.params.flat() - serial.flat()).abs().max()) < 1e-9
    assert float((ap.params.flat() - ap.snapshots[0][3]).abs().max()) > 1e-3
    # and the paper's forward order is a different algorithm: it does not give the same weights
    forward_order, _ = train_admm(digits.train, HIDDEN, iterations, CFG, seed=0)
    assert float((ap.params.flat() - forward_order.flat()).abs().max()) > 1e-3


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="sweep"):
        ADMMConfig(sweep="sideways")
    with pytest.raises(ConfigError, match="rho_o"):
        ADMMConfig(rho_o=0.0)
    with pytest.raises(ConfigError, match="init_scale"):
        init_params(8, 4, 10, init_scale=0.0)
    with pytest.raises(ConfigError, match="task"):
        load_task("imdb")


def test_splits_are_disjoint_and_text_source_is_balanced(digits):
    total = digits.train.samples + digits.validation.samples + digits.test.samples
    assert total == 1797 and digits.validation.samples == 270
    rows = {tuple(x.flatten().tolist()) for x in digits.validation.x.transpose(0, 1)}
    assert not rows & {tuple(x.flatten().tolist()) for x in digits.test.x.transpose(0, 1)}
    text = load_task("text-source", seed=0, train_sequences=40, validation_sequences=10, test_sequences=20)
    assert text.train.x.shape == (32, 40, 28) and text.train.num_classes == 2
    for split in (text.train, text.validation, text.test):
        assert 2 * int(split.y.sum()) == split.samples  # as many Shakespeare as Wikipedia windows
        assert torch.equal(split.x.sum(-1), torch.ones(split.x.shape[:2], dtype=split.x.dtype))  # one-hot


def test_suite_chooses_on_validation_accuracy_and_nan_loses():
    import pandas as pd

    from analysis.admm_suite import choose

    tuning = pd.DataFrame([
        {"method": "sgd", "setting": '{"lr": 0.1}', "val_acc": 0.80, "val_loss": 0.5},
        {"method": "sgd", "setting": '{"lr": 3.0}', "val_acc": float("nan"), "val_loss": float("nan")},
        {"method": "sgd", "setting": '{"lr": 0.3}', "val_acc": 0.90, "val_loss": 0.4},
        {"method": "admm", "setting": '{"rho_o": 0.3, "theta_w": 0.1}', "val_acc": 0.85, "val_loss": 0.6},
        {"method": "admm", "setting": '{"rho_o": 0.1, "theta_w": 0.1}', "val_acc": 0.85, "val_loss": 0.5},
    ])
    chosen = choose(tuning)
    assert chosen["sgd"] == 0.3
    assert chosen["admm"] == ADMMConfig(rho_o=0.1, theta_w=0.1)  # tie on accuracy: lower loss wins


def test_edge_widens_past_the_chosen_edge_and_stops_when_interior(tmp_path):
    import pandas as pd

    from analysis.admm_followup import edge
    from analysis.admm_grid import grid, ladder_step, widened

    assert [ladder_step(v, down=True) for v in (0.1, 0.03, 0.3)] == [0.03, 0.01, 0.1]
    assert [ladder_step(v, down=False) for v in (0.1, 0.03, 0.3)] == [0.3, 0.1, 1.0]
    assert widened({0.1, 0.3}, 0.1) == {0.03, 0.1, 0.3} and widened({0.03, 0.1, 0.3}, 0.1) == {0.03, 0.1, 0.3}
    # every point already tuned, the best (rho_o 0.1, theta_w 0.03) at the suite grid's corner: one
    # widening makes it interior, nothing runs, and the choice did not move (no comparison); the
    # baselines' starting grids have interior choices, so they run nothing either
    wide = grid({"rho_o": {0.03, 0.1, 0.3}, "theta_w": {0.01, 0.03, 0.1}},
                ADMMConfig(rho_o=0.1, theta_w=0.03, sweep="backward-forward"))
    from analysis.admm_suite import _describe

    rows = [{"task": "digits", "method": "admm", "setting": _describe(c), "iterations": 300,
             "val_acc": 0.9 if (c.rho_o, c.theta_w) == (0.1, 0.03) else 0.5, "val_loss": 1.0, "train_loss": 1.0,
             "max_train_loss": 1.0, "seconds": 0.0} for c in wide]
    rows += [{"task": "digits", "method": method, "setting": _describe(lr), "iterations": 300,
              "val_acc": 0.9 if lr == best else 0.5, "val_loss": 1.0, "train_loss": 1.0, "max_train_loss": 1.0,
              "seconds": 0.0}
             for method, lrs, best in (("sgd", (0.1, 0.3, 1.0), 0.3), ("adam", (0.003, 0.01, 0.03), 0.01))
             for lr in lrs]
    pd.DataFrame(rows).to_csv(tmp_path / "tuning_digits.csv", index=False)
    tuning = edge(tmp_path, seeds=1)
    assert tuning.reused.all() and len(tuning) == 9
    assert not (tmp_path / "comparison_digits_wide.csv").exists()
    assert set(pd.read_csv(tmp_path / "tuning_digits_wide.csv").method) == {"sgd", "adam", "admm"}


def test_the_same_widening_rule_applies_to_the_baselines_learning_rates():
    """A baseline whose choice sits on its grid's edge is widened one rung at a time until interior;
    ADMM's two axes go through the same function."""
    import pandas as pd

    from analysis.admm_grid import widen
    from analysis.admm_suite import START_GRIDS, _describe

    ran: list[float] = []

    def run_lr(lr: float) -> dict:  # validation accuracy peaks at lr 3 (the grid stops at 1)
        ran.append(lr)
        return {"method": "sgd", "setting": _describe(lr), "val_acc": 1.0 - abs(math.log10(lr / 3.0)),
                "val_loss": 1.0}

    rows, chosen = widen("sgd", START_GRIDS["sgd"], pd.DataFrame(), run_lr)
    assert chosen == 3.0 and ran == [0.1, 0.3, 1.0, 3.0, 10.0] and len(rows) == 5
    # reusing the rows runs nothing and chooses the same; a known row of another method is not reused
    ran.clear()
    other = rows.assign(method="adam")
    again, chosen_again = widen("sgd", START_GRIDS["sgd"], pd.concat([rows, other]), run_lr)
    assert ran == [] and chosen_again == 3.0 and again.reused.all()

    def run_cfg(cfg: ADMMConfig) -> dict:  # peaks at the grid's (0.3, 0.1) corner: one step past both
        return {"method": "admm", "setting": _describe(cfg), "val_loss": 1.0,
                "val_acc": 1.0 - abs(math.log10(cfg.rho_o / 0.3)) - abs(math.log10(cfg.theta_w / 0.1))}

    admm_rows, cfg = widen("admm", START_GRIDS["admm"], pd.DataFrame(), run_cfg)
    assert (cfg.rho_o, cfg.theta_w) == (0.3, 0.1) and len(admm_rows) == 9  # {0.1,0.3,1} x {0.03,0.1,0.3}


def test_task_settings_are_the_validation_choices_of_the_committed_widened_grids():
    """TASK_SETTINGS (what ``paratwin admm`` runs) must be what the suite chose on its widened grids
    (docs/results/admm/tuning_<task>_wide.csv), for every method and task."""
    from pathlib import Path

    import pandas as pd

    from analysis.admm_experiment import TASK_SETTINGS
    from analysis.admm_grid import choose

    results = Path(__file__).resolve().parents[1] / "docs" / "results" / "admm"
    for task, settings in TASK_SETTINGS.items():
        chosen = choose(pd.read_csv(results / f"tuning_{task}_wide.csv"))
        admm = chosen["admm"]
        assert isinstance(admm, ADMMConfig)
        assert (chosen["sgd"], chosen["adam"], admm.rho_o, admm.theta_w) == (
            settings["sgd_lr"], settings["adam_lr"], settings["rho_o"], settings["theta_w"]), task



def test_the_experiment_figures_say_what_ran_and_what_cv_is(tmp_path, saved_figures):
    """admm_<task>_parallel had no title (task, ranks, machine); the what-if's legend said "cv" unexplained."""
    import pandas as pd

    from analysis.admm_experiment import _plot

    steps = 3
    history = [{"method": m, "iteration": i, "data_passes": float(i), "time_s": 0.1 * i, "train_loss": 2.0 / (i + 1),
                "val_acc": 0.1 * i, "residual_a": 1.0 / (i + 1), "residual_s": 1.0, "residual_o": 1.0,
                **{f"grad_s{t + 1}": 1.0 + t for t in range(steps)}}
               for m in ("admm-serial", "sgd", "adam", "admm-sp", "admm-ap") for i in range(3)]
    whatif = pd.DataFrame([{"straggler_cv": cv, "mode": mode, "workers": n, "iterations_per_s": 10.0 / n}
                           for cv in (0.0, 0.3) for mode in ("sp", "ap") for n in (2, 4)])
    _plot(pd.DataFrame(history), whatif, "digits", steps, tmp_path, workers=2, staleness=2)
    from tests.conftest import said

    assert "digits" in said(saved_figures["admm_digits_parallel"])
    assert "2 gloo ranks" in said(saved_figures["admm_digits_parallel"])
    assert "cv: std / mean of a worker's compute" in said(saved_figures["admm_digits_whatif"])
