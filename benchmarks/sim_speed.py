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

from sim.compile import resolve_plan
from sim.plan import Plan
from sim.simulate import simulate


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-full-above", type=int, default=1024, help="largest GPU count to run --full on")
    args = parser.parse_args()
    print(f"{'GPUs':>6} {'mode':>9} {'median s':>9} {'min-max s':>15} {'rows':>9} {'rows/s':>10} {'iteration s':>12}")
    for gpus in (128, 1024, 4096):
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
