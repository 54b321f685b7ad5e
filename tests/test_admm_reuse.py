"""The ADMM suite reuses a run's row only for a run of the same length: a row of another iteration
count is run again (``compare``), and a directory of other-length rows is refused with a
ConfigError rather than reused or overwritten (a ``--quick`` run into a folder of full runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import analysis.admm_suite as admm_suite
from analysis.admm_suite import TASK_PLANS, compare, run_admm_suite, tuned
from exec.admm.data import load_task
from tests.conftest import said
from traces.errors import ConfigError


@pytest.fixture(scope="module")
def digits():
    torch.set_num_threads(1)
    return load_task("digits", seed=0)


def _marked_row(iterations: int) -> dict:
    """A stored SGD comparison row with an impossible test accuracy, so reuse is visible."""
    return {"task": "digits", "method": "sgd", "seed": 0, "init_scale": 1.0, "setting": '{"lr": 1.0}',
            "iterations": iterations, "test_acc": -1.0}


def test_compare_reuses_a_row_only_at_the_same_iteration_count(digits):
    plan = TASK_PLANS["digits"]
    full = pd.DataFrame([_marked_row(plan.iterations)])  # a full run's row: not for a 2-iteration run
    rows = compare("digits", {0: digits}, plan, {"sgd": 1.0}, iterations=2, known=full)
    assert len(rows) == 1 and rows.test_acc.iloc[0] >= 0 and rows.iterations.iloc[0] == 2
    short = pd.DataFrame([_marked_row(2)])  # the same length: reused as it is
    again = compare("digits", {0: digits}, plan, {"sgd": 1.0}, iterations=2, known=short)
    assert again.test_acc.iloc[0] == -1.0
    # a table written before rows recorded their length matches nothing
    unknown = short.drop(columns="iterations")
    assert compare("digits", {0: digits}, plan, {"sgd": 1.0}, iterations=2, known=unknown).test_acc.iloc[0] >= 0


def test_a_quick_run_refuses_a_folder_of_full_runs(tmp_path, digits):
    pd.DataFrame([_marked_row(TASK_PLANS["digits"].iterations)]).to_csv(tmp_path / "comparison.csv", index=False)
    with pytest.raises(ConfigError, match="out") as err:
        run_admm_suite(tmp_path, quick=True, parts=("tasks",))
    assert "[300] iterations, this run asks 3" in str(err.value)
    # the tuning step alone (as the follow-ups call it) refuses another length's tuning rows too
    (tmp_path / "comparison.csv").unlink()
    pd.DataFrame([{"task": "digits", "method": "sgd", "setting": '{"lr": 1.0}', "iterations": 300,
                   "val_acc": 0.9, "val_loss": 0.3}]).to_csv(tmp_path / "tuning_digits.csv", index=False)
    with pytest.raises(ConfigError, match="out"):
        tuned("digits", tmp_path, digits, TASK_PLANS["digits"], iterations=3)
    # rows without an iterations column cannot be matched: refused, never silently reused
    pd.DataFrame([{"task": "digits", "method": "sgd", "setting": '{"lr": 1.0}'}]).to_csv(
        tmp_path / "comparison.csv", index=False)
    with pytest.raises(ConfigError, match="iterations column"):
        run_admm_suite(tmp_path, quick=True, parts=("tasks",))


def test_the_committed_results_record_their_iteration_counts():
    """Every reusable table under docs/results/admm says how long its runs were, and they match the
    suite's plans (a full-length rerun reuses them; a quick one is refused)."""
    from analysis.admm_suite import check_iterations

    results = Path(__file__).resolve().parents[1] / "docs" / "results" / "admm"
    check_iterations(results, {task: plan.iterations for task, plan in TASK_PLANS.items()})
    with pytest.raises(ConfigError):
        check_iterations(results, {"digits": 3})


ROOT = Path(__file__).resolve().parents[1]


def _results(folder: Path, smoke: bool) -> Path:
    """The committed suite's CSVs; ``smoke``: its comparison cut to seed 0 and marked 3 iterations long,
    as a --quick run writes it (the report part draws from the CSVs alone)."""
    folder.mkdir()
    for path in (ROOT / "docs" / "results" / "admm").glob("*.csv"):
        if path.name.startswith(("tuning_", "comparison.csv", "init_sweep", "init_curves", "ablation")):
            shutil.copyfile(path, folder / path.name)
    if smoke:
        comparison = pd.read_csv(folder / "comparison.csv")
        comparison[comparison.seed == 0].assign(iterations=3).to_csv(folder / "comparison.csv", index=False)
    return folder


def test_a_smoke_runs_figures_say_so_and_stay_beside_its_csvs(tmp_path: Path, saved_figures: dict) -> None:
    """`paratwin admm-suite --quick --out X` drew its figures into docs/figures (the default --figures),
    replacing the committed ones under the same title."""
    smoke = _results(tmp_path / "smoke", smoke=True)
    run_admm_suite(smoke, parts=("report",))
    for name in ("admm_accuracy", "admm_init_sweep"):
        assert said(saved_figures[name]).startswith("SMOKE RUN (3 iterations, 1 seed)"), said(saved_figures[name])
        assert (smoke / f"{name}.png").is_file()
    with pytest.raises(ConfigError, match="^--figures: .*elsewhere is not --out"):
        run_admm_suite(smoke, tmp_path / "elsewhere", parts=("report",))
    assert not (tmp_path / "elsewhere").exists()
    # the full suite's rows: no such line, and their figures may go to any folder asked for
    saved_figures.clear()
    run_admm_suite(_results(tmp_path / "full", smoke=False), tmp_path / "figs", parts=("report",))
    assert "SMOKE" not in said(saved_figures["admm_accuracy"]) and (tmp_path / "figs" / "admm_accuracy.png").is_file()


def test_the_command_writes_nothing_under_docs_unless_asked(tmp_path: Path) -> None:
    """Run from a folder with a docs/ of its own: the figures go under --out, not docs/figures."""
    _results(tmp_path / "smoke", smoke=True)
    done = subprocess.run([sys.executable, "-m", "analysis.cli", "admm-suite", "--out", "smoke", "--part", "report"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "smoke" / "admm_accuracy.png").is_file() and not (tmp_path / "docs").exists()


def test_a_quick_run_with_figures_elsewhere_is_refused_before_any_run(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("a run started")

    monkeypatch.setattr(admm_suite, "load_task", no_run)
    with pytest.raises(ConfigError, match="^--figures: "):
        run_admm_suite(tmp_path / "out", tmp_path / "docs-figures", quick=True)
    assert not (tmp_path / "out").exists() and not (tmp_path / "docs-figures").exists()
    from analysis.admm_spap import run_spap

    monkeypatch.setattr("analysis.admm_spap.run_admm_experiment", no_run)
    with pytest.raises(ConfigError, match="^--figures: "):
        run_spap(("digits",), 1, tmp_path / "table", tmp_path / "runs", tmp_path / "docs-figures", iterations=2)
