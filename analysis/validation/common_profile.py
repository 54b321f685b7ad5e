"""The validation suite's common profile (``paratwin validate-suite --common-profile``, issue 12):
each workload profiled once per round, the rounds' profiles pooled (``pooled_profile``), and every
plan of the workload priced from that pool.

What is the plan's own and not the workload's stays the plan's: the host work of a sharded
table's ids request (``settings.ids_request_host_s``, ``exec.embedding.request_host_work``)
depends on the embedding method (EmbRace asks per micro-batch, the parameter server per
iteration). It is measured for every such plan in every round's slot (the median over the plan's
replicas, as the co-located profile does), and the plan's bundle is the pool with the median of
its rounds' values: ``group<g>-<plan>``, whose layers are the pool's. Plans without an ids
request are priced from the pool itself (``group<g>``)."""

from __future__ import annotations

import shutil
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from analysis.validation.comm import copy_comm_fits
from analysis.validation.pooled_profile import pool_profiles
from analysis.validation.profiling import has_ids_request, ids_request_host_s, profile_plan_workload
from sim.plan import Plan
from traces.bundle import read_bundle, write_bundle

# Rounds of the ids request's host work per replica and slot (as the validation profile's worker
# takes it: analysis.validation.profiling._profile_worker).
IDS_WARMUP, IDS_REPEATS = 5, 100


class CommonProfile:
    def __init__(self, out: Path, plans: list[Plan], key: Callable[[Plan], str], groups: dict[str, Plan],
                 group_number: dict[str, int], repeats: int, verbose: bool) -> None:
        self.root = Path(out) / "profiles" / "common"
        self.plans, self.key, self.repeats, self.verbose = plans, key, repeats, verbose
        self.groups = {k: groups[k] for k in dict.fromkeys(key(p) for p in plans)}  # the suite's, in order
        self.number = group_number
        self.rounds: dict[str, list[Path]] = defaultdict(list)  # group -> its profile of each round
        self.ids_s: dict[str, list[float]] = defaultdict(list)  # plan -> its ids host work of each round
        self.bundles: dict[str, Path] = {}  # plan -> the bundle that prices it

    def take(self, number: int) -> None:
        """Round ``number``'s slot: every workload profiled (co-located, in lockstep), and every sharded
        plan's ids request timed."""
        for key, plan in self.groups.items():
            if self.verbose:
                print(f"profiling {plan.workload} {plan.workload_options} for the common profile (round {number})",
                      flush=True)
            target = self.root / f"group{self.number[key]}-rounds" / f"round{number}"
            write_bundle(profile_plan_workload(plan, plan.world_size, repeats=self.repeats), target)
            self.rounds[key].append(target)
        for plan in self.plans:
            if has_ids_request(plan):
                self.ids_s[plan.name].append(_ids_host_s(plan))

    def pool(self, comm_from: dict[str, Path]) -> None:
        """Write every group's pool (with the group's communication fits) and each sharded plan's copy."""
        pools = {}
        for key in self.groups:
            target = self.root / f"group{self.number[key]}"
            pool_profiles(self.rounds[key], target)
            copy_comm_fits(comm_from[key], target)
            bundle = read_bundle(target)
            bundle.meta["settings"].pop("ids_request_host_s", None)  # one plan's: each plan gets its own below
            write_bundle(bundle, target)
            pools[key] = target.resolve()
        for plan in self.plans:
            pool = pools[self.key(plan)]
            if not self.ids_s.get(plan.name):
                self.bundles[plan.name] = pool
                continue
            target = self.root / f"{pool.name}-{plan.name}"
            shutil.rmtree(target, ignore_errors=True)
            bundle = read_bundle(pool)
            bundle.meta["settings"]["ids_request_host_s"] = float(np.median(self.ids_s[plan.name]))
            bundle.meta["settings"]["ids_request_host_s_rounds"] = self.ids_s[plan.name]
            write_bundle(bundle, target)
            self.bundles[plan.name] = target.resolve()

    def note(self, plan: Plan) -> str:
        pool = self.bundles[plan.name]
        own = f"; its ids request's host work the median of its {len(self.ids_s[plan.name])} round(s)" \
            if self.ids_s.get(plan.name) else ""
        return (f"predicted from the suite's common profile {pool}: per layer the median of "
                f"{len(self.rounds[self.key(plan)])} profile(s) of the workload, one per round{own}")

    def summary(self, slots: list[int]) -> dict:
        return {"bundles": sorted({str(self.root.resolve() / f"group{self.number[k]}") for k in self.groups}),
                "rounds": {str(self.root.resolve() / f"group{self.number[k]}"): [str(p.resolve()) for p in v]
                           for k, v in self.rounds.items()},
                "plans": {name: str(path) for name, path in self.bundles.items()},
                "ids_request_host_s": {name: values for name, values in self.ids_s.items()},
                "slots": slots}


def _ids_host_s(plan: Plan) -> float:
    """The median over the plan's replicas of one ids request's host work (seconds), in this process."""
    import torch

    from exec.contract import load_workload

    workload = load_workload(plan)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank runs it
    try:
        return float(np.median([ids_request_host_s(plan, workload, replica, IDS_WARMUP, IDS_REPEATS)
                                for replica in range(plan.dp)]))
    finally:
        torch.set_num_threads(threads)
