"""Predict a stored validation suite again with today's simulator and calibration, against the
measurements it kept (issue 16): the calibration is measured and fitted on the suite's own
calibration runs (``calibration/``, plans outside the suite), as ``paratwin validate-suite`` does,
then every suite plan is simulated from its own profile and compared with its measured median.

    python scripts/suite_repredict.py runs/suite-1 [runs/suite-2 ...]
    python scripts/suite_repredict.py runs/netns-embedding-6     # a shaped-network run (issue 12)

Prints, per suite, each plan's error as validated then and as predicted now, and the summary
figures; ``--without-runtime-costs`` leaves out the measured dispatch and message costs (the
calibration as it was: an all-reduce overhead only); ``--without-meeting-waits`` predicts "now"
without the expected wait for a collective's latest member (``EngineOptions.meeting_waits``,
``sim.meeting``), calibration fit included, to show that term's effect; ``--without-process-offsets``
without the part of that wait the profiling processes' systematic differences add (bundles with
``process_layers`` only, ``EngineOptions.process_offsets``); ``--overlap-slowdown=X``
predicts with ``EngineOptions.overlap_slowdown`` X (a what-if; the measured alternative is ``--comm-cpu``). Beside
Spearman, the ranking is judged on the pairs the stored per-iteration times resolve
(``analysis.ranking``): how many of them the prediction orders as measured, then and now.

A folder of ``scripts/netns_embedding.sh`` (``<rate>/<method>/report``, one profile in ``base/``, no
calibration: the netns runs are validated uncalibrated) is re-predicted per rate, from the copy of
its profile inside the folder; where the run benchmarked its link (``<rate>/profile``, the profile
with that rate's commbench fits, analysis.netns_comm), from that. ``--comm=DIR`` takes each rate's
``DIR/<rate>/profile`` instead (a benchmark made afterwards: ``COMM_ONLY=1 scripts/netns_embedding.sh
DIR``), to show what a measured link changes in a stored run; ``--rate-only`` ignores every
benchmark (the tbf rate alone prices the link).

``--comm-cpu=DIR`` (issue 12, seventh session): an ``exec.commbench`` folder whose fits have the CPU
of communicating (``cpu_alpha_s``, ``cpu_bandwidth_Bps``; measured after the stored run): each
plan is predicted from a copy of its bundle with those CPU columns added to its own fits (matched
by primitive and ranks), so on a host whose cores the ranks share (``cluster.host_cores``) compute
that overlaps data moving is slowed by the cores the transfers take (``sim.host_cpu``). The
calibration plans keep their bundles as stored. A shaped-network folder's rates take the CPU of
the loopback benchmark too (its kernel path differs: veth, tbf).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pandas as pd

from analysis.metrics import spearman_text
from analysis.ranking import describe, rank_pairs
from analysis.validation.calibration import ValidationCalibration, fit_calibration, with_calibration
from analysis.validation.comm import merge_cpu_fits
from analysis.validation.report import ValidationReport
from analysis.validation_suite import stored_times, unsteadiness
from exec.commbench import read_comm_results
from sim.compile import resolve_plan
from sim.engine import EngineOptions
from sim.plan import Plan
from sim.simulate import simulate
from traces.errors import ConfigError


def with_cpu(profile: Path, cpu: pd.DataFrame | None, scratch: Path) -> Path:
    """``profile``, or a copy of it in ``scratch`` with ``cpu``'s CPU columns (``--comm-cpu``)."""
    if cpu is None:
        return profile
    copy = scratch / f"{len(list(scratch.iterdir()))}-{profile.parent.name}"
    shutil.copytree(profile, copy)
    merge_cpu_fits(copy, cpu)
    return copy


def repredict(suite: Path, runtime_costs: bool, options: EngineOptions, cpu: pd.DataFrame | None = None,
              scratch: Path | None = None) -> tuple[ValidationCalibration, pd.DataFrame]:
    attempts: dict[str, list[ValidationReport]] = {}
    for folder in sorted((suite / "calibration").iterdir()):
        if (folder / "report.json").is_file():
            report = ValidationReport.load(folder / "report.json")
            attempts.setdefault(report.plan, []).append(report)
    # the attempt the suite kept: the steadiest (analysis.validation_suite), not every retry
    reports = [min(tries, key=unsteadiness) for tries in attempts.values()]
    calibration = fit_calibration(reports, options=options) if runtime_costs \
        else fit_calibration_without_runtime_costs(reports, options)
    table = pd.read_csv(suite / "suite.csv", keep_default_na=False, na_values=[""])
    table["timeline"] = table["timeline"].fillna("")
    times = stored_times(suite, table)
    rows = []
    for _, row in table.iterrows():
        folder = Path(str(row["timeline"])).parent if str(row["timeline"]) else suite / "plans" / row["plan"]
        plan = Plan.load(folder / "plan.yaml")
        if cpu is not None and scratch is not None:
            plan = plan.model_copy(update={"profile": str(with_cpu(Path(str(plan.profile)), cpu, scratch))})
        resolved = with_calibration(resolve_plan(plan), calibration)
        now = simulate(plan, full=True, options=calibration.engine_options(options), resolved=resolved)
        rows.append({"plan": row["plan"], "measured_s": row["measured_median_s"], "then": row["error"],
                     "now": now.iteration_s / row["measured_median_s"] - 1, "predicted_s": now.iteration_s,
                     "times_s": times[row["plan"]]})
    return calibration, pd.DataFrame(rows)


def fit_calibration_without_runtime_costs(reports: list[ValidationReport],
                                          options: EngineOptions) -> ValidationCalibration:
    """The calibration as it was before runtime costs were measured: the all-reduce overhead alone."""
    stripped = [replace(r, paths={k: v for k, v in r.paths.items() if k not in ("run", "prediction")})
                for r in reports]
    return fit_calibration(stripped, options=options)


def netns_profile(folder: Path, rate: str, comm: Path | None, rate_only: bool) -> Path:
    """The bundle a rate's plans are predicted from: ``comm``'s benchmark of the rate, else the run's
    own (``<rate>/profile``) unless ``rate_only``, else the run's one profile (``base/profile``)."""
    if comm is not None:
        if not (comm / rate / "profile").is_dir():
            raise ConfigError("--comm", f"{comm / rate / 'profile'} does not exist",
                              f"benchmark that rate: COMM_ONLY=1 RATES={rate} scripts/netns_embedding.sh {comm}")
        return comm / rate / "profile"
    if not rate_only and (folder / rate / "profile").is_dir():
        return folder / rate / "profile"
    if not (folder / "base" / "profile").is_dir():
        raise ConfigError("--rate-only", f"{folder} has no profile without communication fits (base/profile): "
                          "it was run with PROFILE=", "re-predict it without --rate-only")
    return folder / "base" / "profile"


def repredict_netns(folder: Path, options: EngineOptions, comm: Path | None = None,
                    rate_only: bool = False, cpu: pd.DataFrame | None = None,
                    scratch: Path | None = None) -> pd.DataFrame:
    """Every ``<rate>/<method>`` of a shaped-network folder, predicted again (``netns_profile``)."""
    rows = []
    for report_path in sorted(folder.glob("*/*/report/report.json")):
        report = ValidationReport.load(report_path)
        rate, method = report_path.parts[-4], report_path.parts[-3]
        plan = Plan.load(report_path.parent / "plan.yaml")
        profile = netns_profile(folder, rate, comm, rate_only)
        if cpu is not None and scratch is not None:
            profile = with_cpu(profile, cpu, scratch)
        plan = plan.model_copy(update={"profile": str(profile)})
        now = simulate(plan, full=True, options=options)
        rows.append({"plan": f"{rate} {method}", "rate": rate, "measured_s": report.measured_s,
                     "then": report.error, "now": now.iteration_s / report.measured_s - 1,
                     "predicted_s": now.iteration_s, "times_s": report.measured.get("times_s") or [report.measured_s]})
    return pd.DataFrame(rows)


def print_table(table: pd.DataFrame) -> None:
    print("| plan | measured (ms) | error then | error now |\n| --- | ---: | ---: | ---: |")
    for _, r in table.iterrows():
        print(f"| {r['plan']} | {r['measured_s'] * 1e3:.1f} | {r['then']:+.1%} | {r['now']:+.1%} |")
    for label, column in (("then", "then"), ("now", "now")):
        errors = table[column]
        predicted = table["measured_s"] * (1 + errors)
        print(f"{label}: median |error| {errors.abs().median():.1%}, max {errors.abs().max():.1%}, mean "
              f"{errors.mean():+.1%}, {spearman_text(predicted, table['measured_s'])}")
        ranking = rank_pairs(dict(zip(table["plan"], table["times_s"], strict=True)),
                             dict(zip(table["plan"], predicted, strict=True)))
        print(f"  {label}: {describe(ranking.to_dict())}")


def main(argv: list[str]) -> None:
    runtime_costs = "--without-runtime-costs" not in argv
    slowdown = [float(a.split("=", 1)[1]) for a in argv if a.startswith("--overlap-slowdown=")]
    options = EngineOptions(meeting_waits="--without-meeting-waits" not in argv,
                            process_offsets="--without-process-offsets" not in argv,
                            overlap_slowdown=slowdown[-1] if slowdown else 0.0)
    comm = [Path(a.split("=", 1)[1]) for a in argv if a.startswith("--comm=")]
    cpu_dirs = [Path(a.split("=", 1)[1]) for a in argv if a.startswith("--comm-cpu=")]
    cpu = read_comm_results(cpu_dirs[-1])[1] if cpu_dirs else None
    with tempfile.TemporaryDirectory(prefix="paratwin-repredict-") as scratch:
        run_all(argv, options, runtime_costs, comm, cpu, Path(scratch))


def run_all(argv: list[str], options: EngineOptions, runtime_costs: bool, comm: list[Path],
            cpu: pd.DataFrame | None, scratch: Path) -> None:
    for suite in [Path(a) for a in argv if not a.startswith("--")]:
        if not suite.is_dir():
            raise ConfigError("suite", f"{suite} is not a folder", "pass the --out folder of a validation suite "
                              "or of scripts/netns_embedding.sh")
        if any(suite.glob("*/*/report/report.json")):  # scripts/netns_embedding.sh's <rate>/<method>/report
            table = repredict_netns(suite, options, comm[-1] if comm else None, "--rate-only" in argv, cpu, scratch)
            for rate, part in table.groupby("rate", sort=False):
                source = netns_profile(suite, str(rate), comm[-1] if comm else None, "--rate-only" in argv)
                print(f"\n{suite.name} {rate} (uncalibrated, as validated; now from {source})")
                print_table(part)
            continue
        calibration, table = repredict(suite, runtime_costs, options, cpu, scratch)
        print(f"\n{suite.name}: {calibration.source}: +{calibration.allreduce_overhead_s * 1e3:.2f} ms per "
              f"all-reduce (fitted), +{calibration.dispatch_s * 1e3:.3f} ms dispatch per compute instruction and "
              f"+{calibration.p2p_overhead_s * 1e3:.3f} ms per message (measured)")
        print_table(table)


if __name__ == "__main__":
    from analysis.report import error_console, run_cli

    run_cli(lambda: main(sys.argv[1:]), to=error_console)  # a bad option: one line, status 2
