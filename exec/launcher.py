"""Launch a plan's ranks on this machine and watch them: ``run_plan``.

The launcher spawns ``dp x tp x pp`` processes (forked from the process's forkserver,
``traces.forkserver``: the server imports torch once, so later launches start in a fraction of a
second), each running ``exec.rank.run_rank`` with a file rendezvous in the output directory, NCCL
when CUDA is available and gloo otherwise (``backend`` overrides it).

A watchdog polls the ranks every 0.1 s. A rank that exits with an error stops the run at once:
the others are terminated and ``RunFailed`` names the rank, the iteration and the instruction it
was executing (from its error file, or its heartbeat when it died without one). A run in which no
rank completes an instruction for ``timeout_s`` seconds is declared hung and stopped the same way
(the process groups carry the same timeout, so a rank blocked in a collective fails too), and so is
a run in which a live rank's heartbeat has been silent for ``frozen_after_s`` (a stopped or starved
process: its peers then wait on it, and ``timeout_s`` would only say so minutes later). Either way
the iterations already measured are written as a run record before the error is raised.

Lifecycle: the plan is checked here, once, before any rank starts. The output folder is locked
and claimed (``traces.outdir``): a second run into it is refused, nothing the run did not write
is deleted. Each rank dies with its parent (``PR_SET_PDEATHSIG`` on Linux, and a thread that
watches the parent and the launcher's pid). SIGINT and SIGTERM stop the ranks, remove the
rendezvous folder and keep what the completed iterations measured (``RunInterrupted``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import pandas as pd

from exec.contract import RunOptions, compile_for_run, pick_backend
from exec.host_fit import check_host_memory
from exec.rank import run_rank, write_error
from exec.records import read_rank_results, summarise, write_record
from exec.structure import Measured
from sim.compile import check_local_run
from sim.plan import Plan
from traces.errors import ConfigError, ParatwinError
from traces.forkserver import forkserver_context
from traces.outdir import RENDEZVOUS_NAME, OutputLock, claim_run_folder, finish_marker, prepare_out_folder
from traces.runrecord import read_run_record

POLL_S = 0.1
STARTUP_GRACE_S = 120.0  # time allowed for a rank to import, rendezvous and build its stages
PARENT_POLL_S = 0.5  # how often a rank checks that its parent and the launcher still live
STALE_S = 3.0  # a heartbeat older than this (it is rewritten every 0.2 s) means a frozen process
# A live rank whose heartbeat is this old ends the run (``--frozen-after``). The heartbeat is a thread of
# the rank (exec.rank.Heartbeat), so a long torch operation does not silence it (torch releases the GIL
# in its kernels, gloo and NCCL in their waits); what can is the process not running at all (SIGSTOP, a
# debugger, the kernel's swapping) or a machine so loaded that the thread is not scheduled. Measured here:
# the oldest heartbeat seen over 300 iterations of gpt-tiny pp2, polled every 50 ms at load average 9-14
# on 2 cores, was 1.2 s. 60 s leaves 50 times that for a busier machine or a slow shared file system
# under --out, and still ends a stopped run 4 minutes before the default --timeout of 300 s.
FROZEN_AFTER_S = 60.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class RunFailed(ParatwinError):
    """A rank failed or the run hung; ``record`` is the run record of what was measured."""

    def __init__(self, message: str, record: Path | None) -> None:
        super().__init__(message + (f" (measured iterations kept in {record})" if record else ""))
        self.record = record


class RunInterrupted(RunFailed):
    """The launcher got SIGINT or SIGTERM; ``record`` keeps what completed iterations measured."""

    def __init__(self, message: str, record: Path | None, signum: int) -> None:
        super().__init__(message, record)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


class _Signalled(BaseException):  # noqa: N818 - raised by the SIGTERM handler, like KeyboardInterrupt
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


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
             environment: dict[str, str], launcher_pid: int, measured: Measured, errors: Connection) -> None:
    # Runs in the child, forked from the forkserver, whose environment is that of its own start:
    # take the launcher's current one (e.g. NCCL_*, GLOO_* or the fault-injection variable).
    _die_with_parent(launcher_pid)
    os.environ.clear()
    os.environ.update(environment)

    def report(error: dict) -> None:
        # Without the traceback: a message this small never blocks on the pipe, which the launcher reads
        # once this rank has exited.
        with contextlib.suppress(OSError, ValueError):
            errors.send({key: value for key, value in error.items() if key != "traceback"})

    try:
        plan = Plan.from_dict(plan_data)
    except BaseException as exc:  # noqa: BLE001 - reported through the error file and the pipe
        report(write_error(Path(out_dir), rank, exc))
        sys.exit(1)
    try:
        run_rank(plan, rank, world_size, rank, Path(out_dir), options, init_method=init, measured=measured,
                 report=report)
    except BaseException:  # noqa: BLE001 - run_rank reported it; the launcher says what happened
        sys.exit(1)


def _die_with_parent(launcher_pid: int) -> None:
    """Make this rank die when the launcher or its parent dies.

    The parent is the forkserver, which outlives a killed launcher for as long as any rank holds
    its pipe, so the thread that polls the launcher's pid is what ends the ranks of a SIGKILLed
    launcher; the kernel's parent-death signal (Linux) covers a killed forkserver."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    watcher = threading.Thread(target=_watch_parent, args=(parent, launcher_pid), daemon=True,
                               name="paratwin-parent-watch")
    watcher.start()


def _watch_parent(parent: int, launcher_pid: int) -> None:
    while os.getppid() == parent and _alive(launcher_pid):
        time.sleep(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (dead, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (not Linux): the signal test above is all there is
    return state not in ("Z", "X")


def run_plan(plan: Plan | str | Path, nproc: int | None = None, backend: str | None = None,
             iterations: int = 5, warmup: int = 1, out_dir: Path | None = None, timeout_s: float = 300, *,
             save_params: bool = False, threads: int = 1, force: bool = False,
             measured: Measured | None = None, frozen_after_s: float = FROZEN_AFTER_S) -> RunResult:
    """Run ``plan`` for ``warmup + iterations`` training iterations on this machine.

    ``nproc`` defaults to the plan's world size (and must equal it). Results go to ``out_dir``
    (a new temporary directory by default): ``record/`` (the run record: INSTRUCTION_TABLE and a
    summary), ``trace.json`` (Chrome trace), ``ranks/`` (per-rank, per-iteration results),
    ``heartbeat/``, ``errors/`` and, with ``save_params``, ``params/rank<r>.pt``. A folder that
    already holds a run's outputs is refused unless ``force`` (then that run's files are replaced);
    one that holds anything else under those names is always refused. ``measured``: the structural
    measurements ``check_runs_here`` returned for this plan's workload, not taken again. The run is
    declared hung when no rank finishes an instruction for ``timeout_s``, or when a live rank writes
    no heartbeat for ``frozen_after_s`` (at least ``STALE_S``: below it a busy machine's delays count).
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
    if not timeout_s > 0:  # 0 declared the run hung at once; a negative one failed inside gloo on every rank
        raise ConfigError("timeout", f"must be a positive number of seconds, got {timeout_s}", "e.g. --timeout 300")
    if not frozen_after_s >= STALE_S:
        raise ConfigError("frozen-after", f"must be at least {STALE_S:g} s (a heartbeat is rewritten every 0.2 s, "
                          f"and a busy machine delays it by a second or more), got {frozen_after_s}",
                          f"e.g. --frozen-after {FROZEN_AFTER_S:g}")
    backend = pick_backend(backend)
    measured = check_runs_here(plan, measured)
    out_dir = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="paratwin-run-"))
    prepare_out_folder(out_dir, ())  # a file or a place that cannot be written: one line (claim_run_folder: the rest)
    # The process groups time out later than the watchdog, so that a hang is reported as one
    # (naming every rank's instruction) before a blocked rank's own timeout error.
    options = RunOptions(iterations, warmup, backend, 1.5 * float(timeout_s) + 5.0, save_params, threads)
    with OutputLock(out_dir):
        claim_run_folder(out_dir, force)
        return _launch(plan, out_dir, options, _Limits(float(timeout_s), float(frozen_after_s)), measured)


def check_runs_here(plan: Plan, measured: Measured | None = None) -> Measured:
    """Every check a rank makes before its first instruction, here, once (a ``ConfigError``), and whether
    the ranks fit this machine (its cores, its memory); returns the plan's structural measurements,
    which the ranks take instead of measuring again (``measured``: an earlier call's, for the same workload)."""
    check_local_run(plan)
    executable = compile_for_run(plan, measured)
    check_host_memory(executable)
    return executable.structure.measured


@dataclass(frozen=True)
class _Limits:
    """When the watchdog declares a run hung: no progress for ``timeout_s``, or a live rank's heartbeat
    silent for ``frozen_after_s``."""

    timeout_s: float
    frozen_after_s: float


def _launch(plan: Plan, out_dir: Path, options: RunOptions, limits: _Limits, measured: Measured) -> RunResult:
    world = plan.world_size
    rendezvous = out_dir / RENDEZVOUS_NAME
    shutil.rmtree(rendezvous, ignore_errors=True)
    rendezvous.mkdir()
    init = f"file://{rendezvous.resolve()}/store"
    context = forkserver_context()
    environment = dict(os.environ)
    # Each rank's error record also comes through a pipe: on a full disk its errors/rank<r>.json cannot be written.
    pipes = [context.Pipe(duplex=False) for _ in range(world)]
    processes = [context.Process(target=_spawned, name=f"paratwin-rank{r}", daemon=False,
                                 args=(r, world, plan.model_dump(), str(out_dir), options, init, environment,
                                       os.getpid(), measured, pipes[r][1]))
                 for r in range(world)]
    signum = 0
    with _signals_raise():
        try:
            for p in processes:
                p.start()
            failure = _watch(processes, out_dir, limits, [receiver for receiver, _ in pipes])
        except (KeyboardInterrupt, _Signalled) as exc:
            signum = getattr(exc, "signum", int(signal.SIGINT))
            failure = f"run interrupted by {signal.Signals(signum).name}"
        finally:
            with _signals_ignored():  # a second Ctrl-C must not cut the clean-up short
                stop_processes(processes)
                shutil.rmtree(rendezvous, ignore_errors=True)
                for connection in (c for pipe in pipes for c in pipe):
                    connection.close()
    if failure is None:
        finish_marker(out_dir, "ok")
        return _result(plan, out_dir)
    status = "interrupted" if signum else "failed"
    if signum:
        failure += f" after {_measured_iterations(out_dir)} measured iteration(s)"
    record = _salvage(plan, out_dir, options.backend, failure, status)
    with contextlib.suppress(OSError):  # a full disk: the failure is the news (a later run needs --force anyway)
        finish_marker(out_dir, status)
    if signum:
        raise RunInterrupted(failure + ("" if record else "; nothing was measured, so no record was written"),
                             record, signum)
    raise RunFailed(failure, record)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM raises ``_Signalled`` (SIGINT raises KeyboardInterrupt anyway) in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise _Signalled(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _measured_iterations(out_dir: Path) -> int:
    results = read_rank_results(out_dir)
    measured = {(r["rank"], r["iteration"]) for r in results if not r.get("warmup")}
    ranks = {rank for rank, _ in measured}
    # An iteration counts when every rank that wrote anything finished it.
    iterations = {it for _, it in measured}
    return sum(1 for it in iterations if all((rank, it) in measured for rank in ranks))


# ------------------------------------------------------------------------------------------------
# Watchdog


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _received(connection: Connection) -> dict | None:
    """A rank's error record from its pipe, if it sent one."""
    try:
        return connection.recv() if connection.poll() else None
    except (EOFError, OSError):
        return None


def _where(beat: dict | None, now: float) -> str:
    """Where a rank is and for how long, from its last heartbeat; a heartbeat older than
    ``STALE_S`` (it is rewritten every 0.2 s) says the process itself stopped (frozen, starved)."""
    if beat is None:
        return "before its first heartbeat"
    held = f"for {max(0.0, now - beat['since']):.1f} s"
    if beat["index"] >= 0:
        where = f"at iteration {beat['iteration']} instruction {beat['index']} ({beat['instruction']}, {held}"
    elif beat["iteration"] >= 0:
        where = f"in iteration {beat['iteration']}, between instructions ({held}"
    else:  # it read "at iteration -1 instruction -1 ((between instructions), ...)"
        where = "before its first instruction (setting up"
    silent = now - beat["time"]
    if silent > STALE_S:
        where += f"; no heartbeat for {silent:.1f} s: the process is frozen"
    return where + ")"


def _watch(processes: list, out_dir: Path, limits: _Limits, reports: list[Connection]) -> str | None:
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
            return _failure_message(failed, processes, out_dir, beats, reports)
        done = sum(b["done"] for b in beats.values() if b)
        if done != progress:
            progress, progress_at = done, time.time()
        limit = limits.timeout_s if progress > 0 else max(limits.timeout_s, STARTUP_GRACE_S)
        now = time.time()
        # A rank that has exited (or not yet written a heartbeat) is not frozen: the checks above judge it.
        frozen = [r for r, b in beats.items() if b and codes[r] is None and now - b["time"] > limits.frozen_after_s]
        if frozen:
            silent = max(now - beats[r]["time"] for r in frozen)
            return (f"run hung: rank {', '.join(map(str, frozen))} wrote no heartbeat for {silent:.0f} s "
                    f"(frozen after {limits.frozen_after_s:g} s): {_positions(beats, now)}")
        if now - progress_at > limit:
            return (f"run hung: no rank finished an instruction for {now - progress_at:.0f} s "
                    f"(timeout {limits.timeout_s:g} s): {_positions(beats, now)}")
        time.sleep(POLL_S)


def _positions(beats: dict, now: float) -> str:
    """Every rank's instruction and for how long, frozen ones named so (``_where``)."""
    return "; ".join(f"rank {r} {_where(b, now)}" for r, b in beats.items())


def _failure_message(failed: list[int], processes: list, out_dir: Path, beats: dict,
                     reports: list[Connection]) -> str:
    errors = {r: _received(reports[r]) or _read(out_dir / "errors" / f"rank{r}.json")
              for r in range(len(processes))}
    failed = sorted({*failed, *(r for r, e in errors.items() if e)})

    def when(r: int) -> float:
        if errors.get(r):
            return errors[r]["time"]
        return beats[r]["time"] if beats.get(r) else float("inf")

    first = min(failed, key=when)
    error = errors.get(first)
    now = time.time()
    if error:
        message = f"rank {first} failed {_place(error)}: {error['error']}"
    else:
        message = f"rank {first} died (exit code {processes[first].exitcode}) {_where(beats.get(first), now)}"
    others = [r for r in failed if r != first]
    if others:
        message += "; then " + "; ".join(
            f"rank {r} ({errors[r]['instruction']}: {errors[r]['error']})" if errors.get(r)
            else f"rank {r} died" for r in others)
    alive = [r for r in range(len(processes)) if r not in failed]
    if alive:  # a rank that is still running where another timed out is the likely culprit
        message += "; still running: " + "; ".join(f"rank {r} {_where(beats.get(r), now)}" for r in alive)
    return message


def _place(error: dict) -> str:
    """Where a rank failed: at an instruction, or in the phase it was in (setup, gathering, ...)."""
    if error.get("index", -1) >= 0:
        return f"at iteration {error['iteration']} instruction {error['index']} ({error['instruction']})"
    after = f" (after iteration {error['iteration']})" if error.get("iteration", -1) >= 0 else ""
    return f"while {error.get('phase') or error['instruction'].strip('()')}{after}"


def stop_processes(processes: list[BaseProcess]) -> None:
    """SIGTERM to those still running, SIGKILL to any left after 5 s; each joined (no zombie, no orphan).
    Also for ``analysis.validation.profiling``'s workers."""
    processes = [p for p in processes if p.pid is not None]  # a failed start leaves some unstarted
    for p in processes:
        if p.is_alive():
            p.terminate()
            with contextlib.suppress(ProcessLookupError):  # a stopped rank acts on SIGTERM once continued
                os.kill(p.pid, signal.SIGCONT)
    deadline = time.time() + 5.0
    for p in processes:
        p.join(max(0.0, deadline - time.time()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


# ------------------------------------------------------------------------------------------------
# Results


def _salvage(plan: Plan, out_dir: Path, backend: str, failure: str, status: str = "failed") -> Path | None:
    results = read_rank_results(out_dir)
    if not results:
        return None
    try:
        return write_record(out_dir, plan, results, {"backend": backend}, status=status, error=failure)
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


__all__ = ["RunFailed", "RunInterrupted", "RunResult", "run_plan", "stop_processes"]
