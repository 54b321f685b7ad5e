"""The validation suite's figures across independent runs: per plan and per summary figure, the
median and the range over runs (issue 16: a figure that moves between runs is reported as a range).

    python scripts/suite_spread.py runs/suite-1 runs/suite-2 runs/suite-3
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from analysis.metrics import spearman


def summary_of(table: pd.DataFrame) -> dict[str, float]:
    return {"median |error|": table["abs_error"].median(), "max |error|": table["abs_error"].max(),
            "mean error": table["error"].mean(),
            "too fast (of plans)": float((table["error"] < 0).sum()),
            "Spearman": spearman(table["predicted_s"], table["measured_median_s"])}


def main(folders: list[str]) -> None:
    runs = {Path(f).name: pd.read_csv(Path(f) / "suite.csv") for f in folders}
    errors = pd.DataFrame({name: t.set_index("plan")["error"] for name, t in runs.items()})
    print(f"per plan, error over {len(runs)} runs (predicted / measured median - 1)\n")
    print("| plan | " + " | ".join(errors.columns) + " | median | range |")
    print("| --- |" + " --- |" * (len(errors.columns) + 2))
    for plan, row in errors.iterrows():
        cells = " | ".join(f"{v:+.1%}" for v in row)
        print(f"| {plan} | {cells} | {row.median():+.1%} | {row.min():+.1%} .. {row.max():+.1%} |")
    summaries = pd.DataFrame({name: summary_of(t) for name, t in runs.items()})
    print("\n| figure | " + " | ".join(summaries.columns) + " | median | range |")
    print("| --- |" + " --- |" * (len(summaries.columns) + 2))
    for figure, row in summaries.iterrows():
        fmt = {"Spearman": "{:.3f}", "too fast (of plans)": "{:.0f}", "mean error": "{:+.1%}"}.get(figure, "{:.1%}")
        cells = " | ".join(fmt.format(v) for v in row)
        print(f"| {figure} | {cells} | {fmt.format(row.median())} | {fmt.format(row.min())} .. "
              f"{fmt.format(row.max())} |")


if __name__ == "__main__":
    main(sys.argv[1:])
