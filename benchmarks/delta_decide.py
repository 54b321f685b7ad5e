"""DELTA deciding at lowering against deciding at run time, simulated at paper scale.

    python benchmarks/delta_decide.py [--budgets 30 24 20]

GPT-8.3B on 64 A100-80GB (``a100-64``; the catalog's sources in ``sim/data/hardware.yaml``), dp 2 x
tp 8 x pp 4, 1F1B, 16 micro-batches of 16, the project's analytic cost model (nothing fitted here):
``memory: {policy: delta, budget_gb: B, decide: lowering | runtime}``. Prints per budget the
iteration time, the fullest rank's peak and the blocks re-run on the four pipeline ranks (the
symmetric representatives), as docs/memory.md's DELTA table shows them. About 4 s.
"""

from __future__ import annotations

import argparse

from sim.compile import compile_plan
from sim.plan import Plan
from sim.simulate import simulate


def plan_at(budget_gb: float, decide: str) -> Plan:
    return Plan.from_dict({"name": f"gpt-8.3b-delta-{decide}", "workload": "gpt-8.3b", "cluster": "a100-64",
                           "dtype": "fp16", "parallelism": {"dp": 2, "tp": 8, "pp": 4},
                           "schedule": {"name": "1f1b", "micro_batch": 16, "microbatches": 16},
                           "memory": {"policy": "delta", "budget_gb": budget_gb, "decide": decide}})


def rerun_blocks(plan: Plan, table) -> int:  # noqa: ANN001 - the simulated instruction table
    if plan.memory.decide == "lowering":  # RECOMPUTE instructions, each naming its layers
        program = compile_plan(plan).program
        return sum(len(i.layers) for rp in program.ranks.values() for i in rp.instructions
                   if i.kind.value == "RECOMPUTE")
    return int(((table["kind"] == "RECOMPUTE") & (table["parent"] >= 0)).sum())  # one child row per layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", type=float, nargs="*", default=[30.0, 24.0, 20.0])
    args = parser.parse_args()
    print("| budget | iteration (s) | fullest rank's peak (GiB) | re-run blocks (4 pipeline ranks) |")
    print("|---|---|---|---|")
    for budget in args.budgets:
        cells = []
        for decide in ("lowering", "runtime"):
            plan = plan_at(budget, decide)
            result = simulate(plan)
            peak = max(m.peak_bytes for m in result.memory.values()) / 2**30
            cells.append((result.iteration_s, peak, rerun_blocks(plan, result.table)))
        (t0, p0, r0), (t1, p1, r1) = cells
        print(f"| {budget:g} GiB | {t0:.3f} / {t1:.3f} | {p0:.2f} / {p1:.2f} | {r0} / {r1} |")


if __name__ == "__main__":
    main()
