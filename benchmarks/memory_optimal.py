"""The optimal per-layer memory policy against Merak's stage-aware rule, simulated at paper scale.

    python benchmarks/memory_optimal.py [--out docs/figures/memory_optimal] [--quick]

For GPT-8.3B and GPT-20B on 64 A100-80GB (``a100-64``: 8 DGX nodes, NVLink3, HDR InfiniBand,
PCIe Gen4 host links; the catalog's sources in ``sim/data/hardware.yaml``), dp 2 x tp 8 x pp 4,
1F1B, and a memory budget per GPU from 80 GB down, every policy is simulated by the engine
(symmetric mode, the project's analytic cost model, nothing fitted here):

- ``none``: keep everything; ``full``: recompute every layer;
- ``stage-aware``: Merak's rule at the best ratio r0 in 0, 0.05, ..., 1 whose simulated peak fits
  the budget (the rule tuned for the budget, its most favourable use);
- ``optimal``: this project's MILP (keep / recompute / swap per layer); ``optimal-recompute``: the
  same with swapping off (only per-layer recomputation, so the two effects separate);
- ``delta``: DELTA's greedy rule per micro-batch under the same budget (``sim.delta``), and its
  filter with the director forced to ``swap`` (``delta-swap``: swap everything it releases).

A policy counts at a budget when the engine's peak on every rank is within it. Writes
``<out>.csv`` (every policy and budget: iteration time, peak, fits), ``<out>.png/.pdf``
(iteration time against budget) and ``<out>_tradeoff.png/.pdf`` (memory saved against time
overhead), and prints where and by how much the optimum beats the rule.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import pandas as pd

from sim.plan import Plan
from sim.simulate import simulate
from traces.errors import ConfigError

# (workload, micro-batch size, micro-batches): global batch 512 (8.3B, seq 1024) and 128 (20B,
# seq 2048) over dp 2; chosen so that keeping everything needs more than the smaller budgets.
MODELS = [("gpt-8.3b", 16, 16), ("gpt-20b", 4, 16)]
BUDGETS_GB = [80, 48, 40, 36, 32, 28, 26, 24, 22, 20, 19, 18]
RATIOS = [i / 20 for i in range(21)]


def base_plan(workload: str, micro_batch: int, microbatches: int) -> dict[str, Any]:
    return {"name": f"{workload}-a100-64", "workload": workload, "cluster": "a100-64", "dtype": "fp16",
            "parallelism": {"dp": 2, "tp": 8, "pp": 4},
            "schedule": {"name": "1f1b", "micro_batch": micro_batch, "microbatches": microbatches}}


def run(memory: dict[str, Any], base: dict[str, Any]) -> tuple[float, float] | None:
    """(iteration s, largest peak GiB) from the engine, or None when the policy refuses the budget."""
    try:
        result = simulate(Plan.from_dict({**base, "memory": memory}))
    except ConfigError:
        return None
    return result.iteration_s, max(m.peak_bytes for m in result.memory.values()) / 2**30


def rows_for(workload: str, micro_batch: int, microbatches: int, budgets: list[float]) -> list[dict[str, Any]]:
    base = base_plan(workload, micro_batch, microbatches)
    fixed = {"none": run({"policy": "none"}, base), "full": run({"policy": "full"}, base)}
    rule = {r: run({"policy": "stage-aware", "ratio": r}, base) for r in RATIOS}
    rows = []
    for budget in budgets:
        def row(policy: str, outcome: tuple[float, float] | None, setting: str = "", solve_s: float = 0.0,
                budget: float = budget) -> dict[str, Any]:
            fits = outcome is not None and outcome[1] <= budget
            return {"workload": workload, "budget_gb": budget, "policy": policy, "setting": setting,
                    "iteration_s": outcome[0] if outcome else float("nan"),
                    "peak_gib": outcome[1] if outcome else float("nan"), "fits": fits, "solve_s": solve_s}

        rows += [row(name, outcome) for name, outcome in fixed.items()]
        fitting = [(outcome[0], r, outcome) for r, outcome in rule.items() if outcome and outcome[1] <= budget]
        best = min(fitting, default=None)
        rows.append(row("stage-aware", best[2] if best else None, f"r0={best[1]:.2f}" if best else "none fits"))
        for name, memory in (("optimal", {"policy": "optimal"}),
                             ("optimal-recompute", {"policy": "optimal", "allow_swap": False}),
                             ("delta", {"policy": "delta"}), ("delta-swap", {"policy": "delta", "director": "swap"})):
            started = time.perf_counter()
            outcome = run({**memory, "budget_gb": budget}, base)
            rows.append(row(name, outcome, solve_s=time.perf_counter() - started))
    return rows


def draw(table: pd.DataFrame, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(table["workload"]))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        part = table[(table["workload"] == workload) & table["fits"]]
        for policy, marker in (("none", "s"), ("full", "x"), ("stage-aware", "o"), ("optimal-recompute", "^"),
                               ("optimal", "D"), ("delta", "v"), ("delta-swap", "<")):
            rows = part[part["policy"] == policy].sort_values("budget_gb")
            ax.plot(rows["budget_gb"], rows["iteration_s"], marker=marker, label=policy)
        ax.set_xlabel("memory budget per GPU (GiB)")
        ax.set_ylabel("simulated iteration time (s)")
        ax.set_title(f"{workload}, 64 x A100-80GB, dp2 tp8 pp4, 1F1B")
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.text(0.01, 0.01, "simulated (paratwin engine, analytic costs, PCIe Gen4 host link); a point is drawn "
             "only where the simulated peak fits the budget; stage-aware = best r0 that fits", fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out.with_suffix(".png"), dpi=150)
    fig.savefig(out.with_suffix(".pdf"))


def draw_tradeoff(table: pd.DataFrame, out: Path) -> None:
    """Memory saved (1 - peak / peak of keeping everything) against time overhead (iteration /
    iteration of keeping everything - 1), one point per policy and budget that fits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(table["workload"]))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        part = table[table["workload"] == workload]
        keep = part[part["policy"] == "none"].iloc[0]
        for policy, marker in (("stage-aware", "o"), ("optimal-recompute", "^"), ("optimal", "D"), ("delta", "v"),
                               ("full", "x")):
            rows = part[(part["policy"] == policy) & part["fits"]].drop_duplicates("peak_gib")
            ax.plot(100 * (1 - rows["peak_gib"] / keep["peak_gib"]),
                    100 * (rows["iteration_s"] / keep["iteration_s"] - 1), marker=marker, linestyle="", label=policy)
        ax.set_xlabel("memory saved vs keeping everything (% of the largest rank's peak)")
        ax.set_ylabel("time overhead (%)")
        ax.set_title(f"{workload}, 64 x A100-80GB, dp2 tp8 pp4")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.text(0.01, 0.01, "simulated; one point per budget that the policy fits; DELTA's paper reports 40-70% "
             "saved on one GPU (arXiv 2203.15980), not this setting", fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    tradeoff = out.with_name(out.name + "_tradeoff")
    fig.savefig(tradeoff.with_suffix(".png"), dpi=150)
    fig.savefig(tradeoff.with_suffix(".pdf"))


def summary(table: pd.DataFrame) -> list[str]:
    lines = []
    for (workload, budget), part in table.groupby(["workload", "budget_gb"], sort=False):
        by = {r["policy"]: r for _, r in part.iterrows()}
        rule, optimal = by["stage-aware"], by["optimal"]
        if pd.isna(optimal["iteration_s"]):
            lines.append(f"{workload} {budget:>5.0f} GB: the optimal policy refuses (no choice fits its model); "
                         f"stage-aware {'fits' if rule['fits'] else 'does not fit either'}")
            continue
        if not optimal["fits"]:
            lines.append(f"{workload} {budget:>5.0f} GB: optimal's simulated peak {optimal['peak_gib']:.2f} GiB "
                         "exceeds the budget")
            continue
        if not rule["fits"]:
            lines.append(f"{workload} {budget:>5.0f} GB: only the optimum fits ({optimal['iteration_s']:.3f} s)")
            continue
        gain = rule["iteration_s"] / optimal["iteration_s"] - 1
        def shown(policy: str, by: dict = by) -> str:
            r = by[policy]
            return f"{r['iteration_s']:.3f} s" if r["fits"] else "does not fit"

        lines.append(f"{workload} {budget:>5.0f} GB: stage-aware {rule['setting']} {rule['iteration_s']:.3f} s, "
                     f"optimal {optimal['iteration_s']:.3f} s ({gain:+.1%} faster), recompute-only "
                     f"{shown('optimal-recompute')}, delta {shown('delta')}, delta-swap {shown('delta-swap')}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/figures/memory_optimal"))
    parser.add_argument("--quick", action="store_true", help="GPT-8.3B at three budgets only")
    args = parser.parse_args()
    models = MODELS[:1] if args.quick else MODELS
    budgets = [40, 24, 16] if args.quick else BUDGETS_GB
    rows = [row for model in models for row in rows_for(*model, budgets)]
    table = pd.DataFrame(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out.with_suffix(".csv"), index=False)
    draw(table, args.out)
    draw_tradeoff(table, args.out)
    print("\n".join(summary(table)))


if __name__ == "__main__":
    main()
