"""How much of each layer's profiling the co-located processes spend together (issue 12).

    python scripts/probe_profile_overlap.py examples/validation/embedding/emb-dense-dp2.yaml [--lockstep]

Profiles the plan's workload in two processes as the validation does (one torch thread each,
``exec.profiler.profile_workload`` with the suite's 5 repeats), stamping every round of every
layer (``exec.profiler._round``) with the wall clock. Per process and layer it prints how many
rounds ran and for what share of their time the other process was inside a round of the same
layer (the run's condition: both ranks compute the same instruction at once). Without
``--lockstep`` the processes only start together (the profile before issue 12's fix); with it they
move in lockstep (``exec.lockstep``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from pathlib import Path
from typing import Any


def _worker(index: int, barrier: Any, votes: Any, plan_path: str, lockstep: bool, queue: Any) -> None:
    import torch

    torch.set_num_threads(1)
    import exec.profiler as profiler
    from exec.contract import load_workload
    from exec.lockstep import Alone, Lockstep
    from sim.plan import Plan

    plan = Plan.load(plan_path)
    log: list[tuple[int, float, float]] = []
    original = profiler._round

    def stamped(probe: Any, timer: Any) -> tuple[float, ...]:
        t0 = time.time()
        out = original(probe, timer)
        log.append((probe.index, t0, time.time()))
        return out

    profiler._round = stamped  # type: ignore[assignment]
    wl = load_workload(plan)
    barrier.wait()
    started = time.time()
    profiler.profile_workload(wl, micro_batch=plan.micro_batch, device="cpu", warmup=2, repeats=5, with_ops=False,
                              together=Lockstep(barrier, votes, index) if lockstep else Alone())
    queue.put((index, started, time.time(), log))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--lockstep", action="store_true")
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    barrier, votes, queue = ctx.Barrier(2), ctx.Array("i", 2), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(i, barrier, votes, str(args.plan), args.lockstep, queue))
               for i in range(2)]
    for w in workers:
        w.start()
    got = {i: rest for i, *rest in (queue.get() for _ in workers)}
    for w in workers:
        w.join()
    print(f"{args.plan.name}, {'lockstep' if args.lockstep else 'started together only'}")
    print("| process | layer | rounds | seconds | other process in the same layer's rounds |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for i in (0, 1):
        _, _, log = got[i]
        _, _, other = got[1 - i]
        for layer in sorted({entry[0] for entry in log}):
            mine = [(a, b) for j, a, b in log if j == layer]
            theirs = [(a, b) for j, a, b in other if j == layer]
            total = sum(b - a for a, b in mine)
            shared = sum(max(0.0, min(b, d) - max(a, c)) for a, b in mine for c, d in theirs)
            print(f"| {i} | {layer} | {len(mine)} | {total:.2f} | {shared / total:.0%} |")


if __name__ == "__main__":
    main()
