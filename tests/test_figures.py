"""Paper-scale figures on reduced grids: PDF, PNG and CSV are written, with the rows expected."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from analysis.figures import (
    MERAK_VARIANTS,
    PAPER_SPEEDUP,
    STAGE_AWARE_RATIOS,
    make_figures,
    merak_figure,
    merak_spec,
    schedules_figure,
    validation_figure,
)
from traces.errors import ConfigError


def _written(paths: dict[str, Path]) -> None:
    assert paths["pdf"].read_bytes()[:5] == b"%PDF-"
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths["csv"].stat().st_size > 0


def test_merak_figure_on_two_models(tmp_path: Path) -> None:
    models = ("gpt-2.5b", "gpt-8.3b")
    figure = merak_figure(tmp_path, tmp_path / "sweeps", models=models, include_search=False, workers=2)
    _written(figure.paths)
    table = pd.read_csv(figure.paths["csv"])
    assert len(table) == len(models) * len(MERAK_VARIANTS)
    assert list(table["variant"].unique()) == list(MERAK_VARIANTS)
    assert set(table["status"]) == {"ok"}
    for model in models:
        rows = table[table["model"] == model].set_index("variant")
        # the better baseline is 1.0 by definition; the paper's number sits beside Merak (all) only
        assert rows.loc[["Megatron-LM style", "DeepSpeed style"], "speedup_over_best_baseline"].max() == 1.0
        assert rows.loc["Merak (all)", "paper_speedup"] == PAPER_SPEEDUP[model]
        assert rows["paper_speedup"].notna().sum() == 1
        assert rows.loc["stage-aware recompute", "stage_aware_ratio"] in STAGE_AWARE_RATIOS
        assert rows.loc["Megatron-LM style", "memory_policy"] == "full"
        assert rows.loc["DeepSpeed style", "partition"] == "parameters"
        assert rows.loc["Merak (all)", "schedule"] == "merak-shifted" and rows.loc["Merak (all)", "tp_overlap"] == 3
    # every stage-aware ratio was simulated (the table keeps the fastest that fits)
    assert len(merak_spec(models).points) == len(models) * (len(MERAK_VARIANTS) - 1 + len(STAGE_AWARE_RATIOS))
    assert "64 x A100-80GB" in figure.caption and "TPDS" in figure.caption


def test_schedules_figure_on_a_small_grid(tmp_path: Path) -> None:
    schedules = ("1f1b", "zb-h1", "dualpipev")
    figure = schedules_figure(tmp_path, tmp_path / "sweeps", pps=(4,), microbatches=(4, 8), schedules=schedules,
                              workers=1)
    _written(figure.paths)
    table = pd.read_csv(figure.paths["csv"])
    assert len(table) == 6 and set(table["schedule"]) == set(schedules) and set(table["pp"]) == {4}
    refused = table[table["status"] != "ok"]
    # dualpipev needs m >= 2 pp: refused at m = 4 with its reason, drawn nowhere, named in the caption
    assert list(zip(refused["schedule"], refused["m"], strict=True)) == [("dualpipev", 4)]
    assert "needs microbatches >= 2 * pp" in refused["reason"].iloc[0]
    assert "dualpipev pp4 m4" in figure.caption
    ok = table[table["status"] == "ok"].set_index(["schedule", "m"])
    # ZB-H1 idles less than 1F1B at every size, and more micro-batches shrink 1F1B's bubble
    for m in (4, 8):
        assert ok.loc[("zb-h1", m), "bubble_mean"] < ok.loc[("1f1b", m), "bubble_mean"]
    assert ok.loc[("1f1b", 8), "bubble_mean"] < ok.loc[("1f1b", 4), "bubble_mean"]


def _fake_suite(folder: Path) -> Path:
    folder.mkdir()
    pd.DataFrame({"plan": ["gpt-val-a", "gpt-val-b", "gpt-val-c"], "predicted_s": [0.30, 0.45, 0.22],
                  "measured_median_s": [0.31, 0.44, 0.25], "measured_p10_s": [0.29, 0.42, 0.23],
                  "measured_p90_s": [0.33, 0.47, 0.27], "error": [-0.03, 0.02, -0.12],
                  "steady": [True, True, False]}).to_csv(folder / "suite.csv", index=False)
    return folder


def test_validation_figure_from_a_suite_folder(tmp_path: Path) -> None:
    figure = validation_figure(tmp_path / "fig", _fake_suite(tmp_path / "suite"))
    _written(figure.paths)
    assert list(pd.read_csv(figure.paths["csv"])["plan"]) == ["gpt-val-a", "gpt-val-b", "gpt-val-c"]
    with pytest.raises(ConfigError, match="validate-suite"):
        validation_figure(tmp_path / "fig", tmp_path / "nothing-here")


def test_figures_command(tmp_path: Path) -> None:
    suite = _fake_suite(tmp_path / "suite")
    done = subprocess.run([sys.executable, "-m", "analysis.cli", "figures", "--out", str(tmp_path / "figs"),
                           "--only", "validation", "--suite", str(suite)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "figs" / "validation.png").is_file()
    assert "validation.png" in (tmp_path / "figs" / "README.md").read_text()
    assert make_figures(tmp_path / "none", only=("validation",), log=lambda _: None) == []
