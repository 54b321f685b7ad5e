"""Profiling for validation: the plan's workload profiled on this machine as its ranks will run
(co-located processes, one torch thread each), and the bundle a plan is validated with
(``profile_for_validation``: that profile plus communication fits)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.validation.comm import calibrate_comm, comm_sizes, sweep_sizes
from sim.compile import resolve_plan
from sim.plan import Plan
from traces.bundle import ProfileBundle, read_bundle, write_bundle
from traces.errors import ConfigError, Interrupted, ParatwinError
from traces.schema import LAYER_TABLE, PROCESS_LAYER_TABLE
from traces.tables import conform

PLAN_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class ProfilingFailed(ParatwinError):
    """A co-located profiling process that died or failed; the others were stopped."""


def _profile_worker(index: int, barrier: Any, votes: Any, workload: str, options: dict, micro_batch: int,
                    dtype: str, warmup: int, repeats: int, result: str, lockstep: bool,
                    plan: dict | None = None) -> None:
    import torch

    torch.set_num_threads(1)  # as the runtime runs every CPU rank
    from exec.host_memory import keep_freed_memory

    keep_freed_memory()  # as every CPU rank keeps it (exec.host_memory): the same memory, no page faults
    from exec.lockstep import Alone, Lockstep
    from exec.profiler import profile_workload
    from exec.workloads import get_workload

    wl = get_workload(workload, **options)
    if not lockstep:
        barrier.wait()  # start together, then each on its own
    # In lockstep (exec.lockstep): every timed round of every layer runs in all processes at once,
    # so each layer is timed while the others run it too, as the ranks of a run do.
    bundle = profile_workload(wl, micro_batch=micro_batch, dtype=dtype, device="cpu", warmup=warmup,
                              repeats=repeats, with_ops=False,
                              together=Lockstep(barrier, votes, index) if lockstep else Alone())
    if plan is not None:
        # a tenth of a millisecond a request: many more rounds than a layer's (whose few repeats leave
        # first calls in: 0.8 ms with 3 repeats against 0.07-0.11 ms with 200, loaded machine)
        bundle.meta["settings"]["ids_request_host_s"] = ids_request_host_s(Plan.from_dict(plan), wl, index,
                                                                           max(warmup, 5), max(repeats, 100))
    pd.to_pickle(bundle, result)


def ids_request_host_s(plan: Plan, workload: Any, process: int, warmup: int, repeats: int) -> float:
    """Median seconds of one synchronous ids exchange's host work (``exec.embedding.request_host_work``:
    the batch, unique, owners, order, counts) on this process, over ``repeats`` iterations' batches
    of micro-batch 0, as replica ``process`` of the plan (issue 12: about 0.14 ms of the ids
    request's 0.19 ms the calibrated price missed on a quiet host). Wall time: the thread holds the
    rank's runtime while it runs."""
    import time

    from exec.embedding import request_host_work

    times = []
    for iteration in range(warmup + repeats):
        start = time.perf_counter()
        request_host_work(plan, workload, process % plan.dp, iteration, 0)
        if iteration >= warmup:
            times.append(time.perf_counter() - start)
    return float(np.median(times))


def has_ids_request(plan: Plan) -> bool:
    """Whether ``plan``'s runtime sends ids before its lookups (a method with sharded tables)."""
    from exec.embedding import EMBEDDING_RUNTIMES

    return plan.embedding.method in EMBEDDING_RUNTIMES


def profile_plan_workload(plan: Plan, processes: int = 1, warmup: int = 2, repeats: int = 10,
                          lockstep: bool = True) -> ProfileBundle:
    """Profile ``plan``'s workload at its micro-batch and dtype in ``processes`` concurrent processes,
    in lockstep (``exec.lockstep``; ``lockstep=False``: started together, then each on its own, as
    before issue 12's fix: for comparisons).

    Per layer, every time column is the median over the processes and every spread the largest;
    bytes and FLOPs are the first process's (they do not depend on timing)."""
    if plan.dtype not in PLAN_DTYPES:
        raise ConfigError("dtype", f"cannot profile {plan.dtype}", f"use one of {', '.join(PLAN_DTYPES)}")
    from exec.launcher import stop_processes

    context = multiprocessing.get_context("spawn")  # fork after torch has started threads is unsafe
    barrier, votes = context.Barrier(processes), context.Array("i", processes)
    with tempfile.TemporaryDirectory(prefix="paratwin-validate-profile-") as tmp:
        paths = [str(Path(tmp) / f"bundle{i}.pkl") for i in range(processes)]
        workers = [context.Process(target=_profile_worker, name=f"paratwin-profile{i}",
                                   args=(i, barrier, votes, plan.workload, dict(plan.workload_options),
                                         plan.micro_batch, PLAN_DTYPES[plan.dtype], warmup, repeats, paths[i],
                                         lockstep, plan.model_dump(mode="json") if has_ids_request(plan) else None))
                   for i in range(processes)]
        try:
            _start_deaf_to_ctrl_c(workers)
            _wait_for_all(workers, plan.workload)
        except KeyboardInterrupt:
            raise Interrupted(f"interrupted by SIGINT while profiling {plan.workload}: the profiling processes "
                              "were stopped and nothing was written") from None
        finally:
            stop_processes(workers)  # the others, after one failed or Ctrl-C; before their folder is removed
        bundles: list[ProfileBundle] = [pd.read_pickle(p) for p in paths]
    return _merge_profiles(bundles)


def _start_deaf_to_ctrl_c(workers: list[multiprocessing.process.BaseProcess]) -> None:
    """Start ``workers`` with SIGINT ignored, which a spawned process keeps (an exec keeps an ignored signal
    ignored, and Python installs its KeyboardInterrupt handler only over the default action). Ctrl-C reaches
    the whole process group: each worker printed its KeyboardInterrupt traceback (about 150 lines for two),
    and a SIGINT to this process alone left them running. Now this process alone hears it and stops them."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread handles signals
        for w in workers:
            w.start()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for w in workers:
            w.start()
    finally:
        signal.signal(signal.SIGINT, previous)


def _wait_for_all(workers: list[multiprocessing.process.BaseProcess], workload: str) -> None:
    """Return once every worker has exited cleanly; raise as soon as one has not. Its peers would wait for
    it at their lockstep barrier (exec.lockstep) until its timeout of 600 s: joined one after the other,
    a SIGKILLed second worker was noticed only then, and the command printed nothing meanwhile."""
    running = {w.sentinel: (index, w) for index, w in enumerate(workers)}
    while running:
        for sentinel in multiprocessing.connection.wait(list(running)):
            index, worker = running.pop(sentinel)
            worker.join()
            if worker.exitcode != 0:
                code = worker.exitcode or 0
                how = signal.Signals(-code).name if code < 0 else f"exit code {code}"
                raise ProfilingFailed(f"profiling process {index} of {len(workers)} died ({how}) while profiling "
                                      f"{workload}; the others were stopped and nothing was written (fix: run it "
                                      "again; a SIGKILL you did not send is often the out-of-memory killer: see "
                                      "dmesg)")


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
    settings.pop("ids_request_host_s", None)  # the first process's alone is not the profile's
    if all("ids_request_host_s" in b.meta["settings"] for b in bundles):  # absent: not measured (0 charged)
        settings["ids_request_host_s"] = float(combine([float(b.meta["settings"]["ids_request_host_s"])
                                                        for b in bundles]))
    if statistic == "median":  # concurrent processes; a mean merges two profiles taken one after the other
        settings["colocated_processes"] = len(bundles)
        # In lockstep the processes ran the same rounds of every layer (exec.lockstep): equal counts.
        settings["rounds_run_per_process"] = [[int(r) for r in b.layers["rounds_run"]] for b in bundles]
        settings["statistic"] = ("median over repeats in each process, then median over the concurrent "
                                 "processes; spread = the largest of the processes' spreads; a layer is "
                                 "unsteady when it is in any process; each process's medians in "
                                 "process_layers")
    return ProfileBundle({**first.meta, "settings": settings}, conform(layers, LAYER_TABLE, "merged profile"),
                         first.ops, first.comm_samples, first.comm_fits,
                         process_layers(bundles) if statistic == "median" else _mean_process_layers(bundles))


def _mean_process_layers(bundles: list[ProfileBundle]) -> pd.DataFrame | None:
    """Profiles taken one after the other (``bracket_profile``): each process's times averaged, as the
    merged times are, where every profile kept them for the same processes and layers."""
    tables = [b.process_layers for b in bundles]
    if any(t is None for t in tables) or len({len(t) for t in tables}) != 1:  # type: ignore[arg-type]
        return None
    return reduce_process_layers(tables, np.mean, "bracketed per-process profile")  # type: ignore[arg-type]


def reduce_process_layers(tables: list[pd.DataFrame], reduce: Callable[..., np.ndarray],
                          what: str) -> pd.DataFrame | None:
    """Each co-located process's per-layer times over several profiles, combined column by column
    with ``reduce`` (``np.mean``, ``np.median``); None where the profiles do not hold the same
    processes and layers."""
    keys = [t.sort_values(["process", "layer"]).reset_index(drop=True) for t in tables]
    if any(not k[["process", "layer"]].equals(keys[0][["process", "layer"]]) for k in keys):
        return None
    combined = keys[0].copy()
    for column in [c for c in PROCESS_LAYER_TABLE.columns if c not in ("process", "layer")]:
        combined[column] = reduce(np.stack([k[column].to_numpy(dtype=float) for k in keys]), axis=0)
    return conform(combined, PROCESS_LAYER_TABLE, what)


def process_layers(bundles: list[ProfileBundle]) -> pd.DataFrame:
    """Each concurrent process's own per-layer medians (PROCESS_LAYER_TABLE): the merged profile keeps
    their median, and a systematic difference between the processes is lost there (sim.meeting)."""
    columns = [c for c in PROCESS_LAYER_TABLE.columns if c not in ("process", "layer")]
    parts = [b.layers[["layer", *columns]].assign(process=i) for i, b in enumerate(bundles)]
    return conform(pd.concat(parts, ignore_index=True)[list(PROCESS_LAYER_TABLE.columns)], PROCESS_LAYER_TABLE,
                   "per-process profile")


def bracket_profile(before: ProfileBundle, after: ProfileBundle, bundle_dir: Path) -> float:
    """Replace the bundle's times by the mean of ``before`` and ``after``; return the drift
    (total forward + backward time after / before)."""
    merged = _merge_profiles([before, after], statistic="mean")
    merged.comm_samples, merged.comm_fits = before.comm_samples, before.comm_fits
    merged.meta["settings"]["bracketed"] = True
    write_bundle(merged, bundle_dir)
    total = [float((b.layers["fwd_s"] + b.layers["bwd_s"]).sum()) for b in (before, after)]
    return total[1] / total[0] if total[0] > 0 else float("nan")


def profile_for_validation(plan: Plan, out_dir: Path, profile: Path | None = None, commbench: bool = True,
                           colocated: bool = True, comm_plans: list[Plan] | None = None,
                           profile_repeats: int = 10, comm_repeats: int = 10) -> Path:
    """The bundle ``plan`` is validated with: ``profile`` itself when given and nothing is added,
    else ``out_dir/profile`` (profiled here, or a copy of ``profile``) with comm fits when asked.
    ``comm_plans`` (default: just ``plan``) decide the benchmarked sizes, so one bundle can serve
    several plans of the same workload."""
    target = Path(out_dir) / "profile"
    if profile is not None:
        profile = Path(profile).resolve()
        read_bundle(profile)  # a bad bundle fails here, naming the file
        # Another workload's (or dtype's, or layer count's) bundle is refused naming the user's folder,
        # before it is copied under out_dir: the copy's name in the error, and the copy left behind,
        # told the user nothing about their own folder.
        resolve_plan(plan.replace(profile=str(profile)))
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

