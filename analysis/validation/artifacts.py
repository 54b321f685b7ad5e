"""The files a validation leaves besides its report: the predicted and measured Chrome traces and a
combined one, the timeline overlay figure (PNG and PDF) and the prediction itself."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.timeline_figure import plot_timelines
from sim.result import SimResult
from traces.chrome import chrome_events, write_chrome_trace


def write_artifacts(sim: SimResult, measured: pd.DataFrame, out_dir: Path, title: str) -> dict[str, Path]:
    """Traces and the timeline figure of the prediction ``sim`` against one measured iteration
    (``measured``), and the prediction under ``out_dir/prediction``."""
    paths = write_traces(sim.table, measured, out_dir)
    figures = plot_timelines(sim.table, measured, out_dir / "timeline", title=title)
    paths.update({f"timeline_{p.suffix[1:]}": p for p in figures})
    sim.write(out_dir / "prediction")
    paths["prediction"] = out_dir / "prediction"
    return paths


def write_traces(predicted: pd.DataFrame, measured: pd.DataFrame, out_dir: Path) -> dict[str, Path]:
    """predicted_trace.json, measured_trace.json (one iteration) and combined_trace.json, in which
    the prediction is processes "predicted rank r" (pid r) and the measurement "measured rank r"
    (pid 1000 + r)."""
    pred_events = chrome_events(predicted, process_prefix="predicted rank", source="prediction")
    meas_events = chrome_events(measured.drop(columns=["iteration"], errors="ignore"), pid_offset=1000,
                                process_prefix="measured rank", source="measurement")
    return {
        "predicted_trace": write_chrome_trace(pred_events, out_dir / "predicted_trace.json"),
        "measured_trace": write_chrome_trace(meas_events, out_dir / "measured_trace.json"),
        "combined_trace": write_chrome_trace(pred_events + meas_events, out_dir / "combined_trace.json"),
    }
