"""Launch a plan's ranks on this machine and watch them: ``run_plan``.

The launcher spawns ``dp x tp x pp`` processes (torch.multiprocessing, forkserver: the server
imports torch once, so later launches start in a fraction of a second), each running
``exec.runtime.run_rank`` with a file rendezvous in the output directory, NCCL when CUDA is
available and gloo otherwise (``backend`` overrides it).

A watchdog polls the ranks every 0.1 s. A rank that exits with an error stops the run at once:
the others are terminated and ``RunFailed`` names the rank, the iteration and the instruction it
was executing (from its error file, or its heartbeat when it died without one). A run in which no
rank completes an instruction for ``timeout_s`` seconds is declared hung and stopped the same way
(the process groups carry the same timeout, so a rank blocked in a collective fails too). Either
way the iterations already measured are written as a run record before the error is raised.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch.multiprocessing as tmp

from exec.records import read_rank_results, summarise, write_record
from exec.runtime import RunOptions, pick_backend, run_rank, write_error
from sim.plan import Plan
from traces.errors import ConfigError, ParatwinError
from traces.runrecord import read_run_record

POLL_S = 0.1
STARTUP_GRACE_S = 120.0  # time allowed for a rank to import, rendezvous and build its stages


class RunFailed(ParatwinError):
    """A rank failed or the run hung; ``record`` is the run record of what was measured."""

    def __init__(self, message: str, record: Path | None) -> None:
        super().__init__(message + (f" (measured iterations kept in {record})" if record else ""))
        self.record = record


@dataclass
class RunResult:
    plan: Plan
    out_dir: Path
    table: pd.DataFrame  # INSTRUCTION_TABLE rows of the measured iterations (+ "iteration" column)
    iteration_s: dict[int, list[float]]  # rank -> wall time of each measured iteration
    losses: list[float]  # global-batch mean loss of every iteration, warm-up ones first
    peak_memory: dict[int, int]  # rank -> bytes (see summary["memory"] for what is counted)
    paths: dict[str, Path]
    summary: dict = field(default_factory=dict)

    @property
    def iteration_times(self) -> list[float]:
        """Per measured iteration, the slowest rank's time."""
        per_rank = list(self.iteration_s.values())
        return [max(times) for times in zip(*per_rank, strict=True)] if per_rank else []


def _spawned(rank: int, world_size: int, plan_data: dict, out_dir: str, options: RunOptions, init: str,
             environment: dict[str, str]) -> None:
    # Runs in the child, forked from the forkserver, whose environment is that of its own start:
    # take the launcher's current one (e.g. NCCL_*, GLOO_* or the fault-injection variable).
    os.environ.clear()
    os.environ.update(environment)
    try:
        plan = Plan.from_dict(plan_data)
    except BaseException as exc:  # noqa: BLE001 - reported through the error file
        write_error(Path(out_dir), rank, exc)
        sys.exit(1)
    try:
        run_rank(plan, rank, world_size, rank, Path(out_dir), options, init_method=init)
    except BaseException:  # noqa: BLE001 - run_rank wrote errors/rank<r>.json; the launcher reports
        sys.exit(1)


def run_plan(plan: Plan | str | Path, nproc: int | None = None, backend: str | None = None,
             iterations: int = 5, warmup: int = 1, out_dir: Path | None = None, timeout_s: float = 300, *,
             save_params: bool = False, threads: int = 1) -> RunResult:
    """Run ``plan`` for ``warmup + iterations`` training iterations on this machine.

    ``nproc`` defaults to the plan's world size (and must equal it). Results go to ``out_dir``
    (a new temporary directory by default): ``record/`` (the run record: INSTRUCTION_TABLE and a
    summary), ``trace.json`` (Chrome trace), ``ranks/`` (per-rank, per-iteration results),
    ``heartbeat/``, ``errors/`` and, with ``save_params``, ``params/rank<r>.pt``.
    """
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    world = plan.world_size
    if nproc is not None and nproc != world:
        raise ConfigError("nproc", f"{nproc} processes for a plan of dp x tp x pp = {world} ranks",
                          f"use nproc={world} or change the plan's degrees")
    if iterations < 1 or warmup < 0:
        raise ConfigError("iterations", f"need iterations >= 1 and warmup >= 0 (got {iterations}, {warmup})",
                          "e.g. --iterations 5 --warmup 1")
    backend = pick_backend(backend)
    out_dir = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="paratwin-run-"))
    for sub in ("ranks", "heartbeat", "errors", "params", "record"):
        shutil.rmtree(out_dir / sub, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The process groups time out later than the watchdog, so that a hang is reported as one
    # (naming every rank's instruction) before a blocked rank's own timeout error.
    options = RunOptions(iterations, warmup, backend, 1.5 * float(timeout_s) + 5.0, save_params, threads)
    rendezvous = tempfile.mkdtemp(prefix="paratwin-rdzv-")
    init = f"file://{rendezvous}/store"

    context = tmp.get_context("forkserver")
    context.set_forkserver_preload(["exec.runtime"])
    environment = dict(os.environ)
    processes = [context.Process(target=_spawned, name=f"paratwin-rank{r}", daemon=False,
                                 args=(r, world, plan.model_dump(), str(out_dir), options, init, environment))
                 for r in range(world)]
    try:
        for p in processes:
            p.start()
        failure = _watch(processes, out_dir, float(timeout_s))
    finally:
        _stop(processes)
        shutil.rmtree(rendezvous, ignore_errors=True)
    if failure is not None:
        record = _salvage(plan, out_dir, backend, failure)
        raise RunFailed(failure, record)
    return _result(plan, out_dir)


# ------------------------------------------------------------------------------------------------
# Watchdog


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _where(beat: dict | None) -> str:
    if beat is None:
        return "before its first heartbeat"
    return (f"at iteration {beat['iteration']} instruction {beat['index']} ({beat['instruction']}, "
            f"for {max(0.0, beat['time'] - beat['since']):.1f} s)")


def _watch(processes: list, out_dir: Path, timeout_s: float) -> str | None:
    """None when every rank exited cleanly, else the failure message."""
    progress, progress_at = -1, time.time()
    while True:
        beats = {r: _read(out_dir / "heartbeat" / f"rank{r}.json") for r in range(len(processes))}
        codes = [p.exitcode for p in processes]
        if all(c == 0 for c in codes):
            return None
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            time.sleep(0.5)  # let the ranks that fail in consequence write their errors too
            return _failure_message(failed, processes, out_dir, beats)
        done = sum(b["done"] for b in beats.values() if b)
        if done != progress:
            progress, progress_at = done, time.time()
        limit = timeout_s if progress > 0 else max(timeout_s, STARTUP_GRACE_S)
        if time.time() - progress_at > limit:
            stuck = "; ".join(f"rank {r} {_where(b)}" for r, b in beats.items())
            return (f"run hung: no rank finished an instruction for {time.time() - progress_at:.0f} s "
                    f"(timeout {timeout_s:g} s): {stuck}")
        time.sleep(POLL_S)


def _failure_message(failed: list[int], processes: list, out_dir: Path, beats: dict) -> str:
    errors = {r: _read(out_dir / "errors" / f"rank{r}.json") for r in range(len(processes))}
    failed = sorted({*failed, *(r for r, e in errors.items() if e)})

    def when(r: int) -> float:
        if errors.get(r):
            return errors[r]["time"]
        return beats[r]["time"] if beats.get(r) else float("inf")

    first = min(failed, key=when)
    error = errors.get(first)
    if error:
        message = (f"rank {first} failed at iteration {error['iteration']} instruction {error['index']} "
                   f"({error['instruction']}): {error['error']}")
    else:
        message = f"rank {first} died (exit code {processes[first].exitcode}) {_where(beats.get(first))}"
    others = [r for r in failed if r != first]
    if others:
        message += "; then " + "; ".join(
            f"rank {r} ({errors[r]['instruction']}: {errors[r]['error']})" if errors.get(r)
            else f"rank {r} died" for r in others)
    alive = [r for r in range(len(processes)) if r not in failed]
    if alive:  # a rank that is still running where another timed out is the likely culprit
        message += "; still running: " + "; ".join(f"rank {r} {_where(beats.get(r))}" for r in alive)
    return message


def _stop(processes: list) -> None:
    processes = [p for p in processes if p.pid is not None]  # a failed start leaves some unstarted
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.time() + 5.0
    for p in processes:
        p.join(max(0.0, deadline - time.time()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


# ------------------------------------------------------------------------------------------------
# Results


def _salvage(plan: Plan, out_dir: Path, backend: str, failure: str) -> Path | None:
    results = read_rank_results(out_dir)
    if not results:
        return None
    try:
        return write_record(out_dir, plan, results, {"backend": backend}, status="failed", error=failure)
    except Exception:  # noqa: BLE001 - best effort: the failure itself is what gets reported
        return None


def _result(plan: Plan, out_dir: Path) -> RunResult:
    record_dir = out_dir / "record"
    record = read_run_record(record_dir)
    summary = record.summary
    results = read_rank_results(out_dir)
    numbers = summarise(plan, results)
    return RunResult(
        plan=plan,
        out_dir=out_dir,
        table=record.instructions,
        iteration_s={int(k): v for k, v in numbers["iteration_s"].items()},
        losses=numbers["losses"],
        peak_memory={int(k): v for k, v in numbers["peak_memory"].items()},
        paths={"record": record_dir, "trace": out_dir / "trace.json", "ranks": out_dir / "ranks",
               **({"params": out_dir / "params"} if (out_dir / "params").is_dir() else {})},
        summary=summary,
    )


__all__ = ["RunFailed", "RunResult", "run_plan"]
