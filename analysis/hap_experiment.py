"""HAP vs graph-pooling baselines: stratified k-fold cross-validation on TU datasets.

For every dataset, fold and method: train on k-1 folds (10% of them held out for picking the
epoch), test on the remaining fold. All methods see the same folds, the same batches and the same
seed per fold, so the comparison is paired. Outputs in ``out_dir``:

- ``hap_folds.csv``: one row per (dataset, method, fold);
- ``hap_results.csv`` / ``hap_results.md``: accuracy mean and std over the folds per (dataset, method);
- ``hap_accuracy.png`` / ``.pdf``: grouped bars with std error bars and the majority-class line.

Run: ``python -m analysis.hap_experiment --datasets MUTAG PROTEINS --epochs 30 --out runs/hap``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from exec.hap.baselines import METHODS
from exec.hap.data import TU_NAMES, graph_labels, load_tu, majority_accuracy
from exec.hap.train import TrainConfig, fit
from traces.errors import ConfigError

DEFAULT_EPOCHS = 30


def clusters_for(dataset) -> tuple[int, int]:
    """Cluster counts of the two coarsened levels (HAP and DiffPool): 1/2 then 1/8 of the mean size."""
    mean_nodes = float(np.mean([graph.num_nodes for graph in dataset]))
    return max(2, math.ceil(mean_nodes / 2)), max(2, math.ceil(mean_nodes / 8))


def _splits(labels: np.ndarray, folds: int, seed: int):
    """(train, val, test) index arrays per fold: stratified folds, then a stratified 10% val split."""
    from sklearn.model_selection import StratifiedKFold, train_test_split

    outer = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    for fold, (rest, test) in enumerate(outer.split(np.zeros(len(labels)), labels)):
        train, val = train_test_split(
            rest, test_size=0.1, stratify=labels[rest], random_state=seed * 1000 + fold
        )
        yield fold, np.sort(train), np.sort(val), test


def _validate(datasets: Sequence[str], methods: Sequence[str], folds: int, epochs: int) -> None:
    if not datasets:
        raise ConfigError("datasets", "no dataset given", f"name at least one of {', '.join(TU_NAMES)}")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ConfigError("methods", f"unknown method(s) {', '.join(unknown)}",
                          f"choose from {', '.join(METHODS)}")
    if folds < 2:
        raise ConfigError("folds", f"need at least 2 folds, got {folds}", "pass folds >= 2 (10 is usual)")
    if epochs < 1:
        raise ConfigError("epochs", f"need at least 1 epoch, got {epochs}", "pass epochs >= 1")


def run_hap_experiment(
    datasets: list[str],
    methods: list[str] | None = None,
    folds: int = 10,
    epochs: int = DEFAULT_EPOCHS,
    out_dir: Path = Path("runs/hap"),
    seed: int = 0,
    data_root: Path | None = None,
    *,
    cache_dir: Path | None = None,
    train: TrainConfig | None = None,
    verbose: bool = True,
) -> pd.DataFrame:
    """Cross-validate ``methods`` (default: all of METHODS) on ``datasets``; write tables and figure.

    Returns the summary table: dataset, method, accuracy_mean, accuracy_std, folds, epochs,
    majority_accuracy, seconds.
    """
    methods = list(methods) if methods else list(METHODS)
    _validate(datasets, methods, folds, epochs)
    base = train or TrainConfig()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    majority: dict[str, float] = {}
    for name in datasets:
        dataset = load_tu(name, data_root=data_root, cache_dir=cache_dir)
        labels = graph_labels(dataset)
        majority[name] = majority_accuracy(labels)
        config = TrainConfig(**{**base.__dict__, "epochs": epochs, "clusters": clusters_for(dataset)})
        for fold, train_idx, val_idx, test_idx in _splits(labels.numpy(), folds, seed):
            for method in methods:
                result = fit(
                    method, dataset, torch.as_tensor(train_idx), torch.as_tensor(val_idx),
                    torch.as_tensor(test_idx), config, seed=seed * 1000 + fold,
                )
                rows.append({"dataset": name, "method": method, "fold": fold, **result.__dict__})
                if verbose:
                    print(
                        f"{name:9s} fold {fold:2d} {method:9s} test {result.test_accuracy:.3f} "
                        f"val {result.val_accuracy:.3f} epoch {result.best_epoch:3d} {result.seconds:6.1f}s",
                        flush=True,
                    )
    per_fold = pd.DataFrame(rows)
    per_fold.to_csv(out_dir / "hap_folds.csv", index=False)
    summary = summarize(per_fold, epochs, majority)
    summary.to_csv(out_dir / "hap_results.csv", index=False)
    (out_dir / "hap_results.md").write_text(markdown_table(summary))
    plot_accuracy(summary, out_dir / "hap_accuracy")
    return summary


def summarize(per_fold: pd.DataFrame, epochs: int, majority: dict[str, float]) -> pd.DataFrame:
    """Mean and std (over folds, ddof=0) of the test accuracy per (dataset, method), in input order."""
    grouped = per_fold.groupby(["dataset", "method"], sort=False)
    summary = grouped.agg(
        accuracy_mean=("test_accuracy", "mean"),
        accuracy_std=("test_accuracy", lambda a: float(np.std(a, ddof=0))),
        folds=("fold", "count"),
        seconds=("seconds", "sum"),
    ).reset_index()
    summary.insert(5, "epochs", epochs)
    summary.insert(6, "majority_accuracy", summary["dataset"].map(majority))
    return summary


def markdown_table(summary: pd.DataFrame) -> str:
    """Methods as rows, datasets as columns, cells 'mean ± std' in percent; best mean per dataset bold."""
    datasets = list(dict.fromkeys(summary["dataset"]))
    methods = list(dict.fromkeys(summary["method"]))
    cell = {(r.dataset, r.method): (r.accuracy_mean, r.accuracy_std) for r in summary.itertuples()}
    best = {d: max(cell[(d, m)][0] for m in methods if (d, m) in cell) for d in datasets}
    lines = ["| method | " + " | ".join(datasets) + " |", "|---" * (len(datasets) + 1) + "|"]
    for m in methods:
        cells = []
        for d in datasets:
            if (d, m) not in cell:
                cells.append("")
                continue
            mean, std = cell[(d, m)]
            text = f"{100 * mean:.1f} ± {100 * std:.1f}"
            cells.append(f"**{text}**" if mean == best[d] else text)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    majority = summary.drop_duplicates("dataset").set_index("dataset")["majority_accuracy"]
    lines.append("| (majority class) | " + " | ".join(f"{100 * majority[d]:.1f}" for d in datasets) + " |")
    return "\n".join(lines) + "\n"


def plot_accuracy(summary: pd.DataFrame, stem: Path) -> None:
    """Grouped bar chart of accuracy (mean, std error bars) per dataset; saved as stem.png and stem.pdf."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(summary["dataset"]))
    methods = list(dict.fromkeys(summary["method"]))
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(2.6 + 1.1 * len(datasets) * max(1.0, len(methods) / 4), 3.4))
    for j, method in enumerate(methods):
        rows = summary[summary["method"] == method].set_index("dataset").reindex(datasets)
        xs = np.arange(len(datasets)) + (j - (len(methods) - 1) / 2) * width
        ax.bar(xs, 100 * rows["accuracy_mean"], width, yerr=100 * rows["accuracy_std"], capsize=2,
               label=method)
    majority = summary.drop_duplicates("dataset").set_index("dataset")["majority_accuracy"]
    for i, d in enumerate(datasets):
        ax.hlines(100 * majority[d], i - 0.45, i + 0.45, colors="black", linestyles="dashed", linewidth=1)
    ax.set_xticks(np.arange(len(datasets)), datasets)
    ax.set_ylabel("test accuracy (%)")
    folds = int(summary["folds"].max())
    epochs = int(summary["epochs"].iloc[0])
    ax.set_title(f"{folds}-fold CV, {epochs} epochs; dashed: majority class", fontsize=9)
    low = max(0.0, 100 * float((summary["accuracy_mean"] - summary["accuracy_std"]).min()) - 10)
    ax.set_ylim(low, 100)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=150)
    fig.savefig(stem.with_suffix(".pdf"))
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", default=["MUTAG", "PROTEINS"])
    parser.add_argument("--methods", nargs="+", default=None)
    parser.add_argument("--folds", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/hap"))
    parser.add_argument("--data-root", type=Path, default=None)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr, help="Adam learning rate, all methods")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one core per experiment on a shared machine
    start = time.perf_counter()
    summary = run_hap_experiment(
        args.datasets, args.methods, args.folds, args.epochs, args.out, args.seed, args.data_root,
        train=TrainConfig(lr=args.lr),
    )
    print(markdown_table(summary))
    print(f"wrote {args.out}/hap_results.csv, .md, hap_folds.csv, hap_accuracy.png/.pdf "
          f"in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
