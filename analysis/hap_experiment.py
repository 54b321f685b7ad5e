"""HAP vs graph-pooling baselines under one protocol: run (resumable), then tables, tests and figures.

Commands (``python -m analysis.hap_experiment <command> ...``):

- ``run``: the protocol of ``analysis.hap_protocol`` for ``--plan NAME[:SEEDSxFOLDS[:EPOCHS]] ...``
  (every method of ``exec.hap.baselines.METHODS``) and ``--ablation-plan ...`` (HAP and its
  ablations), appending per fold to ``OUT/folds.csv`` and ``OUT/curves.csv``; a rerun skips the
  folds already done, so the full protocol is one command on a bigger machine::

      python -m analysis.hap_experiment run --out docs/results/hap \\
          --plan MUTAG PTC_MR ENZYMES PROTEINS NCI1 --ablation-plan MUTAG PTC_MR

  (a bare NAME is 3 seeds x 10 folds, seeds 0-2; ``--seeds 1 2`` names the seeds instead, e.g. to
  complete seeds 1 and 2 only). ``--workers N`` runs N fits at a time on local processes,
  ``--scheduler local-dask`` or ``--scheduler tcp://host:port`` on Dask workers; this process writes
  every result. Then ``report`` is run on the same directory.
- ``report``: from ``OUT/folds.csv`` and ``curves.csv``, writes ``summary.csv``, ``tests.csv``,
  ``results.md`` (accuracy tables and the paired Wilcoxon tests of HAP against every other method
  and ablation) and the figures ``hap_accuracy``, ``hap_ablation``, ``hap_curves`` (.png, .pdf, .csv)
  into ``--figures`` (default OUT).
- ``merge``: concatenate the CSVs of several ``run`` directories (run side by side) into ``--out``,
  keeping the first row of a key that appears twice.
- ``measure``: seconds per epoch of every method on one fold, to size a run.

``run_hap_experiment`` (used by ``paratwin hap``) is the one-seed form of ``run`` + ``report``.

``run``, ``merge`` and ``report`` hold ``--out``'s ``OutputLock`` for the whole command: a second
command on the same folder is refused in one line naming the holder. ``cli`` prints any error
paratwin reports as one line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch

from exec.hap.baselines import METHODS
from exec.hap.train import TrainConfig
from traces.errors import ConfigError
from traces.outdir import OutputLock

from . import hap_report as report
from .executors import check_workers
from .hap_protocol import (
    ABLATIONS,
    DEFAULT_LRS,
    FOLD_KEY,
    DatasetPlan,
    Protocol,
    carry_over,
    parse_plan,
    parse_seeds,
    run_protocol,
)
from .report import error_console, run_cli

DEFAULT_EPOCHS = 100
DEFAULT_PATIENCE = 20
HARDWARE_NOTE = "CPU, 1 thread per run"  # say more with --note (the machine, its load)


def write_report(results: Path, figures: Path | None = None, note: str = HARDWARE_NOTE,
                 planned_pairs: int | None = None) -> pd.DataFrame:
    """Tables, tests and figures from ``results/folds.csv`` (+ curves.csv, datasets.csv); returns the summary.
    ``planned_pairs``: the (seed, fold) pairs a dataset needs to count as complete (default: the
    protocol's 3 seeds x 10 folds); only complete datasets get paired significance tests."""
    results = Path(results)
    check_results(results)
    with OutputLock(results):  # reentrant: `run` and `merge` hold it already
        return _write_report(results, Path(figures) if figures else results, note, planned_pairs)


def check_results(results: Path) -> None:
    """Refuse in one line a folder without ``folds.csv`` (before a lock creates a mistyped one)."""
    if not (Path(results) / "folds.csv").is_file():
        raise ConfigError("--out", f"{results} holds no folds.csv",
                          "name a directory that `run` or `merge` wrote")


def _write_report(results: Path, figures: Path, note: str, planned_pairs: int | None) -> pd.DataFrame:
    figures.mkdir(parents=True, exist_ok=True)
    info = pd.read_csv(results / "datasets.csv") if (results / "datasets.csv").exists() else None
    majority = dict(zip(info["dataset"], info["majority_accuracy"], strict=True)) if info is not None else None
    graphs = dict(zip(info["dataset"], info["graphs"], strict=True)) if info is not None else None
    # Tables follow this order (baselines, HAP, its ablations), not the order fits finished in.
    order = [*(m for m in METHODS if m != "hap"), "hap", *ABLATIONS]
    folds = report.canonical_order(pd.read_csv(results / "folds.csv"), order, graphs)
    main_folds = report.complete_folds(folds, list(METHODS))
    ablation_folds = report.complete_folds(folds, ["hap", *ABLATIONS])
    ablation_folds = ablation_folds[ablation_folds["dataset"].isin(folds[folds["variant"].isin(ABLATIONS)]["dataset"])]
    complete = pd.concat([main_folds, ablation_folds]).drop_duplicates(FOLD_KEY)
    table = report.summary(complete)
    table.to_csv(results / "summary.csv", index=False)
    if planned_pairs is None:
        protocol = DatasetPlan("")  # the protocol's default: 3 seeds x 10 folds
        planned_pairs = len(protocol.seeds) * protocol.folds
    covered = report.coverage(main_folds, list(METHODS), planned_pairs)
    covered.to_csv(results / "coverage.csv", index=False)
    # Significance only where the protocol is complete: a partial dataset's few pairs are indicative.
    done = covered.loc[covered["status"] == "complete", "dataset"]
    tests = report.paired_tests(complete[complete["dataset"].isin(done)])
    tests.to_csv(results / "tests.csv", index=False)
    main = table[table["variant"].isin(METHODS)]
    ablation = table[table["variant"].isin(["hap", *ABLATIONS])]
    ablation = ablation[ablation["dataset"].isin(table[table["variant"].isin(ABLATIONS)]["dataset"])]
    knobs = (f"{note}; stratified 10-fold CV (first n folds x seeds), epoch and lr picked on a "
             f"10% validation split; error bars: std over folds x seeds; dashed: majority class")
    parts = ["## Protocol coverage\n", report.coverage_markdown(covered),
             "\n## Test accuracy (%), mean ± std (folds x seeds)\n", report.accuracy_markdown(main, majority)]
    parts += ["\n## Late-best share: fits whose best validation epoch was within the patience of the cap\n",
              report.late_best_markdown(main)]
    if not ablation.empty and len(ablation["variant"].unique()) > 1:
        parts += ["\n## HAP ablations\n", report.accuracy_markdown(ablation)]
    if not tests.empty:
        parts += ["\n## Paired tests: HAP minus the other, over (seed, fold), on the complete datasets\n",
                  report.tests_markdown(tests)]
    (results / "results.md").write_text("".join(parts))
    report.plot_accuracy(main, figures / "hap_accuracy", knobs, majority)
    if not ablation.empty and len(ablation["variant"].unique()) > 1:
        report.plot_accuracy(ablation, figures / "hap_ablation", knobs, majority)
    curves_file = next((results / n for n in ("curves.csv", "curves.csv.gz") if (results / n).exists()), None)
    if curves_file is not None:  # the docs keep theirs gzipped (1 MB of text)
        curves = report.canonical_order(pd.read_csv(curves_file), order, graphs)
        report.plot_curves(curves[curves["variant"].isin(METHODS)], figures / "hap_curves",
                           f"{note}; mean over folds x seeds of the tested candidate; "
                           "stopped fits keep their last value")
    return table


def merge_results(sources: Sequence[Path], out: Path) -> None:
    """Merge folds.csv / curves.csv / datasets.csv of ``sources`` into ``out``; a repeated key keeps its first rows."""
    out = Path(out)
    with OutputLock(out):  # the sources are only read
        _merge(sources, out)


def _merge(sources: Sequence[Path], out: Path) -> None:
    folds = [pd.read_csv(Path(s) / "folds.csv") for s in sources if (Path(s) / "folds.csv").exists()]
    if not folds:
        raise ConfigError("merge", f"no folds.csv in {', '.join(map(str, sources))}", "name run directories")
    for frame, source in zip(folds, sources, strict=False):
        frame["source"] = str(source)
    merged = pd.concat(folds, ignore_index=True).drop_duplicates(FOLD_KEY, keep="first")
    merged.drop(columns="source").to_csv(out / "folds.csv", index=False)
    kept = set(zip(merged["source"], *(merged[k] for k in FOLD_KEY), strict=True))
    curves = []
    for source in sources:
        if (Path(source) / "curves.csv").exists():
            frame = pd.read_csv(Path(source) / "curves.csv")
            keys = zip([str(source)] * len(frame), *(frame[k] for k in FOLD_KEY), strict=True)
            curves.append(frame[[key in kept for key in keys]])
    if curves:
        merged_curves = pd.concat(curves, ignore_index=True).drop_duplicates([*FOLD_KEY, "epoch"], keep="first")
        merged_curves.to_csv(out / "curves.csv", index=False)
    infos = [pd.read_csv(Path(s) / "datasets.csv") for s in sources if (Path(s) / "datasets.csv").exists()]
    if infos:
        pd.concat(infos, ignore_index=True).drop_duplicates("dataset").to_csv(out / "datasets.csv", index=False)


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
    patience: int = DEFAULT_PATIENCE,
    verbose: bool = True,
) -> pd.DataFrame:
    """One seed of ``folds``-fold CV of ``methods`` (default: every method) on ``datasets``, then the report.

    The lr grid is ``train.lr`` alone (default TrainConfig's). Returns the summary table (dataset,
    variant, accuracy_mean, accuracy_std, n, ...).
    """
    base = train or TrainConfig()
    plans = tuple(DatasetPlan(name, (seed,), folds, folds, epochs, tuple(methods or METHODS)) for name in datasets)
    protocol = Protocol(plans, lrs=(base.lr,), patience=patience, base=base)
    with OutputLock(Path(out_dir)):  # run and report as one command: no other writer in between
        run_protocol(protocol, Path(out_dir), data_root=data_root, cache_dir=cache_dir, verbose=verbose)
        return write_report(Path(out_dir), planned_pairs=folds)  # this run's own protocol: one seed x folds


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run (or resume) the protocol, then write the report")
    run.add_argument("--plan", nargs="*", default=[], help="NAME[:SEEDSxFOLDS[:EPOCHS]] for every method")
    run.add_argument("--ablation-plan", nargs="*", default=[], help="same, for HAP and its ablations")
    run.add_argument("--seeds", nargs="+", default=None,
                     help="the seeds of every plan (e.g. 1 2, or 1-2) instead of 0..SEEDS-1")
    run.add_argument("--methods", nargs="+", default=list(METHODS))
    run.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS, help="epoch cap (early stopping below it)")
    run.add_argument("--patience", type=int, default=DEFAULT_PATIENCE)
    run.add_argument("--lr", nargs="+", type=float, default=list(DEFAULT_LRS), help="lr grid of every method")
    run.add_argument("--out", type=Path, default=Path("runs/hap"))
    run.add_argument("--carry-from", type=Path, default=None,
                     help="an earlier run's directory: copy the fits this run would repeat exactly (the same "
                          "knobs, or a smaller cap that early stopping ended before), train the rest")
    run.add_argument("--workers", type=int, default=1,
                     help="fits at a time: local processes, or Dask workers with --scheduler local-dask (default 1: "
                          "one after the other in this process)")
    run.add_argument("--scheduler", default=None,
                     help="local-dask (an embedded Dask LocalCluster of --workers workers) or a Dask scheduler "
                          "address, e.g. tcp://host:8786 (its workers need paratwin and the data sets)")
    run.add_argument("--figures", type=Path, default=None)
    run.add_argument("--data-root", type=Path, default=None)
    run.add_argument("--note", default=HARDWARE_NOTE, help="hardware line for the figures")
    rep = sub.add_parser("report", help="tables, tests and figures from OUT/folds.csv")
    rep.add_argument("--out", type=Path, default=Path("runs/hap"))
    rep.add_argument("--figures", type=Path, default=None)
    rep.add_argument("--note", default=HARDWARE_NOTE, help="hardware line for the figures")
    merge = sub.add_parser("merge", help="merge run directories into --out, then write the report")
    merge.add_argument("sources", nargs="+", type=Path)
    merge.add_argument("--out", type=Path, required=True)
    merge.add_argument("--figures", type=Path, default=None)
    merge.add_argument("--note", default=HARDWARE_NOTE, help="hardware line for the figures")
    measure = sub.add_parser("measure", help="seconds per epoch of every method on one fold")
    measure.add_argument("--datasets", nargs="+", default=["MUTAG"])
    measure.add_argument("--epochs", type=int, default=5)
    return parser


def _measure(datasets: Sequence[str], epochs: int) -> None:
    from .hap_protocol import measure_one_fold

    for name in datasets:
        seconds = measure_one_fold(name, METHODS, epochs)
        per_epoch = {k: round(v / epochs, 3) for k, v in seconds.items()}
        print(f"{name}: s/epoch {per_epoch}; all methods {sum(per_epoch.values()):.2f} s/epoch", flush=True)


def _protocol(args: argparse.Namespace) -> Protocol:
    """The protocol ``run`` asks for, its options checked (before anything is written)."""
    seeds = parse_seeds(args.seeds) if args.seeds is not None else None
    plans = [parse_plan(p, args.epochs, args.methods, seeds) for p in args.plan]
    plans += [parse_plan(p, args.epochs, ["hap", *ABLATIONS], seeds) for p in args.ablation_plan]
    check_workers(args.workers)
    return Protocol(tuple(plans), lrs=tuple(args.lr), patience=args.patience)


def _run(protocol: Protocol, args: argparse.Namespace) -> None:
    if args.carry_from is not None:
        counts = carry_over(protocol, args.carry_from, args.out)
        print(f"from {args.carry_from}: {counts['carried']} fits carried, {counts['rerun']} to run again "
              f"(they reached their cap or cannot be carried), {counts['kept']} already in {args.out}", flush=True)
    run_protocol(protocol, args.out, data_root=args.data_root, workers=args.workers, scheduler=args.scheduler)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    torch.set_num_threads(1)  # one core per experiment on a shared machine
    start = time.perf_counter()
    if args.command == "measure":
        _measure(args.datasets, args.epochs)
        return
    protocol = _protocol(args) if args.command == "run" else None
    if args.command == "report":
        check_results(args.out)
    # One command per folder for the whole command (--carry-from's rows, the fits, the report): a
    # second run, merge or report on it is refused in one line; workers only compute, this process writes.
    with OutputLock(args.out):
        if protocol is not None:
            _run(protocol, args)
        if args.command == "merge":
            merge_results(args.sources, args.out)
        table = write_report(args.out, args.figures, args.note)
        print((args.out / "results.md").read_text())
    print(f"wrote {args.out} ({len(table)} rows) in {time.perf_counter() - start:.0f} s")


def cli(argv: Sequence[str] | None = None) -> None:
    """The command line: ``main``, an error paratwin reports printed as one line on stderr (status 2)."""
    run_cli(lambda: main(argv), to=error_console)


if __name__ == "__main__":
    cli()
