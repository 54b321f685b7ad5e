"""One rank's whole run (``run_rank``): process groups, stages, iterations, results, and what it
leaves behind when it fails.

Each iteration's rows, losses and memory are appended to ``<out>/ranks/rank<r>.jsonl`` as soon as
the iteration ends, and a heartbeat file (``heartbeat/rank<r>.json``) names the current
instruction, so a failed or hung run keeps what it measured and says where it stopped; a failing
rank writes ``errors/rank<r>.json``. Rank 0 gathers every rank's results and writes the run record.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from exec.contract import LEARNING_RATE, ExecutablePlan, RunOptions, compile_for_run, pick_backend
from exec.faults import PHASES, Phase
from exec.host_memory import keep_freed_memory
from exec.host_memory import state as host_memory_state
from exec.interpreter import RankRuntime
from exec.records import write_record
from exec.structure import Measured
from sim.plan import Plan
from sim.program import Program
from sim.tied_embedding import TIED_TAG
from traces.errors import ConfigError

HEARTBEAT_PERIOD_S = 0.2
ERROR_CHARS = 500  # an error file keeps this much of the error's first line (and the whole traceback)
MEMORY_NOTE_CPU = ("tracked bytes: parameters + gradients + Adam state + activations held by the runtime "
                   "(stage inputs, tensors saved for backward with each storage counted once, parameters "
                   "excluded, swapped-out ones not counted) + message buffers in flight; sampled at "
                   "instruction ends")
MEMORY_NOTE_CUDA = "torch.cuda.memory_allocated / max_memory_allocated of the rank's device"


class Heartbeat(threading.Thread):
    """Writes ``heartbeat/rank<r>.json`` (current iteration and instruction) every 0.2 s."""

    def __init__(self, runtime_ref: Any, path: Path, rank: int) -> None:
        super().__init__(daemon=True)
        self.ref, self.path, self.rank = runtime_ref, path, rank
        self.stopped = threading.Event()

    def state(self) -> dict:
        rt = self.ref()
        current = getattr(rt, "current", None) if rt is not None else None
        return {
            "rank": self.rank, "pid": os.getpid(), "time": time.time(),
            "iteration": getattr(rt, "iteration", -1), "done": getattr(rt, "done_count", 0),
            "index": current.index if current is not None else -1,
            "instruction": current.label if current is not None else "(between instructions)",
            "since": getattr(rt, "since", time.time()),
        }

    def run(self) -> None:
        while not self.stopped.wait(HEARTBEAT_PERIOD_S):
            # A full disk fails the rank's own next write, which reports it; this thread's traceback said no more.
            with contextlib.suppress(OSError):
                _write_json(self.path, self.state())


def _write_json(path: Path, data: dict) -> None:
    """Whole or not at all (a temporary renamed over ``path``); a failed write leaves no temporary behind."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def run_rank(plan: Plan, rank: int, world_size: int, local_rank: int, out_dir: Path, options: RunOptions,
             init_method: str = "env://", measured: Measured | None = None,
             report: Callable[[dict], None] | None = None) -> None:
    """Everything one rank does; results go to ``out_dir`` (rank 0 also writes the run record).
    ``measured``: the plan's structural measurements, taken by the launcher (``compile_for_run``).
    ``report``: also given a failure's error record (the launcher's pipe: it arrives where no file can be written)."""
    out_dir = Path(out_dir)
    runtime: RankRuntime | None = None
    heartbeat = Heartbeat(lambda: runtime, out_dir / "heartbeat" / f"rank{rank}.json", rank)
    phase = Phase(rank)
    try:
        for sub in ("ranks", "heartbeat", "errors"):
            (out_dir / sub).mkdir(parents=True, exist_ok=True)
        heartbeat.start()
        phase.enter("setup")
        backend = pick_backend(options.backend)
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(options.threads)
            keep_freed_memory()  # no page faults for memory an iteration frees and the next asks for again
        timeout = dt.timedelta(seconds=options.timeout_s)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timeout)
        run = compile_for_run(plan, measured)
        if run.program.world_size != world_size:
            raise ConfigError("world size", f"the plan needs {run.program.world_size} ranks, "
                              f"{world_size} were launched", "launch dp x tp x pp ranks")
        tp_group, dp_group = _groups(run.program, rank, timeout)
        tied_group = _own_group(_tied_groups(run.program), rank, timeout)
        runtime = RankRuntime(run, rank, device, tp_group, dp_group, tied_group)
        results_path = out_dir / "ranks" / f"rank{rank}.jsonl"
        results_path.write_text("")
        results = []
        phase.enter("iterations")
        for iteration in range(options.warmup + options.iterations):
            result = runtime.run_iteration(iteration)
            result["warmup"] = iteration < options.warmup
            with results_path.open("a") as fh:  # kept even if a later iteration fails
                fh.write(json.dumps(result) + "\n")
            results.append(result)
        if options.save_params:
            phase.enter("params")
            (out_dir / "params").mkdir(exist_ok=True)
            torch.save(runtime.parameters_by_name(), out_dir / "params" / f"rank{rank}.pt")
        phase.enter("gather")
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, results)
        if rank == 0:
            phase.enter("record")
            everything = [r for per_rank in gathered for r in per_rank]
            write_record(out_dir, plan, everything, run_meta(run, backend, device))
        phase.enter("finish")
        dist.barrier()
    except BaseException as exc:
        error = write_error(out_dir, rank, exc, runtime, phase.description)
        if report is not None:
            report(error)
        raise
    finally:
        heartbeat.stopped.set()
        if heartbeat.ident is not None:  # started
            heartbeat.join(1.0)
        if runtime is not None and runtime.watchers is not None:
            runtime.watchers.shutdown(wait=False, cancel_futures=True)
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def write_error(out_dir: Path, rank: int, exc: BaseException, runtime: RankRuntime | None = None,
                phase: str = PHASES["setup"]) -> dict:
    """``errors/rank<r>.json``: the error, where the rank was (instruction, or else phase), and the traceback.
    Returns the record. A file that cannot be written (the full disk that failed the rank) is not a second
    error: the record, returned, still says what happened."""
    current = runtime.current if runtime is not None else None
    text = str(exc).strip()
    first_line = text.splitlines()[0] if text else ""
    record = {
        "rank": rank, "time": time.time(),
        "iteration": runtime.iteration if runtime is not None else -1,
        "index": current.index if current is not None else -1,
        "instruction": current.label if current is not None else f"({phase})",
        "phase": phase,
        "error": f"{type(exc).__name__}: {first_line[:ERROR_CHARS]}",
        "traceback": traceback.format_exc(),
    }
    with contextlib.suppress(OSError):
        (Path(out_dir) / "errors").mkdir(parents=True, exist_ok=True)
        _write_json(Path(out_dir) / "errors" / f"rank{rank}.json", record)
    return record


def _groups(program: Program, rank: int, timeout: dt.timedelta) -> tuple[object, object]:
    """TP and DP process groups; every rank creates every group, in the same order."""
    tp_groups = [[program.rank_of(d, p, t) for t in range(program.tp)]
                 for d in range(program.dp) for p in range(program.pp)] if program.tp > 1 else []
    dp_groups = [[program.rank_of(d, p, t) for d in range(program.dp)]
                 for p in range(program.pp) for t in range(program.tp)] if program.dp > 1 else []
    return _own_group(tp_groups, rank, timeout), _own_group(dp_groups, rank, timeout)


def _tied_groups(program: Program) -> list[list[int]]:
    """The first and last stage's rank pairs of a tied word embedding (sim.tied_embedding), in one order."""
    return [list(g) for g in sorted({i.group for rp in program.ranks.values() for i in rp.instructions
                                     if i.tag.startswith(TIED_TAG)})]


def _own_group(all_ranks: list[list[int]], rank: int, timeout: dt.timedelta) -> object:
    """Create every group (a collective call on all ranks) and return the one holding ``rank``."""
    own = None
    for ranks in all_ranks:
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            own = group
    return own


def run_meta(run: ExecutablePlan, backend: str, device: torch.device) -> dict:
    return {
        "backend": backend, "device": str(device), "torch": torch.__version__,
        "stage_layers": [list(layers) for layers in run.program.stage_layers],
        "recompute_layers": [list(layers) for layers in run.resolved.policy.recompute_layers],
        "swap_fraction": list(run.resolved.policy.swap_fraction),
        "memory": MEMORY_NOTE_CUDA if device.type == "cuda" else MEMORY_NOTE_CPU,
        "learning_rate": LEARNING_RATE,
        "costs": "profile" if run.plan.profile else "structural (exec.structure.StructuralCosts)",
        "host_memory": host_memory_state(),  # exec.host_memory: what the allocator does with freed memory
    }

