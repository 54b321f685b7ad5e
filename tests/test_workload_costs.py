"""Non-transformer workloads (RNN, GNN, LSTM, CNN) go through the same profile -> simulate path."""

from __future__ import annotations

from pathlib import Path

import pytest

from exec.profiler import profile_workload
from sim.plan import Plan
from sim.simulate import simulate
from traces.bundle import write_bundle
from traces.errors import ConfigError


@pytest.mark.parametrize("workload", ["rnn-tiny", "hap-tiny", "lstm-tiny", "resnet-tiny"])
def test_profiled_workload_simulates(workload: str, tmp_path: Path) -> None:
    bundle = profile_workload(workload, micro_batch=2, repeats=2, warmup=1, with_ops=False)
    path = write_bundle(bundle, tmp_path / workload)
    layers = len(bundle.layers)
    plan = Plan(workload=workload, profile=str(path), cluster="local-cpu-2",
                parallelism={"pp": 2 if layers >= 2 else 1, "dp": 1 if layers >= 2 else 2},
                schedule={"name": "1f1b", "micro_batch": 2, "microbatches": 4})
    result = simulate(plan)
    layers_s = bundle.layers["fwd_s"] + bundle.layers["bwd_input_s"] + bundle.layers["bwd_weight_s"]
    measured = layers_s.sum() * plan.microbatches  # the backward as the simulator charges it: B + W
    # A pipeline cannot beat a perfect balance of the measured work over its stages.
    assert measured / plan.pp <= result.iteration_s
    assert result.table["kind"].isin(["FWD", "BWD"]).any()


def test_workload_without_closed_form_needs_a_profile() -> None:
    with pytest.raises(ConfigError, match="profile it"):
        simulate(Plan(workload="lstm-tiny", cluster="local-cpu-2", parallelism={"dp": 2}))
