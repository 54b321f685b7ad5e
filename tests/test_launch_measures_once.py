"""A launch measures the plan's structural costs once, in the launcher, and its ranks take that
measurement (exec.structure.StructuralCosts(measured=...)): measuring in every rank was most of a
small model's launch (docs/runtime.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

import exec.structure
from exec.contract import compile_for_run
from sim.plan import Plan
from tests.forked import run_script

PLAN = {"name": "measure-once", "workload": "gpt-tiny", "cluster": {"preset": "local-cpu-2"},
        "parallelism": {"pp": 2}, "schedule": {"name": "1f1b", "micro_batch": 1, "microbatches": 2}}

# Every rank forked from the forkserver imports this script as __mp_main__ first, and there loses
# measure_layers: a rank that measured would fail the launch. The launcher (__main__) measures.
LAUNCH_WITHOUT_MEASURING_IN_RANKS = f"""
import sys

if __name__ == "__mp_main__":
    import exec.structure

    def refuse(*args, **kwargs):
        raise AssertionError("a rank measured the structural costs the launcher had measured")

    exec.structure.measure_layers = refuse

if __name__ == "__main__":
    from exec.launcher import run_plan
    from sim.plan import Plan

    run_plan(Plan.from_dict({PLAN!r}), iterations=1, warmup=0, out_dir=sys.argv[1], timeout_s=120)
"""


def test_a_compile_given_earlier_measurements_measures_nothing_and_compiles_the_same(monkeypatch) -> None:
    plan = Plan.from_dict(PLAN)
    first = compile_for_run(plan)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured again")

    monkeypatch.setattr(exec.structure, "measure_layers", refuse)
    again = compile_for_run(plan, first.structure.measured)
    assert again.structure.measured == first.structure.measured
    assert again.program.ranks == first.program.ranks


@pytest.mark.slow
def test_a_launchs_ranks_take_the_launchers_measurements(tmp_path: Path) -> None:
    run_script(LAUNCH_WITHOUT_MEASURING_IN_RANKS, tmp_path, str(tmp_path / "run"))
