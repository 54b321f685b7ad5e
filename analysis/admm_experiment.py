"""ADMMiRNN experiment: ADMM vs SGD vs Adam on one RNN, SP vs AP vs serial, and a what-if at scale.

``run_admm_experiment("digits", 300, Path("runs/admm"))`` trains the same vanilla RNN (same
initial weights) with serial ADMMiRNN, full-batch SGD and full-batch Adam, runs SP-ADMMiRNN and
AP-ADMMiRNN with real gloo ranks on this machine, and feeds the measured per-worker compute time
into the simpy what-if (``sim.admm_whatif``) for 2..256 workers. It writes

* ``admm_<task>.csv``: one row per method and iteration (or weight update, for AP): training and
  validation losses and accuracies, ADMM Lagrangian and residuals, and the baselines'
  gradient-health measures;
* ``admm_whatif_<task>.csv``: simulated throughput per worker count, mode and straggler level;
* ``admm_<task>_summary.json``: final numbers of every method, with the test split evaluated
  once, on each method's final weights;
* figures ``admm_<task>_training``, ``admm_<task>_parallel``, ``admm_<task>_whatif`` (PNG + PDF).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from exec.admm.baselines import train_gradient
from exec.admm.data import TaskData, load_task
from exec.admm.parallel import ParallelResult, run_ap, run_sp
from exec.admm.rnn_admm import ADMMConfig, evaluate, init_params, summarize, train_admm
from sim.admm_whatif import simulate_admm_parallel
from traces.errors import ConfigError

# Per task: hidden size, the baselines' learning rates and ADMM's rho_o / theta_w, as chosen by the
# suite's tuning (analysis/admm_suite.py: best final validation accuracy, seed 0), every method's
# grid (SGD 0.1/0.3/1, Adam 0.003/0.01/0.03, ADMM rho_o x theta_w) widened by the same rule until
# its choice is interior (analysis/admm_grid.py; docs/results/admm/tuning_<task>_wide.csv,
# 2026-12-01; other ADMMConfig fields at their defaults); pass ``cfg`` for another. The test split
# is not used to choose anything.
TASK_SETTINGS: dict[str, dict[str, float | int]] = {
    "digits": {"hidden": 32, "sgd_lr": 1.0, "adam_lr": 0.03, "rho_o": 0.01, "theta_w": 0.003},
    "shakespeare": {"hidden": 64, "sgd_lr": 1.0, "adam_lr": 0.03, "rho_o": 0.03, "theta_w": 0.001},
    "text-source": {"hidden": 32, "sgd_lr": 0.03, "adam_lr": 0.003, "rho_o": 3.0, "theta_w": 0.1},
}
# AP-ADMMiRNN's own validation choice per task (``python -m analysis.admm_followup ap --task <task>``:
# 2 workers, staleness 2, seed 0, the suite's iterations for the task, the suite's starting ADMM
# grid widened by the same rule; docs/results/admm/tuning_<task>_ap.csv: digits 2026-12-02
# 01:51-02:02 UTC, Shakespeare and text-source 2026-12-02 10:50-11:10 UTC). AP takes one weight step
# per worker message, so the serial choice need not suit it. A task without an entry would run AP
# with the serial setting.
AP_SETTINGS: dict[str, dict[str, float]] = {
    "digits": {"rho_o": 0.1, "theta_w": 0.1},
    "shakespeare": {"rho_o": 0.1, "theta_w": 0.03},
    "text-source": {"rho_o": 3.0, "theta_w": 0.3},
}
WHATIF_WORKERS = (2, 4, 8, 16, 32, 64, 128, 256)
WHATIF_STRAGGLER_CV = (0.0, 0.3, 1.0)
WHATIF_ITERATIONS = 100  # simulated iterations per point: throughput is steady well before this
MAX_CURVE_POINTS = 400  # AP snapshots evaluated per run (one per weight update otherwise)


def _history_rows(method: str, history: list[dict[str, float]]) -> list[dict[str, object]]:
    return [{"method": method, "data_passes": float(row["iteration"]), **row} for row in history]


def _parallel_rows(method: str, result: ParallelResult, data: TaskData, hidden: int,
                   seed: int) -> list[dict[str, object]]:
    template = init_params(data.train.input_dim, hidden, data.train.num_classes, seed, data.train.x.dtype)
    stride = max(1, len(result.snapshots) // MAX_CURVE_POINTS)
    picked = sorted(set(range(0, len(result.snapshots), stride)) | {len(result.snapshots) - 1})
    rows = []
    for index in picked:
        version, time_s, passes, flat = result.snapshots[index]
        params = template.load_flat(flat)
        row: dict[str, object] = {"method": method, "iteration": version, "data_passes": passes,
                                  "time_s": time_s}
        row["train_loss"], row["train_acc"] = evaluate(params, data.train)
        row["val_loss"], row["val_acc"] = evaluate(params, data.validation)
        if index > 0:
            row.update(summarize(result.sums[index - 1]))
        rows.append(row)
    return rows


def whatif_table(compute_s: float, param_bytes: int, iterations: int, seed: int = 0,
                 workers: tuple[int, ...] = WHATIF_WORKERS,
                 straggler_cvs: tuple[float, ...] = WHATIF_STRAGGLER_CV, staleness: int = 2) -> pd.DataFrame:
    """SP and AP throughput from the simpy what-if for every worker count and straggler level."""
    rows = []
    for cv in straggler_cvs:
        for n in workers:
            for mode in ("sp", "ap"):
                rows.append(simulate_admm_parallel(n, compute_s, param_bytes, mode, staleness,
                                                   iterations=iterations, straggler_cv=cv, seed=seed))
    return pd.DataFrame(rows)


def _save(fig: object, out_dir: Path, stem: str) -> None:
    for suffix in ("png", "pdf"):
        fig.savefig(out_dir / f"{stem}.{suffix}", dpi=130, bbox_inches="tight")  # type: ignore[attr-defined]


def _plot(df: pd.DataFrame, whatif: pd.DataFrame, task: str, steps: int, out_dir: Path, workers: int,
          staleness: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"admm-serial": "C0", "sgd": "C1", "adam": "C2", "admm-sp": "C3", "admm-ap": "C4"}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    for method in ("admm-serial", "sgd", "adam"):
        part = df[df.method == method]
        axes[0, 0].plot(part.iteration, part.train_loss, color=styles[method], label=method)
        axes[0, 1].plot(part.iteration, part.val_acc, color=styles[method], label=method)
    axes[0, 0].set(xlabel="iteration (full batch)", ylabel="training cross-entropy", yscale="log")
    axes[0, 1].set(xlabel="iteration (full batch)", ylabel="validation accuracy")
    grad_cols = [f"grad_s{t + 1}" for t in range(steps)]
    initial = df[df.method == "sgd"].iloc[0]  # SGD and Adam start from the same weights
    axes[1, 0].plot(range(1, steps + 1), initial[grad_cols].to_numpy(float), ":", color="k",
                    label="initial weights")
    for method, style in (("sgd", "C1"), ("adam", "C2")):
        final = df[df.method == method].iloc[-1]
        axes[1, 0].plot(range(1, steps + 1), final[grad_cols].to_numpy(float), color=style,
                        label=f"{method} (last iteration)")
    axes[1, 0].set(xlabel="time step t", ylabel="|dL/ds_t|", yscale="log",
                   title="BPTT gradient along the sequence")
    admm = df[(df.method == "admm-serial") & (df.iteration > 0)]
    for col, style in (("residual_a", "C5"), ("residual_s", "C6"), ("residual_o", "C7")):
        axes[1, 1].plot(admm.iteration, admm[col], color=style, label=col)
    axes[1, 1].set(xlabel="iteration", ylabel="RMS residual per sample", yscale="log",
                   title="ADMM constraint residuals")
    for ax in axes.flat:
        ax.legend(fontsize=7)
    fig.suptitle(f"ADMMiRNN vs SGD vs Adam on {task}")
    fig.tight_layout()
    _save(fig, out_dir, f"admm_{task}_training")
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for method in ("admm-serial", "admm-sp", "admm-ap"):
        part = df[df.method == method]
        axes[0].plot(part.data_passes, part.train_loss, color=styles[method], label=method)
        axes[1].plot(part.time_s, part.train_loss, color=styles[method], label=method)
    axes[0].set(xlabel="data passes (iterations of every worker)", ylabel="training cross-entropy")
    axes[1].set(xlabel="wall-clock seconds (this machine)", ylabel="training cross-entropy")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(f"Serial, SP and AP ADMMiRNN on {task}: {workers} gloo ranks (AP: + 1 server, staleness "
                 f"{staleness}) on this machine's CPUs; float64, full batch", fontsize=9)
    fig.tight_layout()
    _save(fig, out_dir, f"admm_{task}_parallel")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, cv in enumerate(sorted(whatif.straggler_cv.unique())):
        for mode, dash in (("sp", "-"), ("ap", "--")):
            part = whatif[(whatif.straggler_cv == cv) & (whatif["mode"] == mode)]
            ax.plot(part.workers, part.iterations_per_s, dash, color=f"C{i}", marker="o", ms=3,
                    label=f"{mode.upper()}, cv {cv:g}")
    ax.set(xscale="log", xlabel="workers", ylabel="iterations per second (simulated)",
           title=f"What-if: SP vs AP ADMMiRNN ({task}, 10 GbE)")
    ax.legend(fontsize=7, title_fontsize=7, title="cv: std / mean of a worker's compute\ntime per iteration "
              "(lognormal stragglers)")
    fig.tight_layout()
    _save(fig, out_dir, f"admm_{task}_whatif")
    plt.close(fig)


def run_configs(task: str, cfg: ADMMConfig | None = None,
                ap_cfg: ADMMConfig | None = None) -> tuple[ADMMConfig, ADMMConfig]:
    """The ADMM settings ``run_admm_experiment`` runs on ``task``: serial and SP with ``cfg`` (default:
    the task's validated serial setting, ``TASK_SETTINGS``), AP with ``ap_cfg`` (default: AP's own
    validation choice, ``AP_SETTINGS``, else ``cfg``)."""
    if task not in TASK_SETTINGS:
        raise ConfigError("task", f"unknown task {task!r}", f"use one of {', '.join(TASK_SETTINGS)}")
    settings = TASK_SETTINGS[task]
    cfg = cfg or ADMMConfig(rho_o=float(settings["rho_o"]), theta_w=float(settings["theta_w"]))
    ap_cfg = ap_cfg or (ADMMConfig(**AP_SETTINGS[task]) if task in AP_SETTINGS else cfg)
    return cfg, ap_cfg


def run_admm_experiment(task: str, iterations: int, out_dir: Path, seed: int = 0, workers: int = 2,
                        staleness: int = 2, cfg: ADMMConfig | None = None,
                        ap_cfg: ADMMConfig | None = None, figures: bool = True) -> pd.DataFrame:
    """Run every method for ``iterations`` full-batch iterations; write CSVs, JSON and figures.

    ``cfg``: ADMM penalties of the serial, SP and AP runs; ``ap_cfg`` overrides them for AP only
    (AP takes one weight update per worker message, and can need a larger rho_o to stay stable).
    Without ``ap_cfg`` AP runs its own validation choice (``AP_SETTINGS``) where the task has one.
    ``figures=False`` skips the three figures (the CSVs and the summary are written either way).
    """
    if task not in TASK_SETTINGS:
        raise ConfigError("task", f"unknown task {task!r}", f"use one of {', '.join(TASK_SETTINGS)}")
    if iterations < 1:
        raise ConfigError("iterations", f"{iterations} iterations", "use at least 1")
    if not 1 <= workers <= 8:
        raise ConfigError("workers", f"{workers} workers on one machine", "use 1..8 (2-4 on a small machine)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like every parallel rank, so serial and parallel timings compare
    try:
        cfg, ap_cfg = run_configs(task, cfg, ap_cfg)
        return _run(task, iterations, out_dir, seed, workers, staleness, cfg, ap_cfg, figures)
    finally:
        torch.set_num_threads(threads)


def _run(task: str, iterations: int, out_dir: Path, seed: int, workers: int, staleness: int,
         cfg: ADMMConfig, ap_cfg: ADMMConfig, figures: bool) -> pd.DataFrame:
    settings = TASK_SETTINGS[task]
    hidden = int(settings["hidden"])
    data = load_task(task, seed)

    rows: list[dict[str, object]] = []
    final_params = {}
    final_params["admm-serial"], history = train_admm(data.train, hidden, iterations, cfg, seed, data.validation)
    rows += _history_rows("admm-serial", history)
    for method in ("sgd", "adam"):
        final_params[method], history = train_gradient(data.train, hidden, iterations, method,
                                                       float(settings[f"{method}_lr"]), seed, data.validation)
        rows += _history_rows(method, history)
    sp = run_sp(data.train, hidden, iterations, cfg, workers, seed)
    ap = run_ap(data.train, hidden, iterations, ap_cfg, workers, staleness, seed)
    final_params["admm-sp"], final_params["admm-ap"] = sp.params, ap.params
    rows += _parallel_rows("admm-sp", sp, data, hidden, seed)
    rows += _parallel_rows("admm-ap", ap, data, hidden, seed)
    df = pd.DataFrame(rows)
    df.insert(0, "task", task)
    df.to_csv(out_dir / f"admm_{task}.csv", index=False)

    # what-if fed by the measured compute of one SP worker iteration (median over ranks and
    # iterations, the first iteration dropped as warm-up): weak scaling, each simulated worker
    # holds a shard of the measured size.
    compute_s = statistics.median(t for per_rank in sp.compute_s for t in per_rank[1:] or per_rank)
    whatif = whatif_table(compute_s, sp.bytes_per_iteration, min(iterations, WHATIF_ITERATIONS), seed)
    whatif.insert(0, "task", task)
    whatif.to_csv(out_dir / f"admm_whatif_{task}.csv", index=False)

    summary = {"task": task, "seed": seed, "description": data.description, "iterations": iterations,
               "workers": workers,
               "staleness": staleness, "hidden": hidden, "admm_config": vars(cfg),
               # AP always runs the local-first order (run_ap ignores cfg.sweep): record what ran
               "ap_admm_config": vars(replace(ap_cfg, sweep="local-first")), "settings": settings,
               "measured_compute_s_per_worker_iteration": compute_s,
               "sp_comm_s_median": statistics.median(sp.comm_s),
               "stats_bytes_per_iteration": sp.bytes_per_iteration,
               "ap_max_clock_gap": max(ap.staleness), "final": {}}
    for method, part in df.groupby("method"):
        last = part.iloc[-1]
        keys = ("train_loss", "train_acc", "val_loss", "val_acc", "time_s", "data_passes")
        summary["final"][method] = {k: float(last[k]) for k in keys}
        test_loss, test_acc = evaluate(final_params[str(method)], data.test)  # the one look at test
        summary["final"][method] |= {"test_loss": test_loss, "test_acc": test_acc}
        if method in ("sgd", "adam"):  # gradient health along the sequence, start and end of training
            summary["final"][method] |= {
                "grad_ratio_first_last_initial": float(part.iloc[0].grad_ratio_first_last),
                "grad_ratio_first_last_final": float(last.grad_ratio_first_last),
                "grad_W_norm_max": float(part.grad_W_norm.max()),
            }
    (out_dir / f"admm_{task}_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if figures:
        _plot(df, whatif, task, data.train.steps, out_dir, workers, staleness)
    return df
