"""scripts/probe_recv_cpu.py reads its options as docs/host_cpu.md and its docstring write them
(``--rounds 10 --repeats 40 --out DIR``): it once read only ``--rounds=10``, and silently measured the
default 5 x 20 for the documented spelling."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from tests.script_module import load_script


def test_documented_options_reach_the_measurement(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    probe = load_script("scripts/probe_recv_cpu.py")
    asked: list[tuple[int, int]] = []

    def fake_measure(rounds: int, repeats: int) -> pd.DataFrame:
        asked.append((rounds, repeats))
        raise SystemExit(0)  # stop before any process starts: the arguments are the point

    monkeypatch.setattr(probe, "measure", fake_measure)
    with pytest.raises(SystemExit):
        probe.main(["--rounds", "10", "--repeats", "40", "--out", str(tmp_path / "probe")])
    assert asked == [(10, 40)]


def test_a_misspelt_option_is_an_error_not_ignored(capsys: pytest.CaptureFixture[str]) -> None:
    probe = load_script("scripts/probe_recv_cpu.py")
    with pytest.raises(SystemExit) as stop:
        probe.main(["--round", "10"])
    assert stop.value.code == 2 and "--round" in capsys.readouterr().err
