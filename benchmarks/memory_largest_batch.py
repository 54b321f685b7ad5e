"""The largest batch that fits a memory budget, and its throughput, per memory policy (simulated).

    python benchmarks/memory_largest_batch.py [--out docs/figures/memory_largest_batch]

GPT-8.3B on 64 A100-80GB (``a100-64``), dp 2 x tp 8 x pp 4, 1F1B, 16 micro-batches per replica;
for budgets of 16, 32 and 80 GiB per GPU and micro-batch sizes 1 .. 64, the engine simulates
every policy (analytic costs, nothing fitted here). A policy's largest batch is the largest
micro-batch size whose simulated peak fits the budget on every rank; its throughput is samples
per second at that size. Policies: ``none``; ``full`` (recompute everything); ``stage-aware``
(Merak's rule at the best ratio that fits); ``delta`` (DELTA's rule under the budget) and
``delta-swap`` (its filter, always swapping: "swap everything"); ``optimal`` (the per-layer MILP);
``selective`` (PyTorch's selective checkpointing: keep matmul and attention outputs).

Beside it, DELTA's headline (Tang et al., arXiv 2203.15980, abstract): 40-70% GPU
memory saved, maximum batch 2.04x (ResNet-50) and 2.25x (ResNet-101) over no policy, on one GPU.
This setting differs (a GPT in a pipeline, not a CNN on one GPU) and ResNets are not simulated
here (the simulator has no closed-form ResNet cost model; a CPU profile would say nothing about an
A100), so the comparison is of kind, not of numbers. Writes ``<out>.csv`` and ``<out>.png/.pdf``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pandas as pd

from sim.plan import Plan
from sim.simulate import simulate
from traces.errors import ConfigError

BUDGETS_GIB = [16, 32, 80]
MICRO_BATCHES = [1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64]
RATIOS = [i / 10 for i in range(11)]
POLICIES: dict[str, list[dict[str, Any]]] = {
    "none": [{"policy": "none"}],
    "full": [{"policy": "full"}],
    "stage-aware": [{"policy": "stage-aware", "ratio": r} for r in RATIOS],
    "delta": [{"policy": "delta"}],
    "delta-swap": [{"policy": "delta", "director": "swap"}],
    "optimal": [{"policy": "optimal"}],
    "selective": [{"policy": "selective"}],
}


def plan(micro_batch: int, memory: dict[str, Any]) -> Plan:
    return Plan.from_dict({"name": "gpt-8.3b-batch", "workload": "gpt-8.3b", "cluster": "a100-64", "dtype": "fp16",
                           "parallelism": {"dp": 2, "tp": 8, "pp": 4},
                           "schedule": {"name": "1f1b", "micro_batch": micro_batch, "microbatches": 16},
                           "memory": memory})


def best_fit(micro_batch: int, variants: list[dict[str, Any]], budget: float) -> tuple[float, float] | None:
    """(iteration s, peak GiB) of the fastest variant that fits ``budget`` GiB, or None."""
    best = None
    for memory in variants:
        if memory["policy"] in ("delta", "optimal"):
            memory = {**memory, "budget_gb": budget}
        try:
            result = simulate(plan(micro_batch, memory))
        except ConfigError:
            continue
        peak = max(m.peak_bytes for m in result.memory.values()) / 2**30
        if peak <= budget and (best is None or result.iteration_s < best[0]):
            best = (result.iteration_s, peak)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/figures/memory_largest_batch"))
    args = parser.parse_args()
    rows = []
    for budget in BUDGETS_GIB:
        for name, variants in POLICIES.items():
            largest = None
            for micro_batch in MICRO_BATCHES:
                fit = best_fit(micro_batch, variants, budget)
                if fit is None:
                    break  # memory grows with the micro-batch: larger ones do not fit either
                largest = (micro_batch, *fit)
            row = {"budget_gib": budget, "policy": name, "largest_micro_batch": largest[0] if largest else 0,
                   "global_batch": largest[0] * 16 * 2 if largest else 0,
                   "iteration_s": largest[1] if largest else float("nan"),
                   "peak_gib": largest[2] if largest else float("nan")}
            row["samples_per_s"] = row["global_batch"] / row["iteration_s"] if largest else 0.0
            rows.append(row)
            print(row, flush=True)
    table = pd.DataFrame(rows)
    none = table[table["policy"] == "none"].set_index("budget_gib")["largest_micro_batch"]
    table["batch_vs_none"] = [r.largest_micro_batch / none[r.budget_gib] if none[r.budget_gib] else float("nan")
                              for r in table.itertuples()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out.with_suffix(".csv"), index=False)
    draw(table, args.out)
    print(table.to_string(index=False))


def draw(table: pd.DataFrame, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(POLICIES)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        part = table[table["policy"] == policy]
        xs = [BUDGETS_GIB.index(b) + (i - len(policies) / 2 + 0.5) * width for b in part["budget_gib"]]
        axes[0].bar(xs, part["global_batch"], width, label=policy)
        axes[1].bar(xs, part["samples_per_s"], width, label=policy)
    for ax, label in zip(axes, ("largest global batch that fits", "samples/s at that batch"), strict=True):
        ax.set_xticks(range(len(BUDGETS_GIB)), [f"{b} GiB" for b in BUDGETS_GIB])
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("GPT-8.3B, 64 x A100-80GB (dp2 tp8 pp4, 1F1B, 16 micro-batches), memory budget per GPU")
    fig.text(0.01, 0.01, "simulated (paratwin engine, analytic costs, PCIe Gen4 host link); micro-batch sizes "
             f"{MICRO_BATCHES}", fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    fig.savefig(out.with_suffix(".png"), dpi=150)
    fig.savefig(out.with_suffix(".pdf"))


if __name__ == "__main__":
    main()
