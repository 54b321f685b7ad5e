"""Run a workload on 2 gloo ranks (pp 2, GPipe, four micro-batches of two, fp32) recomputing only the
layers given, each after a kept layer, and print each rank's runtime activation peak and the engine
ledger's (JSON).

    PYTHONPATH=. python tests/recompute_after_kept_run.py                  # resnet-tiny, the head (4)
    PYTHONPATH=. python tests/recompute_after_kept_run.py lstm-tiny 1 3    # lstm-tiny, layers 1 and 3
    MICRO_BATCH=1 PYTHONPATH=. python tests/recompute_after_kept_run.py lstm-tiny   # nothing, micro-batch 1

Run as a script (``tests/test_memory_selective.py`` does, in a subprocess): the policy below is
test-only, and the runtime's ranks re-import the main script, so it registers there too. No
built-in policy recomputes a layer after a kept one (they recompute a prefix of a stage or all
of it); the per-layer planners (the MILP, DELTA) may."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from sim.costs import CostModel
from sim.memory import MEMORY_POLICIES, MemoryConfig, MemoryPolicy, register_memory_policy
from sim.plan import Plan

NAME = "test-recompute-layers"


class RecomputeLayers(MemoryConfig):
    """Test only: recompute exactly ``layers`` (global indices), keep every other layer."""

    policy: Literal["test-recompute-layers"] = "test-recompute-layers"
    layers: list[int]


def build(plan: Plan, stage_layers: Sequence[Sequence[int]], costs: CostModel, capacity_bytes: int) -> MemoryPolicy:
    assert isinstance(plan.memory, RecomputeLayers)
    chosen = set(plan.memory.layers)
    return MemoryPolicy(tuple(tuple(layer for layer in layers if layer in chosen) for layers in stage_layers),
                        (0.0,) * plan.num_stages)


if NAME not in MEMORY_POLICIES:
    register_memory_policy(NAME, RecomputeLayers, build)


def main(out_dir: Path, workload: str, layers: list[int], micro_batch: int = 2) -> dict[str, object]:
    from exec.contract import compile_for_run
    from exec.launcher import run_plan
    from sim.engine import Engine
    from tests.test_runtime import plan_of
    from traces.runrecord import read_run_record

    plan = plan_of(workload=workload, pp=2, schedule="gpipe", microbatches=4, micro_batch=micro_batch)
    plan = plan.model_copy(update={"name": f"{workload}-recompute-after-kept-{micro_batch}",
                                   "memory": Plan.from_dict({"workload": workload, "memory": {
                                       "policy": NAME, "layers": layers}}).memory})
    run = compile_for_run(plan)
    engine = Engine(run.program, run.resolved.costs, run.resolved.comm, run.resolved.policy, plan.micro_batch)
    engine.run()
    run_plan(plan, iterations=1, warmup=1, out_dir=out_dir / plan.name, timeout_s=120)
    measured = read_run_record(out_dir / plan.name / "record").summary["activation_peak"]
    return {"stage_layers": [list(s) for s in run.resolved.stage_layers],
            "recompute_layers": [list(s) for s in run.resolved.policy.recompute_layers],
            "runtime": {str(k): measured[str(k)] for k in sorted(engine.ledgers)},
            "ledger": {str(k): engine.ledgers[k].activation_peak for k in sorted(engine.ledgers)}}


if __name__ == "__main__":
    arguments = sys.argv[1:] or ["resnet-tiny", "4"]
    with tempfile.TemporaryDirectory() as folder:
        print(json.dumps(main(Path(folder), arguments[0], [int(a) for a in arguments[1:]],
                              int(os.environ.get("MICRO_BATCH", "2")))))
