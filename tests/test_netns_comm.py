"""analysis.netns_comm: a link's commbench fits become the profile the shaped network's plans are
predicted from (scripts/netns_embedding.sh). The namespaces themselves need root and are exercised by
the script; here a real two-rank gloo benchmark over loopback stands in for the link."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from analysis.netns_comm import measure, write_spec
from analysis.validation.comm import COMM_PRIMITIVES
from analysis.validation.profiling import profile_plan_workload
from exec.commbench import run_commbench
from sim.comm_curve import pooled_monotone
from sim.compile import compile_plan
from sim.plan import Plan
from traces.bundle import read_bundle, write_bundle
from traces.errors import ConfigError

PLAN = {"name": "netns-comm", "workload": "lstm-tiny", "cluster": {"preset": "local-cpu-2"},
        "parallelism": {"dp": 2}, "schedule": {"micro_batch": 2, "microbatches": 2},
        "embedding": {"method": "embrace", "schedule": "2d"}}


def test_measuring_outside_a_process_group_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ConfigError) as error:
        measure([tmp_path / "plan.yaml"], tmp_path / "profile", tmp_path / "comm")
    assert "environment" in str(error.value) and "netns_commbench" in str(error.value)


@pytest.mark.slow  # a profile and a two-rank benchmark: ~22 s on the loaded 2-core machine
def test_the_benchmark_prices_the_plans_collectives(tmp_path: Path) -> None:
    plan = Plan.from_dict(PLAN)
    base = tmp_path / "base"
    write_bundle(profile_plan_workload(plan, 1, warmup=1, repeats=1), base)
    run_commbench(nproc=2, sizes=[1024, 65536], primitives=COMM_PRIMITIVES, backend="gloo", repeats=2,
                  warmup=1, out=tmp_path / "comm")
    fits = write_spec(tmp_path / "comm", base, tmp_path / "profile")
    assert read_bundle(base).comm_fits is None or not len(read_bundle(base).comm_fits)  # the base is untouched
    assert set(fits["primitive"]) == set(COMM_PRIMITIVES)
    assert all(p in (tmp_path / "comm" / "spec.md").read_text() for p in COMM_PRIMITIVES)
    comm = compile_plan(plan.replace(profile=str(tmp_path / "profile"))).resolved.comm
    samples = read_bundle(tmp_path / "profile").comm_samples
    for primitive in ("all_reduce", "all_to_all"):
        # between the two measured sizes, the straight line through their (non-decreasing) medians
        sizes, medians = samples[samples["primitive"] == primitive].sort_values("bytes")[["bytes", "median_s"]].T.values
        expected = np.interp(10_000, sizes, pooled_monotone(medians))
        assert comm.collective_s(primitive, 10_000, (0, 1)) == pytest.approx(expected)
