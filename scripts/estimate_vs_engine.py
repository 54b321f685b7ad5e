"""The fast estimate (``sim.estimate``, what the search ranks plans by) against the engine on the
plans of a stored validation run, each from its own stored profile (issue 12): no timing, seconds.

    python scripts/estimate_vs_engine.py runs/suite-embedding-7 [--comm-cpu=runs/comm-cpu-12a] [--overlap-slowdown=S]

``--comm-cpu=DIR``: an ``exec.commbench`` folder, or a profile bundle, whose fits have the CPU of communicating
(e.g. runs/suite-embedding-9/plans/emb-dense-dp2/profile: the loopback fits of run 9); each
plan's bundle is copied with those CPU columns added (``scripts/suite_repredict.py --comm-cpu``), so
on a host whose cores the ranks share both the engine and the estimate price the cores the
transfers take from compute (``sim.host_cpu``). ``--overlap-slowdown=S``: both priced with
``EngineOptions.overlap_slowdown`` S (default 0). Uncalibrated, otherwise default engine options
(the search's settings). Prints per plan the engine's and the estimate's iteration and the estimate's error, and
the two rankings.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pandas as pd

from exec.commbench import read_comm_results
from sim.compile import resolve_plan
from sim.embedding import estimate_terms
from sim.engine import EngineOptions
from sim.estimate import Estimator, _layout
from sim.lower import p2p_gather_tp
from sim.plan import Plan
from sim.schedules import SCHEDULES
from sim.simulate import simulate
from traces.bundle import read_bundle
from traces.errors import BundleError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suite_repredict import with_cpu  # noqa: E402


def estimate_s(plan: Plan, overlap_slowdown: float = 0.0) -> tuple[float, float]:
    """(engine, estimate) seconds of ``plan``'s iteration, both with ``overlap_slowdown``."""
    r = resolve_plan(plan)
    rank_of, stages_of = _layout(plan.pp, plan.chunks, SCHEDULES[plan.schedule.name].placement)
    terms = estimate_terms(plan, r.stage_layers, r.comm, r.costs, list(rank_of), list(stages_of))
    estimate = Estimator(r.costs, r.comm, plan.dtype, plan.workload, plan.workload_options,
                         overlap_slowdown).estimate(
        schedule=plan.schedule.name, dp=plan.dp, tp=plan.tp, pp=plan.pp, chunks=plan.chunks,
        micro_batch=plan.micro_batch, microbatches=plan.microbatches, stage_layers=r.stage_layers,
        policy=r.policy, tp_overlap=plan.parallelism.tp_overlap, sync_method=plan.gradient_sync.method,
        bucket_mb=plan.gradient_sync.bucket_mb, embedding=terms, scatter_gather=p2p_gather_tp(plan),
        sync=plan.gradient_sync, p2p=plan.schedule.p2p)
    options = EngineOptions(overlap_slowdown=overlap_slowdown)
    return simulate(plan, full=True, resolved=r, options=options).iteration_s, estimate.iteration_s


def compare(suite: Path, cpu: pd.DataFrame | None, scratch: Path, overlap_slowdown: float = 0.0) -> pd.DataFrame:
    rows = []
    for plan_yaml in sorted((suite / "plans").glob("*/plan.yaml")):
        if "-retry" in plan_yaml.parent.name:
            continue
        plan = Plan.load(plan_yaml)
        if cpu is not None:
            plan = plan.model_copy(update={"profile": str(with_cpu(Path(str(plan.profile)), cpu, scratch))})
        engine, estimate = estimate_s(plan, overlap_slowdown)
        rows.append({"plan": plan.name, "engine_ms": engine * 1e3, "estimate_ms": estimate * 1e3,
                     "error": estimate / engine - 1})
    return pd.DataFrame(rows)


def cpu_fits(directory: Path) -> pd.DataFrame:
    """The comm fits of an ``exec.commbench`` folder or of a profile bundle."""
    try:
        return read_comm_results(directory)[1]
    except BundleError:
        fits = read_bundle(directory).comm_fits
        if fits is None:
            raise
        return fits


def main(argv: list[str]) -> None:
    cpu_dirs = [Path(a.split("=", 1)[1]) for a in argv if a.startswith("--comm-cpu=")]
    cpu = cpu_fits(cpu_dirs[-1]) if cpu_dirs else None
    slowdowns = [float(a.split("=", 1)[1]) for a in argv if a.startswith("--overlap-slowdown=")]
    slowdown = slowdowns[-1] if slowdowns else 0.0
    with tempfile.TemporaryDirectory(prefix="paratwin-estimate-") as scratch:
        for suite in [Path(a) for a in argv if not a.startswith("--")]:
            table = compare(suite, cpu, Path(scratch), slowdown)
            print(f"\n{suite.name}{' with the CPU of ' + str(cpu_dirs[-1]) if cpu_dirs else ''}"
                  f"{f', overlap_slowdown {slowdown}' if slowdown else ''}")
            print("| plan | engine (ms) | estimate (ms) | estimate error |\n| --- | ---: | ---: | ---: |")
            for r in table.itertuples():
                print(f"| {r.plan} | {r.engine_ms:.2f} | {r.estimate_ms:.2f} | {r.error:+.2%} |")
            same = list(table.sort_values("engine_ms")["plan"]) == list(table.sort_values("estimate_ms")["plan"])
            print(f"median |error| {table['error'].abs().median():.2%}, max {table['error'].abs().max():.2%}; "
                  f"ranking {'the same' if same else 'differs'}: engine "
                  f"{' < '.join(table.sort_values('engine_ms')['plan'])}; estimate "
                  f"{' < '.join(table.sort_values('estimate_ms')['plan'])}")


if __name__ == "__main__":
    main(sys.argv[1:])
