"""Refactors change no prediction: every example and validation plan simulates to the recorded
iteration time, peak memory per rank and instruction count (tests/golden/simulate.json).

GPU plans use the analytic cost model; CPU plans (which need a measured profile) use fixed uniform
costs, so the record depends on the simulator alone, not on this machine. A deliberate change of
the simulator or the cost model updates the record: rerun with PARATWIN_UPDATE_GOLDEN=1 and say
in the commit which predictions moved and why.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sim.cluster import load_cluster
from sim.costs import UniformCosts
from sim.plan import Plan
from sim.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "golden" / "simulate.json"
# examples/validation/*/: its sections (analysis.validation_suite), calibration/ and netns/
PLANS = sorted(str(p.relative_to(ROOT)) for pattern in ("examples/plans/*.yaml", "examples/validation/*.yaml",
                                                         "examples/validation/*/*.yaml")
               for p in ROOT.glob(pattern))
CPU_COSTS = UniformCosts(num_layers=6, fwd_s=1e-3, bwd_input_s=1e-3, bwd_weight_s=1e-3, saved_bytes=1 << 20,
                         output_bytes=1 << 16, param_bytes=1 << 22,
                         # stand-ins for a selective-checkpointing plan (sim.memory_selective)
                         selective_saved_bytes=1 << 19, selective_recompute_s=3e-4)


def outcome(path: str) -> dict[str, object]:
    plan = Plan.load(ROOT / path).replace(profile=None)
    cpu = load_cluster(plan.cluster).device.kind == "cpu"
    result = simulate(plan, costs=CPU_COSTS if cpu else None)
    return {"iteration_s": result.iteration_s, "rows": result.events,
            "instructions": int((result.table["parent"] < 0).sum()),
            "peak_bytes": {str(rank): memory.peak_bytes for rank, memory in sorted(result.memory.items())}}


def test_every_example_plan_is_recorded() -> None:
    assert set(json.loads(RECORD.read_text())) == set(PLANS)


@pytest.mark.parametrize("path", PLANS)
def test_prediction_is_unchanged(path: str) -> None:
    record = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
    now = outcome(path)
    if os.environ.get("PARATWIN_UPDATE_GOLDEN"):
        record[path] = now
        RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    assert now == record[path]
