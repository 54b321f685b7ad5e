"""What the real runtime spends that the profile does not see, measured on instruction tables
(issue 16): the gap before each compute instruction that no wait explains (Python dispatch, hooks,
posting sends and receives: ``dispatch_gaps``), and the time of every point-to-point message as
the run saw it (``message_times``), whose mean on a busy 2-core machine is far above the
median-based communication fit (a tail of messages that wait for a scheduler quantum).

``measure_runtime_costs`` turns the tables of calibration runs into the two constants that
``analysis.validation.calibration.ValidationCalibration`` carries: a dispatch time per compute
instruction and an overhead per message (the runs' mean message time minus the prediction's).
They are measured on calibration plans, never on the plans they are then tested on.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

COMPUTE_KINDS = ("FWD", "BWD", "BWD_I", "BWD_W", "RECOMPUTE", "OPTIMIZER_STEP")


def dispatch_gaps(rank_rows: pd.DataFrame) -> list[float]:
    """One rank, one iteration: for each compute instruction after the first, how long it started
    after both the previous compute instruction's end and the end of every receive or collective
    of the rank that finished in between (the waits)."""
    rows = rank_rows[rank_rows["parent"] == -1]
    compute = rows[rows["stream"] == "compute"].sort_values("start_s")
    waits = rows[rows["stream"] != "compute"]["end_s"].sort_values().to_numpy()
    gaps = []
    previous_end = None
    for start, end in zip(compute["start_s"], compute["end_s"], strict=True):
        if previous_end is not None:
            finished = waits[(waits > previous_end) & (waits <= start)]
            ready = max(previous_end, float(finished.max())) if len(finished) else previous_end
            gaps.append(max(0.0, start - ready))
        previous_end = end
    return gaps


def message_times(table: pd.DataFrame) -> pd.Series:
    """Seconds of every point-to-point message of a table, from the later of the send's start and
    the receive's post to the receive's end (matched by tag, and by iteration when measured)."""
    rows = table[table["parent"] == -1]
    tag = rows["name"].str.split().str[-1]
    sends = rows[rows["kind"].str.startswith("SEND")].assign(tag=tag)
    recvs = rows[rows["kind"].str.startswith("RECV")].assign(tag=tag)
    keys = ["tag", *(["iteration"] if "iteration" in rows else [])]
    pairs = sends.merge(recvs, on=keys, suffixes=("_send", "_recv"))
    return (pairs["end_s_recv"] - pairs[["start_s_send", "start_s_recv"]].max(axis=1)).dropna()


def measure_runtime_costs(runs: Sequence[tuple[Path, Path]]) -> tuple[float, float]:
    """(dispatch seconds per compute instruction, overhead seconds per message) over ``runs``, each
    (measured instruction table, predicted instruction table) as parquet files.

    Both are the median over measured iterations of that iteration's mean: a pipeline's critical
    path adds gaps and message times, so an iteration pays their mean (a frequent tail included),
    while the median over iterations leaves out the rare iteration that a stall hits, as the
    validated figure (the median iteration time) does. The message overhead is that minus the
    prediction's mean message time."""
    dispatch_per_iteration: list[float] = []
    message_per_iteration: list[float] = []
    predicted_messages: list[pd.Series] = []
    for measured_path, predicted_path in runs:
        measured = pd.read_parquet(measured_path)
        for _, rows in measured.groupby("iteration"):
            gaps = [g for _, rank_rows in rows.groupby("rank") for g in dispatch_gaps(rank_rows)]
            if gaps:
                dispatch_per_iteration.append(sum(gaps) / len(gaps))
            messages = message_times(rows)
            if len(messages):
                message_per_iteration.append(float(messages.mean()))
        predicted_messages.append(message_times(pd.read_parquet(predicted_path)))
    dispatch = float(pd.Series(dispatch_per_iteration).median()) if dispatch_per_iteration else 0.0
    predicted = pd.concat(predicted_messages) if predicted_messages else pd.Series(dtype=float)
    if not message_per_iteration or not len(predicted):
        return dispatch, 0.0
    return dispatch, max(0.0, float(pd.Series(message_per_iteration).median() - predicted.mean()))
