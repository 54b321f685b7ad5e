"""Which part of a single-node Megatron iteration a prediction gets wrong: the blocks or the rest.

On the vTrain rows without a pipeline (pp 1) every micro-batch runs ``layers`` identical blocks plus a
fixed part (embedding, LM head, loss, the per-micro-batch bookkeeping), and the data hold each
configuration at 12, 16, 20 and 24 layers. A least-squares fit of

    iteration_s = microbatches x (layers x block_s + fixed_s)

over those rows (per tp, dp, hidden and micro-batch) splits the measurement, and the same fit on a
prediction column splits the model, so the two can be compared term by term. The optimizer step and
the gradient all-reduce are once per iteration and land in ``fixed_s`` divided by the micro-batch
count; dp only moves that part.

    python -m analysis.calibration_terms runs/calibration/predictions.csv [--column pred_sim_host_s]

The input is ``analysis.calibrate``'s predictions.csv. Nothing is fitted to a prediction's benefit:
this only reads measured and predicted times.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from traces.errors import BundleError

GROUP = ["tp", "dp", "hidden", "micro_batch"]


def _terms(layers: np.ndarray, microbatches: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    design = np.c_[layers * microbatches, microbatches]
    block, fixed = np.linalg.lstsq(design, seconds, rcond=None)[0]
    return float(block), float(fixed)


def split_terms(predictions: pd.DataFrame, column: str = "pred_sim_host_s") -> pd.DataFrame:
    """Per (tp, dp, hidden, micro_batch) of the pp 1 rows: block and fixed seconds per micro-batch,
    measured and predicted, and the predicted block's relative error."""
    missing = [c for c in [*GROUP, "pp", "layers", "global_batch", "iter_time_s", column] if c not in predictions]
    if missing:
        raise BundleError(Path("predictions.csv"), f"missing column(s) {missing}: pass analysis.calibrate's output")
    rows = predictions[predictions["pp"] == 1]
    out = []
    for key, g in rows.groupby(GROUP):
        if g["layers"].nunique() < 2:
            continue
        m = (g["global_batch"] // (g["micro_batch"] * g["dp"])).to_numpy(float)
        layers = g["layers"].to_numpy(float)
        measured = _terms(layers, m, g["iter_time_s"].to_numpy(float))
        predicted = _terms(layers, m, g[column].to_numpy(float))
        out.append({**dict(zip(GROUP, key, strict=True)),
                    "block_measured_ms": measured[0] * 1e3, "block_predicted_ms": predicted[0] * 1e3,
                    "block_error": predicted[0] / measured[0] - 1.0,
                    "fixed_measured_ms": measured[1] * 1e3, "fixed_predicted_ms": predicted[1] * 1e3,
                    "fixed_error": predicted[1] / measured[1] - 1.0})
    return pd.DataFrame(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("predictions", type=Path, help="analysis.calibrate's predictions.csv")
    parser.add_argument("--column", default="pred_sim_host_s", help="the prediction to split")
    parser.add_argument("--out", type=Path, help="write the table as CSV here")
    args = parser.parse_args()
    if not args.predictions.is_file():
        raise BundleError(args.predictions, "not found: run python -m analysis.calibrate --out DIR first")
    table = split_terms(pd.read_csv(args.predictions), args.column)
    if args.out:
        table.to_csv(args.out, index=False)
    with pd.option_context("display.width", 200, "display.float_format", "{:.3f}".format):
        print(table[table["dp"] == table.groupby("tp")["dp"].transform("min")].to_string(index=False))


if __name__ == "__main__":
    main()
