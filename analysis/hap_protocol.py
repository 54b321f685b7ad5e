"""The HAP evaluation protocol as a resumable runner: datasets x seeds x folds x variants.

A *variant* is a method plus fixed options plus its tuning grid (``VARIANTS``): the eleven methods of
``exec.hap.baselines.METHODS`` and the HAP ablations (hops 1 / unmasked, GCont per-graph / none,
content loss 0 / tuned). Every (dataset, seed, fold) trains every variant on the same training
graphs, picks epoch and grid candidate on the same validation graphs and tests on the same fold,
so the comparison is paired over (seed, fold).

For seed s the folds are ``StratifiedKFold(k, shuffle=True, random_state=s)``; 10% of the training
folds (stratified) is the validation split; the model seed is ``s * 1000 + fold``. A plan can run
only the first ``folds`` of the k folds and any list of seeds, so a short run is a prefix of the
full protocol and the rest can be added later by running the full plan in the same directory.

Resumable: one row per finished (dataset, variant, seed, fold) is appended to ``folds.csv`` (and
its validation curve to ``curves.csv``) as soon as it is done; a restart skips the keys already
there. A row records the protocol knobs (k, epochs, patience, grid), and a restart with other knobs
in the same directory is refused rather than mixed.

Raising the epoch cap (``carry_over``): early stopping reads only the curve so far, so a fit it ended
before its cap is the same fit under any larger cap. A run with a larger cap in a new directory copies
those rows from the old one and trains only the fits that reached the old cap; the old directory is
only read.
"""

from __future__ import annotations

import csv
import gzip
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from analysis.executors import BrokenProcessPool, backend, check_workers
from exec.hap.baselines import METHODS
from exec.hap.data import TU_NAMES, graph_labels, load_tu
from exec.hap.train import FitResult, TrainConfig, fit_tuned
from exec.host_memory import release_freed_memory
from traces.errors import ConfigError, ParatwinError
from traces.outdir import OutputLock

# The grid every variant is tuned over on the validation split (same budget for every method).
# 1e-3 and 1e-2 are the two learning rates compared in the first HAP run (docs/hap.md).
DEFAULT_LRS = (1e-3, 1e-2)
# Candidate content-loss weights of the "content loss tuned" ablation (a larger budget than the
# others: 3 weights x the lr grid; docs/hap.md says so beside its numbers).
AUX_GRID = (0.1, 1.0, 10.0)


@dataclass(frozen=True)
class Variant:
    name: str
    method: str
    hap: tuple[tuple[str, object], ...] = ()  # HAPConfig options
    fixed: tuple[tuple[str, object], ...] = ()  # TrainConfig fields set for this variant
    extra_grid: tuple[tuple[str, tuple[object, ...]], ...] = ()  # tuned besides the lr grid


VARIANTS: dict[str, Variant] = {m: Variant(m, m) for m in METHODS}
ABLATIONS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("hap-hops1", "hap", hap=(("hops", 1),)),
        Variant("hap-unmasked", "hap", hap=(("masked", False),)),
        Variant("hap-pergraph", "hap", hap=(("content", "per-graph"),)),
        Variant("hap-nogcont", "hap", hap=(("content", "none"),)),
        Variant("hap-aux0", "hap", fixed=(("aux_weight", 0.0),)),
        Variant("hap-auxtuned", "hap", extra_grid=(("aux_weight", AUX_GRID),)),
    )
}
VARIANTS.update(ABLATIONS)


@dataclass(frozen=True)
class DatasetPlan:
    """Run seeds ``seeds`` x the first ``folds`` of a ``k``-fold CV on ``name``."""

    name: str
    seeds: tuple[int, ...] = (0, 1, 2)
    folds: int = 10
    k: int = 10
    epochs: int = 100
    variants: tuple[str, ...] = tuple(METHODS)


@dataclass(frozen=True)
class Protocol:
    datasets: tuple[DatasetPlan, ...]
    lrs: tuple[float, ...] = DEFAULT_LRS
    patience: int = 20
    base: TrainConfig = field(default_factory=TrainConfig)


def parse_seeds(texts: Sequence[str]) -> tuple[int, ...]:
    """Named seeds, e.g. ``["1", "2"]`` or ``["1-2"]`` (a range, both ends included): each once, >= 0."""
    seeds: list[int] = []
    for text in texts:
        try:
            low, _, high = text.partition("-")
            first, last = int(low), int(high) if high else int(low)
        except ValueError:
            raise ConfigError("seeds", f"cannot read seed {text!r}",
                              "name seeds as integers >= 0 or ranges, e.g. --seeds 1 2 or --seeds 1-2") from None
        if first < 0 or last < first:
            raise ConfigError("seeds", f"seed {text!r} is negative or an empty range",
                              "name seeds >= 0; a range runs low-high, e.g. 1-2")
        seeds += range(first, last + 1)
    repeated = sorted({seed for seed in seeds if seeds.count(seed) > 1})
    if repeated:
        raise ConfigError("seeds", f"seed(s) {repeated} named twice", "name every seed once")
    return tuple(seeds)


def parse_plan(text: str, epochs: int, variants: Sequence[str], seeds: Sequence[int] | None = None) -> DatasetPlan:
    """``NAME[:SEEDSxFOLDS[:EPOCHS]]``, e.g. ``MUTAG:3x10`` or ``NCI1:1x2:60``: seeds 0..SEEDS-1,
    or the named ``seeds`` (the CLI's ``--seeds``, e.g. ``ENZYMES --seeds 1 2`` to complete seeds 1
    and 2 only); a SEEDS count in the plan must then equal the number of named seeds."""
    parts = text.split(":")
    name, count, folds = parts[0], None, 10
    try:
        if len(parts) > 1:
            s, f = parts[1].lower().split("x")
            count, folds = int(s), int(f)
        if len(parts) > 2:
            epochs = int(parts[2])
    except ValueError:
        raise ConfigError("plan", f"cannot read {text!r}",
                          "write NAME, NAME:SEEDSxFOLDS or NAME:SEEDSxFOLDS:EPOCHS, e.g. MUTAG:3x10") from None
    if seeds is None:
        return DatasetPlan(name, tuple(range(3 if count is None else count)), folds, 10, epochs, tuple(variants))
    if count is not None and count != len(seeds):
        raise ConfigError("seeds", f"plan {text!r} asks {count} seed(s), --seeds names {list(seeds)}",
                          f"write {name}:{len(seeds)}x{folds} or drop --seeds")
    return DatasetPlan(name, tuple(seeds), folds, 10, epochs, tuple(variants))


def validate(protocol: Protocol) -> None:
    if not protocol.datasets:
        raise ConfigError("datasets", "no dataset given", f"name at least one of {', '.join(TU_NAMES)}")
    for plan in protocol.datasets:
        unknown = [v for v in plan.variants if v not in VARIANTS]
        if unknown:
            raise ConfigError("methods", f"unknown method(s) {', '.join(unknown)}",
                              f"choose from {', '.join(VARIANTS)}")
        if plan.k < 2:
            raise ConfigError("folds", f"need at least 2 folds, got {plan.k}", "pass folds >= 2 (10 is usual)")
        if not 1 <= plan.folds <= plan.k:
            raise ConfigError("folds", f"{plan.name}: runs {plan.folds} of {plan.k} folds",
                              f"run between 1 and {plan.k} folds")
        if plan.epochs < 1:
            raise ConfigError("epochs", f"need at least 1 epoch, got {plan.epochs}", "pass epochs >= 1")
        if not plan.seeds:
            raise ConfigError("seeds", f"{plan.name}: no seed", "run at least one seed")
    if not protocol.lrs or min(protocol.lrs) <= 0:
        raise ConfigError("lrs", f"learning-rate grid {protocol.lrs} is empty or not positive",
                          "pass positive learning rates, e.g. --lr 0.001 0.01")


def clusters_for(dataset) -> tuple[int, int]:
    """Cluster counts of the two coarsened levels (HAP, DiffPool, MinCut): 1/2 then 1/8 of the mean size."""
    mean_nodes = float(np.mean([graph.num_nodes for graph in dataset]))
    return max(2, math.ceil(mean_nodes / 2)), max(2, math.ceil(mean_nodes / 8))


def splits(labels: np.ndarray, k: int, seed: int):
    """(fold, train, val, test) index arrays: stratified k folds, then a stratified 10% val split."""
    from sklearn.model_selection import StratifiedKFold, train_test_split

    outer = StratifiedKFold(n_splits=k, shuffle=True, random_state=seed)
    for fold, (rest, test) in enumerate(outer.split(np.zeros(len(labels)), labels)):
        train, val = train_test_split(
            rest, test_size=0.1, stratify=labels[rest], random_state=seed * 1000 + fold
        )
        yield fold, np.sort(train), np.sort(val), test


def candidates(variant: Variant, base: TrainConfig, lrs: Iterable[float]) -> list[TrainConfig]:
    """The variant's grid: lr x its extra grid, on top of ``base`` with the variant's fixed fields."""
    config = replace(base, hap=variant.hap, **dict(variant.fixed))
    names = ["lr", *(name for name, _ in variant.extra_grid)]
    values = [tuple(lrs), *(vals for _, vals in variant.extra_grid)]
    return [replace(config, **dict(zip(names, combo, strict=True))) for combo in itertools.product(*values)]


FOLD_FIELDS = (
    "dataset", "variant", "method", "seed", "fold", "k", "test_accuracy", "val_accuracy", "best_epoch",
    "epochs_run", "max_epochs", "patience", "grid_size", "lr", "aux_weight", "seconds",
)
CURVE_FIELDS = ("dataset", "variant", "seed", "fold", "epoch", "train_loss", "val_accuracy", "val_loss")
FOLD_KEY = ["dataset", "variant", "seed", "fold"]
KNOBS = ("k", "max_epochs", "patience", "grid_size")


def _append(path: Path, fields: Sequence[str], rows: list[dict]) -> None:
    new = not path.exists()
    with path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        if new:
            writer.writeheader()
        writer.writerows(rows)
        handle.flush()


def _done(path: Path) -> dict[tuple[str, str, int, int], dict[str, str]]:
    if not path.exists():
        return {}
    with path.open(newline="") as handle:
        return {_key(r): r for r in csv.DictReader(handle)}


@dataclass(frozen=True)
class FitTask:
    """One (dataset, variant, seed, fold) fit, small enough to send to a worker: the dataset travels
    by name (a worker loads it once, ``_dataset``), the split as index arrays."""

    key: tuple[str, str, int, int]  # dataset, variant, seed, fold
    grid: tuple[TrainConfig, ...]
    knobs: tuple[tuple[str, int], ...]  # recorded in the row, checked on a resume
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    data_root: Path | None = None
    cache_dir: Path | None = None

    @property
    def id(self) -> str:
        return "-".join(map(str, self.key))

    @property
    def variant(self) -> Variant:
        return VARIANTS[self.key[1]]


def _fit(task: FitTask, dataset) -> FitResult:
    _, _, seed, fold = task.key
    result = fit_tuned(task.variant.method, dataset, torch.as_tensor(task.train), torch.as_tensor(task.val),
                       torch.as_tensor(task.test), list(task.grid), seed=seed * 1000 + fold)
    release_freed_memory()  # else glibc keeps each fit's freed heap: ~200 MB a PROTEINS fit
    return result


# A worker process's datasets, loaded on its first fit of each: a worker runs many fits of one dataset.
_DATASETS: dict[tuple[str, str, str], object] = {}


def _dataset(name: str, data_root: Path | None, cache_dir: Path | None):
    key = (name, str(data_root), str(cache_dir))
    if key not in _DATASETS:  # workers sharing a cache build it once: load_tu's build lock
        _DATASETS[key] = load_tu(name, data_root=data_root, cache_dir=cache_dir)
    return _DATASETS[key]


def fit_in_worker(task: FitTask) -> FitResult:
    """A task in a worker process: one thread (the workers share the cores), the dataset cached."""
    torch.set_num_threads(1)
    return _fit(task, _dataset(task.key[0], task.data_root, task.cache_dir))


def _tasks(protocol: Protocol, out_dir: Path, done: dict, loaded: dict, data_root: Path | None,
           cache_dir: Path | None) -> Iterator[FitTask]:
    """The missing fits of ``protocol``, in the serial order (dataset, seed, fold, variant); a key in
    ``done`` is skipped after its knobs are checked. Loads each dataset into ``loaded`` (the driver
    needs its labels for the folds)."""
    folds_csv = out_dir / "folds.csv"
    for plan in protocol.datasets:
        dataset = load_tu(plan.name, data_root=data_root, cache_dir=cache_dir)
        loaded[plan.name] = dataset
        labels = graph_labels(dataset).numpy()
        _describe(out_dir / "datasets.csv", plan.name, dataset, labels)
        base = replace(protocol.base, epochs=plan.epochs, patience=protocol.patience,
                       clusters=clusters_for(dataset))
        for seed in plan.seeds:
            for fold, train, val, test in splits(labels, plan.k, seed):
                if fold >= plan.folds:
                    break
                for name in plan.variants:
                    grid = candidates(VARIANTS[name], base, protocol.lrs)
                    knobs = {"k": plan.k, "max_epochs": plan.epochs, "patience": protocol.patience,
                             "grid_size": len(grid)}
                    key = (plan.name, name, seed, fold)
                    if key in done:
                        _check_knobs(done[key], knobs, folds_csv)
                        continue
                    # marked as planned here: plans sharing a variant run it once
                    done[key] = {**{k: str(v) for k, v in knobs.items()}, "dataset": plan.name, "variant": name}
                    yield FitTask(key, tuple(grid), tuple(knobs.items()), train, val, test, data_root, cache_dir)


def run_protocol(
    protocol: Protocol,
    out_dir: Path,
    data_root: Path | None = None,
    cache_dir: Path | None = None,
    verbose: bool = True,
    workers: int = 1,
    scheduler: str | None = None,
) -> Path:
    """Run every missing (dataset, seed, fold, variant) of ``protocol``; return ``out_dir/folds.csv``.

    ``workers=1`` without ``scheduler``: one fit after the other in this process. Otherwise every
    missing fit is a task on ``workers`` local processes (``scheduler=None``), an embedded Dask
    cluster (``"local-dask"``) or a Dask scheduler's workers (``"tcp://host:port"``); this process
    writes each result the moment it comes back, so a kill loses only the fits in flight.
    """
    validate(protocol)
    check_workers(workers)
    out_dir = Path(out_dir)
    with OutputLock(out_dir):  # one writer of folds.csv and curves.csv (reentrant: the CLI holds it)
        return _run_locked(protocol, out_dir, data_root, cache_dir, verbose, workers, scheduler)


def _run_locked(protocol: Protocol, out_dir: Path, data_root: Path | None, cache_dir: Path | None,
                verbose: bool, workers: int, scheduler: str | None) -> Path:
    folds_csv, curves_csv = out_dir / "folds.csv", out_dir / "curves.csv"
    loaded: dict[str, object] = {}
    tasks = _tasks(protocol, out_dir, _done(folds_csv), loaded, data_root, cache_dir)

    def record(task: FitTask, result: FitResult) -> None:
        _record(folds_csv, curves_csv, task.key, task.variant, dict(task.knobs), result)
        if verbose:
            dataset, name, seed, fold = task.key
            print(f"{dataset:8s} s{seed} f{fold} {name:13s} test {result.test_accuracy:.3f} "
                  f"val {result.val_accuracy:.3f} best ep {result.best_epoch:3d}/"
                  f"{result.epochs_run:3d} {result.seconds:6.1f}s", flush=True)

    if workers == 1 and not scheduler:
        for task in tasks:  # lazily: each fit is recorded before the next one starts
            record(task, _fit(task, loaded[task.key[0]]))
        return folds_csv
    todo = list(tasks)  # every knob checked before any fit starts
    loaded.clear()  # the workers load their own
    if todo:
        _run_tasks(todo, workers, scheduler, record, folds_csv)
    return folds_csv


def _run_tasks(todo: list[FitTask], workers: int, scheduler: str | None,
               record: Callable[[FitTask, FitResult], None], folds_csv: Path) -> None:
    where = backend(min(workers, len(todo)) if not scheduler else workers, scheduler)
    interrupted = False
    try:
        futures = [where.submit(fit_in_worker, task, f"hap-{task.id}") for task in todo]
        task_of = {id(future): task for future, task in zip(futures, todo, strict=True)}
        for finished, future in enumerate(where.as_completed(futures)):
            try:
                result = future.result()
            except BrokenProcessPool as exc:  # a worker was killed (OOM killer, signal)
                raise ParatwinError(f"a worker process died ({exc}); {finished} of {len(todo)} fits of this "
                                    f"run are recorded in {folds_csv} (fix: run the same command again to "
                                    "resume)") from None
            record(task_of[id(future)], result)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        where.close(abort=interrupted)


def carry_over(protocol: Protocol, source: Path, out_dir: Path) -> dict[str, int]:
    """Copy into ``out_dir`` every row of ``source`` that ``protocol`` would reproduce exactly.

    Carried (with its curve): a planned (dataset, variant, seed, fold) with the same k and patience and
    a one-candidate grid of the same learning rate, run either with the plan's epoch cap or with a
    smaller one that early stopping ended before (its ``max_epochs`` becomes the plan's: the same fit).
    Left to run again: fits that reached their cap (they might have gone on improving), grids of
    several candidates (a row records only the chosen one, not whether every candidate stopped early),
    and everything else. Keys already in ``out_dir`` are kept as they are. Returns the counts
    ``carried``, ``rerun`` (planned rows of ``source`` left to run again) and ``kept``.
    """
    validate(protocol)
    source, out_dir = Path(source), Path(out_dir)
    if not (source / "folds.csv").exists():
        raise ConfigError("carry_from", f"{source} has no folds.csv", "name a directory an earlier run wrote")
    if source.resolve() == out_dir.resolve():
        raise ConfigError("carry_from", f"{source} is the output directory itself",
                          "write the run with the larger cap to a new --out directory")
    planned = {}
    for plan in protocol.datasets:
        base = replace(protocol.base, epochs=plan.epochs, patience=protocol.patience)
        for seed, fold, name in itertools.product(plan.seeds, range(plan.folds), plan.variants):
            planned[(plan.name, name, seed, fold)] = (plan, len(candidates(VARIANTS[name], base, protocol.lrs)))
    with OutputLock(out_dir):  # the source is only read
        return _carry(planned, protocol, source, out_dir)


def _carry(planned: dict, protocol: Protocol, source: Path, out_dir: Path) -> dict[str, int]:
    present = _done(out_dir / "folds.csv")
    counts = {"carried": 0, "rerun": 0, "kept": 0}
    rows = []
    for key, row in _done(source / "folds.csv").items():
        if key not in planned:
            continue
        if key in present:
            counts["kept"] += 1
            continue
        plan, grid_size = planned[key]
        cap, ran = int(float(row["max_epochs"])), int(float(row["epochs_run"]))
        same = (int(float(row["k"])) == plan.k and int(float(row["patience"])) == protocol.patience
                and int(float(row["grid_size"])) == grid_size == 1 and float(row["lr"]) == protocol.lrs[0])
        if same and (cap == plan.epochs or (cap < plan.epochs and ran < cap)):
            rows.append({**row, "max_epochs": plan.epochs})
        else:
            counts["rerun"] += 1
    carried = {_key(r) for r in rows}
    curves = [c for c in _read_curves(source) if _key(c) in carried]
    if rows:
        _append(out_dir / "curves.csv", CURVE_FIELDS, curves)  # curves first, as _record writes them
        _append(out_dir / "folds.csv", FOLD_FIELDS, rows)
    counts["carried"] = len(rows)
    return counts


def _key(row: dict[str, str]) -> tuple[str, str, int, int]:
    return row["dataset"], row["variant"], int(row["seed"]), int(row["fold"])


def _read_curves(directory: Path) -> list[dict[str, str]]:
    for name, opener in (("curves.csv", open), ("curves.csv.gz", gzip.open)):
        if (directory / name).exists():
            with opener(directory / name, "rt", newline="") as handle:
                return list(csv.DictReader(handle))
    return []


def _describe(path: Path, name: str, dataset, labels: np.ndarray) -> None:
    """One row per dataset (graphs, mean nodes, majority-class accuracy, cluster counts), for the report."""
    known = {r["dataset"] for r in csv.DictReader(path.open())} if path.exists() else set()
    if name in known:
        return
    row = {"dataset": name, "graphs": len(dataset), "classes": int(labels.max()) + 1,
           "mean_nodes": round(float(np.mean([g.num_nodes for g in dataset])), 2),
           "majority_accuracy": round(float(np.bincount(labels).max() / len(labels)), 5),
           "clusters": "/".join(map(str, clusters_for(dataset)))}
    _append(path, list(row), [row])


def _check_knobs(row: dict[str, str], knobs: dict[str, int], path: Path) -> None:
    old = {k: int(float(row[k])) for k in KNOBS}
    if old != knobs:
        raise ConfigError("protocol", f"{path} holds {row['dataset']}/{row['variant']} run with {old}, "
                          f"this run asks {knobs}", "use another --out directory, or the same knobs")


def _record(folds_csv: Path, curves_csv: Path, key, variant: Variant, knobs: dict[str, int],
            result: FitResult) -> None:
    dataset, name, seed, fold = key
    chosen = result.config or TrainConfig()
    row = {"dataset": dataset, "variant": name, "method": variant.method, "seed": seed, "fold": fold,
           "test_accuracy": result.test_accuracy, "val_accuracy": result.val_accuracy,
           "best_epoch": result.best_epoch, "epochs_run": result.epochs_run, "lr": chosen.lr,
           "aux_weight": chosen.aux_weight, "seconds": round(result.seconds, 2), **knobs}
    curve = [{"dataset": dataset, "variant": name, "seed": seed, "fold": fold, "epoch": e.epoch,
              "train_loss": round(e.train_loss, 5), "val_accuracy": round(e.val_accuracy, 5),
              "val_loss": round(e.val_loss, 5)} for e in result.curve]
    _append(curves_csv, CURVE_FIELDS, curve)  # curve first: a fold row always has its curve
    _append(folds_csv, FOLD_FIELDS, [row])


def measure_one_fold(
    name: str, variants: Sequence[str], epochs: int, data_root: Path | None = None
) -> dict[str, float]:
    """Seconds of one fold (seed 0, fold 0, lr 1e-3 only) per variant: for sizing a run."""
    dataset = load_tu(name, data_root=data_root)
    labels = graph_labels(dataset).numpy()
    _, train, val, test = next(splits(labels, 10, 0))
    base = replace(TrainConfig(), epochs=epochs, clusters=clusters_for(dataset))
    seconds = {}
    for v in variants:
        start = time.perf_counter()
        fit_tuned(VARIANTS[v].method, dataset, torch.as_tensor(train), torch.as_tensor(val), torch.as_tensor(test),
                  candidates(VARIANTS[v], base, (1e-3,))[:1], seed=0)
        seconds[v] = time.perf_counter() - start
    return seconds
