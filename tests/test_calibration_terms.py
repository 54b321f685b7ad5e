"""analysis/calibration_terms.py recovers a per-block and a per-micro-batch fixed time from iteration
times at several layer counts, for the measurement and for a prediction alike."""

from __future__ import annotations

import pandas as pd
import pytest

from analysis.calibration_terms import split_terms
from traces.errors import BundleError


def _rows(block_s: float, fixed_s: float, predicted_block_s: float) -> pd.DataFrame:
    rows = []
    for layers in (12, 16, 20, 24):
        for global_batch in (8, 16):
            m = global_batch // 2  # micro_batch 2, dp 1
            rows.append({"tp": 8, "dp": 1, "pp": 1, "hidden": 1024, "micro_batch": 2, "layers": layers,
                         "global_batch": global_batch, "iter_time_s": m * (layers * block_s + fixed_s),
                         "pred_sim_host_s": m * (layers * predicted_block_s + fixed_s)})
    rows.append({**rows[0], "pp": 2, "iter_time_s": 99.0})  # pipelined rows are not split
    return pd.DataFrame(rows)


def test_the_split_recovers_the_block_and_the_fixed_part() -> None:
    table = split_terms(_rows(4e-3, 2e-3, 3e-3))
    assert len(table) == 1
    row = table.iloc[0]
    assert row["block_measured_ms"] == pytest.approx(4.0)
    assert row["fixed_measured_ms"] == pytest.approx(2.0)
    assert row["block_predicted_ms"] == pytest.approx(3.0)
    assert row["block_error"] == pytest.approx(-0.25)
    assert row["fixed_error"] == pytest.approx(0.0, abs=1e-9)


def test_a_file_without_the_prediction_column_is_refused_by_name() -> None:
    with pytest.raises(BundleError, match="pred_quick_host_s"):
        split_terms(_rows(4e-3, 2e-3, 3e-3), column="pred_quick_host_s")
