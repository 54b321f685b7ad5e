"""Minor page faults per compute instruction in a real run, against the profile's timed calls
(issue 12: the embedding plans' compute took 1.25x their profile).

    python scripts/probe_faults.py examples/validation/embedding/emb-dense-dp2.yaml --iterations 6

1. The plan's ranks run on gloo (``exec.interpreter.RankRuntime``, as ``paratwin run`` runs them),
   with every instruction wrapped to read the main thread's minor faults (getrusage per thread)
   and its duration; medians per instruction kind over the iterations after the first.
2. The profiler (``exec.profiler.profile_workload``, one process, fixed warm-up) with its timer
   wrapped the same way: faults of every timed call, per layer and quantity.
3. What a fault costs here, side by side: filling a freshly allocated buffer of the head's logits
   size against filling one kept from the last round (``--fill-mb``), alternating, medians.

Fault counts do not depend on the machine's load; the times of step 3 are ratios taken side by
side on a loaded machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from probe_ranks import gather_ranks  # scripts/ is the script's own path


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _rank(rank: int, world: int, plan_path: str, iterations: int, alternate: bool, init: str, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from exec.activations import SavedStore
    from exec.contract import compile_for_run
    from exec.interpreter import RankRuntime
    from sim.plan import Plan

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    plan = Plan.load(plan_path)
    run = compile_for_run(plan)
    runtime = RankRuntime(run, rank, torch.device("cpu"), None, dist.group.WORLD if plan.dp > 1 else None)
    samples: dict[str, list[tuple[int, float]]] = defaultdict(list)
    execute = runtime._execute
    mode = {"tag": ""}
    unpack = SavedStore.unpack

    def keeping_unpack(self: SavedStore, handle: Any) -> Any:
        if mode["tag"] == "keep ":  # the runtime before the fix: every saved tensor held to the end
            self.releasing = False
        return unpack(self, handle)

    SavedStore.unpack = keeping_unpack  # type: ignore[method-assign]

    def counted(ins: Any) -> None:
        f0, t0 = _faults(), time.perf_counter()
        execute(ins)
        samples[mode["tag"] + ins.kind.value].append((_faults() - f0, time.perf_counter() - t0))

    runtime._execute = counted  # type: ignore[method-assign]
    for iteration in range(iterations):
        if iteration == 1:
            samples.clear()  # the first iteration creates the optimizer state and the allocator's pools
        if alternate:
            mode["tag"] = "keep " if iteration % 2 else "release "
        runtime.run_iteration(iteration)
    dist.barrier()
    queue.put((rank, dict(samples)))
    runtime.watchers.shutdown(wait=False)
    dist.destroy_process_group()


def run_faults(plan_path: Path, iterations: int, alternate: bool = False) -> dict[int, dict[str, list]]:
    from sim.plan import Plan

    return gather_ranks(_rank, Plan.load(plan_path).world_size, str(plan_path), iterations, alternate)


def profile_faults(plan_path: Path) -> dict[tuple[str, str], list[int]]:
    import torch

    torch.set_num_threads(1)
    import exec.profiler as profiler
    from exec.contract import load_workload
    from sim.plan import Plan

    plan = Plan.load(plan_path)
    seen: dict[tuple[str, str], list[int]] = defaultdict(list)
    state: dict[str, Any] = {"layer": "", "keys": []}  # the timed calls of the current _round, in order
    original_round = profiler._round

    class Counting(profiler._Timer):
        def __call__(self, fn: Any) -> tuple[float, object]:
            f0 = _faults()
            out = super().__call__(fn)
            key = state["keys"].pop(0) if state["keys"] else "other (optimizer step)"
            seen[(state["layer"], key)].append(_faults() - f0)
            return out

    def rounds(probe: Any, timer: Any) -> tuple[float, ...]:
        state["layer"] = str(probe.index)
        state["keys"] = ["fwd", "bwd", "recompute", *(["bwd_input"] if probe.has_input_grad else []), "bwd_weight"]
        return original_round(probe, timer)

    profiler._Timer = Counting  # type: ignore[misc]
    profiler._round = rounds  # type: ignore[assignment]
    profiler.profile_workload(load_workload(plan), micro_batch=plan.micro_batch, warmup=2, repeats=5,
                              with_ops=False, steady=profiler.Steadiness.fixed())
    return seen


def fault_cost(megabytes: float, rounds: int) -> tuple[float, float, int]:
    """(median ms to fill a fresh buffer, median ms to fill a reused one, faults per fresh fill)."""
    import torch

    torch.set_num_threads(1)
    import mmap

    size = int(megabytes * 2**20) // 4096 * 4096
    kept = torch.empty(size // 4)
    fresh_t, kept_t, faults = [], [], []
    for _ in range(rounds):
        pages = mmap.mmap(-1, size)  # fresh anonymous pages, as a large malloc gets them
        buffer = torch.frombuffer(pages, dtype=torch.float32)
        f0, t0 = _faults(), time.perf_counter()
        buffer.fill_(1.0)
        fresh_t.append(time.perf_counter() - t0)
        faults.append(_faults() - f0)
        del buffer
        pages.close()
        t0 = time.perf_counter()
        kept.fill_(1.0)
        kept_t.append(time.perf_counter() - t0)
    return statistics.median(fresh_t) * 1e3, statistics.median(kept_t) * 1e3, int(statistics.median(faults))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--fill-mb", type=float, default=17.0)
    parser.add_argument("--skip", default="", help="comma list of steps to skip: run,profile,cost")
    parser.add_argument("--alternate", action="store_true",
                        help="odd iterations hold every saved tensor to the backward's end (as before the fix)")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    print(f"{args.plan.name}; MALLOC env: { {k: v for k, v in os.environ.items() if k.startswith('MALLOC_')} }")
    if "run" not in skip:
        got = run_faults(args.plan, args.iterations, args.alternate)
        print("\nrun: per instruction kind, medians over iterations 1.. (main thread)")
        print("| rank | kind | instructions | median faults | median ms |\n| ---: | --- | ---: | ---: | ---: |")
        for rank in sorted(got):
            for kind, rows in sorted(got[rank].items()):
                print(f"| {rank} | {kind} | {len(rows)} | {statistics.median(f for f, _ in rows):.0f} | "
                      f"{statistics.median(t for _, t in rows) * 1e3:.2f} |")
    if "profile" not in skip:
        seen = profile_faults(args.plan)
        print("\nprofile: faults per timed call, per layer and quantity (median over the rounds)")
        print("| layer | quantity | calls | median faults |\n| --- | --- | ---: | ---: |")
        for (layer, key), values in sorted(seen.items()):
            print(f"| {layer} | {key} | {len(values)} | {statistics.median(values):.0f} |")
    if "cost" not in skip:
        fresh, kept, faults = fault_cost(args.fill_mb, 30)
        print(f"\nfilling {args.fill_mb:g} MB: fresh buffer {fresh:.2f} ms ({faults} faults), reused buffer "
              f"{kept:.2f} ms: {(fresh - kept) / max(faults, 1) * 1e3:.2f} us per fault (medians of 30, side by side)")


if __name__ == "__main__":
    main()
