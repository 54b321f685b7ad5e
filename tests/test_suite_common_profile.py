"""The suite's common profile (``paratwin validate-suite --common-profile``, issue 12): one profile of
the workload per round at a drawn slot, pooled by the per-layer median, and every plan predicted
from that one bundle, which the suite's output names. A tiny real suite: two lstm-tiny plans
(dense, EmbRace 2D) on 2 gloo ranks, 2 rounds of 2 iterations."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from analysis.validation.pooled_profile import pool_profiles
from analysis.validation_suite import PROFILE_SLOT, run_suite
from sim.engine import EngineOptions
from sim.plan import Plan
from sim.simulate import simulate
from traces.bundle import read_bundle
from traces.errors import ConfigError

BASE = {"workload": "lstm-tiny", "cluster": {"preset": "local-cpu-2"}, "parallelism": {"dp": 2},
        "schedule": {"micro_batch": 2, "microbatches": 2}}
TIMES = ("fwd_s", "bwd_input_s", "bwd_weight_s", "bwd_s", "recompute_s")


def _plans(folder: Path) -> list[Path]:
    paths = []
    for name, embedding in (("tiny-dense", {"method": "dense"}), ("tiny-embrace", {"method": "embrace",
                                                                                   "schedule": "2d"})):
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**BASE, "name": name, "embedding": embedding}))
        paths.append(path)
    return paths


@pytest.mark.slow
def test_every_plan_is_priced_from_the_pooled_profile_of_the_rounds(tmp_path: Path) -> None:
    out = tmp_path / "suite"
    table = run_suite(out, _plans(tmp_path), iterations=2, warmup=1, calibration=[], verbose=False,
                      profile_repeats=2, rounds=2, seed=3, common_profile=True)
    summary = json.loads((out / "suite.json").read_text())["summary"]
    common = summary["common_profile"]
    assert len(common["bundles"]) == 1 and len(common["slots"]) == 2
    pooled = Path(common["bundles"][0])
    rounds = common["rounds"][str(pooled)]
    assert len(rounds) == 2 and all(Path(p).is_dir() for p in rounds)
    # the suite's table names the one bundle that priced both plans
    stored = pd.read_csv(out / "suite.csv")
    assert set(stored["profile"]) == {str(pooled)} and set(table["profile"]) == {str(pooled)}
    # ... which is the per-layer median of the rounds' profiles, with the group's communication fits
    bundle = read_bundle(pooled)
    for column in TIMES:
        expected = np.median([read_bundle(Path(p)).layers.sort_values("layer")[column].to_numpy() for p in rounds],
                             axis=0)
        np.testing.assert_allclose(bundle.layers.sort_values("layer")[column].to_numpy(), expected)
    assert bundle.comm_fits is not None and len(bundle.comm_fits)
    assert bundle.meta["settings"]["pooled_from"] == rounds
    # ... and each prediction is that bundle's (uncalibrated suite: the engine's own number)
    for row in table.itertuples(index=False):
        plan = Plan.load(out / "plans" / row.plan / "plan.yaml")
        assert Path(str(plan.profile)).resolve() == pooled
        assert row.predicted_s == pytest.approx(simulate(plan, full=True, options=EngineOptions(layer_rows=True))
                                                .iteration_s, rel=1e-9)
    # every plan ran once per round; the profile's slots are recorded, the plans' orders without it
    record = json.loads((out / "rounds.json").read_text())
    assert all(PROFILE_SLOT not in order for order in record["orders"])
    assert {len(v) for v in record["times_s"].values()} == {2}


def test_pooling_takes_the_median_and_refuses_another_workload(tmp_path: Path) -> None:
    """Three stored single-layer-table bundles pooled: the median per layer, not the mean."""
    from exec.profiler import Steadiness, profile_workload
    from traces.bundle import write_bundle

    def profile(workload: str) -> object:
        return profile_workload(workload, micro_batch=2, device="cpu", repeats=1, warmup=0, with_ops=False,
                                steady=Steadiness.fixed())

    paths = []
    for index, scale in enumerate((1.0, 2.0, 10.0)):
        bundle = profile("lstm-tiny")
        for column in TIMES:
            bundle.layers[column] = 1e-3 * scale
        paths.append(write_bundle(bundle, tmp_path / f"p{index}"))
    pooled = read_bundle(pool_profiles(paths, tmp_path / "pooled"))
    np.testing.assert_allclose(pooled.layers["fwd_s"], 2e-3)  # the median of 1, 2 and 10 ms (the mean: 4.3)
    other = profile("gpt-tiny")
    with pytest.raises(ConfigError):
        pool_profiles([paths[0], write_bundle(other, tmp_path / "other")], tmp_path / "bad")
