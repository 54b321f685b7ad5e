"""What ``sim.host_cpu``'s shared slowdown predicts for ``scripts/probe_cpu_share.py``'s figures
(issue 12, eighth session). No timing: the engine on stored profiles, seconds.

    python scripts/predict_cpu_share.py runs/suite-embedding-8/plans/emb-embrace-2d-dp2/plan.yaml [PLAN ...]

Each plan with the profile it names (a bundle whose benchmark measured the CPU of communicating,
on a cluster with ``host_cores``) is simulated twice (full mode, default options): on its cluster,
and on the same cluster with its cores not shared (``host_cores: None``: nothing slowed). Printed
per plan, each a sum per rank, the mean of the ranks:

- ``overlapped compute``: the forwards and backwards that start with a collective of their rank
  launched and not yet complete (the probe's ``overlapped_wall_ms``), their wall time both ways
  and the ratio: the predicted stretch, to set beside the probe's ``overlapped_wall_ms /
  overlapped_cpu_ms`` (wall over the compute thread's own on-CPU time, which a vCPU's speed
  drift moves less than the wall alone);
- ``collectives``: the all-reduces' and all-to-alls' time from their launch to their end, both ways;
- the iteration both ways.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import pandas as pd

from sim.compile import resolve_plan
from sim.engine import EngineOptions
from sim.plan import Plan
from sim.simulate import simulate

COMPUTE = ("FWD", "BWD")
COLLECTIVES = ("ALLREDUCE", "ALLTOALL")


def overlapped_compute_s(table: pd.DataFrame, rank: int) -> float:
    """Wall seconds of ``rank``'s forwards and backwards that start while one of its collectives is
    in flight (launched at its row's start, complete at its end)."""
    rows = table[(table["rank"] == rank) & (table["parent"] < 0)]
    flights = rows[rows["kind"].isin(COLLECTIVES)][["start_s", "end_s"]].to_numpy()
    compute = rows[rows["kind"].isin(COMPUTE)]
    return float(sum(end - start for start, end in compute[["start_s", "end_s"]].to_numpy()
                     if any(a <= start < b for a, b in flights)))


def figures(table: pd.DataFrame) -> dict[str, float]:
    ranks = sorted(table["rank"].unique())
    top = table[table["parent"] < 0]
    collectives = top[top["kind"].isin(COLLECTIVES)]
    return {"overlapped compute": sum(overlapped_compute_s(table, r) for r in ranks) / len(ranks),
            "collectives": float((collectives["end_s"] - collectives["start_s"]).sum()) / len(ranks),
            "iteration": float(top["end_s"].max())}


def predict(plan: Plan) -> tuple[dict[str, float], dict[str, float]]:
    """(figures with the host's cores shared, figures with them not shared)."""
    shared = resolve_plan(plan)
    if shared.cluster.host_cores is None or not shared.comm.measures_cpu:
        raise SystemExit(f"{plan.name}: its cluster does not say its hosts' cores or its profile's benchmark "
                         "did not measure the CPU of communicating: nothing to predict")
    other = resolve_plan(plan)  # a ClusterComm of its own (the engine reads the cores from it)
    unshared = replace(other, cluster=other.cluster.model_copy(update={"host_cores": None}))
    unshared.comm.cluster = unshared.cluster
    table = simulate(plan, full=True, resolved=shared, options=EngineOptions()).table
    alone = simulate(plan, full=True, resolved=unshared, options=EngineOptions()).table
    return figures(table), figures(alone)


def main(paths: list[str]) -> None:
    for path in paths:
        plan = Plan.load(path)
        shared, alone = predict(plan)
        print(f"\n{plan.name} (profile {plan.profile})")
        print("| figure (ms, per rank) | cores shared | not shared | ratio |\n| --- | ---: | ---: | ---: |")
        for key in shared:
            ratio = shared[key] / alone[key] if alone[key] else float("nan")
            print(f"| {key} | {shared[key] * 1e3:.2f} | {alone[key] * 1e3:.2f} | {ratio:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
