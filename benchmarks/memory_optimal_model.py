"""The optimal memory policy's own model against the engine, on one plan of docs/memory.md.

    python benchmarks/memory_optimal_model.py [--budget-gb 20] [--schedules]

GPT-8.3B on 64 A100-80GB (``a100-64``), dp 2 x tp 8 x pp 4, 1F1B, 16 micro-batches of 16 (the plan of
``benchmarks/memory_optimal.py``), ``memory: {policy: optimal, budget_gb: B}``: the MILP's predicted
iteration time and per-pipeline-rank peaks for the choice it makes (``sim.memory_optimal``), and the
engine's for the same plan. ``--schedules``: instead, 16 micro-batches of 8 at 24 GiB under
interleaved-1F1B (2 chunks), ZB-H1, GPipe and ZB-V (2 chunks): the engine's time and largest peak with
the optimal policy and with DELTA, the largest peak keeping everything, and the model's predicted peaks
for its choice. Simulated, analytic costs, nothing fitted here; a few seconds.
"""

from __future__ import annotations

import argparse

BASE = {"workload": "gpt-8.3b", "cluster": "a100-64", "dtype": "fp16", "parallelism": {"dp": 2, "tp": 8, "pp": 4}}


def gib(values: list[int]) -> str:
    return " / ".join(f"{v / 2**30:.2f}" for v in values)


def schedules(budget_gb: float = 24.0) -> None:
    """The other schedules of docs/memory.md's results, 16 micro-batches of 8."""
    from sim.compile import resolve_plan
    from sim.memory_optimal import layer_choice_model
    from sim.plan import Plan
    from sim.simulate import simulate

    print(f"GPT-8.3B dp2 tp8 pp4, 16 micro-batches of 8, budget {budget_gb:g} GiB")
    for name, chunks in (("interleaved-1f1b", 2), ("zb-h1", 1), ("gpipe", 1), ("zb-v", 2)):
        def plan(memory: dict, name: str = name, chunks: int = chunks) -> Plan:
            return Plan.from_dict({**BASE, "name": f"gpt-8.3b-{name}", "memory": memory,
                                   "parallelism": {**BASE["parallelism"], "chunks": chunks},
                                   "schedule": {"name": name, "micro_batch": 8, "microbatches": 16}})

        line = []
        for policy in ("optimal", "delta"):
            result = simulate(plan({"policy": policy, "budget_gb": budget_gb}))
            line.append(f"{policy} {result.iteration_s:.3f} s (peak {result.peak_memory_bytes / 2**30:.2f} GiB)")
        keep = simulate(plan({"policy": "none"})).peak_memory_bytes
        optimal = plan({"policy": "optimal", "budget_gb": budget_gb})
        resolved = resolve_plan(optimal)
        model = layer_choice_model(optimal, resolved.stage_layers, resolved.costs, int(budget_gb * 2**30))
        choice = model.solve()
        predicted = gib(list(model.peaks(choice))) if choice is not None else "no choice fits"
        print(f"{name} x{chunks}: {', '.join(line)}; keeping everything {keep / 2**30:.2f} GiB; "
              f"model's peaks per pipeline rank {predicted} GiB")


def main() -> None:
    from sim.compile import resolve_plan
    from sim.memory_optimal import layer_choice_model
    from sim.plan import Plan
    from sim.simulate import simulate

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-gb", type=float, default=None,
                        help="the policy's budget, GiB per GPU (default 20; 24 with --schedules)")
    parser.add_argument("--schedules", action="store_true", help="the other schedules' figures instead")
    args = parser.parse_args()
    if args.schedules:
        schedules(args.budget_gb or 24.0)
        return
    args.budget_gb = args.budget_gb or 20.0
    plan = Plan.from_dict({
        **BASE, "name": "gpt-8.3b-a100-64-optimal",
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

    print(f"GPT-8.3B dp2 tp8 pp4 1F1B 16 x 16, optimal at {args.budget_gb:g} GiB")
    print(f"model:  {model.time(choice):.3f} s, peaks per pipeline rank {gib(list(model.peaks(choice)))} GiB")
    print(f"engine: {result.iteration_s:.3f} s, peaks per pipeline rank {gib(peaks)} GiB")


if __name__ == "__main__":
    main()
