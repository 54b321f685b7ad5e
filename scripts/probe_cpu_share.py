"""Where a 2-rank CPU run's core-seconds go, per thread (issue 12, seventh session).

    python scripts/probe_cpu_share.py examples/validation/embedding/emb-dense-dp2.yaml [PLAN ...] --rounds 12

On the 2-vCPU host two ranks, each with one compute thread, plus gloo's worker threads and the
kernel's TCP copies share two cores. Every loopback plan's compute ran 1.01-1.29x its profile
(run 7). This spawns the plan's ranks on gloo (``exec.interpreter.RankRuntime``, as ``paratwin
run`` runs them, one torch thread each) and reads the kernel's scheduler statistics of every
thread of each rank (``/proc/self/task/<tid>/schedstat``: nanoseconds on a CPU, nanoseconds
runnable but waiting for one) around each round, and of the main thread around every compute
instruction. Modes, in a rotating order per round (a barrier between rounds):

- ``run``: one iteration of the plan (compute, collectives, optimizer steps);
- ``run-pinned``: the same with every thread of each rank held on one CPU, the ranks swapping
  CPUs every round (``os.sched_setaffinity``; compute wall is then also given per rank and per
  CPU: a rank that is slower on either CPU, or a CPU that is slower for either rank):
  whether the scheduler placing both compute threads (or a compute thread and a woken
  communication thread) on one core, rather than the communication's CPU itself, is what slows
  compute: pinned, each rank's compute shares its core only with its own rank's threads;
- ``compute``: only the plan's forwards and backwards, both ranks at once after a barrier, no
  communication: what the profile (two processes in lockstep, exec.lockstep) measures;
- ``solo``: the same on one rank while the other waits in a barrier (alternating ranks): what
  running beside the other rank's compute costs by itself (caches, memory bandwidth).

``compute`` and ``solo`` only for a plan whose forwards need no exchange (``embedding: dense``);
the other methods' compute is the same model's (docs/embrace.md), so the dense plan's
``compute``/``solo`` rounds are their reference too.

Per mode, medians over rounds after ``--warmup`` (per rank, then the slower rank):

- compute instructions (FWD + BWD): wall, on-CPU (the main thread's), runnable-but-waiting, and
  the main thread's involuntary switches (preempted) and migrations between CPUs (/proc/<tid>/sched;
  this VM's kernel reports no migrations); ``compute on one CPU``: of the time both ranks computed
  at once, the share in which their compute threads started or ended an instruction on the same
  CPU (sampled at the instructions' edges: a scheduler placing both on one core);
  wall / on-CPU above 1 means the compute thread was descheduled (the cores were taken);
- per thread group (the main thread inside and outside compute, gloo's threads, the completion
  watchers, others): on-CPU milliseconds per round; what is not compute is the ranks' CPU cost of
  communicating (gloo's copies and sums, the kernel's TCP stack in the sending thread's syscalls);
- the machine (``/proc/stat``, rank 0): busy core-milliseconds per round, of which softirq and
  steal (a KVM guest: time the hypervisor gave the vCPU to someone else).

What ``sim.host_cpu``'s shared slowdown predicts for the overlapped compute (and the collectives
beside it): ``scripts/predict_cpu_share.py`` on the plan as a validation suite stored it (with its
profile); compare its ratio with ``overlapped_wall_ms / overlapped_cpu_ms`` here.

Thread names come from ``/proc/self/task/<tid>/comm`` (digits stripped). Times on a loaded machine
are only comparable side by side within one invocation; on-CPU times are less sensitive to other
load than wall times, and the runnable-but-waiting time says how much other load took.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from probe_ranks import gather_ranks  # scripts/ is the script's own path

COMPUTE_KINDS = ("FWD", "BWD")


def _schedstat(path: str) -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting) of one task."""
    with open(path) as f:
        on_cpu, waiting, _ = f.read().split()
    return int(on_cpu), int(waiting)


def sched_counts(tid: int) -> tuple[int, int]:
    """(involuntary context switches, migrations between CPUs) of one thread (/proc/<tid>/sched)."""
    found = {}
    with open(f"/proc/self/task/{tid}/sched") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() in ("nr_involuntary_switches", "se.nr_migrations"):
                found[key.strip()] = int(float(value))
    return found.get("nr_involuntary_switches", 0), found.get("se.nr_migrations", 0)


def pin(cpus: set[int]) -> None:
    """Every thread of this process (gloo's, the watchers') onto ``cpus``; threads born later inherit
    the affinity of the thread that creates them."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):
            continue


def on_cpu(tid: int) -> int:
    """The CPU the thread last ran on (/proc/<tid>/stat, field 39)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def threads() -> dict[int, tuple[str, int, int]]:
    """Every thread of this process: tid -> (name without digits, ns on a CPU, ns waiting)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = re.sub(r"[0-9]+", "", f.read().strip())
            out[int(tid)] = (name, *_schedstat(f"/proc/self/task/{tid}/schedstat"))
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended between listdir and read
            continue
    return out


def machine() -> dict[str, int]:
    """/proc/stat's aggregate cpu line in clock ticks: busy (everything but idle and iowait), softirq, steal."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields[:8]
    return {"busy": user + nice + system + irq + softirq + steal, "softirq": softirq, "steal": steal,
            "total": sum(fields[:8])}


def group_of(tid: int, name: str, main: int) -> str:
    if tid == main:
        return "main"
    if name.startswith("paratwin-watch"):
        return "watchers"
    return name or "unnamed"


def per_group(before: dict, after: dict, main: int) -> dict[str, float]:
    """On-CPU ms per thread group between two ``threads()`` snapshots (threads born in between count from 0)."""
    out: dict[str, float] = defaultdict(float)
    for tid, (name, on_cpu, _) in after.items():
        out[group_of(tid, name, main)] += (on_cpu - before.get(tid, (name, 0, 0))[1]) / 1e6
    return dict(out)


def _rank(rank: int, world: int, plan_path: str, rounds: int, init: str, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from exec.contract import compile_for_run
    from exec.interpreter import RankRuntime
    from sim.plan import Plan
    from sim.program import Kind

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    plan = Plan.load(plan_path)
    run = compile_for_run(plan)
    runtime = RankRuntime(run, rank, torch.device("cpu"), None, dist.group.WORLD if plan.dp > 1 else None)
    main = threading.get_native_id()
    own = f"/proc/self/task/{main}/schedstat"
    full = runtime.program
    # The forwards and backwards alone (their dependencies on collectives are simply absent).
    compute_only = type(full)(full.rank, full.coords, full.stages,
                              [i for i in full.instructions if i.kind.value in COMPUTE_KINDS])
    execute = runtime._execute
    current: dict[str, list] = {"rows": []}

    def in_flight() -> bool:
        """A collective launched by this rank and not yet seen complete by its watcher."""
        return any(p.instruction.kind in (Kind.ALLREDUCE, Kind.ALLTOALL) and p.future is not None
                   and not p.future.done() for p in runtime.pending.values())

    def measured(ins: Any) -> None:
        overlapped = in_flight()
        (i0, g0), (c0, w0), p0, t0 = sched_counts(main), _schedstat(own), on_cpu(main), time.perf_counter()
        m0 = time.monotonic()  # one clock for every process: the ranks' rows line up
        execute(ins)
        c1, w1, t1 = *_schedstat(own), time.perf_counter()
        i1, g1 = sched_counts(main)
        current["rows"].append((ins.kind.value, t1 - t0, (c1 - c0) / 1e9, (w1 - w0) / 1e9, overlapped,
                                i1 - i0, g1 - g0, m0, time.monotonic(), p0, on_cpu(main)))

    runtime._execute = measured  # type: ignore[method-assign]
    modes = ["run", "run-pinned"] + (["compute", "solo"] if runtime.embedding is None else [])
    everywhere = os.sched_getaffinity(0)
    cpus = sorted(everywhere)
    samples = []
    for r in range(rounds):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            current["rows"] = []
            dist.barrier()
            computing = mode != "solo" or (r % world) == rank
            m0, t0, s0, w0 = machine(), threads(), sched_counts(main), time.perf_counter()
            # pinned, the ranks swap CPUs every round: a slower CPU and a slower rank come apart
            pinned_to = cpus[(rank + r) % len(cpus)]
            pin({pinned_to} if mode == "run-pinned" else everywhere)
            if computing:
                runtime.program = full if mode.startswith("run") else compute_only
                runtime.run_iteration(r)  # starts with a barrier of its own
            else:
                dist.barrier()  # the computing rank's run_iteration barrier
            wall = time.perf_counter() - w0
            t1, m1, s1 = threads(), machine(), sched_counts(main)
            dist.barrier()
            groups = per_group(t0, t1, main)
            rows = current["rows"]
            compute = [row for row in rows if row[0] in COMPUTE_KINDS]
            groups["main"] = groups.get("main", 0.0)
            # the main thread's on-CPU time per instruction kind (a collective's: its launch, or all
            # of a synchronous one), and what is left: dispatch, waiting on dependencies, the barrier
            for kind in sorted({row[0] for row in rows}):
                groups[f"main in {kind}"] = sum(row[2] for row in rows if row[0] == kind) * 1e3
            groups["main elsewhere"] = groups["main"] - sum(row[2] for row in rows) * 1e3
            samples.append({
                "round": r, "mode": mode, "computing": computing, "wall_ms": wall * 1e3, "rank": rank,
                "cpu": pinned_to if mode == "run-pinned" else -1,
                "compute_wall_ms": sum(row[1] for row in compute) * 1e3,
                "compute_cpu_ms": sum(row[2] for row in compute) * 1e3,
                "compute_wait_ms": sum(row[3] for row in compute) * 1e3,
                # forwards and backwards that started with a collective of this rank in flight
                "overlapped_wall_ms": sum(row[1] for row in compute if row[4]) * 1e3,
                "overlapped_cpu_ms": sum(row[2] for row in compute if row[4]) * 1e3,
                "compute_preempted": sum(row[5] for row in compute),
                "compute_migrations": sum(row[6] for row in compute),
                # the main thread over the whole round: migrations happen at wake-ups, between instructions
                "round_preempted": s1[0] - s0[0], "round_migrations": s1[1] - s0[1],
                "groups": groups,
                "spans": [(row[7], row[8], row[9], row[10]) for row in compute],
                "machine": {k: (m1[k] - m0[k]) * 1e3 / os.sysconf("SC_CLK_TCK") for k in m0},
            })
    runtime.program = full
    pin(everywhere)
    queue.put((rank, samples))
    runtime.watchers.shutdown(wait=False)
    dist.destroy_process_group()


def run_probe(plan_path: Path, rounds: int) -> dict[int, list[dict]]:
    from sim.plan import Plan

    return gather_ranks(_rank, Plan.load(plan_path).world_size, str(plan_path), rounds, prefix="paratwin-cpu-")


def shared_cpu(row: list[dict]) -> float:
    """Of the time both ranks' compute instructions ran at once in a round, the share in which
    they started or ended on the same CPU (two compute threads placed on one core), from the CPU
    each reported at its instruction's start and end: a coarse look, sampled at the edges."""
    together = same = 0.0
    for a0, a1, a_start, a_end in row[0]["spans"]:
        for b0, b1, b_start, b_end in row[1]["spans"]:
            both = max(0.0, min(a1, b1) - max(a0, b0))
            together += both
            if both and (a_start == b_start or a_end == b_end):
                same += both
    return same / together if together else float("nan")


def summarise(samples: dict[int, list[dict]], warmup: int) -> dict[str, dict[str, float]]:
    """Per mode: medians over the rounds after ``warmup`` of each figure, per rank and summed over
    the ranks for CPU (core-ms per round); compute figures of the computing rank(s)."""
    out: dict[str, dict[str, float]] = {}
    world = len(samples)
    by_mode: dict[str, list[list[dict]]] = defaultdict(list)  # mode -> per round, the ranks' samples
    for r in range(len(samples[0])):
        row = [samples[rank][r] for rank in range(world)]
        if row[0]["round"] >= warmup:
            by_mode[row[0]["mode"]].append(row)
    for mode, rows in by_mode.items():
        def med(values: list[float]) -> float:
            return statistics.median(values) if values else float("nan")

        computing = [[s for s in row if s["computing"]] for row in rows]
        groups = sorted({g for row in rows for s in row for g in s["groups"]})
        fig = {
            "rounds": len(rows),
            "wall_ms": med([max(s["wall_ms"] for s in row) for row in rows]),
            "compute_wall_ms": med([s["compute_wall_ms"] for row in computing for s in row]),
            "compute_cpu_ms": med([s["compute_cpu_ms"] for row in computing for s in row]),
            "compute_wait_ms": med([s["compute_wait_ms"] for row in computing for s in row]),
            # neither on a CPU nor runnable: blocked inside compute (a lock, the GIL, a fault's I/O)
            "compute_blocked_ms": med([s["compute_wall_ms"] - s["compute_cpu_ms"] - s["compute_wait_ms"]
                                       for row in computing for s in row]),
            "wall_per_cpu": med([s["compute_wall_ms"] / s["compute_cpu_ms"] for row in computing for s in row
                                 if s["compute_cpu_ms"] > 0]),
            "compute_preempted": med([s["compute_preempted"] for row in computing for s in row]),
            "compute_migrations": med([s["compute_migrations"] for row in computing for s in row]),
            "round_preempted": med([s["round_preempted"] for row in computing for s in row]),
            "round_migrations": med([s["round_migrations"] for row in computing for s in row]),
            "overlapped_wall_ms": med([s["overlapped_wall_ms"] for row in computing for s in row]),
            "overlapped_cpu_ms": med([s["overlapped_cpu_ms"] for row in computing for s in row]),
        }
        for g in groups:  # core-ms per round, both ranks together
            fig[f"cpu {g}"] = med([sum(s["groups"].get(g, 0.0) for s in row) for row in rows])
        fig["cpu ranks"] = med([_threads_total(row) for row in rows])
        fig["cpu not compute"] = med([_threads_total(row) - sum(s["compute_cpu_ms"] for s in row) for row in rows])
        for k in ("busy", "softirq", "steal"):
            fig[f"machine {k}"] = med([row[0]["machine"][k] for row in rows])
        fig["cores busy (ranks)"] = fig["cpu ranks"] / fig["wall_ms"] if fig["wall_ms"] else float("nan")
        fig["compute on one CPU"] = med([shared_cpu(row) for row in rows if len(row) == 2])
        for key, label in (("rank", "rank"), ("cpu", "on CPU")):  # same work: who is slower, the rank or the core?
            for value in sorted({s[key] for row in computing for s in row if s[key] >= 0}):
                fig[f"compute_wall_ms {label} {value}"] = med([s["compute_wall_ms"] for row in computing for s in row
                                                               if s[key] == value])
        out[mode] = fig
    return out


def _threads_total(row: list[dict]) -> float:
    """On-CPU ms of every thread of every rank in one round (the main thread once, not per kind)."""
    return sum(v for s in row for k, v in s["groups"].items() if not k.startswith("main ") or k == "main")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plans", nargs="+", type=Path)
    parser.add_argument("--rounds", type=int, default=12, help="rounds per mode (after the first --warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    for plan in args.plans:
        t0 = time.time()
        samples = run_probe(plan, args.rounds + args.warmup)
        table = summarise(samples, args.warmup)
        print(f"\n## {plan.stem} ({time.time() - t0:.0f} s, load average {os.getloadavg()[0]:.1f})\n")
        keys = list(dict.fromkeys(k for fig in table.values() for k in fig))
        modes = list(table)
        print("| figure (medians; cpu: core-ms per round, both ranks) | " + " | ".join(modes) + " |")
        print("| --- |" + " ---: |" * len(modes))
        for k in keys:
            cells = [table[m].get(k, float("nan")) for m in modes]
            print(f"| {k} | " + " | ".join(f"{c:.2f}" if c == c else "-" for c in cells) + " |")


if __name__ == "__main__":
    main()
