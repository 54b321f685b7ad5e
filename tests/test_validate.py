"""End-to-end validation of one small 2-rank plan: real profile, real commbench, real gloo run.

No accuracy thresholds here (timing on a shared CPU machine is noisy); accuracy is the suite's
report (docs/validation.md). What is checked: the report has every field and finite numbers, the
files exist and are what they claim to be, and the combined trace holds both processes of every rank.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from analysis.validation.calibration import ValidationCalibration, fit_calibration, with_calibration
from analysis.validation.compare import iteration_stats, kind_comparison
from analysis.validation.report import ValidationReport, format_report
from analysis.validation.run import validate_plan, validate_record
from sim.compile import resolve_plan
from sim.costs import UniformCosts
from sim.plan import Plan
from sim.simulate import simulate
from tests.demo_output import MEMORY_TOLERANCE, check_tables_agree
from traces.bundle import read_bundle

PLAN = {
    "name": "test-validate-pp2",
    "workload": "gpt-tiny",
    "cluster": {"preset": "local-cpu-2"},
    "parallelism": {"pp": 2},
    "schedule": {"name": "1f1b", "micro_batch": 2, "microbatches": 2},
}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> ValidationReport:
    out = tmp_path_factory.mktemp("validate")
    return validate_plan(Plan.from_dict(PLAN), iterations=3, warmup=1, out_dir=out, profile_repeats=3,
                         comm_repeats=3)


def test_iteration_numbers_are_finite(report: ValidationReport) -> None:
    assert report.world_size == 2
    assert report.measured["n"] == 3
    assert len(report.measured["times_s"]) == 3
    for value in (report.predicted_s, report.measured_s, report.error, report.measured["spread"]):
        assert math.isfinite(value)
    assert report.predicted_s > 0 and report.measured_s > 0
    assert report.measured["min_s"] <= report.measured_s <= report.measured["max_s"]


def test_every_executed_kind_is_compared(report: ValidationReport) -> None:
    kinds = set(report.per_kind["kind"])
    # 1F1B on two stages: forwards, backwards, both message directions and the optimizer step.
    assert {"FWD", "BWD", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD", "OPTIMIZER_STEP"} <= kinds
    compute = report.per_kind[report.per_kind["kind"].isin(["FWD", "BWD"])]
    assert compute["error"].map(math.isfinite).all()
    # Two ranks x two micro-batches: 2 FWD predicted per stage pair, 3 iterations of them measured.
    fwd = report.per_kind.set_index("kind").loc["FWD"]
    assert fwd["n_predicted"] == 4 and fwd["n_measured"] == 12


def test_memory_compared_per_rank(report: ValidationReport) -> None:
    assert list(report.memory["rank"]) == [0, 1]
    assert (report.memory["predicted_peak"] > 0).all()
    # Comparable = the ledger without buckets in flight, the runtime with gradients from the start.
    assert (report.memory["predicted_comparable"] <= report.memory["predicted_peak"]).all()
    assert (report.memory["measured_comparable"] >= report.memory["measured_peak"]).all()
    # Memory does not depend on the machine's load: like with like, the two sides differ only by p2p
    # buffers (the tolerance's source: tests/demo_output.py). Measured here: -0.51% and -0.58%.
    assert report.memory["error"].abs().max() <= MEMORY_TOLERANCE, report.memory


def test_bundle_carries_measured_comm_fits(report: ValidationReport) -> None:
    bundle = read_bundle(report.profile)
    assert bundle.comm_fits is not None
    # every primitive the engine prices (sim.comm._FIT_NAMES), all-gather and reduce-scatter included
    assert set(bundle.comm_fits["primitive"]) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                                   "send_recv"}
    assert int(bundle.meta["settings"]["micro_batch"]) == PLAN["schedule"]["micro_batch"]
    assert int(bundle.meta["settings"]["colocated_processes"]) == 2
    # The simulated plan pointed at that bundle.
    assert Path(Plan.load(report.out_dir / "plan.yaml").profile) == report.profile


def test_figures_are_png_and_pdf(report: ValidationReport) -> None:
    png, pdf = report.paths["timeline_png"], report.paths["timeline_pdf"]
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert pdf.stat().st_size > 1000 and pdf.read_bytes()[:5] == b"%PDF-"


def test_combined_trace_has_prediction_and_measurement(report: ValidationReport) -> None:
    events = json.loads(report.paths["combined_trace"].read_text())["traceEvents"]
    processes = {e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    assert processes == {"predicted rank 0", "predicted rank 1", "measured rank 0", "measured rank 1"}
    spans = [e for e in events if e.get("ph") == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 1000, 1001}
    for name in ("predicted_trace", "measured_trace"):
        assert json.loads(report.paths[name].read_text())["traceEvents"]


def test_report_files_round_trip(report: ValidationReport) -> None:
    data = json.loads(report.paths["report_json"].read_text())
    assert data["plan"] == PLAN["name"]
    assert data["iteration"]["predicted_s"] == pytest.approx(report.predicted_s)
    assert len(data["per_kind"]) == len(report.per_kind)
    assert "gradient" in data["memory"]["note"]
    text = report.paths["report_md"].read_text()
    assert text == format_report(report)
    assert "| FWD |" in text and "Peak memory per rank" in text


def test_statistics_helpers() -> None:
    stats = iteration_stats([1.0, 2.0, 3.0, 4.0, 10.0])
    assert stats["median_s"] == 3.0 and stats["min_s"] == 1.0 and stats["max_s"] == 10.0
    assert stats["p10_s"] < stats["median_s"] < stats["p90_s"]
    rows = pd.DataFrame({"kind": ["FWD", "FWD", "BWD"], "start_s": [0.0, 1.0, 2.0], "end_s": [1.0, 3.0, 5.0],
                         "parent": [-1, -1, -1]})
    child = pd.DataFrame({"kind": ["FWD"], "start_s": [0.0], "end_s": [0.1], "parent": [0]})
    table = kind_comparison(rows, pd.concat([rows.assign(end_s=rows["end_s"] * 2), child]))
    fwd = table.set_index("kind").loc["FWD"]
    assert fwd["predicted_median_s"] == 1.5 and fwd["n_measured"] == 2  # child rows left out


def test_calibrated_comm_adds_overhead_to_all_reduces_only() -> None:
    plan = Plan.from_dict({**PLAN, "parallelism": {"dp": 2}, "schedule": {"name": "1f1b", "micro_batch": 2,
                                                                             "microbatches": 1}})
    setup = resolve_plan(plan, costs=UniformCosts(num_layers=6, param_bytes=1 << 20))
    calibrated = with_calibration(setup, ValidationCalibration(allreduce_overhead_s=0.004))
    base, comm = setup.comm, calibrated.comm
    assert comm.collective_s("allreduce", 1 << 20, (0, 1)) == pytest.approx(
        base.collective_s("allreduce", 1 << 20, (0, 1)) + 0.004)
    assert comm.collective_s("alltoall", 1 << 20, (0, 1)) == base.collective_s("alltoall", 1 << 20, (0, 1))
    assert comm.p2p_route(0, 1) == base.p2p_route(0, 1)
    # The simulated iteration grows by the overhead of the bucket all-reduce on the critical path.
    plain = simulate(plan, full=True, resolved=setup).iteration_s
    assert simulate(plan, full=True, resolved=calibrated).iteration_s == pytest.approx(plain + 0.004)


def test_a_validation_replaces_its_own_outputs(report: ValidationReport, tmp_path: Path) -> None:
    """Validating again into a validation's folder replaces its outputs (the folder holds the lock file that
    says paratwin wrote it); a folder of the user's holding report.md is refused (tests/test_output_folders.py)."""
    plan = Plan.from_dict({**PLAN, "name": "test-validate-again"})
    out = tmp_path / "again"
    reports = [validate_plan(plan, profile=report.profile, commbench=False, comm_fits_from=report.profile,
                             iterations=1, warmup=0, out_dir=out) for _ in range(2)]
    assert [r.out_dir for r in reports] == [out, out]
    assert ValidationReport.load(out / "report.json").to_dict() == reports[1].to_dict()


@pytest.fixture(scope="module")
def dp_report(report: ValidationReport, tmp_path_factory: pytest.TempPathFactory) -> ValidationReport:
    """A real run of a plan with a data-parallel all-reduce (what the calibration changes), on the
    pipeline report's profile and communication fits (no second profile or benchmark)."""
    plan = Plan.from_dict({**PLAN, "name": "test-validate-dp2", "parallelism": {"dp": 2}})
    return validate_plan(plan, profile=report.profile, commbench=False, comm_fits_from=report.profile,
                         iterations=3, warmup=1, out_dir=tmp_path_factory.mktemp("validate-dp"))


@pytest.fixture(scope="module")
def tp_report(report: ValidationReport, tmp_path_factory: pytest.TempPathFactory) -> ValidationReport:
    """A real run of dp2 x tp2 on four gloo ranks, on the pipeline report's profile and communication fits,
    with small buckets (several all-reduces, each a different mix of blocks and replicated layers)."""
    plan = Plan.from_dict({**PLAN, "name": "test-validate-dp2tp2", "parallelism": {"dp": 2, "tp": 2},
                           "cluster": {"preset": "local-cpu-2", "devices_per_node": 4},
                           "gradient_sync": {"method": "allreduce", "bucket_mb": 0.2}})
    return validate_plan(plan, profile=report.profile, commbench=False, comm_fits_from=report.profile,
                         iterations=1, warmup=1, out_dir=tmp_path_factory.mktemp("validate-tp"))


@pytest.mark.parametrize("which", ["report", "dp_report", "tp_report"])
def test_the_run_executes_the_predicted_instructions_bytes_included(which: str,
                                                                   request: pytest.FixtureRequest) -> None:
    """The spine on pipeline, data-parallel and tensor-parallel runs: every measured iteration holds the
    prediction's instructions, each with the prediction's bytes, whatever its kind (tests/demo_output.py).
    Under TP the profiled cost model divided all of a block's parameters by tp while each rank holds its
    LayerNorms and row-parallel biases whole: 12 of 16 all-reduces 576 B short (an outside-in review)."""
    validated: ValidationReport = request.getfixturevalue(which)
    check_tables_agree(validated.out_dir, range(1, 1 + validated.measured["n"]))
    if which == "tp_report":
        table = pd.read_parquet(validated.out_dir / "prediction" / "instructions.parquet")
        buckets = table[(table["parent"] == -1) & (table["kind"] == "ALLREDUCE") & (table["rank"] == 0)]
        assert len(buckets) >= 3 and buckets["bytes"].nunique() >= 2, buckets


def test_fit_calibration_is_never_worse_than_none(dp_report: ValidationReport) -> None:
    plan = Plan.load(dp_report.out_dir / "plan.yaml")
    setup = resolve_plan(plan)
    # The runtime's own costs are measured on the run's instruction tables, not fitted: a real
    # runtime spends some time between instructions, and far less than a millisecond per message.
    measured = fit_calibration([dp_report], max_overhead_s=0.01)
    assert 0.0 < measured.dispatch_s < 0.005 and measured.p2p_overhead_s >= 0.0

    def predicted(overhead: float) -> float:
        calibration = replace(measured, allreduce_overhead_s=overhead)
        return simulate(plan, full=True, options=calibration.engine_options(),
                        resolved=with_calibration(setup, calibration)).iteration_s

    # The plan exercises what the calibration changes: its all-reduce is on the critical path.
    assert predicted(0.005) >= predicted(0.0) + 0.004
    # On the real measurement: the fit is never worse than no calibration.
    fitted = fit_calibration([dp_report], max_overhead_s=0.01)
    assert 0.0 <= fitted.allreduce_overhead_s <= 0.01 and fitted.compute_scale == 1.0

    def error(overhead: float, measured: float) -> float:
        return abs(math.log(predicted(overhead) / measured))

    assert error(fitted.allreduce_overhead_s, dp_report.measured_s) <= error(0.0, dp_report.measured_s) + 1e-9
    # On a measurement made to be 3 ms of all-reduce overhead away: the fit finds those 3 ms.
    target = predicted(0.003)
    synthetic = replace(dp_report, measured={**dp_report.measured, "median_s": target})
    recovered = fit_calibration([synthetic], max_overhead_s=0.01).allreduce_overhead_s
    assert recovered == pytest.approx(0.003, abs=1e-4)
    assert error(recovered, target) < error(0.0, target)
    # On a measurement faster than the uncalibrated prediction no overhead helps: exactly none.
    faster = replace(dp_report, measured={**dp_report.measured, "median_s": 0.5 * predicted(0.0)})
    assert fit_calibration([faster], max_overhead_s=0.01).allreduce_overhead_s == 0.0


def test_a_poor_communication_fit_is_noted_where_it_is_used(report: ValidationReport, tmp_path: Path) -> None:
    """The report says of each fit it used what paratwin commbench says of it (exec.commbench.fit_quality_note):
    a tiny plan's validation listed a send_recv fit of r2 -0.242 and a reduce_scatter of 1.1e15 GB/s without
    a word (an outside-in review). The real validation's fits, whatever this machine gave them, then the same
    run re-reported (validate_record) from its bundle with send_recv's fit made as poor as the review's."""
    import shutil

    from analysis.validation.comm import poor_fit_notes
    from exec.commbench import POOR_FIT_R2, fit_quality_note
    from traces.bundle import write_bundle

    def noted(validated: ValidationReport) -> set[str]:
        return {note.split(" fit (")[0] for note in validated.notes if " fit (2 ranks): poor fit" in note}

    fits = report.comm_fits
    assert noted(report) == set(fits.loc[fits["r2"] < POOR_FIT_R2, "primitive"])
    table = report.paths["report_md"].read_text()
    for row in fits.itertuples(index=False):
        assert f"| {row.r2:.3f} | {fit_quality_note(row.r2)} |" in table

    bundle = read_bundle(report.profile)
    bundle.comm_fits.loc[bundle.comm_fits["primitive"] == "send_recv", "r2"] = -0.242
    poor = tmp_path / "poor-profile"
    shutil.copytree(report.profile, poor)
    write_bundle(bundle, poor)
    again = validate_record(Plan.from_dict(PLAN), report.out_dir / "run", poor, tmp_path / "again")
    assert "send_recv" in noted(again)
    [note] = [n for n in again.notes if n.startswith("send_recv fit")]
    # validate's sweep spans the plan's messages, which the samples then price, not the line
    assert note.startswith("send_recv fit (2 ranks): poor fit: sweep larger sizes (r2 -0.242); its bandwidth")
    assert note.endswith("every communication size of the plan lies within them"), note
    assert note in json.loads(again.paths["report_json"].read_text())["notes"]
    assert f"- {note}" in again.paths["report_md"].read_text()
    # a size beyond the sweep (another plan's fits, comm_fits_from) is priced by the line: said so
    smallest, largest = int(bundle.comm_samples["bytes"].min()), int(bundle.comm_samples["bytes"].max())
    [beyond] = [n for n in poor_fit_notes(bundle.comm_fits, bundle.comm_samples, [smallest, 10 * largest])
                if n.startswith("send_recv")]
    assert beyond.endswith(f"1 of the plan's 2 communication sizes lie outside them ({10 * largest}-"
                           f"{10 * largest} B), where the line prices them"), beyond


def test_report_loads_back_as_written(report: ValidationReport) -> None:
    again = ValidationReport.load(report.paths["report_json"])
    assert again.to_dict() == json.loads(Path(report.paths["report_json"]).read_text())


def test_dispatch_gaps_leave_out_waits_and_messages_are_timed_from_both_ends() -> None:
    from analysis.validation.runtime_costs import dispatch_gaps, message_times

    columns = ["rank", "kind", "stream", "start_s", "end_s", "parent", "name", "iteration"]
    rows = pd.DataFrame([
        [0, "FWD", "compute", 0.0, 1.0, -1, "FWD s0 mb0", 0],
        [0, "FWD", "compute", 1.25, 2.0, -1, "FWD s0 mb1", 0],  # 0.25 s after the previous: dispatch
        [0, "RECV_GRAD", "p2p_recv", 1.5, 3.0, -1, "RECV_GRAD s0 mb0 grad:0:0", 0],
        [0, "BWD", "compute", 3.5, 4.0, -1, "BWD s0 mb0", 0],  # waited for the receive, then 0.5 s
        [1, "SEND_GRAD", "p2p_send", 2.5, 2.6, -1, "SEND_GRAD s1 mb0 grad:0:0", 0],
    ], columns=columns)
    assert dispatch_gaps(rows[rows["rank"] == 0]) == [0.25, 0.5]
    # The message: from the later of the send's start (2.5) and the receive's post (1.5) to its end (3.0).
    assert message_times(rows).tolist() == [0.5]


def test_dispatch_time_is_paid_before_every_compute_instruction_but_the_first() -> None:
    from sim.engine import EngineOptions

    plan = Plan.from_dict({**PLAN, "cluster": {"preset": "local-cpu-2", "devices_per_node": 1},
                           "parallelism": {}, "schedule": {"name": "1f1b", "micro_batch": 2, "microbatches": 3}})
    setup = resolve_plan(plan, costs=UniformCosts(num_layers=6, param_bytes=1 << 20))
    plain = simulate(plan, full=True, resolved=setup)
    compute = plain.table[(plain.table["parent"] == -1) & (plain.table["stream"] == "compute")]
    slower = simulate(plan, full=True, resolved=setup, options=EngineOptions(dispatch_s=0.001))
    # One rank, nothing to wait for: every compute instruction after the first starts 1 ms later.
    assert slower.iteration_s == pytest.approx(plain.iteration_s + 0.001 * (len(compute) - 1))



def test_a_plan_with_more_ranks_than_this_machine_runs_is_refused_before_profiling(tmp_path: Path) -> None:
    """validate profiled in as many processes as the plan has ranks before the run refused the plan: a
    64-rank GPU plan (examples/plans/gpt-8.3b-a100-64-merak.yaml) started 64 profiling processes on a
    2-core, 24 GiB machine and the kernel's OOM killer took other work. Now it is refused first."""
    import os

    from sim.compile import MAX_LOCAL_RANKS_PER_CORE
    from traces.errors import ConfigError

    ranks = MAX_LOCAL_RANKS_PER_CORE * len(os.sched_getaffinity(0)) + 1
    plan = Plan.from_dict({**PLAN, "name": "too-many-ranks", "parallelism": {"dp": ranks, "tp": 1, "pp": 1},
                           "cluster": {"preset": "local-cpu-2", "devices_per_node": ranks}})
    with pytest.raises(ConfigError, match=rf"parallelism: dp x tp x pp: {ranks} ranks on one machine"):
        validate_plan(plan, out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_another_workloads_profile_is_refused_naming_the_users_folder(tmp_path: Path, gpt_tiny_profile: Path) -> None:
    """validate --profile copied the bundle under its output folder first, then refused the copy
    ("v/profile profiles workload ...") and left it there (found by an outside-in review)."""
    from traces.errors import ConfigError

    plan = Plan.load(Path(__file__).resolve().parent.parent / "examples" / "plans" / "lstm-tiny-dp2.yaml")
    with pytest.raises(ConfigError, match=rf"^profile: {re.escape(str(gpt_tiny_profile))} profiles workload "
                                          r"'gpt-tiny', the plan's workload is 'lstm-tiny'"):
        validate_plan(plan, profile=gpt_tiny_profile, out_dir=tmp_path / "v")
    assert not (tmp_path / "v" / "profile").exists()
