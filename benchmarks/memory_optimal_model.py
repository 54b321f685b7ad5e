"""The optimal memory policy's own model against the engine, on one plan of docs/memory.md.

    python benchmarks/memory_optimal_model.py [--budget-gb 20]

GPT-8.3B on 64 A100-80GB (``a100-64``), dp 2 x tp 8 x pp 4, 1F1B, 16 micro-batches of 16 (the plan of
``benchmarks/memory_optimal.py``), ``memory: {policy: optimal, budget_gb: B}``: the MILP's predicted
iteration time and per-pipeline-rank peaks for the choice it makes (``sim.memory_optimal``), and the
engine's for the same plan. Simulated, analytic costs, nothing fitted here; about 3 s.
"""

from __future__ import annotations

import argparse


def main() -> None:
    from sim.compile import resolve_plan
    from sim.memory_optimal import layer_choice_model
    from sim.plan import Plan
    from sim.simulate import simulate

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-gb", type=float, default=20.0, help="the policy's budget, GiB per GPU")
    args = parser.parse_args()
    plan = Plan.from_dict({
        "name": "gpt-8.3b-a100-64-optimal", "workload": "gpt-8.3b", "cluster": "a100-64", "dtype": "fp16",
        "parallelism": {"dp": 2, "tp": 8, "pp": 4},
        "schedule": {"name": "1f1b", "micro_batch": 16, "microbatches": 16},
        "memory": {"policy": "optimal", "budget_gb": args.budget_gb}})
    resolved = resolve_plan(plan)
    model = layer_choice_model(plan, resolved.stage_layers, resolved.costs, int(args.budget_gb * 2**30))
    choice = model.solve()
    if choice is None:
        raise SystemExit(f"no choice fits {args.budget_gb:g} GiB in the policy's model")
    result = simulate(plan)
    per_rank = plan.tp * plan.dp
    peaks = [0] * plan.pp
    for rank, memory in result.memory.items():
        peaks[rank // per_rank] = max(peaks[rank // per_rank], memory.peak_bytes)

    def gib(values: list[int]) -> str:
        return " / ".join(f"{v / 2**30:.2f}" for v in values)

    print(f"GPT-8.3B dp2 tp8 pp4 1F1B 16 x 16, optimal at {args.budget_gb:g} GiB")
    print(f"model:  {model.time(choice):.3f} s, peaks per pipeline rank {gib(list(model.peaks(choice)))} GiB")
    print(f"engine: {result.iteration_s:.3f} s, peaks per pipeline rank {gib(peaks)} GiB")


if __name__ == "__main__":
    main()
