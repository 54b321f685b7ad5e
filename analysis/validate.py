"""Validate a plan: predict it with measured costs, run it, and compare the two, instruction by instruction.

``validate_plan`` does, on this machine:

1. profile the plan's workload at the plan's micro-batch (``exec.profiler.profile_workload``, one
   torch thread per process, as the runtime runs one thread per rank) or reuse a given bundle. On
   a CPU the profile is taken in as many concurrent processes as the plan has ranks
   (``colocated``): the ranks of a run share this machine's cores with each other, and a layer
   timed alone runs up to twice as fast as the same layer while another rank computes (measured
   here: 19-21 ms alone, 41-56 ms with a second profiler running, for one 256-wide block). Each
   layer's time is the median over the processes;
2. calibrate communication with ``exec.commbench`` on two ranks (all_reduce and send_recv, sizes
   spanning the plan's messages, buckets and TP all-reduces) and store the alpha-beta fits in the
   bundle, where ``sim.comm.ClusterComm`` picks them up;
3. simulate the plan in full mode (every rank) with ``profile:`` pointing at that bundle;
4. run it with ``exec.launcher.run_plan`` for ``warmup + iterations`` iterations;
5. compare: iteration time (prediction vs the median of the measured iterations, with spread),
   the median duration of every instruction kind, and peak memory per rank (like with like, see
   ``memory_comparison``); and write a timeline overlay figure (PNG and PDF), the predicted and
   measured Chrome traces and a combined one, ``report.json`` and ``report.md``.

Errors are ``predicted / measured - 1``: positive when the simulator predicts too much.

A ``Calibration`` (a compute scale and a per-all-reduce overhead, fitted by ``fit_calibration``
on plans outside the suite) may be applied to the prediction; the report then keeps the
uncalibrated prediction too. ``validate_record`` compares a run made elsewhere (torchrun, SLURM,
network namespaces) with its prediction.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.timeline_figure import plot_timelines
from sim.compile import ResolvedPlan, compile_plan, resolve_plan
from sim.engine import EngineOptions
from sim.plan import Plan
from sim.program import COLLECTIVE_KINDS, RECV_KINDS, SEND_KINDS, Kind
from sim.result import SimResult
from sim.simulate import simulate
from traces.bundle import ProfileBundle, read_bundle, write_bundle
from traces.chrome import chrome_events, write_chrome_trace
from traces.errors import ConfigError
from traces.schema import LAYER_TABLE
from traces.tables import conform

PLAN_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
COMM_PRIMITIVES = ["all_reduce", "send_recv"]
COMM_POINTS = 7  # sizes per sweep, geometric between half the smallest and twice the largest message
MIN_COMM_BYTES = 1024
COMM_KINDS = {k.value for k in (*SEND_KINDS, *RECV_KINDS, *COLLECTIVE_KINDS)}
MEMORY_NOTE = (
    "compared: the simulator's memory ledger (parameters + gradients + Adam state, all counted from the "
    "start, + saved activations of the micro-batches in flight + communication buffers: received "
    "gradients until their backward, flattened gradient buckets while all-reduced) against the runtime's "
    "tracked bytes on CPU (parameters + Adam state + gradients once they exist + stage inputs and tensors "
    "saved for backward, each storage once, swapped-out ones not counted, + p2p message buffers in "
    "flight), both sampled at instruction ends. 'predicted comparable' leaves out the flattened buckets "
    "(the runtime does not count its bucket buffer); 'measured comparable' adds the gradient bytes of a "
    "stage to the samples taken before that stage's first backward of the iteration wrote them (the "
    "runtime frees gradients at every zero_grad; the ledger does not). The error compares the two "
    "comparable columns. Neither side counts autograd's transient buffers inside a backward or allocator "
    "overhead; the sides count p2p buffers slightly differently (sends in flight: runtime only).")


# ------------------------------------------------------------------------------------------------
# The report


@dataclass
class ValidationReport:
    plan: str
    out_dir: Path
    world_size: int
    iterations: int
    warmup: int
    predicted_s: float
    measured: dict[str, Any]  # median_s, p10_s, p90_s, min_s, max_s, spread, n, times_s
    per_kind: pd.DataFrame  # kind, predicted_median_s, measured_median_s, error, n_predicted, n_measured
    memory: pd.DataFrame  # rank, predicted_peak, predicted_comparable, measured_peak, measured_comparable, error
    profile: Path
    comm_fits: pd.DataFrame | None
    paths: dict[str, Path] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def measured_s(self) -> float:
        return float(self.measured["median_s"])

    @property
    def error(self) -> float:
        """predicted / measured median - 1."""
        return self.predicted_s / self.measured_s - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan,
            "out_dir": str(self.out_dir),
            "world_size": self.world_size,
            "iterations": self.iterations,
            "warmup": self.warmup,
            "iteration": {"predicted_s": self.predicted_s, "measured": self.measured, "error": self.error},
            "per_kind": _records(self.per_kind),
            "memory": {"note": MEMORY_NOTE, "ranks": _records(self.memory)},
            "profile": str(self.profile),
            "comm_fits": _records(self.comm_fits) if self.comm_fits is not None else [],
            "paths": {k: str(v) for k, v in self.paths.items()},
            "notes": self.notes,
            "settings": self.settings,
        }


def _records(df: pd.DataFrame) -> list[dict]:
    return json.loads(df.to_json(orient="records"))


def _pct(x: float) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:+.1%}"


def _ms(x: float) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x * 1e3:.2f}"


def format_report(report: ValidationReport) -> str:
    """The report as Markdown (also what ``report.md`` holds)."""
    m = report.measured
    lines = [
        f"# Validation of {report.plan}",
        "",
        f"{report.world_size} ranks, {m['n']} measured iterations after {report.warmup} warm-up; "
        f"profile {report.profile}.",
        "",
        "## Iteration time",
        "",
        "| predicted (ms) | measured median (ms) | p10-p90 (ms) | min-max (ms) | spread | error |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| {_ms(report.predicted_s)} | {_ms(m['median_s'])} | {_ms(m['p10_s'])}-{_ms(m['p90_s'])} | "
        f"{_ms(m['min_s'])}-{_ms(m['max_s'])} | {m['spread']:.1%} | {_pct(report.error)} |",
        "",
        "spread = (p90 - p10) / median of the measured iterations (slowest rank of each).",
        "",
        "## Median duration per instruction kind",
        "",
        "| kind | predicted (ms) | measured (ms) | error | rows predicted / measured |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in report.per_kind.itertuples(index=False):
        flag = " (includes waiting)" if row.kind in COMM_KINDS else ""
        lines.append(f"| {row.kind}{flag} | {_ms(row.predicted_median_s)} | {_ms(row.measured_median_s)} | "
                     f"{_pct(row.error)} | {row.n_predicted} / {row.n_measured} |")
    lines += [
        "",
        "Communication rows span posting to completion on both sides, so they include waiting for the "
        "peer: the runtime posts a receive when its program reaches it, the simulator when its "
        "dependencies are met and the matching send has started.",
        "",
        "## Peak memory per rank",
        "",
        "| rank | predicted, ledger peak (MiB) | predicted comparable (MiB) | measured, as tracked (MiB) | "
        "measured comparable (MiB) | error (comparable) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in report.memory.itertuples(index=False):
        lines.append(f"| {row.rank} | {row.predicted_peak / 2**20:.2f} | {row.predicted_comparable / 2**20:.2f} | "
                     f"{row.measured_peak / 2**20:.2f} | {row.measured_comparable / 2**20:.2f} | {_pct(row.error)} |")
    lines += ["", MEMORY_NOTE, ""]
    if report.comm_fits is not None and len(report.comm_fits):
        lines += ["## Communication fits used (alpha-beta, 2 ranks)", "",
                  "| primitive | alpha (us) | bandwidth (GB/s) | r2 |", "| --- | --- | --- | --- |"]
        for row in report.comm_fits.itertuples(index=False):
            lines.append(f"| {row.primitive} | {row.alpha_s * 1e6:.1f} | {row.bandwidth_Bps / 1e9:.3f} | "
                         f"{row.r2:.3f} |")
        lines.append("")
    if report.paths:
        lines += ["## Files", ""] + [f"- {name}: `{path}`" for name, path in report.paths.items()] + [""]
    if report.notes:
        lines += ["## Notes", ""] + [f"- {note}" for note in report.notes] + [""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# An optional calibrated constant


@dataclass(frozen=True)
class Calibration:
    """Constants the simulator may need on this machine, measured on plans that are not validated
    with them (``fit_calibration``), never tuned to the plans they are then tested on."""

    compute_scale: float = 1.0  # x every compute time (layer passes and the optimizer step)
    allreduce_overhead_s: float = 0.0  # + every all-reduce, data-parallel bucket or TP
    source: str = ""

    @property
    def identity(self) -> bool:
        return self.compute_scale == 1.0 and self.allreduce_overhead_s == 0.0


class CalibratedCosts:
    """A cost model whose compute times are ``compute_scale`` x those of ``base``."""

    def __init__(self, base: Any, compute_scale: float) -> None:
        self.base, self.compute_scale = base, float(compute_scale)
        self.num_layers = base.num_layers

    def layer_costs(self, layer: int, micro_batch: int, tp: int) -> Any:
        c, k = self.base.layer_costs(layer, micro_batch, tp), self.compute_scale
        return replace(c, fwd_s=c.fwd_s * k, bwd_input_s=c.bwd_input_s * k, bwd_weight_s=c.bwd_weight_s * k,
                       recompute_s=c.recompute_s * k)

    def optimizer_step_s(self, param_bytes: int) -> float:
        return self.base.optimizer_step_s(param_bytes) * self.compute_scale

    def layer_weights(self, by: str) -> list[float]:
        return self.base.layer_weights(by)


class CalibratedComm:
    """``base`` (a ``sim.comm.ClusterComm``) with ``allreduce_overhead_s`` added to every all-reduce.

    Why: inside a run, a gloo all-reduce also waits for the peer to arrive and for both processes
    to be scheduled at once; commbench, which starts every repeat from a barrier, does not see
    that. It matters most for TP, whose all-reduces sit inside every forward and backward."""

    def __init__(self, base: Any, allreduce_overhead_s: float) -> None:
        self.base, self.overhead = base, float(allreduce_overhead_s)
        self.capacity_bytes = base.capacity_bytes

    def p2p_route(self, src: int, dst: int) -> tuple[str, float, float]:
        return self.base.p2p_route(src, dst)

    def collective_s(self, primitive: str, nbytes: int, ranks: Any) -> float:
        seconds = self.base.collective_s(primitive, nbytes, ranks)
        return seconds + self.overhead if primitive == "allreduce" else seconds

    def host_copy(self) -> tuple[float, float]:
        return self.base.host_copy()


def calibrated_setup(setup: ResolvedPlan, calibration: Calibration) -> ResolvedPlan:
    """``setup`` with the calibration applied (swapped in after ``resolve_plan``, which keeps the
    bundle's communication fits; ``resolve_plan(plan, costs=...)`` would drop them)."""
    costs = CalibratedCosts(setup.costs, calibration.compute_scale) if calibration.compute_scale != 1.0 \
        else setup.costs
    comm = CalibratedComm(setup.comm, calibration.allreduce_overhead_s) if calibration.allreduce_overhead_s \
        else setup.comm
    return replace(setup, costs=costs, comm=comm)


def fit_calibration(reports: list[ValidationReport], max_overhead_s: float = 0.02) -> Calibration:
    """The all-reduce overhead that minimises the squared log errors of the iteration times of
    ``reports`` (validated without calibration), re-simulated with each candidate.

    The compute scale stays 1: with profiles taken right before and after each run, compute
    matched within a few percent whenever the machine's load was steady, and a scale measured in
    one window of load was wrong in the next (docs/validation.md)."""
    from scipy.optimize import minimize_scalar

    cases = []
    for report in reports:
        plan = Plan.load(Path(report.out_dir) / "plan.yaml")
        cases.append((plan, resolve_plan(plan), report.measured_s))
    if not cases:
        raise ConfigError("calibration", "no calibration reports", "validate some calibration plans first")

    def loss(overhead: float) -> float:
        calibration = Calibration(allreduce_overhead_s=overhead)
        return sum(math.log(simulate(plan, full=True, options=EngineOptions(),
                                     resolved=calibrated_setup(setup, calibration)).iteration_s / measured) ** 2
                   for plan, setup, measured in cases)

    best = minimize_scalar(loss, bounds=(0.0, max_overhead_s), method="bounded", options={"xatol": 1e-5})
    return Calibration(allreduce_overhead_s=float(best.x),
                       source=f"fitted on {', '.join(r.plan for r in reports)}")


# ------------------------------------------------------------------------------------------------
# Step 1: profile (co-located processes, one thread each)


def _profile_worker(index: int, barrier: Any, workload: str, options: dict, micro_batch: int, dtype: str,
                    warmup: int, repeats: int, result: str) -> None:
    import torch

    torch.set_num_threads(1)  # as the runtime runs every CPU rank
    from exec.profiler import profile_workload
    from exec.workloads import get_workload

    wl = get_workload(workload, **options)
    barrier.wait()  # start together, so the processes contend as the ranks of a run do
    bundle = profile_workload(wl, micro_batch=micro_batch, dtype=dtype, device="cpu", warmup=warmup,
                              repeats=repeats, with_ops=False)
    pd.to_pickle(bundle, result)


def profile_plan_workload(plan: Plan, processes: int = 1, warmup: int = 2, repeats: int = 10) -> ProfileBundle:
    """Profile ``plan``'s workload at its micro-batch and dtype in ``processes`` concurrent processes.

    Per layer, every time column is the median over the processes and every spread the largest;
    bytes and FLOPs are the first process's (they do not depend on timing)."""
    if plan.dtype not in PLAN_DTYPES:
        raise ConfigError("dtype", f"cannot profile {plan.dtype}", f"use one of {', '.join(PLAN_DTYPES)}")
    context = multiprocessing.get_context("spawn")  # fork after torch has started threads is unsafe
    barrier = context.Barrier(processes)
    with tempfile.TemporaryDirectory(prefix="paratwin-validate-profile-") as tmp:
        paths = [str(Path(tmp) / f"bundle{i}.pkl") for i in range(processes)]
        workers = [context.Process(target=_profile_worker, name=f"paratwin-profile{i}",
                                   args=(i, barrier, plan.workload, dict(plan.workload_options), plan.micro_batch,
                                         PLAN_DTYPES[plan.dtype], warmup, repeats, paths[i]))
                   for i in range(processes)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        failed = [i for i, w in enumerate(workers) if w.exitcode != 0]
        if failed:
            raise RuntimeError(f"profiling process {failed[0]} failed (exit code {workers[failed[0]].exitcode})")
        bundles: list[ProfileBundle] = [pd.read_pickle(p) for p in paths]
    return _merge_profiles(bundles)


def _merge_profiles(bundles: list[ProfileBundle], statistic: str = "median") -> ProfileBundle:
    first = bundles[0]
    if len(bundles) == 1:
        return first
    combine = np.median if statistic == "median" else np.mean
    layers = first.layers.copy()
    for column in LAYER_TABLE.columns:
        values = np.stack([b.layers[column].to_numpy(dtype=float) for b in bundles]) \
            if column.endswith(("_s", "_spread")) else None
        if values is None:
            continue
        layers[column] = combine(values, axis=0) if column.endswith("_s") else values.max(axis=0)
    if "unsteady" in layers:  # unsteady in any process is unsteady in the merged profile
        layers["unsteady"] = np.logical_or.reduce([b.layers["unsteady"].to_numpy(dtype=bool) for b in bundles])
    settings = dict(first.meta["settings"])
    per_byte = [float(b.meta["settings"]["optimizer_s_per_param_byte"]) for b in bundles]
    settings["optimizer_s_per_param_byte"] = float(combine(per_byte))
    if statistic == "median":  # concurrent processes; a mean merges two profiles taken one after the other
        settings["colocated_processes"] = len(bundles)
        settings["statistic"] = ("median over repeats in each process, then median over the concurrent "
                                 "processes; spread = the largest of the processes' spreads; a layer is "
                                 "unsteady when it is in any process")
    return ProfileBundle({**first.meta, "settings": settings}, conform(layers, LAYER_TABLE, "merged profile"),
                         first.ops, first.comm_samples, first.comm_fits)


# ------------------------------------------------------------------------------------------------
# Step 2: communication


def comm_sizes(plan: Plan) -> list[int]:
    """Bytes of every message, gradient bucket and TP all-reduce of ``plan`` (costs from its profile)."""
    compiled = compile_plan(plan, symmetric=False)
    program, setup = compiled.program, compiled.resolved
    sizes = {ins.bytes for rp in program.ranks.values() for ins in rp.instructions
             if ins.kind.value in COMM_KINDS and ins.bytes > 0}
    if plan.tp > 1:
        sizes |= {setup.costs.layer_costs(layer, plan.micro_batch, plan.tp).tp_comm_bytes
                  for layer in range(setup.costs.num_layers)} - {0}
    return sorted(sizes)


def sweep_sizes(message_sizes: list[int], points: int = COMM_POINTS) -> list[int]:
    """Geometric sizes from half the smallest to twice the largest message (at least 1 KiB apart)."""
    lo = max(min(message_sizes, default=MIN_COMM_BYTES) // 2, MIN_COMM_BYTES)
    hi = max(max(message_sizes, default=MIN_COMM_BYTES) * 2, 4 * lo)
    return sorted({int(round(v)) for v in np.geomspace(lo, hi, points)})


def calibrate_comm(bundle_dir: Path, sizes: list[int], repeats: int = 10) -> pd.DataFrame:
    """Benchmark all_reduce and send_recv on two ranks over ``sizes``; store samples and fits in the bundle."""
    from exec.commbench import run_commbench

    samples, fits = run_commbench(nproc=2, sizes=sizes, primitives=COMM_PRIMITIVES, backend="gloo",
                                  repeats=repeats)
    fits = fits[np.isfinite(fits["alpha_s"]) & np.isfinite(fits["bandwidth_Bps"])].reset_index(drop=True)
    bundle = read_bundle(bundle_dir)
    bundle.comm_samples, bundle.comm_fits = samples, fits
    write_bundle(bundle, bundle_dir)
    return fits


def prepare_profile(plan: Plan, out_dir: Path, profile: Path | None = None, commbench: bool = True,
                    colocated: bool = True, comm_plans: list[Plan] | None = None, profile_repeats: int = 10,
                    comm_repeats: int = 10) -> Path:
    """The bundle ``plan`` is validated with: ``profile`` itself when given and nothing is added,
    else ``out_dir/profile`` (profiled here, or a copy of ``profile``) with comm fits when asked.
    ``comm_plans`` (default: just ``plan``) decide the benchmarked sizes, so one bundle can serve
    several plans of the same workload."""
    target = Path(out_dir) / "profile"
    if profile is not None:
        profile = Path(profile).resolve()
        read_bundle(profile)  # a bad bundle fails here, naming the file
        if not commbench:
            return profile
        if profile != target.resolve():
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(profile, target)
    else:
        processes = plan.world_size if colocated else 1
        write_bundle(profile_plan_workload(plan, processes, repeats=profile_repeats), target)
    if commbench:
        sizes = [s for p in (comm_plans or [plan]) for s in comm_sizes(p.replace(profile=str(target.resolve())))]
        calibrate_comm(target, sweep_sizes(sizes), repeats=comm_repeats)
    return target.resolve()


# ------------------------------------------------------------------------------------------------
# Step 5: comparisons (pure functions of the two tables)


def iteration_stats(times: list[float]) -> dict[str, Any]:
    values = np.asarray(times, dtype=float)
    median = float(np.median(values))
    p10, p90 = (float(v) for v in np.percentile(values, [10, 90]))
    return {"median_s": median, "p10_s": p10, "p90_s": p90, "min_s": float(values.min()),
            "max_s": float(values.max()), "spread": (p90 - p10) / median if median > 0 else float("nan"),
            "n": int(values.size), "times_s": [float(v) for v in values]}


def kind_comparison(predicted: pd.DataFrame, measured: pd.DataFrame) -> pd.DataFrame:
    """Median duration of every instruction kind (top-level rows), predicted vs measured."""
    def medians(table: pd.DataFrame) -> pd.DataFrame:
        top = table[table["parent"] == -1]
        durations = (top["end_s"] - top["start_s"]).groupby(top["kind"])
        return pd.DataFrame({"median_s": durations.median(), "n": durations.size()})

    pred, meas = medians(predicted), medians(measured)
    kinds = [k.value for k in Kind if k.value in set(pred.index) | set(meas.index)]
    rows = []
    for kind in kinds:
        p = float(pred["median_s"].get(kind, float("nan")))
        m = float(meas["median_s"].get(kind, float("nan")))
        rows.append({"kind": kind, "predicted_median_s": p, "measured_median_s": m,
                     "error": p / m - 1.0 if m > 0 else float("nan"),
                     "n_predicted": int(pred["n"].get(kind, 0)), "n_measured": int(meas["n"].get(kind, 0))})
    return pd.DataFrame(rows, columns=["kind", "predicted_median_s", "measured_median_s", "error",
                                       "n_predicted", "n_measured"])


def memory_comparison(sim: SimResult, measured: pd.DataFrame, measured_peak: dict[int, int],
                      setup: ResolvedPlan, stage_ranks: dict[int, tuple[int, ...]]) -> pd.DataFrame:
    """Per rank: the ledger's peak and the runtime's tracked peak as each side reports them, and
    both made comparable (see MEMORY_NOTE): the ledger sampled at instruction ends without the
    flattened data-parallel buckets in flight, the runtime with gradients counted from the start."""
    plan = setup.plan
    grad_bytes = {s: sum(setup.costs.layer_costs(layer, plan.micro_batch, plan.tp).grad_bytes for layer in layers)
                  for s, layers in enumerate(setup.stage_layers)}
    rows = []
    for rank in sorted(sim.memory):
        mine = measured[(measured["rank"] == rank) & (measured["parent"] == -1)]
        comparable = 0
        for _, it in mine.groupby("iteration"):
            samples = it["mem_after"].to_numpy(dtype=float).copy()
            ends = it["end_s"].to_numpy(dtype=float)
            for stage in stage_ranks.get(rank, ()):
                writers = it[(it["stage"] == stage) & it["kind"].isin([Kind.BWD.value, Kind.BWD_W.value])]
                first = float(writers["end_s"].min()) if len(writers) else math.inf
                samples[ends < first] += grad_bytes[stage]
            comparable = max(comparable, int(samples.max()) if samples.size else 0)
        predicted = _predicted_at_ends(sim.table[(sim.table["rank"] == rank) & (sim.table["parent"] == -1)])
        rows.append({"rank": rank, "predicted_peak": int(sim.memory[rank].peak_bytes),
                     "predicted_comparable": predicted, "measured_peak": int(measured_peak.get(rank, 0)),
                     "measured_comparable": comparable,
                     "error": predicted / comparable - 1.0 if comparable > 0 else float("nan")})
    return pd.DataFrame(rows, columns=["rank", "predicted_peak", "predicted_comparable", "measured_peak",
                                       "measured_comparable", "error"])


def _predicted_at_ends(top: pd.DataFrame) -> int:
    """The ledger at instruction ends, less the flattened gradient buckets being all-reduced then
    (the simulator holds one per bucket in flight; the runtime's CPU count has none)."""
    buckets = top[top["kind"] == Kind.ALLREDUCE.value]
    best = 0
    for end, mem in zip(top["end_s"], top["mem_after"], strict=True):
        in_flight = buckets[(buckets["start_s"] <= end) & (buckets["end_s"] > end)]["bytes"].sum()
        best = max(best, int(mem - in_flight))
    return best


def representative_iteration(measured: pd.DataFrame, times: list[float]) -> int:
    """The measured iteration whose time (slowest rank) is closest to the median."""
    iterations = sorted(measured["iteration"].unique())
    median = float(np.median(times))
    best = min(range(len(times)), key=lambda k: abs(times[k] - median))
    return int(iterations[best]) if best < len(iterations) else int(iterations[-1])


# ------------------------------------------------------------------------------------------------
# Artifacts


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


def write_report(report: ValidationReport) -> dict[str, Path]:
    out = Path(report.out_dir)
    paths = {"report_json": out / "report.json", "report_md": out / "report.md"}
    report.paths.update(paths)
    paths["report_json"].write_text(json.dumps(report.to_dict(), indent=2, allow_nan=True))
    paths["report_md"].write_text(format_report(report))
    return paths


# ------------------------------------------------------------------------------------------------
# The whole validation


def validate_plan(plan: Plan | str | Path, nproc: int | None = None, profile: Path | None = None,
                  iterations: int = 20, warmup: int = 3, out_dir: Path | None = None, commbench: bool = True,
                  *, colocated: bool = True, bracket: bool = False, comm_fits_from: Path | None = None,
                  timeout_s: float = 300.0, profile_repeats: int = 10, comm_repeats: int = 10,
                  options: EngineOptions | None = None, calibration: Calibration | None = None
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
    from exec.launcher import run_plan

    source = str(plan) if not isinstance(plan, Plan) else None
    plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    if iterations < 1 or warmup < 0:
        raise ConfigError("iterations", f"need iterations >= 1 and warmup >= 0 (got {iterations}, {warmup})",
                          "e.g. iterations=20, warmup=3")
    if nproc is not None and nproc != plan.world_size:
        raise ConfigError("nproc", f"{nproc} processes for a plan of dp x tp x pp = {plan.world_size} ranks",
                          f"use nproc={plan.world_size} or change the plan's degrees")
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="paratwin-validate-"))
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    with_comm = commbench and plan.world_size > 1
    bundle_dir = prepare_profile(plan, out, profile, with_comm, colocated, profile_repeats=profile_repeats,
                                 comm_repeats=comm_repeats)
    if comm_fits_from is not None and not with_comm:
        _copy_comm_fits(Path(comm_fits_from), bundle_dir)
    measured_plan = plan.replace(profile=str(bundle_dir))

    # Measure first when the profile brackets the run; the prediction never reads the run.
    run = run_plan(measured_plan, nproc=plan.world_size, iterations=iterations, warmup=warmup, out_dir=out / "run",
                   timeout_s=timeout_s, force=True)  # a validation's own folder: replace its earlier run
    drift = None
    if bracket and profile is None:
        before = read_bundle(bundle_dir)
        after = profile_plan_workload(plan, plan.world_size if colocated else 1, repeats=profile_repeats)
        drift = _bracket(before, after, bundle_dir)
        notes.append(f"profile bracketed the run: compute times after / before = {drift:.3f} (mean of both used)")

    measured = MeasuredRun(run.table, run.iteration_times, run.peak_memory, warmup, run.paths["trace"], out / "run")
    return _predict_and_compare(plan, measured_plan, measured, out, notes, options,
                                {"plan_file": source, "bracketed_profile": drift is not None, "profile_drift": drift},
                                calibration)


@dataclass
class MeasuredRun:
    """What the comparison needs of a real run (``exec.launcher.RunResult`` or a run record)."""

    table: pd.DataFrame  # INSTRUCTION_TABLE + "iteration", times from each iteration's start
    iteration_times: list[float]  # per measured iteration, the slowest rank's seconds
    peak_memory: dict[int, int]
    warmup: int = 0  # iterations run before the measured ones
    trace: Path | None = None
    directory: Path | None = None

    @classmethod
    def from_record(cls, run_dir: Path) -> MeasuredRun:
        """A run written by ``python -m exec.runtime`` (torchrun, SLURM, netns): ``run_dir/record``."""
        from traces.runrecord import read_run_record

        record = read_run_record(Path(run_dir) / "record")
        per_rank = [record.summary["iteration_s"][k] for k in sorted(record.summary["iteration_s"], key=int)]
        times = [max(values) for values in zip(*per_rank, strict=True)]
        peak = {int(k): int(v) for k, v in record.summary["peak_memory"].items()}
        trace = Path(run_dir) / "trace.json"
        return cls(record.instructions, times, peak, int(record.summary.get("warmup", 0)),
                   trace if trace.exists() else None, Path(run_dir))


def validate_record(plan: Plan | str | Path, run_dir: Path, profile: Path, out_dir: Path,
                    options: EngineOptions | None = None) -> ValidationReport:
    """Compare a run made elsewhere (``python -m exec.runtime`` under torchrun, SLURM or in network
    namespaces) with the prediction of ``plan`` from the bundle ``profile``. The plan's own
    cluster prices communication unless the bundle has fits."""
    plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    measured_plan = plan.replace(profile=str(Path(profile).resolve()))
    return _predict_and_compare(plan, measured_plan, MeasuredRun.from_record(run_dir), out, [], options,
                                {"run_dir": str(run_dir)})


def _predict_and_compare(plan: Plan, measured_plan: Plan, run: MeasuredRun, out: Path, notes: list[str],
                         options: EngineOptions | None, extra_settings: dict,
                         calibration: Calibration | None = None) -> ValidationReport:
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
    setup = resolve_plan(measured_plan)
    calibration = calibration or Calibration()
    extra_settings["calibration"] = asdict(calibration)
    extra_settings["predicted_uncalibrated_s"] = None
    if not calibration.identity:
        plain = simulate(measured_plan, full=True, options=options, resolved=setup).iteration_s
        extra_settings["predicted_uncalibrated_s"] = float(plain)
        notes.append(f"calibrated ({calibration.source}): compute x {calibration.compute_scale:.3f}, "
                     f"+{calibration.allreduce_overhead_s * 1e3:.2f} ms per all-reduce; uncalibrated "
                     f"prediction {plain * 1e3:.1f} ms")
        setup = calibrated_setup(setup, calibration)
    sim = simulate(measured_plan, full=True, options=options, resolved=setup)
    measured_plan.dump(out / "plan.yaml")
    times = run.iteration_times

    # Compare and draw.
    measured = run.table
    program = compile_plan(measured_plan, symmetric=False, resolved=setup).program
    stage_ranks = {rank: rp.stages for rank, rp in program.ranks.items()}
    chosen = representative_iteration(measured, times)
    one = measured[measured["iteration"] == chosen]
    paths = {"profile": bundle_dir, **({"run": run.directory} if run.directory else {}),
             **({"run_trace": run.trace} if run.trace else {})}
    paths.update(write_traces(sim.table, one, out))
    figures = plot_timelines(sim.table, one, out / "timeline",
                             title=f"{plan.name}: predicted vs measured (iteration {chosen}, median time)")
    paths.update({f"timeline_{p.suffix[1:]}": p for p in figures})
    sim.write(out / "prediction")
    paths["prediction"] = out / "prediction"
    report = ValidationReport(
        plan=plan.name, out_dir=out, world_size=plan.world_size, iterations=len(times),
        warmup=run.warmup,
        predicted_s=float(sim.iteration_s), measured=iteration_stats(times),
        per_kind=kind_comparison(sim.table, measured),
        memory=memory_comparison(sim, measured, run.peak_memory, setup, stage_ranks),
        profile=bundle_dir, comm_fits=bundle.comm_fits, paths=paths, notes=notes + list(sim.notes),
        settings={**extra_settings, "colocated_profile": int(settings.get("colocated_processes", 1)),
                  "timeline_iteration": chosen, "engine_options": asdict(options),
                  "profile_settings": settings},
    )
    write_report(report)
    return report


def _copy_comm_fits(source: Path, bundle_dir: Path) -> None:
    donor = read_bundle(source)
    if donor.comm_fits is None:
        raise ConfigError("comm_fits_from", f"{source} has no communication fits",
                          "benchmark first (validate_plan(..., commbench=True)) or pass another bundle")
    bundle = read_bundle(bundle_dir)
    bundle.comm_samples, bundle.comm_fits = donor.comm_samples, donor.comm_fits
    write_bundle(bundle, bundle_dir)


def _bracket(before: ProfileBundle, after: ProfileBundle, bundle_dir: Path) -> float:
    """Replace the bundle's times by the mean of ``before`` and ``after``; return the drift
    (total forward + backward time after / before)."""
    merged = _merge_profiles([before, after], statistic="mean")
    merged.comm_samples, merged.comm_fits = before.comm_samples, before.comm_fits
    merged.meta["settings"]["bracketed"] = True
    write_bundle(merged, bundle_dir)
    total = [float((b.layers["fwd_s"] + b.layers["bwd_s"]).sum()) for b in (before, after)]
    return total[1] / total[0] if total[0] > 0 else float("nan")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m analysis.validate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="profile, benchmark, simulate, run and compare a plan")
    run.add_argument("plan", type=Path)
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--iterations", type=int, default=20)
    run.add_argument("--warmup", type=int, default=3)
    run.add_argument("--profile", type=Path, default=None, help="reuse this bundle")
    run.add_argument("--no-commbench", action="store_true")
    prof = sub.add_parser("profile", help="profile a plan's workload here: OUT/profile and OUT/plan.yaml "
                          "(the plan with profile: set), e.g. before launching it elsewhere")
    prof.add_argument("plan", type=Path)
    prof.add_argument("--out", type=Path, required=True)
    rec = sub.add_parser("record", help="compare a run record made elsewhere with its prediction")
    rec.add_argument("plan", type=Path)
    rec.add_argument("run_dir", type=Path, help="the --out of python -m exec.runtime")
    rec.add_argument("--profile", type=Path, required=True)
    rec.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "run":
        report = validate_plan(args.plan, profile=args.profile, iterations=args.iterations, warmup=args.warmup,
                               out_dir=args.out, commbench=not args.no_commbench)
    elif args.command == "profile":
        plan = Plan.load(args.plan)
        bundle = write_bundle(profile_plan_workload(plan, processes=plan.world_size), args.out / "profile")
        plan.replace(profile=str(bundle.resolve())).dump(args.out / "plan.yaml")
        print(f"profiled {plan.workload} {plan.workload_options} at micro-batch {plan.micro_batch} in "
              f"{plan.world_size} processes: {bundle}; plan with profile: {args.out / 'plan.yaml'}")
        return 0
    else:
        report = validate_record(args.plan, args.run_dir, args.profile, args.out)
    print(format_report(report))
    return 0


__all__ = ["Calibration", "MeasuredRun", "ValidationReport", "fit_calibration", "format_report", "validate_plan",
           "validate_record"]


if __name__ == "__main__":
    raise SystemExit(main())
