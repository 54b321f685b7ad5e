"""The HAP protocol in parallel (``run_protocol(workers=, scheduler=)``): the same rows and curves as a
serial run on local processes and on Dask, a resume trains only the missing fits, and the report does
not depend on the order in which fits finished."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch

from analysis.hap_experiment import write_report
from analysis.hap_protocol import FOLD_KEY, DatasetPlan, Protocol, run_protocol
from exec.hap.data import load_tu
from traces.errors import ConfigError

# MUTAG (bundled), seed 0, folds 0-1, three methods, cap 5: six fits of about half a second each.
PROTOCOL = Protocol((DatasetPlan("MUTAG", (0,), 2, 10, 5, ("gcn-mean", "topk", "hap")),), lrs=(1e-2,))
CURVE_KEY = [*FOLD_KEY, "epoch"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tu")
    load_tu("MUTAG", cache_dir=root)
    return root


@pytest.fixture(scope="module")
def serial(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Path:
    """The serial run, with one thread as the CLI and every worker run it."""
    out = tmp_path_factory.mktemp("serial")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_protocol(PROTOCOL, out, cache_dir=cache, verbose=False)
    finally:
        torch.set_num_threads(threads)
    return out


def rows(directory: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """folds.csv without ``seconds`` and curves.csv, sorted by key (parallel runs write as fits finish)."""
    folds = pd.read_csv(directory / "folds.csv").drop(columns="seconds")
    curves = pd.read_csv(directory / "curves.csv")
    return (folds.sort_values(FOLD_KEY).reset_index(drop=True),
            curves.sort_values(CURVE_KEY).reset_index(drop=True))


def assert_same_run(directory: Path, serial: Path) -> None:
    for got, expected in zip(rows(directory), rows(serial), strict=True):
        pd.testing.assert_frame_equal(got, expected)


def test_two_local_processes_write_the_rows_and_curves_of_a_serial_run(tmp_path: Path, cache: Path,
                                                                        serial: Path) -> None:
    run_protocol(PROTOCOL, tmp_path, cache_dir=cache, verbose=False, workers=2)
    assert len(pd.read_csv(tmp_path / "folds.csv")) == 6
    assert_same_run(tmp_path, serial)


def test_a_local_dask_cluster_writes_the_rows_and_curves_of_a_serial_run(tmp_path: Path, cache: Path,
                                                                         serial: Path) -> None:
    pytest.importorskip("distributed")
    run_protocol(PROTOCOL, tmp_path, cache_dir=cache, verbose=False, workers=2, scheduler="local-dask")
    assert_same_run(tmp_path, serial)


def test_a_parallel_resume_trains_only_the_missing_fits(tmp_path: Path, cache: Path, serial: Path) -> None:
    """A directory holding some fits (as a killed run leaves it): the parallel run appends exactly the
    others, and the whole equals the serial run."""
    folds, curves = (pd.read_csv(serial / name) for name in ("folds.csv", "curves.csv"))
    kept = (folds["fold"] == 0) & (folds["variant"] != "hap")  # 2 of 6 fits already there
    folds[kept].to_csv(tmp_path / "folds.csv", index=False)
    kept_keys = set(folds[kept][FOLD_KEY].itertuples(index=False, name=None))
    curves[[key in kept_keys for key in curves[FOLD_KEY].itertuples(index=False, name=None)]].to_csv(
        tmp_path / "curves.csv", index=False)
    shutil.copy(serial / "datasets.csv", tmp_path / "datasets.csv")
    before = (tmp_path / "folds.csv").read_text()
    run_protocol(PROTOCOL, tmp_path, cache_dir=cache, verbose=False, workers=2)
    after = pd.read_csv(tmp_path / "folds.csv")
    assert (tmp_path / "folds.csv").read_text().startswith(before)  # what was there is untouched
    assert len(after) == 6 and not after.duplicated(FOLD_KEY).any()  # 4 trained, none twice
    assert_same_run(tmp_path, serial)


def test_bad_workers_and_an_unreachable_scheduler_are_config_errors_naming_the_field(tmp_path: Path,
                                                                                     cache: Path) -> None:
    with pytest.raises(ConfigError, match="--workers"):
        run_protocol(PROTOCOL, tmp_path / "zero", cache_dir=cache, verbose=False, workers=0)
    dask = pytest.importorskip("dask")
    pytest.importorskip("distributed")
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}), \
            pytest.raises(ConfigError, match="--scheduler.*cannot reach the Dask scheduler at tcp://127.0.0.1:9"):
        run_protocol(PROTOCOL, tmp_path / "nowhere", cache_dir=cache, verbose=False, workers=2,
                     scheduler="tcp://127.0.0.1:9")
    assert not (tmp_path / "nowhere" / "folds.csv").exists()  # nothing trained


def test_the_report_does_not_depend_on_the_order_of_the_rows(tmp_path: Path, serial: Path) -> None:
    """Parallel runs append fits as they finish: the report of shuffled rows is the report of the
    serial order, byte for byte (tables, tests, figure data)."""
    written = {}
    for name, shuffle in (("ordered", False), ("shuffled", True)):
        out = tmp_path / name
        out.mkdir()
        for table in ("folds.csv", "curves.csv"):
            frame = pd.read_csv(serial / table)
            (frame.sample(frac=1.0, random_state=3) if shuffle else frame).to_csv(out / table, index=False)
        shutil.copy(serial / "datasets.csv", out / "datasets.csv")
        write_report(out, planned_pairs=2)
        written[name] = {f: (out / f).read_bytes() for f in ("summary.csv", "coverage.csv", "tests.csv",
                                                              "results.md", "hap_accuracy.csv", "hap_curves.csv")}
    assert written["shuffled"] == written["ordered"]
