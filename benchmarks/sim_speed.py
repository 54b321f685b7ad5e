"""Simulator speed: wall time per simulated iteration of GPT-175B at 128, 1,024 and 4,096 GPUs.

    python benchmarks/sim_speed.py [--repeats 3] [--skip-full-above 1024]

Plan: GPT-175B (96 layers, hidden 12,288), tp 8, 1F1B, 64 micro-batches; pp 16; dp grows with the
GPU count (1, 8, 32). Symmetric mode simulates one rank per pipeline stage; --full simulates all.
Goals on the 2-core development machine: <= 1 s symmetric and <= 60 s full at 1,024 GPUs.
Prints medians over repeats with the spread (min-max), and instruction rows per second.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import sim.compile
from sim.compile import estimate_instructions, resolve_plan
from sim.plan import Plan
from sim.simulate import simulate

GPU_COUNTS = (128, 1024, 4096)


def plan_for(gpus: int) -> Plan:
    tp, pp = 8, 16
    nodes = gpus // 8
    cluster = {"preset": "h100-1024", "nodes": nodes}
    return Plan(name=f"gpt-175b-{gpus}", workload="gpt-175b", cluster=cluster, dtype="bf16",
                parallelism={"tp": tp, "pp": pp, "dp": gpus // (tp * pp)},
                schedule={"name": "1f1b", "micro_batch": 1, "microbatches": 64}, memory={"policy": "full"})


def measure(plan: Plan, full: bool, repeats: int) -> tuple[list[float], float, int]:
    setup = resolve_plan(plan)
    walls, iteration, rows = [], 0.0, 0
    for _ in range(repeats):
        started = time.perf_counter()
        result = simulate(plan, full=full, resolved=setup)
        walls.append(time.perf_counter() - started)
        iteration, rows = result.iteration_s, result.events
    return walls, iteration, rows


@contextmanager
def instruction_limit_at_least(count: int) -> Iterator[None]:
    """Lift the simulator's size guard (``sim.compile.MAX_INSTRUCTIONS``) to ``count`` while the
    benchmark runs, and restore it. The guard is an upper estimate meant to stop a user's accidental
    giant plan; this benchmark simulates GPT-175B on 1,024 GPUs in full mode on purpose (about 6.6e5
    instructions by the estimate, over the 5e5 limit, though the plan lowers fewer rows)."""
    before = sim.compile.MAX_INSTRUCTIONS
    sim.compile.MAX_INSTRUCTIONS = max(before, count)
    try:
        yield
    finally:
        sim.compile.MAX_INSTRUCTIONS = before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-full-above", type=int, default=1024, help="largest GPU count to run --full on")
    args = parser.parse_args()
    print(f"{'GPUs':>6} {'mode':>9} {'median s':>9} {'min-max s':>15} {'rows':>9} {'rows/s':>10} {'iteration s':>12}")
    largest_full = max([g for g in GPU_COUNTS if g <= args.skip_full_above], default=GPU_COUNTS[0])
    with instruction_limit_at_least(estimate_instructions(plan_for(largest_full), full=True)):
        run(args)


def run(args: argparse.Namespace) -> None:
    for gpus in GPU_COUNTS:
        plan = plan_for(gpus)
        for full in (False, True):
            if full and gpus > args.skip_full_above:
                continue
            repeats = args.repeats if not full else max(1, args.repeats // 3)
            walls, iteration, rows = measure(plan, full, repeats)
            median = statistics.median(walls)
            print(f"{gpus:>6} {'full' if full else 'symmetric':>9} {median:>9.3f} "
                  f"{min(walls):>7.3f}-{max(walls):<7.3f} {rows:>9} {rows / median:>10.0f} {iteration:>12.3f}")


if __name__ == "__main__":
    main()
