"""AP-ADMMiRNN tuned on its own for every task (``analysis.admm_followup ap --task``), its ranking
noise (``--repeats``), ``AP_SETTINGS`` for every task, and the SP/AP table over tasks and seeds
(``analysis.admm_spap``). The AP runs here are real (gloo ranks), 2 iterations each."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch

from analysis.admm_experiment import AP_SETTINGS, TASK_SETTINGS, run_configs
from analysis.admm_followup import ap, ap_repeats, distinguishable
from analysis.admm_grid import axes, choose, describe, grid, widened
from analysis.admm_suite import TASK_PLANS
from exec.admm.rnn_admm import ADMMConfig
from traces.errors import ConfigError

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "admm"
TEXT_VALIDATION = 128  # text-source's validation windows (digits has 270): a real run's accuracy is k/128


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


def _row(task: str, cfg: ADMMConfig, val_acc: float, iterations: int = 2) -> dict:
    return {"task": task, "method": "admm-ap", "setting": describe(cfg), "iterations": iterations, "workers": 2,
            "staleness": 2, "train_loss": 1.0, "max_train_loss": 1.0, "val_loss": 1.0 - val_acc,
            "val_acc": val_acc, "seconds": 0.0}


def test_ap_tuning_runs_on_the_given_task(tmp_path):
    """``ap(task="text-source")`` widens AP's grid on text-source's data and writes its own file: of a
    3 x 3 grid whose centre is best, the one missing point runs (a real AP run on text-source)."""
    centre = ADMMConfig(rho_o=0.1, theta_w=0.1, sweep="local-first")
    points = grid({"rho_o": {0.03, 0.1, 0.3}, "theta_w": {0.03, 0.1, 0.3}}, centre)
    missing = replace(centre, rho_o=0.3, theta_w=0.3)
    rows = [_row("text-source", c, 1.0 if c == centre else 0.5) for c in points if c != missing]
    pd.DataFrame(rows).to_csv(tmp_path / "tuning_text-source_ap.csv", index=False)
    table, chosen = ap(tmp_path, "text-source", iterations=2)
    assert chosen == centre and len(table) == 9
    ran = table[~table.reused]
    assert list(ran.setting) == [describe(missing)]
    assert set(table.task) == {"text-source"} and set(table.iterations) == {2}
    assert float(ran.val_acc.iloc[0] * TEXT_VALIDATION).is_integer()  # scored on text-source's validation
    assert not (tmp_path / "tuning_digits_ap.csv").exists()
    with pytest.raises(ConfigError, match="task"):
        ap(tmp_path, "mnist", iterations=2)


def test_ap_repeats_rerun_the_choice_and_the_runner_up(tmp_path):
    """The chosen setting and the runner-up, each re-run ``repeats`` times; a repeat already in the
    repeats file is kept (here the choice's), the runner-up's runs for real."""
    best = ADMMConfig(rho_o=0.1, theta_w=0.1, sweep="local-first")
    second = replace(best, rho_o=0.3)
    rows = [_row("text-source", best, 0.6), _row("text-source", second, 0.55),
            _row("text-source", replace(best, theta_w=0.3), 0.5)]
    pd.DataFrame(rows).to_csv(tmp_path / "tuning_text-source_ap.csv", index=False)
    kept = _row("text-source", best, 0.58) | {"rank": 0, "repeat": 1}
    pd.DataFrame([kept]).to_csv(tmp_path / "tuning_text-source_ap_repeats.csv", index=False)
    runs = ap_repeats(tmp_path, "text-source", repeats=1, iterations=2)
    assert list(zip(runs["rank"], runs.repeat, strict=True)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert list(runs.setting) == [describe(best)] * 2 + [describe(second)] * 2
    assert runs.val_acc.iloc[1] == 0.58  # kept, not re-run
    assert float(runs.val_acc.iloc[3] * TEXT_VALIDATION).is_integer()  # a real run on text-source
    assert pd.read_csv(tmp_path / "tuning_text-source_ap_repeats.csv").shape[0] == 4


def test_distinguishable_needs_the_choice_above_every_runner_up_run():
    runs = pd.DataFrame({"rank": [0, 0, 1, 1], "val_acc": [0.60, 0.58, 0.55, 0.57]})
    assert distinguishable(runs)
    assert not distinguishable(runs.assign(val_acc=[0.60, 0.56, 0.55, 0.57]))


def test_ap_settings_are_aps_own_validation_choice_on_every_task():
    """AP_SETTINGS (what ``paratwin admm`` runs AP with) must be AP's choice on its widened grid for
    every task (docs/results/admm/tuning_<task>_ap.csv), at the task's suite length, 2 workers,
    staleness 2, and interior to the grid."""
    assert set(AP_SETTINGS) == set(TASK_PLANS) == set(TASK_SETTINGS)
    for task, plan in TASK_PLANS.items():
        tuning = pd.read_csv(RESULTS / f"tuning_{task}_ap.csv")
        assert set(tuning.task) == {task}
        assert set(tuning.iterations) == {plan.iterations}, task
        assert set(tuning.workers) == {2} and set(tuning.staleness) == {2}
        chosen = choose(tuning)["admm-ap"]
        assert isinstance(chosen, ADMMConfig) and chosen.sweep == "local-first"
        assert {"rho_o": chosen.rho_o, "theta_w": chosen.theta_w} == AP_SETTINGS[task], task
        points = [axes(ADMMConfig(**json.loads(setting))) for setting in tuning.setting]
        for name in ("rho_o", "theta_w"):
            values = {point[name] for point in points}
            assert widened(values, axes(chosen)[name]) == values, (task, name)  # interior: the widening stopped


def test_run_configs_give_ap_its_own_setting_on_every_task():
    for task, settings in TASK_SETTINGS.items():
        cfg, ap_cfg = run_configs(task)
        assert (cfg.rho_o, cfg.theta_w) == (settings["rho_o"], settings["theta_w"])
        assert (ap_cfg.rho_o, ap_cfg.theta_w) == (AP_SETTINGS[task]["rho_o"], AP_SETTINGS[task]["theta_w"]), task
    override = ADMMConfig(rho_o=1.0)
    assert run_configs("digits", ap_cfg=override)[1] == override
    with pytest.raises(ConfigError, match="task"):
        run_configs("mnist")


def test_spap_table_runs_each_task_and_seed_once_and_aggregates_over_seeds(tmp_path):
    """One real run (text-source, seed 0, 1 iteration: serial, SP, AP, SGD, Adam) through the table;
    a second call reuses it; a second seed's summary (the first's, test accuracies shifted) is
    aggregated into mean +- std; a summary recorded with another AP setting is not reused."""
    from analysis.admm_spap import METHODS, _matches, expected, run_spap

    out, runs_dir = tmp_path / "spap", tmp_path / "runs"
    stats = run_spap(("text-source",), 1, out, runs_dir, iterations=1, run_figures=False)
    assert list(stats.method) == list(METHODS) and set(stats.seeds) == {1}
    first = json.loads((out / "admm_text-source_seed0_summary.json").read_text())
    assert first["seed"] == 0 and first["iterations"] == 1
    assert first["ap_admm_config"]["rho_o"] == AP_SETTINGS["text-source"]["rho_o"]
    second = json.loads(json.dumps(first)) | {"seed": 1}
    for method in METHODS:
        second["final"][method]["test_acc"] = first["final"][method]["test_acc"] + 0.1
    (runs_dir / "text-source-seed1").mkdir()
    (runs_dir / "text-source-seed1" / "admm_text-source_summary.json").write_text(json.dumps(second))
    stats = run_spap(("text-source",), 2, out, runs_dir, iterations=1, run_figures=False)  # both reused
    runs = pd.read_csv(out / "spap_runs.csv")
    assert runs.reused.all() and len(runs) == 2 * len(METHODS)
    ap_row = stats[stats.method == "admm-ap"].iloc[0]
    assert ap_row.seeds == 2
    assert ap_row.test_acc_mean == pytest.approx(first["final"]["admm-ap"]["test_acc"] + 0.05)
    assert ap_row.test_acc_std == pytest.approx(0.1 / 2 ** 0.5)
    assert (out / "spap.md").is_file() and (out / "admm_spap.png").is_file()
    want = expected("text-source", 0, 1, 2, 2)
    assert _matches(first, want)
    other_ap = json.loads(json.dumps(first))
    other_ap["ap_admm_config"]["theta_w"] = 1e-6
    assert not _matches(other_ap, want) and not _matches(first, expected("text-source", 1, 1, 2, 2))
