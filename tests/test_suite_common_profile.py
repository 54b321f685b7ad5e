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
    # the suite's table names the bundle that priced each plan: the pool, or the pool with the sharded
    # plan's own ids request host work (timed in the same two slots)
    stored = pd.read_csv(out / "suite.csv").set_index("plan")["profile"].to_dict()
    assert stored == common["plans"] == dict(zip(table["plan"], table["profile"], strict=True))
    assert Path(stored["tiny-dense"]) == pooled
    assert Path(stored["tiny-embrace"]) != pooled and Path(stored["tiny-embrace"]).parent == pooled.parent
    # ... the pool is the per-layer median of the rounds' profiles, with the group's communication fits
    bundle = read_bundle(pooled)
    for column in TIMES:
        expected = np.median([read_bundle(Path(p)).layers.sort_values("layer")[column].to_numpy() for p in rounds],
                             axis=0)
        np.testing.assert_allclose(bundle.layers.sort_values("layer")[column].to_numpy(), expected)
    assert bundle.comm_fits is not None and len(bundle.comm_fits)
    assert bundle.meta["settings"]["pooled_from"] == rounds
    assert "ids_request_host_s" not in bundle.meta["settings"]
    own = read_bundle(Path(stored["tiny-embrace"]))
    pd.testing.assert_frame_equal(own.layers, bundle.layers)
    ids = common["ids_request_host_s"]["tiny-embrace"]
    assert len(ids) == 2 and own.meta["settings"]["ids_request_host_s"] == pytest.approx(float(np.median(ids)))
    # ... and each prediction is that bundle's (uncalibrated suite: the engine's own number)
    for row in table.itertuples(index=False):
        plan = Plan.load(out / "plans" / row.plan / "plan.yaml")
        assert Path(str(plan.profile)).resolve() == Path(stored[row.plan])
        assert row.predicted_s == pytest.approx(simulate(plan, full=True, options=EngineOptions(layer_rows=True))
                                                .iteration_s, rel=1e-9)
    # every plan ran once per round; the profile's slots are recorded, the plans' orders without it
    record = json.loads((out / "rounds.json").read_text())
    assert all(PROFILE_SLOT not in order for order in record["orders"])
    assert {len(v) for v in record["times_s"].values()} == {2}


def test_pooling_takes_the_median_and_refuses_another_workloads_layers(tmp_path: Path) -> None:
    """One real lstm-tiny profile stored three times with its times set to 1, 2 and 10 ms: the pool
    holds the median (2 ms, not the mean's 4.3); a profile whose layers differ is refused."""
    from exec.profiler import Steadiness, profile_workload
    from traces.bundle import write_bundle

    bundle = profile_workload("lstm-tiny", micro_batch=2, device="cpu", repeats=1, warmup=0, with_ops=False,
                              steady=Steadiness.fixed())
    paths = []
    for index, scale in enumerate((1.0, 2.0, 10.0)):
        for column in TIMES:
            bundle.layers[column] = 1e-3 * scale
        paths.append(write_bundle(bundle, tmp_path / f"p{index}"))
    pooled = read_bundle(pool_profiles(paths, tmp_path / "pooled"))
    np.testing.assert_allclose(pooled.layers["fwd_s"], 2e-3)
    assert pooled.meta["settings"]["pooled_from"] == [str(p.resolve()) for p in paths]
    bundle.layers.loc[0, "param_bytes"] += 4  # another workload's first layer
    with pytest.raises(ConfigError):
        pool_profiles([paths[0], write_bundle(bundle, tmp_path / "other")], tmp_path / "bad")
