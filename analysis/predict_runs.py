"""Predict your own Megatron-LM GPT runs: ``paratwin predict-runs RUNS.csv --out DIR``.

RUNS.csv is in the vTrain column format (``sim.calibration.read_megatron_csv``: GPUs, global batch, micro
batch, hidden size, attention heads, # layers, sequence length, tensor / data / pipeline parallelism, and
optionally iteration time (ms)). Each row becomes the calibration's plan (``analysis.calibrate.row_to_plan``:
1F1B with Megatron-LM's blocking whole-tensor exchange, full recompute as Megatron checkpoints (each
transformer layer re-run inside the backward, the embedding and LM head not), fp16 A100; one node up to 8 GPUs,
8-GPU nodes over 4 x HDR above) and is simulated
by ``SimulatorPredictor`` with the curve ``paratwin simulate`` uses for A100 fp16 (``sim.analytic.default_for``),
or the physical prior without the host launch path (``prior=True``, the calibration's ``default_calibration``).

A row that cannot be a Megatron run (heads not dividing hidden, tp x dp x pp != GPUs, a batch that is not a
multiple, ...) is skipped with one line naming it and the field; it stays in ``predictions.csv`` with its
reason, and every other row is predicted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.calibrate import CONFIG_COLUMNS, CurveCalibration, SimulatorPredictor, default_calibration, error_metrics
from sim.analytic import default_for
from sim.calibration import MEGATRON_DEVICE, MEGATRON_DTYPE, read_csv_rows, read_megatron_csv
from sim.hardware import get_device
from traces.atomic import atomic_path
from traces.errors import ConfigError, ParatwinError
from traces.outdir import OutputLock


@dataclass(frozen=True)
class RunPredictions:
    """The table written (one row per input row) and the lines to print."""

    table: pd.DataFrame
    skipped: list[str]
    metrics: dict[str, float] | None  # None: no row with both a measurement and a prediction


def row_problem(row: Mapping[str, Any]) -> ConfigError | None:
    """What makes ``row`` no Megatron run, checked before a plan is built (the plan checks the rest:
    the batch, pp dividing the layers, the GPU count's nodes)."""
    for column in CONFIG_COLUMNS:
        value = row[column]
        if pd.isna(value):  # a row with fewer cells than the header
            return ConfigError(column, "missing", f"give {column} as a whole number in every row")
        if not _positive_whole(value):
            return ConfigError(column, f"{value!r} is not a positive integer", f"give {column} as a whole number")
    if not pd.isna(row["iter_time_ms"]) and row["iter_time_ms"] <= 0:
        return ConfigError("iteration time (ms)", f"{row['iter_time_ms']!r} is not a positive time",
                           "give the measured milliseconds, or leave the cell empty")
    if int(row["hidden"]) % int(row["heads"]):
        return ConfigError("heads", f"{int(row['heads'])} heads do not divide hidden {int(row['hidden'])}",
                           "use a head count that divides the hidden size")
    if int(row["tp"]) * int(row["dp"]) * int(row["pp"]) != int(row["gpus"]):
        return ConfigError("gpus", f"{int(row['gpus'])} GPUs != tp x dp x pp = "
                           f"{int(row['tp']) * int(row['dp']) * int(row['pp'])}", "make tp x dp x pp the GPU count")
    return None


def _positive_whole(value: Any) -> bool:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return False
    return math.isfinite(number) and number == int(number) and number >= 1


def predict_runs(csv_path: Path, prior: bool = False) -> RunPredictions:
    """Simulate every row of ``csv_path``; see the module docstring."""
    df = read_megatron_csv(csv_path)
    curve = (default_calibration() if prior
             else CurveCalibration(default_for(get_device(MEGATRON_DEVICE), MEGATRON_DTYPE)))
    predict = SimulatorPredictor()
    raw = read_csv_rows(csv_path, as_written=True)  # every input column as written, extra ones included
    predicted, problems, skipped = [], [], []
    for i, row in enumerate(df.to_dict("records")):
        problem = row_problem(row)
        seconds = math.nan
        if problem is None:
            try:
                seconds = predict({**row, "row_id": i}, curve)
            except ParatwinError as exc:  # a ConfigError from the plan, or a plan the simulator rejects
                problem = exc
        if problem is not None:
            skipped.append(f"row {i} (CSV line {i + 2}): skipped, {problem}")
        predicted.append(seconds * 1e3)
        problems.append("" if problem is None else str(problem))
    table = raw.copy()
    table["predicted time (ms)"] = predicted
    measured = df["iter_time_ms"].to_numpy(dtype=float)
    table["signed error"] = (table["predicted time (ms)"] - measured) / measured
    table["skipped"] = problems
    scored = table["signed error"].notna()
    metrics = error_metrics(measured[scored], table.loc[scored, "predicted time (ms)"]) if scored.any() else None
    return RunPredictions(table, skipped, metrics)


def summary_lines(result: RunPredictions) -> list[str]:
    from analysis.metrics import rho_text

    n, n_skipped = len(result.table), len(result.skipped)
    lines = [*result.skipped, f"predicted {n - n_skipped} of {n} rows ({n_skipped} skipped)"]
    m = result.metrics
    if m is None:
        lines.append("no row has both a measured time and a prediction: no error to report")
    else:
        rows = f"{m['rows']} row{'s' if m['rows'] != 1 else ''}"
        lines.append(f"{rows} with a measured time: MAPE {m['mape']:.1%}, median |error| "
                     f"{m['median_abs_error']:.1%}, max |error| {m['max_abs_error']:.1%}, mean signed error "
                     f"{m['mean_signed_error']:+.1%} (positive: predicted too slow), "
                     f"Spearman {rho_text(m['spearman'])}")
    return lines


PREDICTIONS_NAME = "predictions.csv"


def write_predictions(result: RunPredictions, out_dir: Path) -> Path:
    """``predictions.csv`` in ``out_dir``, written whole (atomically) under the folder's lock; the CLI has
    checked the folder with ``prepare_out_folder`` before predicting."""
    with OutputLock(out_dir), atomic_path(out_dir / PREDICTIONS_NAME) as tmp:
        result.table.to_csv(tmp, index=False)
    return out_dir / PREDICTIONS_NAME
