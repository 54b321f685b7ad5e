"""Seconds per epoch of every HAP-protocol method, this tree against an older commit, same curves.

    nice -n 5 python benchmarks/hap_fit_speed.py [--before fd6347a] [--dataset PROTEINS] \\
        [--methods hap gcn-mean ...] [--epochs 3] [--repeats 3] [--fold-epochs docs/results/hap-cap300/folds.csv]

One fit per method (seed 0, fold 0 of the protocol's split, lr 1e-3, ``--epochs`` epochs without
early stopping, 1 thread), as ``analysis.hap_protocol`` runs it. ``--before`` is checked out with
``git archive`` into a scratch folder and run in a child process with that folder first on the path
(the "before" code), this tree in another child (the "after" code); the two alternate, repeat by
repeat, so a load change on a shared machine hits both alike. Prints per method the median CPU
(process) seconds and wall seconds per epoch of each (min-max over the repeats in brackets), the
CPU ratio, and whether the fit's per-epoch
training loss, validation accuracy and loss and the test accuracy are identical (bit for bit) in the
two. Wall-clock numbers depend on the machine and its load: say which when quoting them.
``--fold-epochs`` adds the estimate for one (seed, fold) of every method: each method's median CPU
s/epoch times its mean ``epochs_run`` over that folds.csv's rows of the dataset.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALL_METHODS = ("hap", "gcn-mean", "gcn-max", "topk", "sag", "asap", "edge", "sort", "diffpool", "mincut", "mem")


def child(dataset_name: str, methods: list[str], epochs: int) -> None:
    """Fit every method once in the code found first on sys.path; print one JSON line."""
    from dataclasses import replace

    import torch

    from analysis.hap_protocol import VARIANTS, candidates, clusters_for, splits
    from exec.hap.data import graph_labels, load_tu
    from exec.hap.train import TrainConfig, fit_tuned

    torch.set_num_threads(1)
    dataset = load_tu(dataset_name)
    _, train, val, test = next(splits(graph_labels(dataset).numpy(), 10, 0))
    base = replace(TrainConfig(), epochs=epochs, clusters=clusters_for(dataset))
    out = {}
    for method in methods:
        config = candidates(VARIANTS[method], base, (1e-3,))[0]
        start, cpu = time.perf_counter(), time.process_time()
        result = fit_tuned(method, dataset, torch.as_tensor(train), torch.as_tensor(val), torch.as_tensor(test),
                           [config], seed=0)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        curve = [[e.train_loss, e.val_accuracy, e.val_loss] for e in result.curve]
        out[method] = {"s_per_epoch": seconds / epochs, "cpu_per_epoch": cpu / epochs, "curve": curve,
                       "test": result.test_accuracy}
    print(json.dumps(out))


def run_child(tree: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--dataset", args.dataset,
               "--epochs", str(args.epochs), "--methods", *args.methods]
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def mean_epochs(folds_csv: Path, dataset: str) -> dict[str, float]:
    """Mean ``epochs_run`` per variant over the rows of ``dataset`` in a protocol's folds.csv."""
    runs: dict[str, list[int]] = {}
    with open(folds_csv, newline="") as handle:
        for row in csv.DictReader(handle):
            if row["dataset"] == dataset:
                runs.setdefault(row["variant"], []).append(int(row["epochs_run"]))
    if not runs:
        raise SystemExit(f"error: --fold-epochs: no {dataset} rows in {folds_csv} (fix: give one that has some)")
    return {variant: sum(epochs) / len(epochs) for variant, epochs in runs.items()}


def print_fold_estimate(cpu: dict[str, dict[str, float]], epochs: dict[str, float]) -> None:
    """CPU seconds of one (seed, fold) of every method, before and after (``--fold-epochs``);
    ``cpu[side][method]``: the median CPU s/epoch."""
    missing = sorted(set(cpu["after"]) - set(epochs))
    if missing:
        print(f"(no fold estimate: no rows for {', '.join(missing)} in the folds.csv)")
        return
    before, after = (sum(cpu[side][method] * epochs[method] for method in cpu[side]) for side in ("before", "after"))
    print(f"one (seed, fold), mean epochs_run per method from --fold-epochs: CPU s before {before:.0f}, "
          f"after {after:.0f} ({after / before:.2f}); x 30 (3 seeds x 10 folds): {30 * before / 3600:.1f} "
          f"-> {30 * after / 3600:.1f} core-hours")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="fd6347a", help="git ref of the code to compare against")
    parser.add_argument("--dataset", default="PROTEINS")
    parser.add_argument("--methods", nargs="+", default=list(ALL_METHODS))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fold-epochs", type=Path, help="a folds.csv: estimate one (seed, fold) from its epochs_run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.dataset, args.methods, args.epochs)
        return
    with tempfile.TemporaryDirectory() as scratch:
        archive = subprocess.run(["git", "archive", args.before, "exec", "analysis", "traces"], cwd=ROOT,
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", scratch], input=archive, check=True)
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for _ in range(args.repeats):
            runs["before"].append(run_child(Path(scratch), args))
            runs["after"].append(run_child(ROOT, args))
    print(f"{args.dataset}, {args.epochs} epochs, seed 0 fold 0, 1 thread, {args.repeats} repeats alternating; "
          f"before = {args.before}, after = this tree")
    print("CPU seconds (process time: what a core-hour estimate needs, less sensitive to other jobs than "
          "wall time) and wall seconds per epoch, median (min-max) over the repeats")
    print("| method | before CPU s/epoch | after CPU s/epoch | after/before | before wall | after wall "
          "| same curve and test accuracy |")
    print("|---|---|---|---|---|---|---|")
    totals = {(side, kind): 0.0 for side in ("before", "after") for kind in ("cpu", "s")}
    cpu_medians: dict[str, dict[str, float]] = {"before": {}, "after": {}}
    for method in args.methods:
        cells, medians = {}, {}
        for side in ("before", "after"):
            for kind in ("cpu", "s"):
                values = [run[method][f"{kind}_per_epoch"] for run in runs[side]]
                medians[side, kind] = statistics.median(values)
                totals[side, kind] += medians[side, kind]
                cells[side, kind] = f"{medians[side, kind]:.3f} ({min(values):.3f}-{max(values):.3f})"
        same = all(run[method]["curve"] == runs["before"][0][method]["curve"]
                   and run[method]["test"] == runs["before"][0][method]["test"]
                   for side in ("before", "after") for run in runs[side])
        ratio = medians["after", "cpu"] / medians["before", "cpu"]
        for side in ("before", "after"):
            cpu_medians[side][method] = medians[side, "cpu"]
        print(f"| {method} | {cells['before', 'cpu']} | {cells['after', 'cpu']} | {ratio:.2f} | "
              f"{cells['before', 's']} | {cells['after', 's']} | {'yes' if same else 'NO'} |")
    print(f"| all | {totals['before', 'cpu']:.2f} | {totals['after', 'cpu']:.2f} | "
          f"{totals['after', 'cpu'] / totals['before', 'cpu']:.2f} | {totals['before', 's']:.2f} | "
          f"{totals['after', 's']:.2f} | |")
    if args.fold_epochs:
        print_fold_estimate(cpu_medians, mean_epochs(args.fold_epochs, args.dataset))

if __name__ == "__main__":
    main()
