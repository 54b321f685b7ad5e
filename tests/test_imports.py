"""The import rule (README, Layout): ``sim`` never imports torch; ``exec`` never imports the simpy
engine, only the Plan/Program types and the compile step."""

from __future__ import annotations

import subprocess
import sys

import pytest


def loaded_after(modules: list[str]) -> set[str]:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "print(' '.join(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return set(done.stdout.split())


def test_sim_does_not_import_torch() -> None:
    loaded = loaded_after(["sim.simulate", "sim.compile", "sim.lower", "sim.engine", "sim.analytic_costs",
                           "sim.bundle_costs", "sim.calibration", "sim.admm_whatif"])
    assert "torch" not in loaded


@pytest.mark.parametrize("module", ["exec.runtime", "exec.launcher"])
def test_exec_does_not_import_the_simulator_engine(module: str) -> None:
    loaded = loaded_after([module])
    assert "simpy" not in loaded
    assert not {"sim.engine", "sim.simulate"} & loaded
