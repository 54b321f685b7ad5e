"""Two follow-ups to the ADMMiRNN suite (docs/admm.md, "Limits"), same protocol as the suite:
settings chosen on the validation split, the test split read once per run.

- ``edge``: on digits the chosen ADMM setting sat at the corner of its grid (the smallest rho_o,
  0.1, and theta_w, 0.03). The grid is widened by one step of its 1-3-10 ladder past every edge
  the choice sits on, the choice is made again on validation, and so on until it is interior.
  Points already run (the suite's ``tuning_digits.csv``, an earlier ``tuning_digits_wide.csv``) are
  reused: a run is deterministic for a seed. When the final choice differs from the suite's, it is
  tested over the seeds. Writes ``tuning_digits_wide.csv`` and ``comparison_digits_wide.csv``.
- ``longer``: Shakespeare and text-source ran 40 iterations in the suite. Tune every method again
  at ``--iterations`` (the best setting at 40 iterations need not be the best at 120) and test the
  choices over the seeds. Writes ``long/tuning_<task>.csv`` and ``long/comparison.csv``.

Run: ``python -m analysis.admm_followup edge --out docs/results/admm`` and
``python -m analysis.admm_followup longer --iterations 120 --out docs/results/admm``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd
import torch

from exec.admm.data import load_task
from exec.admm.rnn_admm import ADMMConfig

from .admm_suite import ADMM_GRID, TASK_PLANS, _describe, choose, compare, train, tune

LONG_TASKS = ("shakespeare", "text-source")


MAX_WIDENINGS = 4  # at most this many steps past the suite's grid along each axis


def ladder_step(value: float, down: bool) -> float:
    """The next value on the 1-3-10 ladder of the suite's grids (..., 0.01, 0.03, 0.1, 0.3, ...)."""
    mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
    factor = (0.3 if mantissa < 2 else 1 / 3) if down else (3.0 if mantissa < 2 else 10 / 3)
    return float(f"{value * factor:.6g}")


def grid_of(rhos: set[float], thetas: set[float], base: ADMMConfig = ADMM_GRID[0]) -> tuple[ADMMConfig, ...]:
    """rho_o x theta_w on the suite grid's fixed settings (rho_a, rho_s, sweep)."""
    return tuple(ADMMConfig(rho_a=base.rho_a, rho_s=base.rho_s, rho_o=r, theta_w=t, sweep=base.sweep)
                 for r in sorted(rhos) for t in sorted(thetas))


def widened(values: set[float], chosen: float) -> set[float]:
    """``values`` plus one ladder step past the edge ``chosen`` sits on (none when it is interior)."""
    if chosen == min(values):
        return values | {ladder_step(chosen, down=True)}
    if chosen == max(values):
        return values | {ladder_step(chosen, down=False)}
    return values


def edge(out_dir: Path, seeds: int = 3, iterations: int | None = None) -> pd.DataFrame:
    """Re-tune digits' ADMM on validation, widening the grid past every edge the choice sits on
    until it is interior (at most ``MAX_WIDENINGS`` times); test the final choice if it moved."""
    task, plan = "digits", TASK_PLANS["digits"]
    paths = [out_dir / f"tuning_{task}.csv", out_dir / f"tuning_{task}_wide.csv"]
    known = pd.concat([pd.read_csv(p) for p in paths if p.is_file()] or [pd.DataFrame(columns=["setting"])])
    known = known.drop_duplicates("setting")
    suite_choice = choose(pd.read_csv(paths[0]))["admm"] if paths[0].is_file() else None
    data = load_task(task, 0)
    rows: dict[str, dict] = {}
    rhos, thetas = {c.rho_o for c in ADMM_GRID}, {c.theta_w for c in ADMM_GRID}
    for _ in range(MAX_WIDENINGS + 1):
        for cfg in grid_of(rhos, thetas):
            setting = _describe(cfg)
            if setting in rows:
                continue
            if iterations is None and (known.setting == setting).any():  # runs are deterministic per seed
                rows[setting] = known[known.setting == setting].iloc[0].to_dict() | {"reused": True}
                continue
            _, history, seconds = train("admm", cfg, data, plan, 0, iterations=iterations)
            last = history.iloc[-1]
            rows[setting] = {"task": task, "method": "admm", "setting": setting,
                             "train_loss": float(last.train_loss), "max_train_loss": float(history.train_loss.max()),
                             "val_loss": float(last.val_loss), "val_acc": float(last.val_acc), "seconds": seconds,
                             "reused": False}
        chosen = choose(pd.DataFrame(rows.values()))["admm"]
        grown = widened(rhos, chosen.rho_o), widened(thetas, chosen.theta_w)
        if grown == (rhos, thetas):
            break
        rhos, thetas = grown
    tuning = pd.DataFrame(rows.values())
    tuning.to_csv(paths[1], index=False)
    print(f"digits ADMM, grid rho_o {sorted(rhos)} x theta_w {sorted(thetas)}: {_describe(chosen)} "
          f"(suite's grid: {_describe(suite_choice) if suite_choice else 'n/a'})", flush=True)
    if chosen != suite_choice:
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
