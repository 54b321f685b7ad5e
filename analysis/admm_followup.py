"""Two follow-ups to the ADMMiRNN suite (docs/admm.md, "Limits"), same protocol as the suite:
settings chosen on the validation split, the test split read once per run.

- ``edge``: on digits the chosen ADMM setting sat at the corner of its grid (the smallest rho_o,
  0.1, and theta_w, 0.03). ``widened_grid`` adds one step beyond that corner on the grid's 1-3-10
  ladder: rho_o {0.03, 0.1, 0.3} x theta_w {0.01, 0.03, 0.1}. Points already in the suite's
  ``tuning_digits.csv`` are reused (a run is deterministic for a seed), the new ones are run, the
  choice is made again on validation, and when it moves the chosen setting is tested over the seeds.
  Writes ``tuning_digits_wide.csv`` and ``comparison_digits_wide.csv``.
- ``longer``: Shakespeare and text-source ran 40 iterations in the suite. Tune every method again
  at ``--iterations`` (the best setting at 40 iterations need not be the best at 120) and test the
  choices over the seeds. Writes ``long/tuning_<task>.csv`` and ``long/comparison.csv``.

Run: ``python -m analysis.admm_followup edge --out docs/results/admm`` and
``python -m analysis.admm_followup longer --iterations 120 --out docs/results/admm``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch

from exec.admm.data import load_task
from exec.admm.rnn_admm import ADMMConfig

from .admm_suite import ADMM_GRID, TASK_PLANS, _describe, choose, compare, train, tune

LONG_TASKS = ("shakespeare", "text-source")


# One step beyond the suite's grid on its own 1-3-10 ladder, at the corner where digits' choice sat
# (rho_o 0.1, theta_w 0.03 were the grid's smallest values).
WIDE_RHO_O = (0.03, 0.1, 0.3)
WIDE_THETA_W = (0.01, 0.03, 0.1)


def widened_grid(grid: tuple[ADMMConfig, ...] = ADMM_GRID) -> tuple[ADMMConfig, ...]:
    """rho_o x theta_w over the widened values, on the suite grid's fixed settings (rho_a, rho_s, sweep)."""
    base = grid[0]
    return tuple(ADMMConfig(rho_a=base.rho_a, rho_s=base.rho_s, rho_o=r, theta_w=t, sweep=base.sweep)
                 for r in WIDE_RHO_O for t in WIDE_THETA_W)


def edge(out_dir: Path, seeds: int = 3, iterations: int | None = None) -> pd.DataFrame:
    """Re-tune digits' ADMM on the widened grid (validation); test the choice if it moved."""
    task, plan = "digits", TASK_PLANS["digits"]
    known = pd.read_csv(out_dir / f"tuning_{task}.csv") if (out_dir / f"tuning_{task}.csv").is_file() else None
    data = load_task(task, 0)
    rows = []
    for cfg in widened_grid():
        setting = _describe(cfg)
        if known is not None and iterations is None and (known.setting == setting).any():
            rows.append(known[known.setting == setting].iloc[0].to_dict() | {"reused": True})
            continue
        _, history, seconds = train("admm", cfg, data, plan, 0, iterations=iterations)
        last = history.iloc[-1]
        rows.append({"task": task, "method": "admm", "setting": setting, "train_loss": float(last.train_loss),
                     "max_train_loss": float(history.train_loss.max()), "val_loss": float(last.val_loss),
                     "val_acc": float(last.val_acc), "seconds": seconds, "reused": False})
    tuning = pd.DataFrame(rows)
    tuning.to_csv(out_dir / f"tuning_{task}_wide.csv", index=False)
    chosen = choose(tuning)["admm"]
    before = choose(known)["admm"] if known is not None else None
    print(f"digits ADMM on the widened grid: {_describe(chosen)} (suite's grid: "
          f"{_describe(before) if before else 'n/a'})", flush=True)
    if chosen != before:
        data_by_seed = {seed: load_task(task, seed) for seed in range(seeds)}
        compare(task, data_by_seed, plan, {"admm": chosen}, iterations).to_csv(
            out_dir / f"comparison_{task}_wide.csv", index=False)
    return tuning


def longer(out_dir: Path, iterations: int, seeds: int = 3, tasks: tuple[str, ...] = LONG_TASKS) -> pd.DataFrame:
    """Tune and test every method on ``tasks`` at ``iterations`` iterations."""
    long_dir = out_dir / "long"
    long_dir.mkdir(parents=True, exist_ok=True)
    comparisons = []
    for task in tasks:
        plan = TASK_PLANS[task]
        data_by_seed = {seed: load_task(task, seed) for seed in range(seeds)}
        tuning = tune(task, data_by_seed[0], plan, iterations)
        tuning.assign(iterations=iterations).to_csv(long_dir / f"tuning_{task}.csv", index=False)
        comparisons.append(compare(task, data_by_seed, plan, choose(tuning), iterations).assign(iterations=iterations))
    comparison = pd.concat(comparisons, ignore_index=True)
    comparison.to_csv(long_dir / "comparison.csv", index=False)
    return comparison


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=("edge", "longer"))
    parser.add_argument("--out", type=Path, default=Path("docs/results/admm"))
    parser.add_argument("--iterations", type=int, default=None,
                        help="longer: iterations per run (required); edge: override (smoke runs only)")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "edge":
        print(edge(args.out, args.seeds, args.iterations).to_string(), flush=True)
    else:
        if args.iterations is None:
            parser.error("longer needs --iterations (e.g. 120)")
        comparison = longer(args.out, args.iterations, args.seeds)
        print(comparison.groupby(["task", "method"]).test_acc.agg(["mean", "std", "count"]).to_string())


if __name__ == "__main__":
    main()
