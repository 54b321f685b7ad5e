"""Co-located profiling in lockstep (exec.lockstep, issue 12): the processes run the same rounds
of the same layer at the same time, as the ranks of a run do, whatever each would decide alone.
Counts of rounds, not times, so nothing here depends on the machine's load."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.validation.profiling import profile_plan_workload
from sim.plan import Plan, migrate_flat
from traces.forkserver import forkserver_context


def _worker(index: int, barrier: object, votes: object, warmup: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    from exec.lockstep import Lockstep
    from exec.profiler import Steadiness, profile_workload

    bundle = profile_workload("gpt-tiny", micro_batch=1, warmup=warmup, repeats=2, with_ops=False,
                              layers=range(0, 2), steady=Steadiness.fixed(),
                              together=Lockstep(barrier, votes, index))
    pd.to_pickle(bundle.layers, out)


def test_processes_in_lockstep_run_the_rounds_any_of_them_wants(tmp_path: Path) -> None:
    """One process would warm up once, the other four times: in lockstep both warm up four times."""
    context = forkserver_context()
    barrier, votes = context.Barrier(2), context.Array("i", 2)
    outs = [str(tmp_path / f"layers{i}.pkl") for i in range(2)]
    workers = [context.Process(target=_worker, args=(i, barrier, votes, warmup, outs[i]))
               for i, warmup in enumerate((1, 4))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert [w.exitcode for w in workers] == [0, 0]
    rounds = [pd.read_pickle(out)[["warmup_rounds", "rounds_run"]].values.tolist() for out in outs]
    assert rounds == [[[4, 6], [4, 6]], [[4, 6], [4, 6]]]  # 4 warm-up + 2 timed rounds per layer


def test_the_validation_profile_runs_its_processes_in_lockstep() -> None:
    """``profile_plan_workload`` (what a validation profiles with): with its adaptive warm-up each
    process would stop when its own rounds agree; in lockstep they stop together."""
    plan = Plan.from_dict(migrate_flat({
        "name": "lockstep", "workload": "gpt-tiny", "dp": 2, "schedule": "1f1b", "microbatches": 1,
        "micro_batch": 1, "cluster": {"preset": "local-cpu-2", "devices_per_node": 2}}))
    bundle = profile_plan_workload(plan, processes=2, warmup=1, repeats=2)
    settings = bundle.meta["settings"]
    assert settings["lockstep"] is True
    per_process = settings["rounds_run_per_process"]
    assert len(per_process) == 2 and per_process[0] == per_process[1]
