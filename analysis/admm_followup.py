"""Two follow-ups to the ADMMiRNN suite (docs/admm.md, "Limits"), same protocol as the suite:
settings chosen on the validation split, the test split read once per run.

- ``edge``: on digits the chosen ADMM setting sat at the corner of its grid (the smallest rho_o,
  0.1, and theta_w, 0.03). The grid is widened by one step of its 1-3-10 ladder past every edge
  the choice sits on, the choice is made again on validation, and so on until it is interior
  (``analysis.admm_grid``; the suite itself now does this for every task). Points already run are
  reused: a run is deterministic for a seed. When the final choice differs from the suite's first
  grid's, it is tested over the seeds. Writes ``tuning_digits_wide.csv`` and
  ``comparison_digits_wide.csv``.
- ``longer``: Shakespeare and text-source ran 40 iterations in the suite. Tune every method again
  at ``--iterations`` (the best setting at 40 iterations need not be the best at 120), every grid
  widened by the suite's rule until its choice is interior (``admm_suite.tuned`` on ``long/``),
  and test the choices over the seeds. Writes ``long/tuning_<task>.csv`` (starting grids),
  ``long/tuning_<task>_wide.csv`` and ``long/comparison.csv``; rows of the same length already
  there are reused.

- ``ap``: AP-ADMMiRNN (2 workers, staleness 2, as ``paratwin admm`` runs it) tuned on its own,
  per ``--task``: AP takes one weight update per worker message, so the serial algorithm's
  validated setting need not suit it. Its rho_o x theta_w grid starts at the suite's starting
  ADMM grid and is widened by the same rule (``admm_grid.widen``), scored on the task's
  validation split (seed 0) after the suite's iterations for the task. Writes
  ``tuning_<task>_ap.csv``. AP's message order depends on timing, so a rerun of a setting is not
  bit-equal (reused rows are those of the run that wrote the file). ``--repeats N`` then re-runs
  the chosen setting and its runner-up N more times each (``tuning_<task>_ap_repeats.csv``): is
  the choice distinguishable from the runner-up given that noise?

Run: ``python -m analysis.admm_followup edge --out docs/results/admm``,
``python -m analysis.admm_followup longer --iterations 120 --out docs/results/admm`` and
``python -m analysis.admm_followup ap --task shakespeare --repeats 2 --out docs/results/admm``.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from exec.admm.data import TaskData, load_task
from exec.admm.parallel import run_ap
from exec.admm.rnn_admm import ADMMConfig, evaluate, init_params
from traces.errors import ConfigError

from .admm_grid import Setting, at_iterations, choose, describe, parse, ranked, widen
from .admm_suite import ADMM_GRID, TASK_PLANS, TaskPlan, compare, run_length, tuned

AP_WORKERS, AP_STALENESS = 2, 2  # paratwin admm's defaults: the SP/AP table's AP run
AP_LOSS_POINTS = 100  # weight versions evaluated for AP's largest training loss along the run

LONG_TASKS = ("shakespeare", "text-source")


def edge(out_dir: Path, seeds: int = 3, iterations: int | None = None) -> pd.DataFrame:
    """Digits' ADMM tuned on the widened grid (the suite's ``tuned``, which every part now uses);
    the choice tested over the seeds if it moved from the suite's first grid. Returns the ADMM rows."""
    task, plan = "digits", TASK_PLANS["digits"]
    suite_path = out_dir / f"tuning_{task}.csv"
    suite_choice = choose(pd.read_csv(suite_path))["admm"] if suite_path.is_file() else None
    tuning = tuned(task, out_dir, load_task(task, 0), plan, iterations)
    chosen = choose(tuning)["admm"]
    if chosen != suite_choice:
        data_by_seed = {seed: load_task(task, seed) for seed in range(seeds)}
        compare(task, data_by_seed, plan, {"admm": chosen}, iterations).to_csv(
            out_dir / f"comparison_{task}_wide.csv", index=False)
    return tuning[tuning.method == "admm"]


def longer(out_dir: Path, iterations: int, seeds: int = 3, tasks: tuple[str, ...] = LONG_TASKS) -> pd.DataFrame:
    """Tune (widened grids) and test every method on ``tasks`` at ``iterations`` iterations."""
    long_dir = out_dir / "long"
    long_dir.mkdir(parents=True, exist_ok=True)
    known = pd.read_csv(long_dir / "comparison.csv") if (long_dir / "comparison.csv").is_file() else None
    comparisons = []
    for task in tasks:
        plan = TASK_PLANS[task]
        data_by_seed = {seed: load_task(task, seed) for seed in range(seeds)}
        tuning = tuned(task, long_dir, data_by_seed[0], plan, iterations)
        comparisons.append(compare(task, data_by_seed, plan, choose(tuning), iterations, known))
    comparison = pd.concat(comparisons, ignore_index=True)
    comparison.to_csv(long_dir / "comparison.csv", index=False)
    return comparison


def ap_point(setting: Setting, task: str, data: TaskData, hidden: int, iterations: int) -> dict:
    """One AP run (real gloo ranks) of ``setting`` on ``task``'s seed-0 data, as a tuning row: the
    final weights scored on validation; ``max_train_loss`` over about ``AP_LOSS_POINTS`` weight
    versions (AP's training loss can rise mid-run, docs/admm.md)."""
    assert isinstance(setting, ADMMConfig)
    result = run_ap(data.train, hidden, iterations, setting, AP_WORKERS, AP_STALENESS, 0)
    template = init_params(data.train.input_dim, hidden, data.train.num_classes, 0, data.train.x.dtype)
    stride = max(1, len(result.snapshots) // AP_LOSS_POINTS)
    losses = [evaluate(template.load_flat(snap[3]), data.train)[0] for snap in result.snapshots[::stride]]
    train_loss = evaluate(result.params, data.train)[0]
    val_loss, val_acc = evaluate(result.params, data.validation)
    print(f"  {task} admm-ap {describe(setting)}: val acc {val_acc:.3f}, {result.wall_s:.0f} s", flush=True)
    return {"task": task, "method": "admm-ap", "setting": describe(setting), "iterations": iterations,
            "workers": AP_WORKERS, "staleness": AP_STALENESS, "train_loss": train_loss,
            "max_train_loss": max([*losses, train_loss]), "val_loss": val_loss, "val_acc": val_acc,
            "seconds": result.wall_s}


def ap_tuning_path(out_dir: Path, task: str) -> Path:
    return Path(out_dir) / f"tuning_{task}_ap.csv"


def _check_task(task: str) -> TaskPlan:
    if task not in TASK_PLANS:
        raise ConfigError("task", f"unknown task {task!r}", f"use one of {', '.join(TASK_PLANS)}")
    return TASK_PLANS[task]


def ap(out_dir: Path, task: str = "digits", iterations: int | None = None) -> tuple[pd.DataFrame, ADMMConfig]:
    """AP's own validation choice on ``task`` (module docstring); returns its tuning rows and choice."""
    plan = _check_task(task)
    its = run_length(plan, iterations)
    data = load_task(task, 0)
    path = ap_tuning_path(out_dir, task)
    known = at_iterations(pd.read_csv(path), its) if path.is_file() else pd.DataFrame()
    start = tuple(replace(cfg, sweep="local-first") for cfg in ADMM_GRID)  # the order AP runs
    rows, chosen = widen("admm-ap", start, known, lambda s: ap_point(s, task, data, plan.hidden, its))
    rows.to_csv(path, index=False)
    assert isinstance(chosen, ADMMConfig)
    return rows, chosen


def ap_repeats(out_dir: Path, task: str, repeats: int, iterations: int | None = None) -> pd.DataFrame:
    """AP's ranking noise: the chosen setting and the runner-up of ``tuning_<task>_ap.csv`` re-run
    ``repeats`` more times each (same seed, data and setting; only the message order differs).
    Repeats already in ``tuning_<task>_ap_repeats.csv`` (same setting and length) are kept.
    Returns one row per run, the tuning run as ``repeat`` 0."""
    plan = _check_task(task)
    its = run_length(plan, iterations)
    tuning = at_iterations(pd.read_csv(ap_tuning_path(out_dir, task)), its)
    top = ranked(tuning).head(2)
    path = Path(out_dir) / f"tuning_{task}_ap_repeats.csv"
    known = at_iterations(pd.read_csv(path), its) if path.is_file() else pd.DataFrame()
    data = load_task(task, 0)
    rows = []
    for rank, first in enumerate(top.to_dict("records")):
        rows.append(first | {"rank": rank, "repeat": 0})
        done = known[(known.setting == first["setting"]) & (known.repeat > 0)] if len(known) else known
        for repeat in range(1, repeats + 1):
            same = done[done.repeat == repeat] if len(done) else done
            row = (same.iloc[0].to_dict() if len(same)
                   else ap_point(parse(first["setting"]), task, data, plan.hidden, its))
            rows.append(row | {"rank": rank, "repeat": repeat})
    table = pd.DataFrame(rows)[["task", "method", "setting", "iterations", "workers", "staleness", "rank",
                                "repeat", "train_loss", "max_train_loss", "val_loss", "val_acc", "seconds"]]
    table.to_csv(path, index=False)
    return table


def distinguishable(repeats: pd.DataFrame) -> bool:
    """Whether the chosen setting (rank 0) beat the runner-up (rank 1) in every pair of runs: its
    worst validation accuracy above the runner-up's best."""
    acc = repeats.groupby("rank").val_acc
    return bool(acc.min()[0] > acc.max()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=("edge", "longer", "ap"))
    parser.add_argument("--out", type=Path, default=Path("docs/results/admm"))
    parser.add_argument("--iterations", type=int, default=None,
                        help="longer: iterations per run (required); edge: override (smoke runs only)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--task", default="digits", choices=tuple(TASK_PLANS), help="ap: the task AP is tuned on")
    parser.add_argument("--repeats", type=int, default=0,
                        help="ap: re-run the choice and the runner-up this many more times each")
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "edge":
        print(edge(args.out, args.seeds, args.iterations).to_string(), flush=True)
    elif args.part == "ap":
        rows, chosen = ap(args.out, args.task, args.iterations)
        print(ranked(rows).to_string(), flush=True)
        print(f"AP chosen on validation ({args.task}): {describe(chosen)}", flush=True)
        if args.repeats > 0:
            runs = ap_repeats(args.out, args.task, args.repeats, args.iterations)
            print(runs.groupby(["rank", "setting"]).val_acc.agg(["mean", "std", "min", "max", "count"]).to_string())
            print(f"choice distinguishable from the runner-up: {distinguishable(runs)}")
    else:
        if args.iterations is None:
            parser.error("longer needs --iterations (e.g. 120)")
        comparison = longer(args.out, args.iterations, args.seeds)
        print(comparison.groupby(["task", "method"]).test_acc.agg(["mean", "std", "count"]).to_string())


if __name__ == "__main__":
    main()
