"""Validate a plan: predict it with measured costs, run it, and compare the two, instruction by instruction.

``validate_plan`` does, on this machine:

1. profile the plan's workload at the plan's micro-batch (``exec.profiler.profile_workload``, one
   torch thread per process, as the runtime runs one thread per rank) or reuse a given bundle. On
   a CPU the profile is taken in as many concurrent processes as the plan has ranks
   (``colocated``): the ranks of a run share this machine's cores with each other, and a layer
   timed alone runs up to twice as fast as the same layer while another rank computes (measured
   here: 19-21 ms alone, 41-56 ms with a second profiler running, for one 256-wide block). Each
   layer's time is the median over the processes (``analysis.validation.profiling``);
2. calibrate communication with ``exec.commbench`` on two ranks (``analysis.validation.comm.COMM_PRIMITIVES``,
   sizes spanning the plan's messages, buckets and TP all-reduces) and store the alpha-beta fits in the
   bundle, where ``sim.comm.ClusterComm`` picks them up (``analysis.validation.comm``);
3. simulate the plan in full mode (every rank) with ``profile:`` pointing at that bundle;
4. run it with ``exec.launcher.run_plan`` for ``warmup + iterations`` iterations;
5. compare: iteration time (prediction vs the median of the measured iterations, with spread),
   the median duration of every instruction kind, and peak memory per rank (like with like, see
   ``memory_comparison``) (``analysis.validation.compare``); and write a timeline overlay figure
   (PNG and PDF), the predicted and measured Chrome traces and a combined one
   (``analysis.validation.artifacts``), ``report.json`` and ``report.md``
   (``analysis.validation.report``).

Errors are ``predicted / measured - 1``: positive when the simulator predicts too much.

A ``ValidationCalibration`` (a compute scale and a per-all-reduce overhead, fitted by
``fit_calibration`` on plans outside the suite, ``analysis.validation.calibration``) may be applied
to the prediction; the report then keeps the uncalibrated prediction too. ``validate_record``
compares a run made elsewhere (torchrun, SLURM, network namespaces) with its prediction.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict
from pathlib import Path

from analysis.validation.artifacts import write_artifacts
from analysis.validation.calibration import ValidationCalibration, with_calibration
from analysis.validation.comm import comm_sizes, copy_comm_fits, poor_fit_notes
from analysis.validation.compare import (
    MeasuredRun,
    iteration_stats,
    kind_comparison,
    memory_comparison,
    representative_iteration,
)
from analysis.validation.profiling import bracket_profile, profile_for_validation, profile_plan_workload
from analysis.validation.report import ValidationReport, write_report
from sim.compile import compile_plan, resolve_plan
from sim.engine import EngineOptions
from sim.plan import Plan
from sim.simulate import simulate
from traces.bundle import read_bundle
from traces.errors import ConfigError
from traces.outdir import OutputLock, prepare_out_folder

# What validate_plan writes in its folder: a folder of the user's holding one of these names is refused
# (report.md and plan.yaml were overwritten, and a user's profile/ deleted).
VALIDATION_OUTPUTS = ("profile", "run", "prediction", "plan.yaml", "predicted_trace.json", "measured_trace.json",
                      "combined_trace.json", "timeline.png", "timeline.pdf", "report.json", "report.md")


def validate_plan(plan: Plan | str | Path, nproc: int | None = None, profile: Path | None = None,
                  iterations: int = 20, warmup: int = 3, out_dir: Path | None = None, commbench: bool = True,
                  *, colocated: bool = True, bracket: bool = False, comm_fits_from: Path | None = None,
                  timeout_s: float = 300.0, profile_repeats: int = 10, comm_repeats: int = 10,
                  options: EngineOptions | None = None, calibration: ValidationCalibration | None = None
                  ) -> ValidationReport:
    """Profile (or reuse ``profile``), calibrate communication, simulate, run and compare ``plan``.

    ``profile``: an existing bundle of the same workload and micro-batch; with ``commbench`` it is
    copied to ``out_dir/profile`` and the fits are added there. ``colocated``: profile in as many
    concurrent processes as the plan has ranks (see the module docstring). ``bracket`` (only when
    profiling here): profile again right after the run and use the mean of the two profiles, so
    that a machine whose load drifts during the run is seen by both sides alike; the prediction
    still uses nothing measured in the run. ``comm_fits_from``: take the communication fits of
    this bundle instead of benchmarking (with ``commbench=False``). ``calibration``: constants fitted on
    other plans (``fit_calibration``); the report also gives the uncalibrated prediction.
    Results go to ``out_dir`` (a new temporary directory by default)."""
    from exec.launcher import check_runs_here, run_plan

    source = str(plan) if not isinstance(plan, Plan) else None
    plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    if iterations < 1 or warmup < 0:
        raise ConfigError("iterations", f"need iterations >= 1 and warmup >= 0 (got {iterations}, {warmup})",
                          "e.g. iterations=20, warmup=3")
    if nproc is not None and nproc != plan.world_size:
        raise ConfigError("nproc", f"{nproc} processes for a plan of dp x tp x pp = {plan.world_size} ranks",
                          f"use nproc={plan.world_size} or change the plan's degrees")
    if out_dir is not None:  # a temporary folder is new; a validation's own folder is reused (its lock file)
        prepare_out_folder(Path(out_dir), VALIDATION_OUTPUTS)
    # The run would refuse such a plan, but only after the profile, which starts as many processes
    # as the plan has ranks: a 64-rank GPU plan took this 2-core, 24 GiB machine's memory first.
    structure = check_runs_here(plan)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="paratwin-validate-"))
    with OutputLock(out):  # one validation per folder; the lock file marks it as paratwin's for a rerun
        notes: list[str] = []
        with_comm = commbench and plan.world_size > 1
        bundle_dir = profile_for_validation(plan, out, profile, with_comm, colocated, profile_repeats=profile_repeats,
                                            comm_repeats=comm_repeats)
        if comm_fits_from is not None and not with_comm:
            copy_comm_fits(Path(comm_fits_from), bundle_dir)
        measured_plan = plan.replace(profile=str(bundle_dir))

        # Measure first when the profile brackets the run; the prediction never reads the run.
        run = run_plan(measured_plan, nproc=plan.world_size, iterations=iterations, warmup=warmup, out_dir=out / "run",
                       timeout_s=timeout_s, force=True, measured=structure)  # its own folder: replace its run
        drift = None
        if bracket and profile is None:
            before = read_bundle(bundle_dir)
            after = profile_plan_workload(plan, plan.world_size if colocated else 1, repeats=profile_repeats)
            drift = bracket_profile(before, after, bundle_dir)
            notes.append(f"profile bracketed the run: compute times after / before = {drift:.3f} (mean of both used)")

        measured = MeasuredRun(run.table, run.iteration_times, run.peak_memory, warmup, run.paths["trace"], out / "run")
        settings = {"plan_file": source, "bracketed_profile": drift is not None, "profile_drift": drift}
        return _predict_and_compare(plan, measured_plan, measured, out, notes, options, settings, calibration)


def validate_record(plan: Plan | str | Path, run_dir: Path, profile: Path, out_dir: Path,
                    options: EngineOptions | None = None, calibration: ValidationCalibration | None = None,
                    notes: list[str] | None = None) -> ValidationReport:
    """Compare a run made elsewhere (``python -m exec.runtime`` under torchrun, SLURM or in network
    namespaces), or earlier (a suite's rounds priced from a profile taken after them), with the
    prediction of ``plan`` from the bundle ``profile``. The plan's own cluster prices communication
    unless the bundle has fits. ``calibration`` and ``notes`` as in ``validate_plan``."""
    plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    measured_plan = plan.replace(profile=str(Path(profile).resolve()))
    return _predict_and_compare(plan, measured_plan, MeasuredRun.from_record(run_dir), out, list(notes or []),
                                options, {"run_dir": str(run_dir)}, calibration)


def _predict_and_compare(plan: Plan, measured_plan: Plan, run: MeasuredRun, out: Path, notes: list[str],
                         options: EngineOptions | None, extra_settings: dict,
                         calibration: ValidationCalibration | None = None) -> ValidationReport:
    bundle_dir = Path(measured_plan.profile)
    bundle = read_bundle(bundle_dir)
    if bundle.comm_fits is None or not len(bundle.comm_fits):
        notes.append("no communication fits in the bundle: the cluster's link model prices communication")
    settings = bundle.meta.get("settings", {})
    if int(settings.get("micro_batch", plan.micro_batch)) != plan.micro_batch:
        notes.append(f"the profile was taken at micro-batch {settings.get('micro_batch')}, the plan runs "
                     f"{plan.micro_batch}: times scaled linearly")

    # Predict (full mode: every rank, waiting for its real peers).
    options = options or EngineOptions(layer_rows=True)
    resolved = resolve_plan(measured_plan)
    calibration = calibration or ValidationCalibration()
    extra_settings["calibration"] = asdict(calibration)
    extra_settings["predicted_uncalibrated_s"] = None
    if not calibration.identity:
        plain = simulate(measured_plan, full=True, options=options, resolved=resolved).iteration_s
        extra_settings["predicted_uncalibrated_s"] = float(plain)
        notes.append(f"calibrated ({calibration.source}): compute x {calibration.compute_scale:.3f}, "
                     f"+{calibration.allreduce_overhead_s * 1e3:.2f} ms per all-reduce, "
                     f"+{calibration.dispatch_s * 1e3:.2f} ms dispatch per compute instruction, "
                     f"+{calibration.p2p_overhead_s * 1e3:.2f} ms per message; uncalibrated "
                     f"prediction {plain * 1e3:.1f} ms")
        resolved = with_calibration(resolved, calibration)
        options = calibration.engine_options(options)
    sim = simulate(measured_plan, full=True, options=options, resolved=resolved)
    measured_plan.dump(out / "plan.yaml")
    times = run.iteration_times

    # Compare and draw.
    measured = run.table
    compiled = compile_plan(measured_plan, symmetric=False, resolved=resolved)
    program = compiled.program
    if bundle.comm_fits is not None:  # what commbench says of its fits, said where they are used
        notes.extend(poor_fit_notes(bundle.comm_fits, bundle.comm_samples, comm_sizes(measured_plan, compiled)))
    stage_ranks = {rank: rp.stages for rank, rp in program.ranks.items()}
    chosen = representative_iteration(measured, times)
    one = measured[measured["iteration"] == chosen]
    paths = {"profile": bundle_dir, **({"run": run.directory} if run.directory else {}),
             **({"run_trace": run.trace} if run.trace else {})}
    paths.update(write_artifacts(sim, one, out,
                                 f"{plan.name}: predicted vs measured (iteration {chosen}, median time)"))
    report = ValidationReport(
        plan=plan.name, out_dir=out, world_size=plan.world_size, iterations=len(times),
        warmup=run.warmup,
        predicted_s=float(sim.iteration_s), measured=iteration_stats(times),
        per_kind=kind_comparison(sim.table, measured),
        memory=memory_comparison(sim, measured, run.peak_memory, resolved, stage_ranks, program.unheld_param_bytes),
        profile=bundle_dir, comm_fits=bundle.comm_fits, paths=paths, notes=notes + list(sim.notes),
        settings={**extra_settings, "colocated_profile": int(settings.get("colocated_processes", 1)),
                  "timeline_iteration": chosen, "engine_options": asdict(options),
                  "profile_settings": settings},
    )
    write_report(report)
    return report

