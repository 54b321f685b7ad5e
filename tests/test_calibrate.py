"""Calibration of the A100 analytic model with the full simulator (analysis/calibrate.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.calibrate import (
    CALIBRATION_DATA,
    CurveCalibration,
    SimulatorPredictor,
    default_calibration,
    error_metrics,
    fit_on,
    load_calibrated_curve,
    load_rows,
    megatron_partition,
    microbatches_of,
    predict_rows,
    row_to_plan,
    save_calibration_data,
    subsample,
)
from sim.analytic import EfficiencyCurve
from sim.calibration import MEGATRON_A100_CSV, hold_out_model, model_splits
from sim.cluster import load_cluster
from sim.compile import resolve_plan
from sim.simulate import simulate
from traces.errors import BundleError, ConfigError


@pytest.fixture(scope="module")
def rows() -> pd.DataFrame:
    return load_rows()


def test_every_csv_row_is_one_configuration_with_its_csv_row_id(rows: pd.DataFrame) -> None:
    raw = pd.read_csv(MEGATRON_A100_CSV)
    assert len(rows) == len(raw) == 1440 and rows["repeats"].eq(1).all()
    assert rows["row_id"].tolist() == list(range(len(raw)))
    # row_id is the 0-based data row: its measured time is that line's.
    assert np.allclose(rows["iter_time_ms"], raw["iteration time (ms)"])


def test_repeated_configurations_are_merged_and_averaged(tmp_path: Path) -> None:
    raw = pd.read_csv(MEGATRON_A100_CSV).head(3)
    doubled = pd.concat([raw, raw.iloc[[1]].assign(**{"iteration time (ms)": 300.0})], ignore_index=True)
    doubled.to_csv(tmp_path / "dup.csv", index=False)
    merged = load_rows(tmp_path / "dup.csv")
    assert len(merged) == 3 and merged["repeats"].tolist() == [1, 2, 1]
    assert merged.loc[1, "row_id"] == 1
    assert merged.loc[1, "iter_time_ms"] == pytest.approx((raw.loc[1, "iteration time (ms)"] + 300.0) / 2)


def test_rows_become_the_plans_megatron_ran(rows: pd.DataFrame) -> None:
    # CSV data row 1: 8 GPUs, global 32, micro 4, hidden 1024, 16 heads, 24 layers, seq 1024, tp2 dp2 pp2.
    plan = row_to_plan(rows.iloc[1])
    assert (plan.tp, plan.dp, plan.pp, plan.micro_batch) == (2, 2, 2, 4)
    assert plan.microbatches == 32 // (4 * 2) == 4 and plan.global_batch == 32
    # Megatron-LM's (implementation: megatron-lm): unfused attention, dropout 0.1, the embedding tied to the head.
    assert plan.workload_options == {"hidden": 1024, "heads": 16, "num_layers": 24, "seq": 1024, "vocab": 51200,
                                     "attention": "unfused", "dropout": 0.1, "tied_embedding": True}
    assert (plan.dtype, plan.schedule.name, plan.memory.policy) == ("fp16", "1f1b", "full")
    assert plan.parallelism.partition == [[0, 13], [13, 26]]  # embedding + 12 blocks | 12 blocks + head
    cluster = load_cluster(plan.cluster)
    assert (cluster.nodes, cluster.devices_per_node, cluster.device.name) == (1, 8, "A100-80GB")
    # Row 3: 8 GPUs, global 8, micro 2, hidden 2048, 20 layers, tp4 dp1 pp2: 8 / (2 x 1) = 4 micro-batches.
    plan = row_to_plan(rows.iloc[3])
    assert (plan.tp, plan.dp, plan.pp, plan.microbatches) == (4, 1, 2, 4)
    assert plan.workload_options["hidden"] == 2048 and plan.workload_options["num_layers"] == 20
    # A 2-GPU row runs on a 2-GPU node, and an NVLink efficiency reaches the cluster's link.
    two = rows[rows["gpus"] == 2].iloc[0]
    cluster = load_cluster(row_to_plan(two, nvlink_efficiency=0.5).cluster)
    assert cluster.world_size == 2 and cluster.intra_node_link.effective_bandwidth_Bps == pytest.approx(150e9)


def test_megatron_partition_and_bad_batches() -> None:
    assert megatron_partition(20, 4) == [[0, 6], [6, 11], [11, 16], [16, 22]]
    assert megatron_partition(12, 1) == [[0, 14]]
    with pytest.raises(ConfigError, match="pp"):
        megatron_partition(20, 3)
    with pytest.raises(ConfigError, match="global_batch"):
        microbatches_of({"global_batch": 12, "micro_batch": 8, "dp": 1})


def test_every_csv_plan_validates(rows: pd.DataFrame) -> None:
    # No row is skipped: each plan passes every check the simulator makes before running.
    for row in rows.to_dict("records"):
        setup = resolve_plan(row_to_plan(row))
        assert setup.cluster.world_size == row["gpus"] == row["tp"] * row["dp"] * row["pp"]
        assert len(setup.stage_layers) == row["pp"]


def test_the_largest_configuration_fits_in_memory(rows: pd.DataFrame) -> None:
    # Biggest activations per GPU: hidden 2048, 24 layers, micro-batch 8, no model parallelism.
    big = rows[(rows["hidden"] == 2048) & (rows["layers"] == 24) & (rows["micro_batch"] == 8)]
    big = big.sort_values(["tp", "pp"]).iloc[0]
    result = simulate(row_to_plan(big))
    assert not result.oom and result.peak_memory_bytes < 80e9


def test_engine_only_predictor_equals_simulate(rows: pd.DataFrame) -> None:
    calibration = CurveCalibration(default_calibration().curve, nvlink_efficiency=0.7)
    sample = rows.sample(6, random_state=3)
    fast = predict_rows(sample, SimulatorPredictor(engine_only=True), calibration)
    full = predict_rows(sample, SimulatorPredictor(engine_only=False), calibration)
    assert fast.tolist() == full.tolist()


def test_fit_reads_only_its_rows_and_improves_them(rows: pd.DataFrame) -> None:
    calib, holdout = hold_out_model(rows, (2048, 16, 1024))
    fit_rows = subsample(calib, 10, seed=0)
    predictor = SimulatorPredictor()
    fitted = fit_on(fit_rows, lambda: predictor, default_calibration())
    assert predictor.seen == set(fit_rows["row_id"])
    assert predictor.seen.isdisjoint(holdout["row_id"])
    before = error_metrics(fit_rows["iter_time_s"], predict_rows(fit_rows, predictor, default_calibration()))
    after = error_metrics(fit_rows["iter_time_s"], predict_rows(fit_rows, predictor, fitted))
    assert after["median_abs_error"] < before["median_abs_error"] / 2


class _LeakyPredictor(SimulatorPredictor):
    """A predictor that also looks at one row it was not given (what the guard must catch)."""

    def __init__(self, extra_row: dict) -> None:
        super().__init__()
        self.extra_row = extra_row

    def __call__(self, row, calibration):  # type: ignore[no-untyped-def]
        super().__call__(self.extra_row, calibration)
        return super().__call__(row, calibration)


def test_a_fit_that_reads_a_held_out_row_is_refused(rows: pd.DataFrame) -> None:
    calib, holdout = hold_out_model(rows, (1024, 16, 1024))
    leaky = _LeakyPredictor(holdout.iloc[0].to_dict())
    with pytest.raises(RuntimeError, match="not given"):
        fit_on(subsample(calib, 3, seed=0), lambda: leaky, default_calibration())


def test_error_metrics_on_a_hand_example() -> None:
    measured = [1.0, 2.0, 4.0, 5.0]
    predicted = [2.5, 1.8, 4.0, 6.0]  # relative errors +150%, -10%, 0%, +20%
    m = error_metrics(measured, predicted)
    assert m["rows"] == 4
    assert m["mape"] == pytest.approx((1.5 + 0.1 + 0.0 + 0.2) / 4)
    assert m["median_abs_error"] == pytest.approx(0.15)  # |err| sorted 0, 0.1, 0.2, 1.5
    assert m["p90_abs_error"] == pytest.approx(0.2 + 0.7 * 1.3)  # linear interpolation at rank 2.7
    assert m["max_abs_error"] == pytest.approx(1.5)
    assert m["mean_signed_error"] == pytest.approx((1.5 - 0.1 + 0.0 + 0.2) / 4)
    # Ranks of predicted 2, 1, 3, 4 against 1, 2, 3, 4: 1 - 6 x 2 / (4 x 15) = 0.8.
    assert m["spearman"] == pytest.approx(0.8)
    with pytest.raises(ConfigError):
        error_metrics([1.0, 2.0], [1.0])


def test_every_held_out_split_reports_mape_of_its_stored_predictions(tmp_path: Path, capsys) -> None:
    """A small run (both widths x four depths, 8 rows, ~6 s): every split's table line (default model
    and chosen fit, model and depth splits) carries MAPE, and it is the mean |error| of the predictions
    predictions.csv stores for the rows that split held out."""
    from analysis.calibrate import DEFAULT_FIT, print_summary, run_calibration

    raw = pd.read_csv(MEGATRON_A100_CSV)
    pick = raw[(raw["# GPUs"] == 2) & (raw["pipeline parallelism"] == 1) & (raw["micro batch"] == 1)]
    pick[pick["global batch"] == pick["global batch"].min()].to_csv(tmp_path / "small.csv", index=False)
    summary = run_calibration(tmp_path, tmp_path / "small.csv", max_fit_rows=None, fit_nvlink=False, figure=False)
    stored = json.loads((tmp_path / "calibration.json").read_text())
    predictions = pd.read_csv(tmp_path / "predictions.csv", keep_default_na=False)
    lines = stored["held_out"]
    assert [(line["kind"], line["role"]) for line in lines] == [(kind, role) for kind in ("model",) * 2 + ("depth",) * 2
                                                                for role in ("default", "chosen")]
    assert {line["fit"] for line in lines} == {DEFAULT_FIT, summary["chosen"]}
    for line in lines:
        held = predictions[predictions[f"held_out_{line['kind']}"] == line["split"]]
        column = f"err_{line['fit']}" + ("_depth" if line["kind"] == "depth" else "")
        assert len(held) == line["rows"] == 4
        assert line["mape"] == pytest.approx(float(held[column].abs().mean()), rel=1e-9), line
    print_summary(summary)
    printed = capsys.readouterr().out
    assert "MAPE" in printed and f"{lines[0]['mape']:6.1%}" in printed


def test_a100_defaults_to_the_physical_model_with_the_host_path_and_the_curve_fit_is_not_shipped() -> None:
    from dataclasses import replace

    from sim.analytic import GPU_HOST_LAUNCH_S, default_for, uncalibrated_curve
    from sim.hardware import get_device

    a100 = get_device("A100-80GB")
    # The kernel-by-kernel model's single-node curve fit is recorded with use_as_default false
    # (docs/accuracy.md): the default is the physical model, no fixed per-call cost, plus the host
    # launch path's one fitted scalar (section 4 there). Calibrations start from the bare prior.
    assert json.loads(CALIBRATION_DATA.read_text())["use_as_default"] is False
    physical = uncalibrated_curve(a100, "fp16")
    assert physical.host_launch_s == 0 and physical.flops_half == 0
    assert default_for(a100, "fp16") == replace(physical, host_launch_s=GPU_HOST_LAUNCH_S) != load_calibrated_curve()
    assert default_for(a100, "fp32") == replace(uncalibrated_curve(a100, "fp32"), host_launch_s=GPU_HOST_LAUNCH_S)
    h200 = get_device("H200")
    assert default_for(h200, "bf16") == replace(uncalibrated_curve(h200, "bf16"), host_launch_s=GPU_HOST_LAUNCH_S)
    assert default_calibration().curve == physical
    assert default_calibration().nvlink_efficiency == 1.0


def test_saved_curve_round_trips(tmp_path: Path) -> None:
    curve = {"eff_max": 0.7, "flops_half": 2e11, "mem_eff": 0.9, "nvlink_efficiency": 1.0}
    error = {"rows": 5, "median_abs_error": 0.15}
    summary = {
        "fitted": {"sim_fitted": curve}, "chosen": "sim_fitted", "fit_rows": 10,
        "in_sample": {"sim_fitted": {"median_abs_error": 0.08}},
        "splits": [{"held_out_model": [1024, 16, 1024], "fit_rows": 5, "holdout_rows": 5,
                    "fitted": {"sim_fitted": curve, "quick_fitted": curve},
                    "metrics": {"sim_fitted": error, "quick_fitted": error}}],
        "data": {"source": "x.csv", "distinct_configurations": 10},
        "split": {"method": "m", "seed": 0, "max_fit_rows": None}, "assumptions": {},
        "date": "2026-01-01",
    }
    path = save_calibration_data(summary, tmp_path / "cal.json")
    loaded = load_calibrated_curve(path)
    assert (loaded.eff_max, loaded.flops_half, loaded.mem_eff) == (0.7, 2e11, 0.9)
    assert json.loads(path.read_text())["provenance"]["holdout"][0]["error"] == error
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(BundleError):
        load_calibrated_curve(tmp_path / "bad.json")


def test_shipped_calibration_file_reports_every_held_out_model(rows: pd.DataFrame) -> None:
    record = json.loads(CALIBRATION_DATA.read_text())
    curve = load_calibrated_curve()
    assert 0 < curve.eff_max <= 1 and curve.flops_half > 0
    provenance = record["provenance"]
    assert "sim/data/a100_single_node_megatron.csv" in provenance["data"] and "/work/" not in provenance["data"]
    # The shipped curve is fitted on rows drawn from all models (all rows unless max_fit_rows caps them) ...
    assert provenance["rows"] == len(rows) and provenance["fit_rows"] == min(len(rows), provenance["max_fit_rows"]
                                                                             or len(rows))
    held = [tuple(h["held_out_model"]) for h in provenance["holdout"]]
    assert held == [shape for shape, _, _ in model_splits(rows)]  # ... and every model was held out once
    for entry in provenance["holdout"]:
        assert entry["holdout_rows"] == 720 and entry["fit_rows"] <= len(rows) - entry["holdout_rows"]
        assert math.isfinite(entry["error"]["median_abs_error"])


def test_reported_held_out_errors_are_what_the_simulator_gives(rows: pd.DataFrame) -> None:
    """Each recorded held-out error, recomputed: the simulator with the recorded fold curve on the
    rows of the model that fold held out. Catches a record that no longer matches the code."""
    provenance = json.loads(CALIBRATION_DATA.read_text())["provenance"]
    predictor = SimulatorPredictor()
    for entry in provenance["holdout"]:
        _, held = hold_out_model(rows, tuple(entry["held_out_model"]))
        fitted = entry["fitted"]  # every field of the recorded curve (the attention rate, the host path too)
        calibration = CurveCalibration(EfficiencyCurve.from_dict(fitted), fitted["nvlink_efficiency"])
        again = error_metrics(held["iter_time_s"], predict_rows(held, predictor, calibration))
        for key in ("median_abs_error", "p90_abs_error", "max_abs_error", "mean_signed_error"):
            assert again[key] == pytest.approx(entry["error"][key], rel=1e-6, abs=1e-9), (entry["held_out_model"],
                                                                                           key)


def test_the_calibrations_predictor_prices_the_pipeline_as_the_engine_does(rows: pd.DataFrame) -> None:
    """``sim.calibration.quick_predict`` (the closed form the calibration fits) prices a pipeline by the
    fast estimate's weighted schedule graph (``sim.estimate_pipeline.pipeline_time``). On vTrain rows
    with pp 2 and 4 at 2 and 4 micro-batches (the LM head on the last stage, where the old (m + pp - 1)
    x slowest-stage rule was 4-54% slower than the engine) it is within 1.5% of the engine; at pp 1 it
    is the engine's number. What remains is the tail: the closed form all-reduces every rank's gradients
    after the last one ends. Both add the tied embedding's all-reduce (the rows' plans are tied)."""
    from dataclasses import replace

    from analysis.calibrate import quick_predictor
    from sim.analytic import GPU_HOST_LAUNCH_S

    calibration = CurveCalibration(replace(default_calibration().curve, host_launch_s=GPU_HOST_LAUNCH_S))
    engine, quick = SimulatorPredictor(), quick_predictor()
    m = rows["global_batch"] // (rows["micro_batch"] * rows["dp"])
    for pp, microbatches in ((1, 2), (2, 2), (4, 2), (4, 4)):
        picked = rows[(rows["pp"] == pp) & (m == microbatches)].drop_duplicates(["tp", "hidden", "micro_batch"])
        for row in picked.head(6).to_dict("records"):
            expected = engine(row, calibration)
            tolerance = 1e-9 if pp == 1 else 0.015
            assert quick(row, calibration) == pytest.approx(expected, rel=tolerance), row
