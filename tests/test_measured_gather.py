"""All-gather and reduce-scatter from a real benchmark (issue 9, ninth session): a profile bundle's
``exec.commbench`` fits and samples price them in ``sim.comm.ClusterComm`` as they price the all-reduce,
so a measured cluster's distributed optimizer (and sequence parallelism, the sparse all-gather
baselines) no longer mixes a measured all-reduce with modelled all-gathers. A bundle benchmarked
before (all-reduce, all-to-all and send/recv only) keeps pricing them from the cluster's links."""

from __future__ import annotations

import math
import shutil
import typing
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.estimate_grid import estimate_plan
from analysis.validation.comm import COMM_PRIMITIVES, comm_sizes
from exec.commbench import PRIMITIVES, run_commbench
from sim.collectives import PRIMITIVES as MODELLED
from sim.collectives import collective_time
from sim.comm import _FIT_NAMES, ClusterComm
from sim.comm_curve import MeasuredCurve
from sim.compile import compile_plan
from sim.engine import EngineOptions
from sim.gradient_sync import Collective
from sim.plan import Plan
from sim.simulate import simulate
from traces.bundle import read_bundle, write_bundle

ROOT = Path(__file__).resolve().parents[1]
# The gpt-wordlm profile of the lead's loopback run 7 with its all-reduce / all-to-all / send-recv
# benchmark (tests/data/comm/README.md): a bundle from before all-gathers were measured.
LOOPBACK = ROOT / "tests" / "data" / "comm" / "loopback-2d-run7"
GATHERS = ["all_gather", "reduce_scatter"]


def test_every_collective_the_engine_prices_has_a_benchmark_name() -> None:
    """A name the engine or a gradient-sync phase uses that maps to no benchmark primitive would be
    priced from the model on every measured cluster, silently (the all-gathers were, before)."""
    names = {*typing.get_args(Collective), *MODELLED, "p2p"} - {"memory", "broadcast"}  # nothing broadcasts
    assert {_FIT_NAMES.get(name, name) for name in names} <= set(PRIMITIVES)
    assert set(COMM_PRIMITIVES) == set(PRIMITIVES)  # the validation benchmarks every one of them


def distopt_plan(profile: Path) -> Plan:
    return Plan.from_dict({
        "name": "gather-distopt-dp2", "workload": "gpt-wordlm",
        "workload_options": {"data": "wikitext-2", "hidden": 64, "heads": 2, "seq": 32},
        "cluster": {"preset": "local-cpu-2"}, "profile": str(profile), "dtype": "fp32",
        "parallelism": {"dp": 2}, "schedule": {"micro_batch": 4, "microbatches": 2},
        "gradient_sync": {"method": "distopt"}})


def bucket_rows(plan: Plan) -> pd.DataFrame:
    # without meeting waits a collective's row is exactly its price (the identical ranks arrive together)
    t = simulate(plan, options=EngineOptions(meeting_waits=False)).table
    return t[(t["kind"] == "ALLREDUCE") & (t["parent"] == -1) & (t["rank"] == 0)].set_index("index")


@pytest.mark.slow  # a two-rank gloo benchmark of two primitives at two sizes: ~5 s on the loaded machine
def test_a_real_benchmarks_gathers_price_the_distributed_optimizers_buckets(tmp_path: Path) -> None:
    old = distopt_plan(LOOPBACK)
    phase_bytes = sorted({b for kind, b in (p for ins in compile_plan(old).program.ranks[0].instructions
                                            for p in ins.phases) if kind in ("allgather", "reducescatter")})
    assert phase_bytes == [17446912]  # one bucket: reduce-scatter its gradients, all-gather its parameters
    assert set(phase_bytes) <= set(comm_sizes(old))  # the validation's sweep spans them (the bucket's size)

    # Real gloo ranks; the bucket (17.4 MB) lies beyond the samples, where the fitted bandwidth extends them.
    samples, fits = run_commbench(nproc=2, sizes=[1 << 18, 1 << 21], primitives=GATHERS, backend="gloo",
                                  repeats=2, warmup=1)
    assert sorted(fits["primitive"]) == GATHERS
    assert np.isfinite(fits["alpha_s"]).all() and (fits["bandwidth_Bps"] > 0).all()
    # the CPU a call costs a rank (sim.host_cpu) comes from the same rows under the engine's names
    cpu = ClusterComm(compile_plan(old).resolved.cluster, fits)
    measured_rows = fits.set_index("primitive").loc[GATHERS].itertuples()
    for kind, row in zip(("allgather", "reducescatter"), measured_rows, strict=True):
        assert cpu.cpu_s(kind, 1 << 20, 2) == pytest.approx(row.cpu_alpha_s + (1 << 20) / row.cpu_bandwidth_Bps)
    # The run-7 bundle has no CPU columns; leave the new rows' CPU unmeasured too, so only the times change.
    fits = fits.assign(cpu_alpha_s=math.nan, cpu_bandwidth_Bps=math.nan)
    measured = tmp_path / "measured"
    shutil.copytree(LOOPBACK, measured)
    bundle = read_bundle(measured)
    assert bundle.comm_fits is not None and not set(GATHERS) & set(bundle.comm_fits["primitive"])
    bundle.comm_samples = pd.concat([bundle.comm_samples, samples], ignore_index=True)
    bundle.comm_fits = pd.concat([bundle.comm_fits, fits], ignore_index=True)
    write_bundle(bundle, measured)

    new = distopt_plan(measured)
    cluster = compile_plan(new).resolved.cluster

    def fitted(primitive: str, nbytes: int) -> float:  # from the samples, not through ClusterComm
        rows = samples[samples["primitive"] == primitive]
        fit = fits.set_index("primitive").loc[primitive]
        curve = MeasuredCurve.from_samples(rows["bytes"].to_numpy(), rows["median_s"].to_numpy(),
                                           fit["alpha_s"], fit["bandwidth_Bps"])
        assert curve is not None
        return curve.seconds(nbytes)

    phases = {ins.index: ins.phases for ins in compile_plan(new).program.ranks[0].instructions if ins.phases}
    before, after = bucket_rows(old), bucket_rows(new)
    assert sorted(phases) == sorted(before.index) == sorted(after.index) and len(phases) == 2
    moved = 0.0
    for index, bucket in phases.items():
        (kind, nbytes), = bucket
        primitive = {"allgather": "all_gather", "reducescatter": "reduce_scatter"}[kind]
        modelled = collective_time(primitive, nbytes, [0, 1], cluster)
        was = before.loc[index, "end_s"] - before.loc[index, "start_s"]
        now = after.loc[index, "end_s"] - after.loc[index, "start_s"]
        assert was == pytest.approx(modelled, rel=1e-9)  # the old bundle: the cluster's links
        assert now == pytest.approx(fitted(primitive, nbytes), rel=1e-9)  # the new one: the measurement
        assert now - was == pytest.approx(fitted(primitive, nbytes) - modelled, rel=1e-9)
        moved += now - was
    # the iteration moves by as much, in the engine and in the fast estimate the search ranks plans by
    for predict in (lambda p: simulate(p).iteration_s, lambda p: estimate_plan(p).iteration_s):
        assert predict(new) - predict(old) == pytest.approx(moved, rel=1e-9)
    # and what the all-reduce of the same bundle would cost still comes from its own benchmark
    comm = ClusterComm(cluster, bundle.comm_fits, bundle.comm_samples)
    assert comm.collective_s("allreduce", 1 << 20, (0, 1)) != collective_time("all_reduce", 1 << 20, [0, 1], cluster)
