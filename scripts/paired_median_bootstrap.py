"""Is one calibration run's held-out median error different from another's beyond noise? A paired
bootstrap over the held-out rows (docs/accuracy.md section 13).

    python scripts/paired_median_bootstrap.py runs/vtrain_default/predictions.csv runs/vtrain_e6/predictions.csv

Both files are ``python -m analysis.calibrate --out DIR`` predictions (same rows, ``row_id``); for each
held-out model shape it resamples the rows with replacement (the same draw for both runs) and reports
the median |error| of each and the 95% interval of their difference (second minus first), for the
``err_<predictor>`` column (default ``sim_host``, what the section's tables quote).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd


def paired_median_difference(before: np.ndarray, after: np.ndarray, draws: int, seed: int) -> tuple[float, float]:
    """95% interval of median(after) - median(before) over ``draws`` paired resamples of the rows."""
    rng = np.random.default_rng(seed)
    n = len(before)
    diffs = [float(np.median(after[i]) - np.median(before[i])) for i in (rng.integers(0, n, n) for _ in range(draws))]
    return float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--predictor", default="sim_host")
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    a, b = (pd.read_csv(p).set_index("row_id") for p in (args.before, args.after))
    column = f"err_{args.predictor}"
    for shape in a.held_out_model.unique():
        ea = a[a.held_out_model == shape][column].abs()
        eb = b.loc[ea.index, column].abs()
        lo, hi = paired_median_difference(ea.to_numpy(), eb.to_numpy(), args.draws, args.seed)
        print(f"{shape}: {len(ea)} rows, median |err| {ea.median():.2%} -> {eb.median():.2%}, difference "
              f"95% interval [{lo:+.2%}, {hi:+.2%}]; rows closer {(eb < ea).sum()}, further {(eb > ea).sum()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
