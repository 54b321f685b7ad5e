"""The largest batch that fits a memory budget, measured: the real runtime (two gloo ranks on this
machine's CPU) at doubling micro-batch sizes until the fullest rank's tracked peak passes the budget.

    python benchmarks/memory_measured_batch.py [--out docs/figures/memory_measured_batch] [--budget-mib 48]

gpt-tiny and resnet-tiny, pp 2, GPipe, 4 micro-batches (all in flight on the first stage), fp32,
one measured iteration after one warm-up. The peak is the runtime's own count (``peak_memory`` of
the run record: parameters, gradients, Adam state, activation slots with each storage once,
communication buffers; on a CPU nothing else is tracked), so "fits" means that count <= budget; the
machine itself has memory to spare. Policies: none, full recompute, selective (torch SAC), DELTA
and the optimum under the same budget (the runtime's structural costs, no profile: with zero times
DELTA's director always recomputes). Memory only, no timing: the numbers do not depend on the load.
Writes ``<out>.csv``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

from exec.launcher import RunFailed, run_plan
from sim.plan import Plan
from traces.errors import ConfigError

WORKLOADS = ["gpt-tiny", "resnet-tiny"]
POLICIES: dict[str, dict[str, Any]] = {
    "none": {"policy": "none"},
    "full": {"policy": "full"},
    "selective": {"policy": "selective"},
    "delta": {"policy": "delta", "tiny_mb": 0.0},
    "optimal": {"policy": "optimal"},
}
MICRO_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]


def plan(workload: str, micro_batch: int, memory: dict[str, Any], budget_gb: float) -> Plan:
    if memory["policy"] in ("delta", "optimal"):
        memory = {**memory, "budget_gb": budget_gb}
    return Plan.from_dict({"name": f"{workload}-{memory['policy']}-{micro_batch}", "workload": workload,
                           "cluster": {"preset": "local-cpu-2"}, "parallelism": {"pp": 2},
                           "schedule": {"name": "gpipe", "micro_batch": micro_batch, "microbatches": 4},
                           "memory": memory})


def measured_peak(p: Plan, out: Path) -> int | None:
    """The fullest rank's tracked peak, or None when the policy refuses the plan (nothing fits)."""
    try:
        result = run_plan(p, iterations=1, warmup=1, out_dir=out / p.name, timeout_s=300)
    except (ConfigError, RunFailed) as exc:
        print(f"{p.name}: {exc}", flush=True)
        return None
    return max(result.peak_memory.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/figures/memory_measured_batch"))
    parser.add_argument("--budget-mib", type=float, default=48.0)
    args = parser.parse_args()
    budget = args.budget_mib * 2**20
    rows = []
    with tempfile.TemporaryDirectory(prefix="paratwin-batch-") as tmp:
        for workload in WORKLOADS:
            for name, memory in POLICIES.items():
                largest, peak_at = 0, float("nan")
                for micro_batch in MICRO_BATCHES:
                    peak = measured_peak(plan(workload, micro_batch, memory, budget / 2**30), Path(tmp))
                    print(workload, name, micro_batch, peak, flush=True)
                    if peak is None or peak > budget:
                        break
                    largest, peak_at = micro_batch, peak / 2**20
                rows.append({"workload": workload, "policy": name, "budget_mib": args.budget_mib,
                             "largest_micro_batch": largest, "peak_mib": peak_at})
    table = pd.DataFrame(rows)
    none = table[table["policy"] == "none"].set_index("workload")["largest_micro_batch"]
    table["batch_vs_none"] = [r.largest_micro_batch / none[r.workload] if none[r.workload] else float("nan")
                              for r in table.itertuples()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.with_suffix(".csv").open("w") as f:
        f.write("# measured on the 2-core development VM (gloo, CPU), pp 2 GPipe 4 micro-batches, fp32; "
                "peak = the runtime's tracked bytes of the fullest rank; largest of micro-batches "
                f"{MICRO_BATCHES}\n")
        table.to_csv(f, index=False)
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
