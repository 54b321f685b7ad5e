"""The accuracy table (benchmarks/accuracy_table.py): its checks are the benchmarks' own computations, and
the README's table is the recorded output of the script, line for line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.script_module import load_script

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "results" / "accuracy_table.json"
table = load_script("benchmarks/accuracy_table.py")


def recorded() -> list:
    return [table.Check(**entry) for entry in json.loads(RECORD.read_text())]


def test_the_readme_shows_the_recorded_table_line_for_line() -> None:
    """Each recorded check is a line of the README's table, so a number changed in one and not the other
    (or a rerun not copied over) fails here."""
    readme = (ROOT / "README.md").read_text()
    checks = recorded()
    assert {c.group for c in checks} == set(table.CHECKS)  # every check was recorded
    assert table.markdown(checks) in readme


def test_a_check_is_its_benchmarks_computation_and_the_record_is_reproducible() -> None:
    """GPT-NeoX-20B (one row, under a second): the check's error is what megatron_at_scale.py records for
    the table, and what the accuracy table recorded."""
    [neox] = table.at_scale_check("neox")
    bench = json.loads((ROOT / "docs" / "results" / "neox_20b.json").read_text())
    assert neox.mape == pytest.approx(bench["summary"]["mape"], rel=1e-12)
    [recorded_neox] = [c for c in recorded() if c.group == "neox"]
    assert neox == recorded_neox


def test_an_unknown_check_is_refused_naming_the_choices() -> None:
    with pytest.raises(SystemExit, match="no check named tabel5.*choose from sc21"):
        table.run(["tabel5"])
