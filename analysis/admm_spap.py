"""The SP/AP table over tasks and seeds: ``run_admm_experiment`` (serial ADMMiRNN, SP and AP with
real gloo ranks, full-batch SGD and Adam, the test split read once per method and run) for every
task and seed, gathered into one table of mean +- std (docs/admm.md, "One task with SP, AP and the
what-if").

Every run uses the suite's iteration count for its task (``TASK_PLANS``: digits 300, Shakespeare and
text-source 40), the validated serial setting for serial and SP (``TASK_SETTINGS``) and AP's own
validation choice (``AP_SETTINGS``). A run's full output (curves, what-if, figures) goes to
``<runs>/<task>-seed<seed>/``; a run whose summary there records the same task, seed, length,
workers, staleness and settings is not run again (so a long table can be built seed by seed); any
other run is. The committed part: ``<out>/admm_<task>_seed<seed>_summary.json`` (each run's final
numbers), ``spap_runs.csv`` (one row per task, seed and method), ``spap_table.csv`` (mean, std and
count per task and method), ``spap.md``, and the figure ``admm_spap.{png,pdf}`` in ``figures``
(default: ``out``; a run of other lengths than the suite's says so in the figure's title and draws it
beside its table only).

Run: ``python -m analysis.admm_spap --seeds 3 --out docs/results/admm/spap --figures docs/figures``
(``paratwin admm-spap`` is the same; without ``--out`` and ``--figures`` both write to
``runs/admm-spap/table``).
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from traces.errors import ConfigError

from .admm_experiment import AP_SETTINGS, TASK_SETTINGS, run_admm_experiment, run_configs
from .admm_suite import TASK_PLANS, _mean_std, check_smoke_figures, run_length, smoke_note

METHODS = ("admm-serial", "admm-sp", "admm-ap", "sgd", "adam")  # the table's row order
VALUES = ("train_loss", "val_acc", "test_acc", "time_s")
WORKERS, STALENESS = 2, 2  # paratwin admm's defaults


def expected(task: str, seed: int, iterations: int, workers: int, staleness: int) -> dict[str, object]:
    """What a run's summary must record to be reused: the fields ``run_admm_experiment`` writes,
    with its default settings for ``task`` (JSON round-tripped, as the summary stores them)."""
    cfg, ap_cfg = run_configs(task)
    return json.loads(json.dumps({
        "task": task, "seed": seed, "iterations": iterations, "workers": workers, "staleness": staleness,
        "admm_config": vars(cfg), "ap_admm_config": vars(replace(ap_cfg, sweep="local-first")),
        "settings": TASK_SETTINGS[task]}))


def _summary(run_dir: Path, task: str) -> dict | None:
    path = run_dir / f"admm_{task}_summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _matches(summary: dict | None, want: dict[str, object]) -> bool:
    return summary is not None and all(summary.get(k) == v for k, v in want.items())


def one_run(task: str, seed: int, runs_dir: Path, iterations: int | None = None,
            workers: int = WORKERS, staleness: int = STALENESS, figures: bool = True) -> tuple[dict, bool]:
    """The summary of ``task`` at ``seed`` (run now unless ``runs_dir`` holds the same run);
    returns it and whether it was reused."""
    its = run_length(TASK_PLANS[task], iterations)
    run_dir = Path(runs_dir) / f"{task}-seed{seed}"
    want = expected(task, seed, its, workers, staleness)
    summary = _summary(run_dir, task)
    if summary is not None and _matches(summary, want):
        return summary, True
    print(f"{task} seed {seed}: {its} iterations, AP {want['ap_admm_config']}", flush=True)
    run_admm_experiment(task, its, run_dir, seed=seed, workers=workers, staleness=staleness, figures=figures)
    return _summary(run_dir, task) or {}, False


def rows_of(summary: dict, reused: bool) -> list[dict[str, object]]:
    """One table row per method of a run's summary."""
    return [{"task": summary["task"], "seed": summary["seed"], "method": method,
             "iterations": summary["iterations"], "workers": summary["workers"],
             "staleness": summary["staleness"], "reused": reused,
             **{k: summary["final"][method][k] for k in VALUES},
             "data_passes": summary["final"][method]["data_passes"],
             "ap_max_clock_gap": summary["ap_max_clock_gap"] if method == "admm-ap" else None}
            for method in METHODS]


def table(runs: pd.DataFrame) -> pd.DataFrame:
    """Mean, std (0 for one seed) and count of every value per task and method, in ``METHODS`` order."""
    parts = []
    for value in VALUES:
        stats = _mean_std(runs, ["task", "method"], value)
        parts.append(stats.rename(columns={"mean": f"{value}_mean", "std": f"{value}_std", "count": "seeds"}))
    out = parts[0]
    for part in parts[1:]:
        out = out.merge(part, on=["task", "method", "seeds"])
    order = {m: i for i, m in enumerate(METHODS)}
    tasks = {t: i for i, t in enumerate(dict.fromkeys(runs.task))}
    return out.sort_values(["task", "method"], key=lambda col: col.map(tasks if col.name == "task" else order),
                           ignore_index=True)


def markdown(stats: pd.DataFrame, runs: pd.DataFrame) -> str:
    lines = ["# SP/AP table (generated by `python -m analysis.admm_spap`)", "",
             "Mean +- std over seeds; 2 workers, AP staleness 2; serial and SP with the task's validated "
             "serial setting, AP with its own (`AP_SETTINGS`), SGD and Adam with theirs (`TASK_SETTINGS`); "
             "test split read once per method and run. Seconds are wall time on a loaded 2-core CPU "
             "(not a timing result).", "",
             "| task (iterations) | method | seeds | training loss | validation acc | test acc | seconds |",
             "|---|---|---|---|---|---|---|"]
    for row in stats.itertuples():
        its = int(runs[runs.task == row.task].iterations.iloc[0])
        lines.append(f"| {row.task} ({its}) | {row.method} | {row.seeds} "
                     f"| {row.train_loss_mean:.3f} +- {row.train_loss_std:.3f} "
                     f"| {row.val_acc_mean:.3f} +- {row.val_acc_std:.3f} "
                     f"| {row.test_acc_mean:.3f} +- {row.test_acc_std:.3f} "
                     f"| {row.time_s_mean:.1f} +- {row.time_s_std:.1f} |")
    return "\n".join(lines) + "\n"


def plot(stats: pd.DataFrame, fig_dir: Path, smoke: str = "") -> None:
    """Test accuracy per task and method, mean +- std over seeds (bars); ``smoke`` heads the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(stats.task))
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    width = 0.8 / len(METHODS)
    for i, method in enumerate(METHODS):
        part = stats[stats.method == method].set_index("task")
        xs = [t + (i - (len(METHODS) - 1) / 2) * width for t in range(len(tasks))]
        ax.bar(xs, [part.loc[t, "test_acc_mean"] for t in tasks], width,
               yerr=[part.loc[t, "test_acc_std"] for t in tasks], capsize=3, label=method)
    seeds = ", ".join(sorted({str(n) for n in stats.seeds}))
    ax.set_xticks(range(len(tasks)), tasks)
    title = ("Serial, SP and AP ADMMiRNN vs SGD and Adam\n2 gloo ranks (AP: +1 server, staleness 2) on one "
             "2-core CPU;\nfloat64, full batch; settings chosen on validation; test read once per run")
    ax.set(ylabel=f"test accuracy (mean +- std, {seeds} seeds)", title=(f"{smoke}\n" if smoke else "") + title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    for suffix in ("png", "pdf"):
        fig.savefig(fig_dir / f"admm_spap.{suffix}", dpi=130, bbox_inches="tight")
    plt.close(fig)


def run_spap(tasks: tuple[str, ...], seeds: int, out_dir: Path, runs_dir: Path, fig_dir: Path | None = None,
             iterations: int | None = None, run_figures: bool = True) -> pd.DataFrame:
    """Every task at seeds ``0..seeds-1``; writes the table files (module docstring); returns the stats.
    ``run_figures=False``: no per-run figures in ``runs_dir`` (the table's figure is drawn either way)."""
    unknown = [t for t in tasks if t not in TASK_PLANS]
    if unknown:
        raise ConfigError("tasks", f"unknown task(s) {unknown}", f"use any of {', '.join(TASK_PLANS)}")
    if seeds < 1:
        raise ConfigError("seeds", f"{seeds} seeds", "use at least 1")
    out_dir, runs_dir = Path(out_dir), Path(runs_dir)
    fig_dir = out_dir if fig_dir is None else Path(fig_dir)
    check_smoke_figures(out_dir, fig_dir, any(run_length(TASK_PLANS[t], iterations) != TASK_PLANS[t].iterations
                                              for t in tasks))
    for folder in (out_dir, runs_dir, fig_dir):
        folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for task in tasks:
        for seed in range(seeds):
            summary, reused = one_run(task, seed, runs_dir, iterations, figures=run_figures)
            shutil.copyfile(runs_dir / f"{task}-seed{seed}" / f"admm_{task}_summary.json",
                            out_dir / f"admm_{task}_seed{seed}_summary.json")
            rows += rows_of(summary, reused)
    runs = pd.DataFrame(rows)
    runs.to_csv(out_dir / "spap_runs.csv", index=False)
    stats = table(runs)
    stats.to_csv(out_dir / "spap_table.csv", index=False)
    (out_dir / "spap.md").write_text(markdown(stats, runs))
    plot(stats, fig_dir, smoke_note(runs))
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASK_PLANS), choices=tuple(TASK_PLANS))
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    parser.add_argument("--out", type=Path, default=Path("runs/admm-spap/table"),
                        help="the table files (the committed ones: docs/results/admm/spap)")
    parser.add_argument("--runs", type=Path, default=Path("runs/admm-spap"),
                        help="every run's full output (curves, what-if, figures)")
    parser.add_argument("--figures", type=Path, default=None, help="admm_spap.{png,pdf} (default: --out)")
    parser.add_argument("--iterations", type=int, default=None, help="override the suite's (smoke runs only)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    stats = run_spap(tuple(args.tasks), args.seeds, args.out, args.runs, args.figures, args.iterations)
    print(markdown(stats, pd.read_csv(args.out / "spap_runs.csv")))
    print(f"AP settings: {AP_SETTINGS}")


if __name__ == "__main__":
    main()
