"""The ``paratwin`` command line: profile, benchmark, simulate, run and validate training plans."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from analysis.report import console, plain, print_layers, print_sim, run_cli, size
from traces.atomic import atomic_write_text
from traces.errors import ConfigError, Interrupted
from traces.outdir import OutputLock, fresh_run_folder, prepare_out_file, prepare_out_folder, safe_name

try:  # typer parses with a copy of click of its own (0.2x)
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover - a typer on the click package
    from click.exceptions import UsageError

app = typer.Typer(
    name="paratwin",
    help="A digital twin of a training cluster: profile a model, simulate a parallel training plan, "
    "run the same plan with torch.distributed, and compare the two.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def workloads() -> None:
    """List the workload presets; a plan may also name its own Workload by import path."""
    from exec.workloads import workload_names

    for name in workload_names():
        console.print(name)
    plain("or your own model by import path, module:Class (a Workload subclass or a factory taking the plan's "
          "workload_options), found from the current directory or PYTHONPATH: docs/profiler.md, \"Your own model\"")


@app.command()
def options() -> None:
    """List the registered choices of every plan dimension (schedules, memory policies, gradient sync)."""
    from sim.options import registered_options

    for field, choices in registered_options().items():
        plain(f"{field}:")
        for name, doc in choices:
            plain(f"  {name:<32} {doc}")


@app.command("migrate-plan")
def migrate_plan(
    plan: Annotated[Path, typer.Argument(help="a plan in the flat form (dp:, schedule: 1f1b, ... at the top)")],
    out: Annotated[Path | None, typer.Option(help="write the sectioned plan here instead of printing it")] = None,
    force: Annotated[bool, typer.Option("--force", help="replace an existing --out file")] = False,
) -> None:
    """Spell a plan written in the flat form in sections (parallelism, schedule, memory, gradient_sync)."""
    import yaml

    from sim.plan import Plan, migrate_flat, read_plan_document
    from traces.limits import check_document

    data = read_plan_document(plan)
    if not isinstance(data, dict):
        raise ConfigError(str(plan), "a plan must be a mapping of fields", "see examples/plans/*.yaml")
    check_document(data, str(plan))  # before migrate_flat walks it
    migrated = Plan.from_dict(migrate_flat(data), source=str(plan))  # the result must be a valid plan
    text = yaml.safe_dump(migrated.model_dump(exclude_defaults=True), sort_keys=False)
    if out is None:
        plain(text.rstrip())
        return
    prepare_out_file(out, force)  # a folder was a traceback, an existing file silently replaced
    try:
        atomic_write_text(out, text)  # whole or not at all: a plan it replaces is never left half written
    except OSError as exc:  # a traceback before
        raise ConfigError("--out", f"cannot write {out} ({exc.strerror})",
                          "name a file in a place you can write") from None
    plain(f"wrote {out}")


def workload_options(items: list[str] | None) -> dict[str, object]:
    """``--workload-option KEY=VALUE`` (repeatable) as a plan's ``workload_options``: each value read as YAML."""
    import yaml

    options = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError("--workload-option", f"{item!r} is not KEY=VALUE", "write e.g. --workload-option seq=128")
        try:
            options[key] = yaml.safe_load(value)
        except yaml.YAMLError as exc:  # a yaml ParserError traceback before
            raise ConfigError(f"--workload-option {key}", f"{value!r} is not a YAML value "
                              f"({getattr(exc, 'problem', None) or str(exc).splitlines()[0]})",
                              f"quote it, or write e.g. --workload-option {key}=128") from None
    return options


WORKLOAD_OPTION_HELP = "KEY=VALUE workload option (a plan's workload_options), repeatable"


@app.command()
def profile(
    workload: Annotated[str, typer.Option(help="workload preset, e.g. gpt2-small, or your own Workload by import "
                                          "path, module:Class (see `paratwin workloads`)")],
    out: Annotated[Path, typer.Option(help="directory of the trace bundle to write")],
    micro_batch: Annotated[int, typer.Option(help="samples per micro-batch")] = 4,
    seq: Annotated[int | None, typer.Option(help="sequence length (transformers); default: preset's")] = None,
    workload_option: Annotated[list[str] | None, typer.Option(help=WORKLOAD_OPTION_HELP)] = None,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16")] = "float32",
    device: Annotated[str, typer.Option(help="auto, cpu or cuda")] = "auto",
    repeats: Annotated[int, typer.Option(help="timed repeats per layer (after warm-up)")] = 10,
    warmup: Annotated[int, typer.Option(help="untimed warm-up runs per layer")] = 2,
    ops: Annotated[bool, typer.Option(help="keep the per-op Kineto table")] = True,
    fmt: Annotated[str, typer.Option("--format", help="parquet or csv")] = "parquet",
    force: Annotated[bool, typer.Option("--force", help="replace a paratwin folder in --out that is not a profile "
                                        "of this workload (another workload's bundle, a run record)")] = False,
) -> None:
    """Measure per-layer time (forward, backward input/weight, recompute), memory and FLOPs."""
    from exec.host_memory import keep_freed_memory
    from exec.profiler import profile_workload
    from exec.workloads import get_workload
    from traces.bundle import MANIFEST_NAME, OP_TIMELINE_NAME, check_profile_target, write_bundle

    options = workload_options(workload_option)
    if seq is not None and options.setdefault("seq", seq) != seq:  # --seq is the option seq
        raise ConfigError("--seq", f"{seq} and --workload-option seq={options['seq']} disagree", "give one of them")
    built = get_workload(workload, **options)  # checks the options (and the name) before anything is written
    prepare_out_folder(out, ())  # a file, or a place that cannot be written: one line, before profiling
    check_profile_target(out, workload, force)  # before profiling: another workload's bundle was replaced
    earlier = (out / MANIFEST_NAME).is_file()  # an interrupted profile leaves it whole
    with OutputLock(out):  # one writer at a time, as every command; the bundle keeps the lock file
        keep_freed_memory()  # as the runtime's CPU ranks keep it (exec.host_memory); recorded in the bundle
        try:
            bundle = profile_workload(built, micro_batch=micro_batch, dtype=dtype, device=device,
                                      warmup=warmup, repeats=repeats, with_ops=ops)
        except KeyboardInterrupt:  # exit 130 without a word before
            kept = f"the earlier bundle in {out} is unchanged" if earlier else f"nothing was written to {out}"
            raise Interrupted(f"profile interrupted by SIGINT; {kept}") from None
        path = write_bundle(bundle, out, fmt=fmt)
    print_layers(bundle.layers)
    plain(f"wrote trace bundle {path}")
    if (path / OP_TIMELINE_NAME).is_file():
        plain(f"per-op timeline (open in https://ui.perfetto.dev): {path / OP_TIMELINE_NAME}")


@app.command()
def commbench(
    nproc: Annotated[int, typer.Option(help="ranks to spawn (ignored under torchrun)")] = 2,
    out: Annotated[Path | None, typer.Option(help="directory for samples and fits")] = None,
    min_bytes: Annotated[int, typer.Option(help="smallest message")] = 1024,
    max_bytes: Annotated[int, typer.Option(help="largest message")] = 256 * 2**20,
    repeats: Annotated[int, typer.Option(help="timed repeats per size")] = 10,
    backend: Annotated[str | None, typer.Option(help="gloo or nccl; default: nccl on CUDA, else gloo")] = None,
) -> None:
    """Benchmark collectives and send/recv over a size sweep and fit latency + size/bandwidth."""
    from exec.commbench import fit_quality_note, run_commbench

    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    samples, fits = run_commbench(nproc=nproc, sizes=sizes, backend=backend, repeats=repeats, out=out)
    table = Table("primitive", "backend", "ranks", "latency us", "bandwidth GB/s", "R^2",
                  "CPU us + GB per CPU-s", "note",
                  title="alpha-beta fits (time = latency + bytes / bandwidth; a rank's CPU alike)")
    for row in fits.itertuples():
        # A sweep of small messages alone cannot pin the bandwidth down: say so rather than print it.
        note = "; ".join(n for n in (row.note, fit_quality_note(row.r2)) if n)
        table.add_row(row.primitive, row.backend, str(row.world_size), f"{row.alpha_s * 1e6:.1f}",
                      f"{row.bandwidth_Bps / 1e9:.3g}", f"{row.r2:.2f}",
                      f"{row.cpu_alpha_s * 1e6:.0f} + {row.cpu_bandwidth_Bps / 1e9:.3g}", note)
    console.print(table)
    if out:
        plain(f"wrote {out}")


@app.command()
def simulate(
    plan: Annotated[Path, typer.Argument(help="plan YAML or JSON")],
    out: Annotated[Path | None, typer.Option(help="directory for the instruction table and timeline")] = None,
    full: Annotated[bool, typer.Option("--full", help="simulate every rank, not one per symmetric group")] = False,
    profile: Annotated[Path | None, typer.Option(help="trace bundle to use in place of the plan's profile:")] = None,
) -> None:
    """Predict iteration time, throughput, bubbles and memory of a plan; write its timeline."""
    from sim.plan import Plan
    from sim.result import SIM_OUTPUTS
    from sim.simulate import simulate as run_simulation

    loaded = Plan.load(plan)
    if profile is not None:
        loaded = loaded.replace(profile=str(profile))
    target = out or Path("runs") / f"sim-{safe_name(loaded.name)}"
    prepare_out_folder(target, SIM_OUTPUTS)  # before simulating, not after
    result = run_simulation(loaded, full=full)
    print_sim(result)
    paths = result.write(target)  # under the folder's lock: one writer at a time
    plain(f"instruction table: {paths['table']}\ntimeline (open in https://ui.perfetto.dev): "
          f"{paths['trace']}\nsummary: {paths['summary']}")
    does_not_fit = result.does_not_fit()
    if does_not_fit is not None:  # the outputs are written (summary.json says "oom": true); exit 3
        raise does_not_fit


@app.command()
def run(
    plan: Annotated[Path, typer.Argument(help="plan YAML or JSON")],
    out: Annotated[Path | None, typer.Option(help="directory for the run record and timeline")] = None,
    nproc: Annotated[int | None, typer.Option(help="ranks to launch (default: the plan's world size)")] = None,
    iterations: Annotated[int, typer.Option(help="measured training iterations")] = 5,
    warmup: Annotated[int, typer.Option(help="untimed iterations first")] = 1,
    backend: Annotated[str | None, typer.Option(help="gloo or nccl; default: nccl on CUDA, else gloo")] = None,
    timeout: Annotated[float, typer.Option(help="seconds without progress before the run is declared hung")] = 300,
    frozen_after: Annotated[float, typer.Option(help="seconds a live rank's heartbeat may be silent before the run "
                                                "is declared hung (a stopped process)")] = 60,
    force: Annotated[bool, typer.Option("--force", help="replace an earlier run's files in --out")] = False,
) -> None:
    """Run a plan for real with torch.distributed: every rank interprets its Program and times it."""
    from statistics import median

    from exec.launcher import run_plan
    from sim.plan import Plan

    loaded = Plan.load(plan)
    # Without --out every run gets a folder of its own (runs/run-<name>, then -2, -3, ...).
    target = out or fresh_run_folder(Path("runs") / f"run-{safe_name(loaded.name)}")
    result = run_plan(loaded, nproc=nproc, backend=backend, iterations=iterations, warmup=warmup,
                      out_dir=target, timeout_s=timeout, force=force, frozen_after_s=frozen_after)
    times = result.iteration_times
    table = Table("figure", "value", title=f"run of {escape(loaded.name)} ({loaded.world_size} ranks)")
    table.add_row("iteration time (median)", f"{median(times) * 1e3:.3f} ms")
    table.add_row("iteration time (min-max)", f"{min(times) * 1e3:.3f} - {max(times) * 1e3:.3f} ms")
    table.add_row("losses", ", ".join(f"{loss:.4f}" for loss in result.losses))
    for rank, peak in sorted(result.peak_memory.items()):
        table.add_row(f"peak memory, rank {rank}", size(peak))
    console.print(table)
    for name, path in result.paths.items():
        plain(f"{name}: {path}")


@app.command()
def validate(
    plan: Annotated[Path, typer.Argument(help="plan YAML or JSON")],
    out: Annotated[Path | None, typer.Option(help="directory for the report, figure and traces")] = None,
    nproc: Annotated[int | None, typer.Option(help="ranks (default: the plan's world size)")] = None,
    profile: Annotated[Path | None, typer.Option(help="reuse this trace bundle instead of profiling")] = None,
    iterations: Annotated[int, typer.Option(help="measured iterations")] = 20,
    warmup: Annotated[int, typer.Option(help="untimed iterations first")] = 3,
    commbench: Annotated[bool, typer.Option(help="benchmark communication for the simulator")] = True,
) -> None:
    """Profile, benchmark communication, simulate, run, and compare prediction with measurement."""
    from analysis.validation.report import format_report
    from analysis.validation.run import validate_plan
    from sim.plan import Plan

    loaded = Plan.load(plan)
    target = out or Path("runs") / f"validate-{safe_name(loaded.name)}"
    report = validate_plan(loaded, nproc=nproc, profile=profile, iterations=iterations, warmup=warmup,
                           out_dir=target, commbench=commbench)
    plain(format_report(report))
    plain(f"wrote {target}")


@app.command("validate-suite")
def validate_suite(
    out: Annotated[Path, typer.Option(help="directory for the suite table and per-plan reports")] = Path(
        "runs/validation"),
    plans: Annotated[list[Path] | None, typer.Option("--plan", help="plan (repeatable); default: "
                                                     "examples/validation/*.yaml")] = None,
    iterations: Annotated[int, typer.Option(help="measured iterations per plan")] = 20,
    warmup: Annotated[int, typer.Option(help="untimed iterations first")] = 3,
    section: Annotated[str | None, typer.Option(help="run examples/validation/<SECTION>/*.yaml instead of the "
                                                "default plans (e.g. compression)")] = None,
    rounds: Annotated[int, typer.Option(help="interleaved rounds: every plan once per round, in a fresh random "
                                        "order; pairs judged by their per-round ratios (analysis.rounds)")] = 1,
    seed: Annotated[int | None, typer.Option(help="seed of the rounds' orders (default 12 when --rounds > 1)")
                    ] = None,
    common_profile: Annotated[bool, typer.Option(
        "--common-profile", help="predict every plan of a workload from one profile: the workload profiled once "
                                 "per round (a drawn slot), pooled by the per-layer median")] = False,
) -> None:
    """Validate the simulator on >= 8 plans on 2 gloo ranks; one table of errors."""
    from analysis.validation_suite import format_suite, run_suite

    table = run_suite(out, plans, iterations, warmup, section=section, rounds=rounds, seed=seed,
                      common_profile=common_profile)
    plain(format_suite(table))
    plain(f"wrote {out}")


@app.command()
def calibrate(
    out: Annotated[Path, typer.Option(help="directory for predictions, figure and summary")] = Path("runs/calibration"),
    seed: Annotated[int, typer.Option(help="seed of the draw of fit rows")] = 0,
    save: Annotated[bool, typer.Option("--save-data", help="store the fitted curve as the A100 default")] = False,
) -> None:
    """Fit the A100 analytic model on the Megatron-LM measurements, holding out one whole model shape at a time."""
    from analysis.calibrate import print_summary, run_calibration, save_calibration_data

    summary = run_calibration(out, seed=seed)
    print_summary(summary)
    plain(f"wrote {out}")
    if save:
        plain(f"wrote {save_calibration_data(summary)}")


@app.command("predict-runs")
def predict_runs_command(
    runs: Annotated[Path, typer.Argument(help="CSV of Megatron-LM GPT runs in the vTrain column format "
                                               "(sim/data/a100_single_node_megatron.csv; iteration time optional)")],
    out: Annotated[Path, typer.Option(help="directory for predictions.csv")] = Path("runs/predict-runs"),
    prior: Annotated[bool, typer.Option(help="the physical prior without the host launch path (the calibration's "
                                             "starting point) instead of simulate's A100 default")] = False,
) -> None:
    """Predict Megatron-LM runs on A100 (1F1B, full recompute; 8-GPU nodes over 4 x HDR above 8 GPUs)."""
    from analysis.predict_runs import PREDICTIONS_NAME, predict_runs, summary_lines, write_predictions

    prepare_out_folder(out, (PREDICTIONS_NAME,))  # before predicting, not after
    result = predict_runs(runs, prior=prior)
    for line in summary_lines(result):
        plain(line)
    plain(f"wrote {write_predictions(result, out)}")


@app.command()
def hap(
    datasets: Annotated[list[str], typer.Option("--dataset", help="TU dataset (repeatable): MUTAG, PROTEINS, ...")],
    out: Annotated[Path, typer.Option(help="directory for the table and figure")] = Path("runs/hap"),
    methods: Annotated[list[str] | None, typer.Option("--method", help="method (repeatable); default all")] = None,
    folds: Annotated[int, typer.Option(help="cross-validation folds")] = 10,
    epochs: Annotated[int | None, typer.Option(help="training epochs per fold")] = None,
    seed: Annotated[int, typer.Option(help="seed of folds and models")] = 0,
) -> None:
    """HAP graph pooling vs pooling baselines: k-fold accuracy on TU graph-classification datasets."""
    from analysis.hap_experiment import run_hap_experiment

    extra = {} if epochs is None else {"epochs": epochs}
    table = run_hap_experiment(datasets, methods, folds=folds, out_dir=out, seed=seed, **extra)
    plain(table.to_string(index=False))
    plain(f"wrote {out}")


@app.command()
def admm(
    task: Annotated[str, typer.Option(help="digits, shakespeare or text-source")] = "digits",
    iterations: Annotated[int, typer.Option(help="full-batch iterations of every method")] = 100,
    out: Annotated[Path, typer.Option(help="directory for curves, tables and figures")] = Path("runs/admm"),
    workers: Annotated[int, typer.Option(help="ranks of the SP/AP runs")] = 2,
    staleness: Annotated[int, typer.Option(help="AP staleness bound")] = 2,
    seed: Annotated[int, typer.Option(help="seed")] = 0,
) -> None:
    """ADMMiRNN vs SGD and Adam on one RNN; SP/AP parallel runs; what-if at larger worker counts."""
    from analysis.admm_experiment import run_admm_experiment

    table = run_admm_experiment(task, iterations, out, seed=seed, workers=workers, staleness=staleness)
    final = table.sort_values("iteration").groupby("method").tail(1)
    plain(final[["method", "iteration", "train_loss", "val_loss", "val_acc"]].to_string(index=False))
    plain(f"test split (evaluated once per method): {out}/admm_{task}_summary.json")
    plain(f"wrote {out}")


@app.command("admm-spap")
def admm_spap(
    task: Annotated[list[str] | None, typer.Option(help="tasks (repeat the option; default: all three)")] = None,
    seeds: Annotated[int, typer.Option(help="seeds 0..N-1 per task")] = 3,
    out: Annotated[Path, typer.Option(help="directory for the table files (the committed ones: "
                                      "docs/results/admm/spap)")] = Path("runs/admm-spap/table"),
    runs: Annotated[Path, typer.Option(help="every run's full output; a run already there is reused")] = Path(
        "runs/admm-spap"),
    figures: Annotated[Path | None, typer.Option(help="directory for admm_spap.{png,pdf} (default: --out)")] = None,
) -> None:
    """Serial, SP and AP ADMMiRNN, SGD and Adam over tasks and seeds: the SP/AP table (docs/admm.md)."""
    import pandas as pd
    import torch

    from analysis.admm_spap import markdown, run_spap
    from analysis.admm_suite import TASK_PLANS

    torch.set_num_threads(1)  # like every parallel rank
    stats = run_spap(tuple(task) if task else tuple(TASK_PLANS), seeds, out, runs, figures)
    plain(markdown(stats, pd.read_csv(out / "spap_runs.csv")))
    plain(f"wrote {out}")


@app.command("admm-suite")
def admm_suite(
    out: Annotated[Path, typer.Option(help="directory for the CSVs and tables.md (the committed ones: "
                                      "docs/results/admm)")] = Path("runs/admm-suite"),
    figures: Annotated[Path | None, typer.Option(help="directory for the figures (default: --out; a --quick "
                                                 "run's go there only)")] = None,
    seeds: Annotated[int, typer.Option(help="seeds per task, method and init scale")] = 3,
    quick: Annotated[bool, typer.Option(help="smoke run: 3 iterations, one seed, into its own --out; its "
                                        "figures' titles say SMOKE RUN")] = False,
    part: Annotated[list[str] | None, typer.Option(help="tasks, robustness, ablation, report (default: all)")] = None,
) -> None:
    """ADMMiRNN vs its paper's claims: tuning on validation, accuracy per task over seeds,
    init-scale sweep, ablation; tables and figures (docs/admm.md)."""
    from analysis.admm_suite import PARTS, run_admm_suite

    plain(run_admm_suite(out, figures, seeds=seeds, quick=quick, parts=tuple(part) if part else PARTS))


@app.command()
def sweep(
    spec: Annotated[Path, typer.Argument(help="sweep spec YAML: base plan, grid, axes, points (docs/figures.md)")],
    out: Annotated[Path, typer.Option(help="directory of the results; rerun with the same one to resume")],
    workers: Annotated[int | None, typer.Option(help="processes or Dask workers (default: usable cores; "
                                                "1: in this process)")] = None,
    scheduler: Annotated[str | None, typer.Option(help="local-dask (an embedded Dask LocalCluster) or a Dask "
                                                  "scheduler address, e.g. tcp://host:8786; default: local "
                                                  "processes")] = None,
) -> None:
    """Simulate every point of a sweep, in parallel, each result written as it completes; resumable."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from analysis.sweep import SweepSpec, no_point_ok, run_sweep

    loaded = SweepSpec.load(spec)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=not console.is_terminal) as bar:
        task = bar.add_task(f"sweep {escape(loaded.name)}", total=len(loaded.points))

        def advance(done: int, total: int, record: dict) -> None:
            bar.update(task, completed=done)

        result = run_sweep(loaded, out, workers=workers, scheduler=scheduler, progress=advance)
    counts = ", ".join(f"{n} {status}" for status, n in sorted(result.counts.items()))
    points = f"{result.total} point{'s' if result.total != 1 else ''}"  # "1 points" before
    plain(f"sweep {loaded.name}: {points} ({counts}); computed {len(result.computed)} on "
          f"{result.backend}, {result.reused} already recorded; {result.wall_s:.1f} s")
    bad = result.table[result.table["status"] != "ok"]
    for row in bad.head(5).itertuples():
        plain(f"  {row.status}: {row.name}: {row.reason}")
    if len(bad) > 5:
        plain(f"  ... {len(bad) - 5} more not ok (results.csv has every reason)")
    plain(f"results: {out / 'results.parquet'} (and results.csv); one record per point in {out / 'points'}")
    failed = no_point_ok(result, loaded.name)
    if failed is not None:  # exit 2, or 3 when no point fits; it exited 0
        raise failed


@app.command()
def figures(
    out: Annotated[Path, typer.Option(help="directory for the figures (PDF, PNG, CSV) and README.md")],
    suite: Annotated[Path | None, typer.Option(help="a validation suite's output (paratwin validate-suite "
                                               "--out DIR) for the predicted-vs-measured scatter")] = None,
    sweeps: Annotated[Path | None, typer.Option(help="where the figures' sweeps keep their records "
                                                "(default OUT/sweeps); a rerun only draws")] = None,
    only: Annotated[list[str] | None, typer.Option("--only", help="merak, schedules or validation "
                                                   "(repeatable; default all)")] = None,
    search: Annotated[bool, typer.Option(help="add the plan sim.search finds to the Merak figure")] = True,
    workers: Annotated[int | None, typer.Option(help="processes or Dask workers (default: usable cores)")] = None,
    scheduler: Annotated[str | None, typer.Option(help="local-dask or a Dask scheduler address")] = None,
) -> None:
    """Paper-scale figures from simulation: Merak's ablation, pipeline schedules, the validation scatter."""
    from analysis.figures import make_figures

    made = make_figures(out, sweeps=sweeps, suite=suite, only=tuple(only or ("merak", "schedules", "validation")),
                        include_search=search, workers=workers, scheduler=scheduler, log=plain)
    for figure in made:
        plain(f"{figure.name}: " + ", ".join(str(p) for p in figure.paths.values()))
    plain(f"captions: {out / 'README.md'}")


@app.command()
def search(
    workload: Annotated[str, typer.Option(help="workload preset, e.g. gpt-8.3b, or your own by import path, "
                                          "module:Class, with --profile (see `paratwin workloads`)")],
    cluster: Annotated[str, typer.Option(help="cluster preset or YAML file, e.g. a100-64")],
    global_batch: Annotated[int | None, typer.Option(min=1, help="samples per iteration; default 2 x devices")] = None,
    top: Annotated[int, typer.Option(min=0, help="rows of the ranked table")] = 10,
    simulate_top: Annotated[int, typer.Option(min=0, help="best plans by estimate to simulate with the engine")] = 50,
    sample: Annotated[int, typer.Option(min=0, help="random plans simulated to measure estimate/engine match")] = 30,
    out: Annotated[Path | None, typer.Option(help="directory for best.yaml, ranked.parquet, summary.json")] = None,
    dtype: Annotated[str, typer.Option(help="fp32, fp16 or bf16")] = "fp16",
    profile: Annotated[Path | None, typer.Option(help="trace bundle measured on this hardware (CPU clusters)")] = None,
    workload_option: Annotated[list[str] | None, typer.Option(help=WORKLOAD_OPTION_HELP)] = None,
    workers: Annotated[int | None, typer.Option(min=1, help="processes simulating plans; default one per core")] = None,
    lossy_gradient_sync: Annotated[bool, typer.Option(help="also search gradient-sync methods that change the "
                                                      "gradients (fp16, top-k, S2, PowerSGD)")] = False,
    gradient_sync: Annotated[list[str] | None, typer.Option(help="search only this gradient-sync method, "
                                                           "repeatable (default: every exact one)")] = None,
    blocking_p2p: Annotated[bool, typer.Option(help="also search blocking pipeline exchanges (schedule.p2p: "
                                               "blocking, Megatron-LM 2021) on pipelined plans")] = False,
    exhaustive: Annotated[bool, typer.Option(help="estimate every plan (ranked.parquet then holds them all); by "
                                             "default a large space estimates only plans whose lower bound can "
                                             "reach the best --simulate-top (the same best plans)")] = False,
) -> None:
    """Search plans: enumerate every registered choice, prune, rank by a fast estimate, simulate the best."""
    from analysis.search_report import run_search
    from sim.search import SearchSpace

    options = workload_options(workload_option)
    space = SearchSpace(workload, cluster, global_batch=global_batch, dtype=dtype, workload_options=options,
                        profile=str(profile) if profile else None, lossy_gradient_sync=lossy_gradient_sync,
                        gradient_syncs=tuple(gradient_sync) if gradient_sync else None,
                        p2p=("async", "blocking") if blocking_p2p else ("async",))
    target = out or fresh_run_folder(Path("runs") / f"search-{safe_name(workload)}-{safe_name(Path(cluster).stem)}")
    run_search(space, top=top, simulate_top=simulate_top, sample=sample, out=target, workers=workers,
               bound=False if exhaustive else None)


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="where to write the demo's outputs")] = Path("runs/demo"),
) -> None:
    """The main job end to end on two local ranks: profile, search, run and validate plans, one what-if at
    paper scale, and a report (Markdown and HTML)."""
    from analysis.demo import run_demo

    run_demo(out, console)


def main() -> None:
    run_cli(run_app)


def run_app() -> None:
    """``app`` with click's usage errors (an option value out of range or of the wrong type, an unknown or
    missing option, an unknown command) raised as ``ConfigError``s, so that they print as one line with a
    fix and exit 2 like every other refusal: typer's own handling drew a box of several lines, no fix."""
    try:
        status = app(prog_name="paratwin", standalone_mode=False)
    except UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # `paratwin` alone: the help is printed (typer checks so too)
            sys.exit(exc.exit_code)
        raise usage_error(exc) from None
    if isinstance(status, int):  # --help: 0; Ctrl-C where the command says nothing more: 130
        sys.exit(status)


def usage_error(exc: UsageError) -> ConfigError:
    """A usage error in the project's words: the option, argument or command at fault, click's problem, and
    a fix (the number a count wants, which typer checks with pydantic; else where the help is)."""
    from pydantic import ValidationError

    from sim.plan import number_fix

    command = exc.ctx.command_path if exc.ctx else "paratwin"
    param = getattr(exc, "param", None)
    if param is not None:
        field = param.opts[0] if param.param_type_name == "option" else str(param.name).upper()
    else:
        field = getattr(exc, "option_name", None) or command
    # a bad value's own words, without "Invalid value for '--top': " (the field says which)
    problem = exc.message if param is not None and exc.message else exc.format_message()
    cause = exc.__cause__
    wanted = number_fix(cause.errors()[0]) if isinstance(cause, ValidationError) else None
    return ConfigError(field, problem.rstrip("."), wanted or f"{command} --help lists what it takes")


if __name__ == "__main__":
    main()
