"""The fast estimate against the engine on a grid of simulated plans (no measurements involved).

The plan search ranks plans by ``sim.estimate`` and simulates only the best; where the two disagree the
search is wrong. This grid covers the regimes where a closed form can fail: every registered schedule
(with its chunk counts), pp 2 / 4 / 8, micro-batches below, at and above pp, TP and DP degrees, no
recompute and full recompute, a GPT whose LM head weighs about two blocks on the last stage beside one
whose head is negligible, and pipelines inside one node or across nodes (InfiniBand, or Ethernet slow
enough that the hops, not the stages, set the steady state). Each plan is simulated
(``sim.simulate``, symmetric mode) and estimated (``estimate_plan``); the relative difference is
reported by regime.

    python -m analysis.estimate_grid --out runs/estimate-grid        # full grid, CSV + summary
    python -m analysis.estimate_grid --quick                         # the test's grid

tests/test_estimate_grid.py runs the quick grid and bounds the difference.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from sim.compile import resolve_plan
from sim.estimate import Estimate, Estimator
from sim.lower import p2p_gather_tp
from sim.plan import Plan
from sim.schedules import SCHEDULES, check_preconditions
from sim.simulate import simulate
from traces.errors import ConfigError

# Two GPTs on one DGX A100 (fp16, micro-batch 4), wide enough that the GPU, not the host launch path,
# sets each layer's time (at hidden 512 every layer is host-bound and all stages cost alike): "head"
# keeps GPT-2's 50,257-word vocabulary, so the LM head (2 b s h V FLOPs against a block's 24 b s h^2)
# weighs about two blocks on the last stage; "flat" has a 512-word vocabulary, every stage about alike.
WORKLOADS = {
    "head": {"hidden": 2048, "heads": 16, "num_layers": 16, "seq": 1024},
    "flat": {"hidden": 2048, "heads": 16, "num_layers": 16, "seq": 1024, "vocab": 512},
}
MICRO_BATCH = 4
# Where the pipeline's hops go: "node", all ranks in one DGX A100 (NVLink, hops of tens of microseconds);
# "ib", one node per pipeline rank of the a100-64 preset (HDR InfiniBand between stages: a hop of a
# b x s x h fp16 activation, 16 MiB here, takes about 0.7 ms against a block's few milliseconds);
# "eth", the same nodes joined by 25 Gbit/s Ethernet instead (sim/data/hardware.yaml's eth-25g: a hop
# takes about 5.4 ms, about a stage's forward at pp 2, so a micro-batch's round trip through the hops,
# not a rank's compute, sets the steady state of most schedules, without a rank's sends queueing
# behind each other: the communication-bound pipelines whose capped run the estimate once extended by
# compute alone, up to 7.5% under the engine here; issue 12g).
NETWORKS = ("node", "ib", "eth")
QUICK_NETWORKS = ("ib", "eth")
# (tp, dp) per pipeline degree, on one 8-GPU node.
DEGREES = {2: [(1, 1), (2, 1), (1, 2), (2, 2)], 4: [(1, 1), (2, 1), (1, 2)], 8: [(1, 1)]}
QUICK_DEGREES = {2: [(1, 1), (2, 2)], 4: [(1, 1), (2, 1)]}


def microbatch_counts(pp: int, quick: bool = False, network: str = "ib") -> list[int]:
    """Below, at, just above and well above the pipeline depth (quick: below, at and twice it; on
    Ethernet only well above it, where the estimate caps the graph's run and extends it)."""
    if not quick:
        return sorted({max(1, pp // 2), pp, pp + 1, 2 * pp, 4 * pp})
    return [4 * pp] if network == "eth" else sorted({max(1, pp // 2), pp, 2 * pp})


def chunk_counts(schedule: str) -> list[int]:
    spec = SCHEDULES[schedule].chunks
    return [2] if spec in ("2", ">= 2") else [1]


def grid_plans(quick: bool = False) -> Iterator[tuple[dict[str, str | int], Plan]]:
    """(regime labels, plan) for every valid point of the grid."""
    workloads = ["head"] if quick else list(WORKLOADS)
    policies = ["full"] if quick else ["none", "full"]
    degrees = QUICK_DEGREES if quick else DEGREES
    networks = QUICK_NETWORKS if quick else NETWORKS
    for workload, network in ((w, n) for w in workloads for n in networks):
        for schedule in SCHEDULES:
            for chunks in chunk_counts(schedule):
                for pp, shapes in degrees.items():
                    for m in microbatch_counts(pp, quick, network):
                        try:
                            check_preconditions(schedule, pp, m, chunks)
                        except ConfigError:
                            continue
                        for tp, dp in shapes:
                            for policy in policies:
                                labels = {"workload": workload, "schedule": schedule, "chunks": chunks, "pp": pp,
                                          "m": m, "tp": tp, "dp": dp, "memory": policy,
                                          "network": network}
                                yield labels, _plan(labels)


def _plan(labels: dict) -> Plan:
    world = labels["tp"] * labels["dp"] * labels["pp"]
    return Plan.from_dict({
        "name": "estimate-grid-" + "-".join(str(v) for v in labels.values()),
        "workload": "gpt2-small", "workload_options": WORKLOADS[labels["workload"]], "dtype": "fp16",
        "cluster": _cluster(labels["network"], world, labels["pp"]),
        "parallelism": {"tp": labels["tp"], "dp": labels["dp"], "pp": labels["pp"], "chunks": labels["chunks"]},
        "schedule": {"name": labels["schedule"], "micro_batch": MICRO_BATCH, "microbatches": labels["m"]},
        "memory": {"policy": labels["memory"]},
    })


def _cluster(network: str, world: int, pp: int) -> dict:
    if network == "node":
        return {"preset": "dgx-a100-8", "devices_per_node": world}
    nodes = {"preset": "a100-64", "nodes": pp, "devices_per_node": world // pp}
    return nodes if network == "ib" else {**nodes, "inter_node_link": "eth-25g"}


def estimate_plan(plan: Plan) -> Estimate:
    """The fast estimate of one plan, with the inputs the search would give it (no sharded embedding) and the
    plan's own pipeline exchanges (scatter/gather, blocking)."""
    r = resolve_plan(plan)
    return Estimator(r.costs, r.comm, plan.dtype, plan.workload, plan.workload_options).estimate(
        schedule=plan.schedule.name, dp=plan.dp, tp=plan.tp, pp=plan.pp, chunks=plan.chunks,
        micro_batch=plan.micro_batch, microbatches=plan.microbatches, stage_layers=r.stage_layers,
        policy=r.policy, tp_overlap=plan.parallelism.tp_overlap, sync_method=plan.gradient_sync.method,
        bucket_mb=plan.gradient_sync.bucket_mb, scatter_gather=p2p_gather_tp(plan),
        p2p=plan.schedule.p2p)


def compare(quick: bool = False) -> pd.DataFrame:
    """One row per grid plan: its labels, the engine's and the estimate's seconds, and
    ``rel`` = (estimate - engine) / engine."""
    rows = []
    for labels, plan in grid_plans(quick):
        engine = simulate(plan).iteration_s
        rows.append({**labels, "engine_s": engine, "estimate_s": estimate_plan(plan).iteration_s})
    out = pd.DataFrame(rows)
    out["rel"] = out["estimate_s"] / out["engine_s"] - 1.0
    out["regime"] = ["m < pp" if m < pp else "m = pp" if m == pp else "m > pp"
                     for m, pp in zip(out["m"], out["pp"], strict=True)]
    return out


def summary(df: pd.DataFrame, by: str) -> pd.DataFrame:
    """Median and max |estimate - engine| / engine, and the signed extremes, per value of ``by``."""
    a = df.assign(abs_rel=df["rel"].abs())
    return a.groupby(by).agg(plans=("rel", "size"), median_abs=("abs_rel", "median"), max_abs=("abs_rel", "max"),
                             min_signed=("rel", "min"), max_signed=("rel", "max"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="folder for grid.csv")
    parser.add_argument("--quick", action="store_true", help="the test's smaller grid")
    args = parser.parse_args()
    started = time.perf_counter()
    df = compare(args.quick)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        df.to_csv(args.out / "grid.csv", index=False)
    a = df["rel"].abs()
    print(f"{len(df)} plans in {time.perf_counter() - started:.0f} s: |estimate - engine| / engine "
          f"median {a.median():.2%}, max {a.max():.2%}")
    with pd.option_context("display.float_format", "{:.2%}".format, "display.width", 160):
        for by in ("schedule", "regime", "pp", "tp", "dp", "memory", "workload", "network"):
            print(summary(df, by).to_string(), end="\n\n")


if __name__ == "__main__":
    main()
