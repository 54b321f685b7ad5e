"""The largest batch that fits a memory budget, per memory policy, for ResNet-50 and ResNet-101
(simulated). DELTA's headline (Tang et al., arXiv 2203.15980, abstract): maximum
batch 2.04x (ResNet-50) and 2.25x (ResNet-101) over no policy, 40-70% memory saved, on one GPU.

    python benchmarks/memory_largest_batch_resnet.py [--out docs/figures/memory_largest_batch_resnet]

Layers: paratwin's bottleneck ResNets (``exec.workloads.resnet``, torchvision's v1.5 architecture,
224 x 224 images), measured once with real fp32 tensors on this machine's CPU for their saved,
selectively-kept and boundary-shared activation bytes, parameters and forward FLOPs
(``exec.structure.measured_layer_specs``: bytes do not depend on the device). Times: the analytic
model's roofline on the catalog's A100-80GB and V100-32GB (``sim.analytic``: FLOPs at the
calibrated A100 efficiency curve or 0.8 of peak, bytes at 0.9 of memory bandwidth; a 2-pass
backward), fp16 with Adam (16 bytes of state per parameter). Nothing here is fitted to DELTA's
numbers.

Setting. In paratwin a RECOMPUTE re-runs a stage's checkpointed layers right before that stage's
backward, and a swap moves a whole forward's tensors after it: with one GPU and one micro-batch in
flight neither lowers the peak (it is reached during the backward with every layer back), so the
DELTA paper's single-GPU setting cannot be reproduced at this granularity (only selective
checkpointing, which keeps fewer bytes per layer for good, lowers it). The ResNets therefore run as
a 4-stage pipeline (pp 4, 1F1B, 8 micro-batches; 4 GPUs of one kind, NVLink), where policies act on
the micro-batches waiting for their backward. The largest micro-batch that fits a budget is found
by doubling then bisection (memory grows with it); budgets 16, 32 and 80 GiB per GPU (A100-80GB
for all three, V100-32GB for 16 and 32). Writes ``<out>.csv`` and ``<out>.png/.pdf``.
"""

from __future__ import annotations

import argparse
from functools import cache
from pathlib import Path
from typing import Any

import pandas as pd

from sim.costs import CostModel
from sim.plan import Plan
from sim.simulate import simulate
from traces.errors import ConfigError

MODELS = ["resnet50", "resnet101"]
SETTINGS = [("A100-80GB", "nvlink3", 16), ("A100-80GB", "nvlink3", 32), ("A100-80GB", "nvlink3", 80),
            ("V100-32GB", "nvlink2", 16), ("V100-32GB", "nvlink2", 32)]
PP, MICROBATCHES = 4, 8
POLICIES: dict[str, dict[str, Any]] = {
    "none": {"policy": "none"},
    "full": {"policy": "full"},
    "swap-all": {"policy": "none", "swap": [1.0] * PP},
    "delta": {"policy": "delta"},
    "optimal": {"policy": "optimal"},
    "selective": {"policy": "selective"},
}
MAX_MICRO_BATCH = 4096


@cache
def costs(model: str, device: str) -> CostModel:
    from sim.analytic_costs import AnalyticCosts
    from sim.cluster import load_cluster

    return AnalyticCosts(specs(model), load_cluster(cluster(device, "nvlink3")).device, "fp16")


@cache
def specs(model: str) -> tuple:
    from exec.structure import measured_layer_specs
    from exec.workloads import get_workload

    return tuple(measured_layer_specs(get_workload(model)))


def cluster(device: str, link: str) -> dict[str, Any]:
    return {"name": f"{device.lower()}-{PP}", "nodes": 1, "devices_per_node": PP, "device": device,
            "intra_node_link": link}


def fits(model: str, device: str, link: str, budget: float, name: str, micro_batch: int) -> tuple[float, float] | None:
    """(iteration s, peak GiB of the fullest GPU) when ``name`` fits ``budget`` GiB at ``micro_batch``."""
    memory = dict(POLICIES[name])
    if memory["policy"] in ("delta", "optimal"):
        memory["budget_gb"] = budget
    plan = Plan.from_dict({"name": f"{model}-{name}", "workload": model, "cluster": cluster(device, link),
                           "dtype": "fp16", "parallelism": {"pp": PP},
                           "schedule": {"name": "1f1b", "micro_batch": micro_batch, "microbatches": MICROBATCHES},
                           "memory": memory})
    try:
        result = simulate(plan, costs=costs(model, device))
    except ConfigError:
        return None  # e.g. an optimiser that finds no choice fitting the budget
    peak = max(m.peak_bytes for m in result.memory.values()) / 2**30
    return (result.iteration_s, peak) if peak <= budget else None


# Fitting need not be monotone in the micro-batch (a planner's choice changes with it, a layer's
# bytes round): past the bisection's answer this many sizes are tried too, and the search goes on
# from any that fits (none did in the run recorded in docs/memory.md).
PAST_FAILURE = 4


def largest(model: str, device: str, link: str, budget: float, name: str) -> tuple[int, float, float] | None:
    """Doubling, then bisection; then the next ``PAST_FAILURE`` sizes, going on from any that fits."""
    low, found, step = 0, None, 1
    while True:
        while low + step <= MAX_MICRO_BATCH and (fit := fits(model, device, link, budget, name, low + step)):
            low, found, step = low + step, fit, step * 2  # doubling from low
        high = min(low + step, MAX_MICRO_BATCH + 1)
        while high - low > 1:
            mid = (low + high) // 2
            fit = fits(model, device, link, budget, name, mid)
            if fit is None:
                high = mid
            else:
                low, found = mid, fit
        later = next(((size, fit) for size in range(low + 2, min(low + 1 + PAST_FAILURE, MAX_MICRO_BATCH) + 1)
                      if (fit := fits(model, device, link, budget, name, size)) is not None), None)
        if later is None:
            return (low, *found) if found else None
        print(f"{model} {device} {budget} GiB {name}: {low + 1} does not fit, {later[0]} does", flush=True)
        (low, found), step = later, 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/figures/memory_largest_batch_resnet"))
    args = parser.parse_args()
    rows = []
    for model in MODELS:
        for device, link, budget in SETTINGS:
            for name in POLICIES:
                best = largest(model, device, link, budget, name)
                row = {"model": model, "device": device, "budget_gib": budget, "policy": name,
                       "largest_micro_batch": best[0] if best else 0,
                       "iteration_s": best[1] if best else float("nan"), "peak_gib": best[2] if best else float("nan")}
                row["samples_per_s"] = row["largest_micro_batch"] * MICROBATCHES / row["iteration_s"] if best else 0.0
                rows.append(row)
                print(row, flush=True)
    table = pd.DataFrame(rows)
    key = ["model", "device", "budget_gib"]
    none = table[table["policy"] == "none"].set_index(key)["largest_micro_batch"]
    table["batch_vs_none"] = [r.largest_micro_batch / none[(r.model, r.device, r.budget_gib)]
                              if none[(r.model, r.device, r.budget_gib)] else float("nan") for r in table.itertuples()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.with_suffix(".csv").open("w") as f:
        f.write("# simulated (paratwin engine); ResNet layer bytes measured on CPU (fp32 tensors, "
                "exec.structure.measured_layer_specs), times by the analytic roofline (sim.analytic) on the "
                "hardware catalog's A100-80GB / V100-32GB, fp16 + Adam; pp 4, 1F1B, 8 micro-batches of "
                "largest_micro_batch; DELTA's paper: 2.04x (ResNet-50), 2.25x (ResNet-101) on one GPU\n")
        table.to_csv(f, index=False)
    draw(table, args.out)
    print(table.to_string(index=False))


def draw(table: pd.DataFrame, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(POLICIES)
    settings = [f"{d.split('-')[0]} {b} GiB" for d, _, b in SETTINGS]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7))
    width = 0.8 / len(policies)
    for row, model in enumerate(MODELS):
        part = table[table["model"] == model]
        for i, policy in enumerate(policies):
            p = part[part["policy"] == policy]
            xs = [k + (i - len(policies) / 2 + 0.5) * width for k in range(len(p))]
            axes[row][0].bar(xs, p["batch_vs_none"], width, label=policy)
            axes[row][1].bar(xs, p["samples_per_s"], width, label=policy)
        for ax, label in zip(axes[row], ("largest batch / no policy's", "samples/s at that batch"), strict=True):
            ax.set_xticks(range(len(settings)), settings, fontsize=8)
            ax.set_ylabel(label)
            ax.set_title(model, fontsize=9)
            ax.grid(axis="y", alpha=0.3)
        axes[row][0].axhline({"resnet50": 2.04, "resnet101": 2.25}[model], color="k", ls="--", lw=0.8)
    axes[0][0].legend(fontsize=7, ncol=3)
    fig.suptitle("ResNet-50/101, 4-stage pipeline (1F1B, 8 micro-batches), fp16, memory budget per GPU "
                 "(dashed: DELTA's reported 2.04x / 2.25x on one GPU)", fontsize=10)
    fig.text(0.01, 0.01, "simulated: layer bytes measured on CPU (fp32 tensors), times by the analytic roofline "
             "(datasheet peaks and bandwidths, sim/data/hardware.yaml); not measured on a GPU", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(out.with_suffix(".png"), dpi=150)
    fig.savefig(out.with_suffix(".pdf"))


if __name__ == "__main__":
    main()
