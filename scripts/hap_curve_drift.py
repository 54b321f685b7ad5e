"""Where two HAP runs of the same fits part: per fit, the first epoch whose validation loss differs.

    python scripts/hap_curve_drift.py OLD_DIR NEW_DIR [--tolerance 1e-3] [--epochs 100] [--capped-only]

For every (dataset, variant, seed, fold) in both directories' ``curves.csv`` (or ``.csv.gz``), compares
the validation loss epoch by epoch over the first ``--epochs`` epochs both ran and prints the first
epoch that differs at all and the first that differs by more than ``--tolerance``, then their
spread. ``--capped-only``: only the fits that reached their cap in OLD (those ``run --carry-from``
trains again; the others are copied and equal by construction). Used to tell float rounding of
another machine (curves agree for some epochs, then drift) from a code change (they differ from the
first epoch on). docs/hap.md, "Reproducibility".
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

KEY = ["dataset", "variant", "seed", "fold"]


def read_curves(directory: Path) -> pd.DataFrame:
    for name in ("curves.csv", "curves.csv.gz"):
        if (directory / name).exists():
            return pd.read_csv(directory / name)
    raise SystemExit(f"{directory}: no curves.csv or curves.csv.gz")


def first_epochs(old: pd.DataFrame, new: pd.DataFrame, tolerance: float, epochs: int) -> pd.DataFrame:
    """One row per fit in both: the first epoch that differs at all, and by more than ``tolerance``."""
    both = old.merge(new, on=[*KEY, "epoch"], suffixes=("_old", "_new"))
    both = both[both["epoch"] <= epochs]
    both["gap"] = (both["val_loss_old"] - both["val_loss_new"]).abs()
    rows = []
    for key, fit in both.groupby(KEY, sort=True):
        differs = fit.loc[fit["gap"] > 0, "epoch"]
        drifts = fit.loc[fit["gap"] > tolerance, "epoch"]
        rows.append({**dict(zip(KEY, key, strict=True)), "epochs_compared": len(fit),
                     "first_difference": differs.min() if len(differs) else None,
                     "first_beyond_tolerance": drifts.min() if len(drifts) else None})
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--capped-only", action="store_true", help="only fits that reached their cap in OLD")
    args = parser.parse_args()
    old = read_curves(args.old)
    if args.capped_only:
        folds = pd.read_csv(args.old / "folds.csv")
        capped = folds.loc[folds["epochs_run"] >= folds["max_epochs"], KEY]
        old = old.merge(capped, on=KEY)
    table = first_epochs(old, read_curves(args.new), args.tolerance, args.epochs)
    if table.empty:
        raise SystemExit("no fit is in both directories")
    print(table.to_string(index=False))
    beyond = table["first_beyond_tolerance"].dropna()
    print(f"{len(table)} fits; identical over the compared epochs: {table['first_difference'].isna().sum()}; "
          f"beyond {args.tolerance:g}: {len(beyond)} (first epoch min {beyond.min():.0f}, median "
          f"{beyond.median():.0f}, max {beyond.max():.0f})" if len(beyond) else f"{len(table)} fits; none beyond")


if __name__ == "__main__":
    main()
