"""Paper-scale figures on reduced grids: PDF, PNG and CSV are written, with the rows expected."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import analysis.figures as figures_module
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

# The README's accuracy table, as recorded by benchmarks/accuracy_table.py
ACCURACY_RECORD = Path(__file__).resolve().parents[1] / "docs" / "results" / "accuracy_table.json"


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
    # the CLI flag that left the searched bar out, not the Python argument behind it
    assert "--no-search" in figure.caption and "include_search" not in figure.caption


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
    # the model's accuracy as the README's table states it (its recorded output), not a stale figure
    sc21 = next(row for row in json.loads(ACCURACY_RECORD.read_text()) if row["group"] == "sc21")
    assert f"MAPE {sc21['mape']:.1%}" in figure.caption and "SC'21" in figure.caption
    assert "uncalibrated" not in figure.caption and "9.6%" not in figure.caption


def test_the_accuracy_in_captions_is_read_when_drawn(tmp_path: Path) -> None:
    record = tmp_path / "accuracy_table.json"
    record.write_text(json.dumps([{"group": "sc21", "check": "at scale, never fitted", "rows": 10, "mape": 0.123,
                                   "median": 0.1, "max": 0.2}]))
    assert "MAPE 12.3% (median 10.0%, max 20.0%)" in figures_module.a100_accuracy(record)
    assert "README" in figures_module.a100_accuracy(tmp_path / "missing.json")  # an installed copy: no docs/


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


def _write_suite(folder: Path, text: str) -> Path:
    folder.mkdir()
    (folder / "suite.csv").write_text(text)
    return folder


HEADER = "plan,predicted_s,measured_median_s,measured_p10_s,measured_p90_s,error\n"


def test_a_bad_suite_file_is_refused_naming_the_row_and_column(tmp_path: Path) -> None:
    bad = _write_suite(tmp_path / "bad", HEADER + "x,0.3,0.31,0.29,0.33,0.1\ny,abc,1,1,1,0.1\n")
    with pytest.raises(ConfigError, match=r"--suite: .*bad/suite.csv row 2 \(plan y\), column predicted_s: 'abc' "
                                          "is not a number"):
        validation_figure(tmp_path / "fig", bad)
    with pytest.raises(ConfigError, match="has no rows"):
        validation_figure(tmp_path / "fig", _write_suite(tmp_path / "empty", HEADER))
    assert not (tmp_path / "fig").exists()
    # through the command: one line, exit 2, no traceback (a TypeError / ValueError traceback, exit 1 before)
    done = subprocess.run([sys.executable, "-m", "analysis.cli", "figures", "--out", str(tmp_path / "figs"),
                           "--only", "validation", "--suite", str(bad)], capture_output=True, text=True, timeout=300)
    said = (done.stdout + done.stderr).strip()
    assert done.returncode == 2 and len(said.splitlines()) == 1, said
    assert said.startswith("error: --suite:") and "column predicted_s" in said


def test_a_plan_without_a_measurement_is_said_not_counted(tmp_path: Path) -> None:
    suite = _write_suite(tmp_path / "suite", HEADER + "gpt-val-a,0.3,0.31,0.29,0.33,0.03\ngpt-val-b,0.4,,,,\n")
    figure = validation_figure(tmp_path / "fig", suite)
    assert "Not drawn, no prediction or measurement: gpt-val-b." in figure.caption
    assert len(pd.read_csv(figure.paths["csv"])) == 2  # the data keeps both rows


def test_validation_labels_do_not_overprint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three plans within 2 ms of each other (as pp2-swap, -gpipe and -1f1b in the committed figure)."""
    boxes = []
    save = figures_module._save

    def measure(fig, *args, **kwargs):  # noqa: ANN001, ANN202 - the figure before _save closes it
        renderer = fig.canvas.get_renderer()
        boxes.extend(text.get_window_extent(renderer) for text in fig.axes[0].texts)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(figures_module, "_save", measure)
    suite = _write_suite(tmp_path / "suite", HEADER + "".join(
        f"gpt-val-pp2-{name},{p},{m},{m - 0.01},{m + 0.02},0.0\n"
        for name, p, m in [("swap", 0.330, 0.3512), ("gpipe", 0.334, 0.3428), ("1f1b", 0.3285, 0.3410),
                           ("dp2", 0.285, 0.278), ("big", 0.605, 0.611)]))
    validation_figure(tmp_path / "fig", suite)
    assert len(boxes) == 5
    overlaps = [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]
    assert not overlaps


def test_spread_keeps_neighbours_apart_around_where_they_were() -> None:
    assert figures_module.spread([1.0, 1.0, 1.0], 1.0) == [0.0, 1.0, 2.0]
    assert figures_module.spread([3.0, 1.0, 2.5], 1.0) == [3.25, 1.0, 2.25]
    assert figures_module.spread([0.0, 10.0], 1.0) == [0.0, 10.0]


def test_arguments_are_checked_before_any_search(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--workers 0 and an unwritable --out were refused after the Merak searches (65 s); a bad --sweeps
    was reported as --out."""
    def no_work(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(figures_module, "searched_points", no_work)
    monkeypatch.setattr(figures_module, "run_sweep", no_work)
    with pytest.raises(ConfigError, match="--workers"):
        make_figures(tmp_path / "a", workers=0, log=lambda _: None)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="^--out: "):
        make_figures(a_file / "figs", log=lambda _: None)
    with pytest.raises(ConfigError, match="^--sweeps: .*file"):
        make_figures(tmp_path / "b", sweeps=a_file, only=("schedules",), log=lambda _: None)
    bad = _write_suite(tmp_path / "bad", HEADER)
    with pytest.raises(ConfigError, match="^--suite: "):
        make_figures(tmp_path / "c", suite=bad, log=lambda _: None)


def test_only_keeps_the_other_figures_captions(tmp_path: Path) -> None:
    """A --only run rewrote DIR/README.md with its own caption alone; the other figures stay in DIR,
    so their captions stay too (a figure no longer in DIR loses its caption)."""
    out = tmp_path / "figs"
    out.mkdir()
    (out / "merak.png").write_bytes(b"png")
    (out / "README.md").write_text("# Figures\n\n## merak\n\n![merak](merak.png)\n\nMerak caption, 64 x A100.\n\n"
                                   "## schedules\n\n![schedules](schedules.png)\n\nGone caption.\n")
    make_figures(out, suite=_fake_suite(tmp_path / "suite"), only=("validation",), log=lambda _: None)
    index = (out / "README.md").read_text()
    assert "## merak" in index and "Merak caption, 64 x A100." in index and "## validation" in index
    assert "Gone caption" not in index
    assert index.index("## merak") < index.index("## validation")
    make_figures(out, suite=tmp_path / "suite", only=("validation",), log=lambda _: None)
    assert (out / "README.md").read_text() == index  # a rerun keeps the index as it is


def test_figures_command(tmp_path: Path) -> None:
    suite = _fake_suite(tmp_path / "suite")
    done = subprocess.run([sys.executable, "-m", "analysis.cli", "figures", "--out", str(tmp_path / "figs"),
                           "--only", "validation", "--suite", str(suite)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "figs" / "validation.png").is_file()
    index = (tmp_path / "figs" / "README.md").read_text()
    assert "validation.png" in index
    # --only validation without --suite draws nothing: refused in one line, the index left as it was
    # (it exited 0 and emptied README.md)
    done = subprocess.run([sys.executable, "-m", "analysis.cli", "figures", "--out", str(tmp_path / "figs"),
                           "--only", "validation"], capture_output=True, text=True, timeout=300)
    said = (done.stdout + done.stderr).strip()
    assert done.returncode == 2 and said.startswith("error: --suite:") and len(said.splitlines()) == 1, said
    assert (tmp_path / "figs" / "README.md").read_text() == index
