"""The validation suite's CLIs and scripts answer bad input as `paratwin` does: one ``error:`` line on
stderr, status 2, no traceback (analysis.report.run_cli)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [
    ["-m", "analysis.validation_suite", "--plans", "{missing}/plan.json"],
    [str(ROOT / "scripts" / "suite_ranking.py"), "--out", "{tmp}/ranking", "{missing}"],
    [str(ROOT / "scripts" / "suite_repredict.py"), "{missing}"],
    ["-m", "analysis.rounds", "orders", "{missing}", "a", "b", "--rounds", "2", "--iterations", "3"],
    ["-m", "analysis.validate", "profile", "{missing}/plan.yaml", "--out", "{tmp}/val"],
], ids=["validation_suite", "suite_ranking", "suite_repredict", "rounds_orders", "validate_profile"])
def test_bad_input_is_one_line_with_status_2(command: list[str], tmp_path: Path) -> None:
    args = [a.format(missing=tmp_path / "missing", tmp=tmp_path) for a in command]
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert str(tmp_path / "missing") in lines[0]
    assert not done.stdout.strip(), done.stdout  # nothing else: no orders drawn for a folder that is not there
