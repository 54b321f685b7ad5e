"""The ADMM suite reuses a run's row only for a run of the same length: a row of another iteration
count is run again (``compare``), and a directory of other-length rows is refused with a
ConfigError rather than reused or overwritten (a ``--quick`` run into a folder of full runs)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from analysis.admm_suite import TASK_PLANS, compare, run_admm_suite, tuned
from exec.admm.data import load_task
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
    from pathlib import Path

    from analysis.admm_suite import check_iterations

    results = Path(__file__).resolve().parents[1] / "docs" / "results" / "admm"
    check_iterations(results, {task: plan.iterations for task, plan in TASK_PLANS.items()})
    with pytest.raises(ConfigError):
        check_iterations(results, {"digits": 3})
