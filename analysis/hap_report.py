"""Tables, paired significance tests and figures from the HAP protocol's ``folds.csv`` / ``curves.csv``.

- ``summary``: test accuracy mean, std (ddof 0) and count over (seed, fold) per (dataset, variant),
  the mean best / run epochs, and the share of fits whose best epoch came within the patience of
  the epoch cap (those may not have converged).
- ``paired_tests``: HAP against every other variant per dataset, over the (seed, fold) pairs both
  have: mean difference, wins / ties / losses and the two-sided Wilcoxon signed-rank p value
  (scipy, ``zero_method="zsplit"``: tied folds, common on MUTAG's 19-graph folds, count as half a
  win each instead of being dropped), with Holm's correction over the comparisons of a dataset
  (baselines and ablations are separate families).
- figures: accuracy per dataset and variant (bars, std error bars, majority-class line) and the
  mean validation-accuracy / validation-loss curves (a fit that stopped early keeps its last value).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from exec.hap.baselines import METHODS

KEY = ["seed", "fold"]


def canonical_order(frame: pd.DataFrame, variants: list[str], graphs: dict[str, int] | None = None) -> pd.DataFrame:
    """``frame`` (folds or curves) sorted by dataset, variant, seed, fold (and epoch): every table and
    figure follows first appearance, and a parallel run appends its fits as they finish. Datasets go
    smallest first (``graphs``: graphs per dataset; unknown ones last, by name), variants in the
    order of ``variants`` (others after, by name)."""
    graphs = graphs or {}
    dataset_rank = {d: (graphs.get(d, float("inf")), d) for d in frame["dataset"].unique()}
    dataset_rank = {d: i for i, d in enumerate(sorted(dataset_rank, key=dataset_rank.get))}
    others = sorted(set(frame["variant"]) - set(variants))
    variant_rank = {v: i for i, v in enumerate([*variants, *others])}
    keys = [k for k in ("seed", "fold", "epoch") if k in frame]
    ranked = frame.assign(_dataset=frame["dataset"].map(dataset_rank), _variant=frame["variant"].map(variant_rank))
    ranked = ranked.sort_values(["_dataset", "_variant", *keys], kind="mergesort")
    return ranked.drop(columns=["_dataset", "_variant"]).reset_index(drop=True)


def complete_folds(folds: pd.DataFrame, variants: list[str]) -> pd.DataFrame:
    """Only the (dataset, seed, fold) of ``variants`` that every one of them that ran on the dataset finished.

    A run stopped mid-fold leaves some methods with one fold more than others; a mean over different
    folds would not be a fair comparison, so those fold rows are left out of the tables.
    """
    part = folds[folds["variant"].isin(variants)]
    ran = part.groupby("dataset")["variant"].nunique()
    per_key = part.groupby(["dataset", *KEY])["variant"].transform("nunique")
    return part[per_key.to_numpy() == part["dataset"].map(ran).to_numpy()]


def coverage(complete: pd.DataFrame, variants: list[str], planned_pairs: int) -> pd.DataFrame:
    """Per dataset, the (seed, fold) pairs every one of ``variants`` finished (``complete`` as
    ``complete_folds`` leaves it) against the protocol's ``planned_pairs``; ``status`` is ``complete``
    when they are all there, else ``partial`` (a dataset no verdict may rest on)."""
    part = complete[complete["variant"].isin(variants)]
    rows = []
    for dataset, group in part.groupby("dataset", sort=False):
        pairs = group[KEY].drop_duplicates()
        rows.append({"dataset": dataset, "pairs": len(pairs), "planned_pairs": planned_pairs,
                     "seeds": int(pairs["seed"].nunique()), "methods": int(group["variant"].nunique()),
                     "status": "complete" if len(pairs) >= planned_pairs else "partial"})
    return pd.DataFrame(rows, columns=["dataset", "pairs", "planned_pairs", "seeds", "methods", "status"])


def coverage_markdown(table: pd.DataFrame) -> str:
    lines = ["| dataset | (seed, fold) pairs every method finished | of the protocol's | methods | status |",
             "|---|---|---|---|---|"]
    lines += [f"| {r.dataset} | {r.pairs} | {r.planned_pairs} | {r.methods} | "
              f"{r.status if r.status == 'complete' else '**partial: indicative only, no verdict**'} |"
              for r in table.itertuples()]
    return "\n".join(lines) + "\n"


def summary(folds: pd.DataFrame) -> pd.DataFrame:
    grouped = folds.groupby(["dataset", "variant"], sort=False)
    table = grouped.agg(
        accuracy_mean=("test_accuracy", "mean"),
        accuracy_std=("test_accuracy", lambda a: float(np.std(a, ddof=0))),
        n=("test_accuracy", "size"),
        seeds=("seed", "nunique"),
        best_epoch=("best_epoch", "mean"),
        epochs_run=("epochs_run", "mean"),
        max_epochs=("max_epochs", "max"),
        grid_size=("grid_size", "max"),
        seconds=("seconds", "sum"),
    ).reset_index()
    late = folds["best_epoch"] > folds["max_epochs"] - folds["patience"]
    table["late_best_share"] = late.groupby([folds["dataset"], folds["variant"]], sort=False).mean().values
    return table


def holm(pvalues: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p values, in the input order."""
    order = np.argsort(pvalues)
    adjusted = np.empty(len(pvalues))
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted.tolist()


def paired_tests(folds: pd.DataFrame, reference: str = "hap") -> pd.DataFrame:
    """``reference`` vs every other variant, per dataset, paired over (seed, fold)."""
    from scipy.stats import wilcoxon

    rows = []
    for dataset, part in folds.groupby("dataset", sort=False):
        wide = part.pivot_table(index=KEY, columns="variant", values="test_accuracy")
        if reference not in wide:
            continue
        block = []
        for other in [v for v in dict.fromkeys(part["variant"]) if v != reference]:
            pair = wide[[reference, other]].dropna()
            diff = (pair[reference] - pair[other]).to_numpy()
            if len(diff) == 0:
                continue
            p = 1.0 if np.allclose(diff, 0) else float(wilcoxon(diff, zero_method="zsplit").pvalue)
            family = "baseline" if other in METHODS else "ablation"
            block.append({"dataset": dataset, "reference": reference, "other": other, "family": family,
                          "pairs": len(diff),
                          "mean_difference": float(diff.mean()), "wins": int((diff > 1e-9).sum()),
                          "ties": int((np.abs(diff) <= 1e-9).sum()), "losses": int((diff < -1e-9).sum()),
                          "p_wilcoxon": p})
        for family in ("baseline", "ablation"):  # Holm within a family: baselines apart from ablations
            members = [r for r in block if r["family"] == family]
            for row, adjusted in zip(members, holm([r["p_wilcoxon"] for r in members]), strict=True):
                row["p_holm"] = adjusted
        rows.extend(block)
    return pd.DataFrame(rows)


def accuracy_markdown(table: pd.DataFrame, majority: dict[str, float] | None = None) -> str:
    """Variants as rows, datasets as columns, 'mean ± std (n)' in percent; best mean per dataset bold."""
    datasets = list(dict.fromkeys(table["dataset"]))
    variants = list(dict.fromkeys(table["variant"]))
    cell = {(r.dataset, r.variant): r for r in table.itertuples()}
    best = {d: max(cell[(d, v)].accuracy_mean for v in variants if (d, v) in cell) for d in datasets}
    lines = ["| method | " + " | ".join(datasets) + " |", "|---" * (len(datasets) + 1) + "|"]
    for v in variants:
        cells = []
        for d in datasets:
            r = cell.get((d, v))
            if r is None:
                cells.append("")
                continue
            text = f"{100 * r.accuracy_mean:.1f} ± {100 * r.accuracy_std:.1f} ({r.n})"
            cells.append(f"**{text}**" if r.accuracy_mean == best[d] else text)
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    if majority:
        lines.append("| (majority class) | " + " | ".join(f"{100 * majority[d]:.1f}" for d in datasets) + " |")
    return "\n".join(lines) + "\n"


def late_best_markdown(table: pd.DataFrame) -> str:
    """Share of fits whose best validation epoch came within the patience of the epoch cap, per
    method (rows) and dataset (columns), in percent: those fits may have stopped still improving."""
    wide = table.pivot_table(index="variant", columns="dataset", values="late_best_share", sort=False)
    datasets = list(dict.fromkeys(table["dataset"]))
    lines = ["| method | " + " | ".join(datasets) + " |", "|---" * (len(datasets) + 1) + "|"]
    for variant, row in wide.iterrows():
        cells = ["" if pd.isna(row.get(d)) else f"{100 * row[d]:.0f}%" for d in datasets]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def tests_markdown(tests: pd.DataFrame) -> str:
    lines = ["| dataset | HAP vs | pairs | mean diff (points) | wins/ties/losses | p (Wilcoxon) | p (Holm) |",
             "|---|---|---|---|---|---|---|"]
    for r in tests.itertuples():
        lines.append(f"| {r.dataset} | {r.other} | {r.pairs} | {100 * r.mean_difference:+.1f} | "
                     f"{r.wins}/{r.ties}/{r.losses} | {r.p_wilcoxon:.3g} | {r.p_holm:.3g} |")
    return "\n".join(lines) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(table: pd.DataFrame, stem: Path, note: str, majority: dict[str, float] | None = None) -> None:
    """Grouped bars (mean, std error bars) per dataset; stem.png, stem.pdf and stem.csv (the data)."""
    plt = _pyplot()
    datasets = list(dict.fromkeys(table["dataset"]))
    variants = list(dict.fromkeys(table["variant"]))
    width = 0.85 / len(variants)
    fig, ax = plt.subplots(figsize=(3 + 1.6 * len(datasets) * max(1.0, len(variants) / 6), 3.8))
    cmap = plt.get_cmap("tab20")
    for j, v in enumerate(variants):
        rows = table[table["variant"] == v].set_index("dataset").reindex(datasets)
        xs = np.arange(len(datasets)) + (j - (len(variants) - 1) / 2) * width
        ax.bar(xs, 100 * rows["accuracy_mean"], width, yerr=100 * rows["accuracy_std"], capsize=1.5,
               label=v, color=cmap(j % 20), edgecolor="black" if v == "hap" else None)
    for i, d in enumerate(datasets):
        if majority and d in majority:
            ax.hlines(100 * majority[d], i - 0.45, i + 0.45, colors="black", linestyles="dashed", linewidth=1)
    ax.set_xticks(np.arange(len(datasets)), [f"{d}\n(n={int(table[table.dataset == d]['n'].max())})"
                                              for d in datasets])
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(textwrap.fill(note, 110), fontsize=7)
    low = max(0.0, 100 * float((table["accuracy_mean"] - table["accuracy_std"]).min()) - 10)
    ax.set_ylim(low, 100)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    for suffix in ("png", "pdf"):
        fig.savefig(stem.with_suffix(f".{suffix}"), dpi=150)
    plt.close(fig)
    table.to_csv(stem.with_suffix(".csv"), index=False)


def mean_curves(curves: pd.DataFrame) -> pd.DataFrame:
    """Mean validation accuracy and loss per (dataset, variant, epoch); stopped fits carry their last value."""
    frames = []
    for (dataset, variant), part in curves.groupby(["dataset", "variant"], sort=False):
        last = int(part["epoch"].max())
        wide_acc = part.pivot_table(index="epoch", columns=KEY, values="val_accuracy").reindex(range(1, last + 1))
        wide_loss = part.pivot_table(index="epoch", columns=KEY, values="val_loss").reindex(range(1, last + 1))
        wide_train = part.pivot_table(index="epoch", columns=KEY, values="train_loss").reindex(range(1, last + 1))
        frames.append(pd.DataFrame({
            "dataset": dataset, "variant": variant, "epoch": wide_acc.index,
            "val_accuracy": wide_acc.ffill().mean(axis=1).to_numpy(),
            "val_loss": wide_loss.ffill().mean(axis=1).to_numpy(),
            "train_loss": wide_train.ffill().mean(axis=1).to_numpy(),
            "running": wide_acc.notna().sum(axis=1).to_numpy(),
        }))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def plot_curves(curves: pd.DataFrame, stem: Path, note: str) -> None:
    """Per dataset: mean validation accuracy (top) and loss (bottom) against epoch for every variant."""
    plt = _pyplot()
    mean = mean_curves(curves)
    datasets = list(dict.fromkeys(mean["dataset"]))
    fig, axes = plt.subplots(2, len(datasets), figsize=(3.2 * len(datasets) + 1.5, 5.2), squeeze=False)
    cmap = plt.get_cmap("tab20")
    variants = list(dict.fromkeys(mean["variant"]))
    for i, d in enumerate(datasets):
        for j, v in enumerate(variants):
            part = mean[(mean.dataset == d) & (mean.variant == v)]
            if part.empty:
                continue
            style = {"color": cmap(j % 20), "linewidth": 2.0 if v == "hap" else 0.9, "label": v}
            axes[0][i].plot(part["epoch"], 100 * part["val_accuracy"], **style)
            axes[1][i].plot(part["epoch"], part["val_loss"], **style)
        axes[0][i].set_title(d, fontsize=9)
        axes[1][i].set_xlabel("epoch")
    axes[0][0].set_ylabel("mean val accuracy (%)")
    axes[1][0].set_ylabel("mean val cross-entropy")
    axes[0][-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.suptitle(textwrap.fill(note, 40 * len(datasets) + 30), fontsize=7)
    fig.tight_layout()
    for suffix in ("png", "pdf"):
        fig.savefig(stem.with_suffix(f".{suffix}"), dpi=100)
    plt.close(fig)
    mean.round(5).to_csv(stem.with_suffix(".csv"), index=False)
