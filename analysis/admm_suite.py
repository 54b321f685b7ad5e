"""ADMMiRNN against its paper's claims: tuning on validation, accuracy per task and method over
seeds, the robustness-to-initialisation sweep and a block-order / fix ablation, in one command.

``run_admm_suite(out_dir)`` (CLI: ``paratwin admm-suite --out docs/results/admm --figures docs/figures``
regenerates the committed results; without them it writes to ``runs/admm-suite``):

1. **Tuning** (``tuning_<task>.csv``): for every task, a small grid per method (SGD and Adam
   learning rates, ADMM rho_o x theta_w), seed 0, default initialisation, scored by the final
   accuracy on the validation split carved from training. The test split is not read. Every
   method's grid is then widened past every edge its choice sits on until the choice is interior
   (``analysis.admm_grid``, one rule for every method; ``tuning_<task>_wide.csv``).
2. **Comparison** (``comparison.csv``): the chosen setting of every method, ``seeds`` seeds per
   task; the test split is evaluated once per run, on the final weights.
3. **Init-scale sweep** (``init_sweep.csv``, ``init_curves.csv``): digits, every weight drawn
   from torch's default range times {0.01, 1, 4, 10}, ``seeds`` seeds; ADMM, SGD and Adam as
   chosen, each with the gradient-health measures of its final weights (ADMM as it was before
   issue 15, ``ADMM_BEFORE``, is in the ablation).
4. **Ablation** (``ablation.csv``): digits, seed 0, scales 0.01 and 1: each of the three changes
   switched off alone, and the authors' fixed-penalty setting.
5. ``tables.md`` and figures ``admm_accuracy``, ``admm_init_sweep`` (PNG + PDF), in ``fig_dir``
   (default: ``out_dir``). A smoke run's figures say so in their title and are drawn beside its CSVs
   only (``check_smoke_figures``).

The default hidden sizes and iteration counts keep the whole suite at about 20 minutes of one
loaded core; ``quick=True`` is a smoke run (a few iterations, one seed). Runs are deterministic for
a (setting, seed, init scale, iteration count), so a rerun into the same directory reuses every
tuning, comparison and sweep row (and sweep curve) whose setting string and iteration count are
unchanged and runs only the rest. Every row records its ``iterations``; a directory holding rows of
another length is refused (``check_iterations``): a ``--quick`` run needs its own ``--out``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch

from exec.admm.baselines import gradient_health, train_gradient
from exec.admm.data import TASKS, TaskData, load_task
from exec.admm.rnn_admm import ADMMConfig, evaluate, train_admm
from traces.errors import ConfigError

from .admm_grid import Setting, at_iterations, choose, widen
from .admm_grid import describe as _describe


@dataclass(frozen=True)
class TaskPlan:
    hidden: int
    iterations: int


TASK_PLANS = {
    "digits": TaskPlan(hidden=32, iterations=300),
    "shakespeare": TaskPlan(hidden=64, iterations=40),
    "text-source": TaskPlan(hidden=32, iterations=40),
}
SGD_LRS = (0.1, 0.3, 1.0)
ADAM_LRS = (0.003, 0.01, 0.03)
# ADMM grid: the output penalty and the weight prox; rho_a = rho_s = 10, theta_a = 1 and the
# authors' backward-then-forward block order are fixed (the ablation shows what each changes).
ADMM_GRID = tuple(ADMMConfig(rho_o=rho_o, theta_w=theta_w, sweep="backward-forward")
                  for rho_o in (0.1, 0.3) for theta_w in (0.03, 0.1))
# the algorithm as it stood before issue 15, for the sweep: step 1/Lipschitz, no re-anchoring
ADMM_BEFORE = ADMMConfig(rho_o=0.1, theta_w=0.0, reanchor=False, sweep="forward")
# every method's starting grid; each is widened by the same rule (analysis/admm_grid.py)
START_GRIDS: dict[str, tuple[Setting, ...]] = {"sgd": SGD_LRS, "adam": ADAM_LRS, "admm": ADMM_GRID}
INIT_SCALES = (0.01, 1.0, 4.0, 10.0)
SWEEP_TASK = "digits"
CURVE_EVERY = 5  # iterations between the points of init_curves.csv (keeps the CSV small)


def run_length(plan: TaskPlan, iterations: int | None) -> int:
    """The iterations a run of ``plan`` takes: ``iterations`` when given (quick runs, follow-ups)."""
    return plan.iterations if iterations is None else iterations


def check_iterations(out_dir: Path, lengths: dict[str, int]) -> None:
    """Refuse a directory whose tuning / comparison / sweep rows ran another number of iterations
    than this run's ``lengths`` (per task): its rows would be neither reusable nor safe to overwrite."""
    for path in sorted(Path(out_dir).glob("*.csv")):
        if not path.name.startswith(("tuning_", "comparison", "init_sweep")):
            continue
        rows = pd.read_csv(path)
        if "iterations" not in rows:
            raise ConfigError("out", f"{path} has no iterations column (written before runs recorded their "
                              "length), so its rows cannot be matched to this run",
                              "use another --out directory")
        for task, part in rows.groupby("task"):
            ran = sorted(set(part["iterations"]))
            if task in lengths and ran != [lengths[str(task)]]:
                raise ConfigError("out", f"{path} holds {task} runs of {ran} iterations, this run asks "
                                  f"{lengths[str(task)]}", "use another --out directory (a --quick run needs its own)")


def smoke_note(runs: pd.DataFrame) -> str:
    """The line a figure of ``runs`` (rows with task, seed, iterations) carries in its title when they
    are not the suite's lengths (``TASK_PLANS``): a smoke run's figure looked like the result before."""
    if "iterations" not in runs:
        return ""
    short = sorted({int(i) for task, part in runs.groupby("task") for i in part.iterations
                    if str(task) in TASK_PLANS and i != TASK_PLANS[str(task)].iterations})
    if not short:
        return ""
    seeds = runs.seed.nunique() if "seed" in runs else 1
    return (f"SMOKE RUN ({'/'.join(map(str, short))} iterations, {seeds} seed{'s' * (seeds > 1)}): "
            "not the suite's result")


def check_smoke_figures(out_dir: Path, fig_dir: Path, smoke: bool) -> None:
    """A smoke run draws its figures only beside its CSVs, in the folder ``check_iterations`` guards
    (with --figures elsewhere, docs/figures by default until session 22, a --quick run replaced the
    committed figures of the same name)."""
    if smoke and Path(fig_dir).resolve() != Path(out_dir).resolve():
        raise ConfigError("--figures", f"{fig_dir} is not --out ({out_dir}): a smoke run (--quick, or runs of "
                          "another length than the suite's) draws its figures beside its CSVs only",
                          "leave out --figures (nothing was written)")


def train(method: str, setting: ADMMConfig | float, data: TaskData, plan: TaskPlan, seed: int,
          init_scale: float = 1.0, iterations: int | None = None) -> tuple[object, pd.DataFrame, float]:
    """One run; returns (final weights, history with validation columns, seconds)."""
    its = run_length(plan, iterations)
    start = time.perf_counter()
    if method.startswith("admm"):
        assert isinstance(setting, ADMMConfig)
        params, history = train_admm(data.train, plan.hidden, its, setting, seed, data.validation, init_scale)
    else:
        params, history = train_gradient(data.train, plan.hidden, its, method, float(setting), seed,
                                         data.validation, init_scale=init_scale)
    seconds = time.perf_counter() - start
    last = history[-1]
    print(f"  {method} {_describe(setting)} seed {seed} init x{init_scale:g}: val acc {last['val_acc']:.3f}, "
          f"{seconds:.0f} s", file=sys.stderr, flush=True)  # progress: the suite runs for minutes
    return params, pd.DataFrame(history), seconds


def _final(history: pd.DataFrame) -> dict[str, float]:
    last = history.iloc[-1]
    return {"train_loss": float(last.train_loss), "max_train_loss": float(history.train_loss.max()),
            "val_loss": float(last.val_loss), "val_acc": float(last.val_acc)}


def _tuning_row(task: str, method: str, setting: ADMMConfig | float, history: pd.DataFrame,
                seconds: float, iterations: int) -> dict[str, object]:
    return {"task": task, "method": method, "setting": _describe(setting), "iterations": iterations,
            **_final(history), "seconds": seconds}


def tune(task: str, data: TaskData, plan: TaskPlan, iterations: int | None = None) -> pd.DataFrame:
    """Every grid point at seed 0 and default initialisation, scored on validation only."""
    rows = []
    for method, setting in ((m, s) for m, grid in START_GRIDS.items() for s in grid):
        _, history, seconds = train(method, setting, data, plan, 0, iterations=iterations)
        rows.append(_tuning_row(task, method, setting, history, seconds, run_length(plan, iterations)))
    return pd.DataFrame(rows)


def _test_row(task: str, method: str, setting: ADMMConfig | float, data: TaskData, params: object,
              history: pd.DataFrame, seed: int, init_scale: float, seconds: float,
              iterations: int) -> dict[str, object]:
    """Final numbers of one run: the one evaluation of the test split, plus gradient health."""
    test_loss, test_acc = evaluate(params, data.test)  # type: ignore[arg-type]
    health = gradient_health(params, data.train)  # type: ignore[arg-type]
    initial = gradient_health_initial(history)
    return {"task": task, "method": method, "seed": seed, "init_scale": init_scale,
            "setting": _describe(setting), "iterations": iterations, **_final(history),
            "test_loss": test_loss, "test_acc": test_acc,
            "grad_ratio_first_last": health["grad_ratio_first_last"], "grad_W_norm": health["grad_W_norm"],
            "grad_ratio_initial": initial, "seconds": seconds}


def gradient_health_initial(history: pd.DataFrame) -> float:
    """SGD/Adam record the ratio at every iteration; row 0 is the initial weights."""
    return float(history.grad_ratio_first_last.iloc[0]) if "grad_ratio_first_last" in history else float("nan")


RUN_KEY = ["task", "method", "seed", "init_scale", "setting", "iterations"]


def _known_runs(known: pd.DataFrame | None) -> dict[tuple, dict]:
    """Rows of an earlier run by ``RUN_KEY`` (runs are deterministic, so a matching row is reused;
    a row without an iterations column matches nothing)."""
    if known is None or known.empty or "iterations" not in known:
        return {}
    return {tuple(r[k] for k in RUN_KEY): r for r in known.to_dict("records")}


def compare(task: str, data_by_seed: dict[int, TaskData], plan: TaskPlan,
            chosen: dict[str, ADMMConfig | float], iterations: int | None = None,
            known: pd.DataFrame | None = None) -> pd.DataFrame:
    """Test rows of every chosen setting and seed; rows of ``known`` with the same key are reused."""
    reuse, rows, its = _known_runs(known), [], run_length(plan, iterations)
    for seed, data in data_by_seed.items():
        for method, setting in chosen.items():
            key = (task, method, seed, 1.0, _describe(setting), its)
            if key in reuse:
                rows.append(reuse[key])
                continue
            params, history, seconds = train(method, setting, data, plan, seed, iterations=iterations)
            rows.append(_test_row(task, method, setting, data, params, history, seed, 1.0, seconds, its))
    return pd.DataFrame(rows)


def init_sweep(data_by_seed: dict[int, TaskData], plan: TaskPlan, chosen: dict[str, ADMMConfig | float],
               scales: tuple[float, ...], iterations: int | None = None, known: pd.DataFrame | None = None,
               known_curves: pd.DataFrame | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Sweep rows and thinned curves; a ``known`` row with the same key is reused with its curve."""
    methods = chosen  # ADMM as it was before issue 15: in the ablation (seed 0), to save compute
    reuse, rows, curves, its = _known_runs(known), [], [], run_length(plan, iterations)
    for scale in scales:
        for seed, data in data_by_seed.items():
            for method, setting in methods.items():
                key = (SWEEP_TASK, method, seed, scale, _describe(setting), its)
                if key in reuse and known_curves is not None:
                    rows.append(reuse[key])
                    curves.append(known_curves[(known_curves.method == method) & (known_curves.seed == seed)
                                               & (known_curves.init_scale == scale)])
                    continue
                params, history, seconds = train(method, setting, data, plan, seed, scale, iterations)
                rows.append(_test_row(SWEEP_TASK, method, setting, data, params, history, seed, scale, seconds,
                                      its))
                keep = ["iteration", "train_loss", "val_acc"] + (["lagrangian"] if "lagrangian" in history else [])
                thin = (history.iteration % CURVE_EVERY == 0) | (history.iteration == history.iteration.max())
                curve = history.loc[thin, keep].assign(method=method, seed=seed, init_scale=scale)
                curves.append(curve)
    return pd.DataFrame(rows), pd.concat(curves, ignore_index=True)


def ablation(data: TaskData, plan: TaskPlan, chosen: ADMMConfig, iterations: int | None = None) -> pd.DataFrame:
    """Each change of issue 15 switched off alone, and the algorithm as it was before."""
    variants = {
        "chosen": chosen,
        "forward order": replace(chosen, sweep="forward"),
        "local-first order (AP's)": replace(chosen, sweep="local-first"),
        "no weight prox (theta_w = 0)": replace(chosen, theta_w=0.0),
        "no re-anchoring": replace(chosen, reanchor=False),
        "before issue 15": ADMM_BEFORE,
    }
    rows = []
    for scale in (0.01, 1.0):
        for name, cfg in variants.items():
            params, history, seconds = train("admm", cfg, data, plan, 0, scale, iterations)
            rows.append({"variant": name, "init_scale": scale, "setting": _describe(cfg),
                         "iterations": run_length(plan, iterations), **_final(history), "seconds": seconds})
    return pd.DataFrame(rows)


def _mean_std(df: pd.DataFrame, keys: list[str], value: str) -> pd.DataFrame:
    out = df.groupby(keys)[value].agg(["mean", "std", "count"]).reset_index()
    out["std"] = out["std"].fillna(0.0)
    return out


def write_tables(out_dir: Path, tuning: pd.DataFrame, comparison: pd.DataFrame, sweep: pd.DataFrame,
                 abl: pd.DataFrame) -> str:
    """Markdown tables of the suite (also returned)."""
    lines = ["# ADMMiRNN suite results", "",
             "Generated by `paratwin admm-suite`; machine: a loaded 2-core CPU (timings noisy).", "",
             "## Chosen settings (best final validation accuracy, seed 0; every method's grid widened "
             "until its choice is interior)", "",
             "| task | method | setting | val acc |", "|---|---|---|---|"]
    for (task, method), part in tuning.groupby(["task", "method"]):
        best = part.sort_values(["val_acc", "val_loss"], ascending=[False, True]).iloc[0]
        lines.append(f"| {task} | {method} | `{best.setting}` | {best.val_acc:.3f} |")
    lines += ["", "## Test accuracy, chosen settings, default initialisation (mean +- std over seeds)", "",
              "| task | method | test acc | test loss | grad ratio s1/sT (final) | seeds |",
              "|---|---|---|---|---|---|"]
    acc = _mean_std(comparison, ["task", "method"], "test_acc")
    loss = _mean_std(comparison, ["task", "method"], "test_loss")
    ratio = comparison.groupby(["task", "method"]).grad_ratio_first_last.median()
    for (_, a), (_, lo) in zip(acc.iterrows(), loss.iterrows(), strict=True):
        lines.append(f"| {a.task} | {a.method} | {a['mean']:.3f} +- {a['std']:.3f} | "
                     f"{lo['mean']:.3f} +- {lo['std']:.3f} | {ratio[(a.task, a.method)]:.3g} | {int(a['count'])} |")
    lines += ["", f"## Init-scale sweep on {SWEEP_TASK} (test acc mean +- std; max training loss; "
              "BPTT gradient ratio |dL/ds_1|/|dL/ds_T| of the final weights, median)", "",
              "| init scale | method | test acc | final train loss | max train loss | grad ratio |",
              "|---|---|---|---|---|---|"]
    grouped = sweep.groupby(["init_scale", "method"])
    for (scale, method), part in grouped:
        lines.append(f"| {scale:g} | {method} | {part.test_acc.mean():.3f} +- {part.test_acc.std(ddof=1):.3f} | "
                     f"{part.train_loss.mean():.3f} | {part.max_train_loss.max():.2f} | "
                     f"{part.grad_ratio_first_last.median():.3g} |")
    lines += ["", f"## Ablation on {SWEEP_TASK}, seed 0 (validation accuracy)", "",
              "| variant | init 0.01: val acc | max train loss | init 1: val acc | max train loss |",
              "|---|---|---|---|---|"]
    for name, part in abl.groupby("variant", sort=False):
        small, one = part[part.init_scale == 0.01].iloc[0], part[part.init_scale == 1.0].iloc[0]
        lines.append(f"| {name} | {small.val_acc:.3f} | {small.max_train_loss:.2f} | {one.val_acc:.3f} | "
                     f"{one.max_train_loss:.2f} |")
    text = "\n".join(lines) + "\n"
    (out_dir / "tables.md").write_text(text)
    return text


def plot(fig_dir: Path, comparison: pd.DataFrame, curves: pd.DataFrame, smoke: str = "") -> None:
    """``admm_accuracy`` and ``admm_init_sweep`` (PNG + PDF); ``smoke`` (``smoke_note``) heads both titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    note = "CPU, float64, full batch; test split evaluated once per run"
    head = f"{smoke}\n" if smoke else ""
    fig_dir.mkdir(parents=True, exist_ok=True)
    methods = sorted(comparison.method.unique())
    tasks = list(dict.fromkeys(comparison.task))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        stats = _mean_std(comparison[comparison.method == method], ["task"], "test_acc").set_index("task")
        xs = [t + (i - (len(methods) - 1) / 2) * width for t in range(len(tasks))]
        ax.bar(xs, [stats.loc[t, "mean"] for t in tasks], width, yerr=[stats.loc[t, "std"] for t in tasks],
               capsize=3, label=method)
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set(ylabel="test accuracy (mean +- std over seeds)", title=f"{head}ADMMiRNN vs SGD vs Adam\n{note}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    for suffix in ("png", "pdf"):
        fig.savefig(fig_dir / f"admm_accuracy.{suffix}", dpi=130)
    plt.close(fig)

    scales = sorted(curves.init_scale.unique())
    fig, axes = plt.subplots(2, len(scales), figsize=(3.2 * len(scales), 6), squeeze=False)
    for j, scale in enumerate(scales):
        for k, method in enumerate(sorted(curves.method.unique())):
            part = curves[(curves.init_scale == scale) & (curves.method == method)]
            for n, (_, run) in enumerate(part.groupby("seed")):
                label = method if n == 0 else None
                axes[0, j].plot(run.iteration, run.train_loss, color=f"C{k}", lw=0.8, label=label)
                axes[1, j].plot(run.iteration, run.val_acc, color=f"C{k}", lw=0.8, label=label)
        axes[0, j].set(title=f"init x{scale:g}", yscale="log", xlabel="iteration")
        axes[1, j].set(xlabel="iteration", ylim=(0, 1))
    axes[0, 0].set_ylabel("training cross-entropy (forward pass)")
    axes[1, 0].set_ylabel("validation accuracy")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"{head}{SWEEP_TASK}: curves per init scale, every seed ({note})", fontsize=9)
    fig.tight_layout()
    for suffix in ("png", "pdf"):
        fig.savefig(fig_dir / f"admm_init_sweep.{suffix}", dpi=130)
    plt.close(fig)


PARTS = ("tasks", "robustness", "ablation", "report")


def _read_if(path: Path) -> pd.DataFrame | None:
    return pd.read_csv(path) if path.is_file() else None


def _read_tuning(out_dir: Path, task: str) -> pd.DataFrame:
    """What ``tuned`` returned, from its files (the report part reads them): a method's widened
    grid where ``tuning_<task>_wide.csv`` has it, its starting grid otherwise."""
    tuning, wide_path = pd.read_csv(out_dir / f"tuning_{task}.csv"), out_dir / f"tuning_{task}_wide.csv"
    if not wide_path.is_file():
        return tuning
    wide = pd.read_csv(wide_path)
    return pd.concat([tuning[~tuning.method.isin(wide.method)], wide], ignore_index=True)


def tuned(task: str, out_dir: Path, data: TaskData, plan: TaskPlan, iterations: int | None) -> pd.DataFrame:
    """The task's tuning table, every method's grid widened until its choice is interior
    (``admm_grid.widen``, the same rule for SGD, Adam and ADMM).

    ``tuning_<task>.csv`` (the starting grid of every method) and ``tuning_<task>_wide.csv`` (the
    widened grids) are read when an earlier part wrote them (runs are deterministic per seed), and
    only missing points are run. Returns every row of every method's final grid."""
    path, wide_path = out_dir / f"tuning_{task}.csv", out_dir / f"tuning_{task}_wide.csv"
    its = run_length(plan, iterations)
    check_iterations(out_dir, {task: its})
    if path.is_file():
        tuning = pd.read_csv(path)
    else:
        tuning = tune(task, data, plan, iterations)
        tuning.to_csv(path, index=False)
    known = pd.concat([tuning] + ([pd.read_csv(wide_path)] if wide_path.is_file() else []),
                      ignore_index=True).drop_duplicates(["method", "setting"])
    known = at_iterations(known, its)  # never another length's rows (check_iterations refuses them too)
    finals = []
    for method, start in START_GRIDS.items():
        def run_point(setting: Setting, method: str = method) -> dict:
            _, history, seconds = train(method, setting, data, plan, 0, iterations=iterations)
            return _tuning_row(task, method, setting, history, seconds, its)

        rows, chosen = widen(method, start, known, run_point)
        finals.append(rows)
        print(f"{task}: {method} chosen on the widened grid ({len(rows)} points): {_describe(chosen)}",
              file=sys.stderr, flush=True)
    wide = pd.concat(finals, ignore_index=True)
    wide.to_csv(wide_path, index=False)
    return wide


def run_admm_suite(out_dir: Path, fig_dir: Path | None = None, seeds: int = 3, quick: bool = False,
                   parts: tuple[str, ...] = PARTS) -> str:
    """The whole study; writes CSVs and tables.md to ``out_dir``, figures to ``fig_dir``.

    ``parts`` (in this order): ``tasks`` (tuning and comparison on every task), ``robustness``
    (digits init-scale sweep), ``ablation`` (both reuse ``tuning_digits.csv`` when ``tasks`` wrote
    it), ``report`` (tables and figures from the CSVs). The first three can run as separate
    processes, the later two started once ``tuning_digits.csv`` exists.
    """
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ConfigError("parts", f"unknown suite part(s) {unknown}", f"use any of {', '.join(PARTS)}")
    out_dir = Path(out_dir)
    fig_dir = Path(fig_dir) if fig_dir is not None else out_dir
    check_smoke_figures(out_dir, fig_dir, quick)  # before any run, like check_iterations below
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    its = 3 if quick else None
    seed_list = list(range(1 if quick else seeds))
    if set(parts) - {"report"}:  # a folder of other-length runs is neither reused nor overwritten
        check_iterations(out_dir, {task: run_length(plan, its) for task, plan in TASK_PLANS.items()})
    if "tasks" in parts:
        comparisons, known = [], _read_if(out_dir / "comparison.csv")
        for task in TASKS:
            plan = TASK_PLANS[task]
            data_by_seed = {seed: load_task(task, seed) for seed in seed_list}
            chosen = choose(tuned(task, out_dir, data_by_seed[0], plan, its))
            comparisons.append(compare(task, data_by_seed, plan, chosen, its, known))
        pd.concat(comparisons).to_csv(out_dir / "comparison.csv", index=False)
    if "robustness" in parts:
        plan = TASK_PLANS[SWEEP_TASK]
        data_by_seed = {seed: load_task(SWEEP_TASK, seed) for seed in seed_list}
        chosen = choose(tuned(SWEEP_TASK, out_dir, data_by_seed[0], plan, its))
        sweep, curves = init_sweep(data_by_seed, plan, chosen, INIT_SCALES, its, _read_if(out_dir / "init_sweep.csv"),
                                   _read_if(out_dir / "init_curves.csv"))
        sweep.to_csv(out_dir / "init_sweep.csv", index=False)
        curves.to_csv(out_dir / "init_curves.csv", index=False, float_format="%.5g")
    if "ablation" in parts:
        plan = TASK_PLANS[SWEEP_TASK]
        data = load_task(SWEEP_TASK, 0)
        chosen_admm = choose(tuned(SWEEP_TASK, out_dir, data, plan, its))["admm"]
        assert isinstance(chosen_admm, ADMMConfig)
        ablation(data, plan, chosen_admm, its).to_csv(out_dir / "ablation.csv", index=False)
    if "report" not in parts:
        return f"wrote {out_dir}"
    tuning = pd.concat(_read_tuning(out_dir, task) for task in TASKS)
    comparison = pd.read_csv(out_dir / "comparison.csv")
    smoke = smoke_note(comparison)  # the report part alone may draw another run's rows
    check_smoke_figures(out_dir, fig_dir, bool(smoke))
    text = write_tables(out_dir, tuning, comparison, pd.read_csv(out_dir / "init_sweep.csv"),
                        pd.read_csv(out_dir / "ablation.csv"))
    plot(fig_dir, comparison, pd.read_csv(out_dir / "init_curves.csv"), smoke)
    return text
