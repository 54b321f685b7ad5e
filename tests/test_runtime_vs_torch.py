"""Our runtime and torch.distributed.pipelining's runtime train the same stages identically.

Same partition, same seeded weights, same micro-batches, same Adam; torch runs its own schedule
class, we run the Program paratwin lowers for the same schedule (two gloo ranks, three steps).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

_BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")


def _benchmark():
    # Imported by name (not from a file spec), so the spawned ranks can import it too.
    if _BENCHMARKS not in sys.path:
        sys.path.insert(0, _BENCHMARKS)
    return importlib.import_module("runtime_vs_torch")


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_same_losses_and_parameters_as_torch_pipelining(schedule: str) -> None:
    bench = _benchmark()
    result = bench.compare(bench.make_plan(schedule, microbatches=4), iterations=2, warmup=1)
    assert len(result["our_losses"]) == len(result["torch_losses"]) == 3
    torch.testing.assert_close(torch.tensor(result["our_losses"]), torch.tensor(result["torch_losses"]),
                               rtol=1e-6, atol=0)
    assert len(result["our_times"]) == len(result["torch_times"]) == 2
    # The same stages, batches and micro-batch order on both sides: every parameter after three
    # Adam steps is bit-identical (the gradient sums run in the same order; any tolerance would let
    # Adam hide a lost or doubled micro-batch in small-gradient elements).
    ours, theirs = result["our_params"], result["torch_params"]
    assert set(ours) == set(theirs) and ours
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), (
            f"{name}: largest difference {(value - theirs[name]).abs().max():.2e}")
