"""benchmarks/sim_speed.py (``make bench``, docs/simulator.md) runs its documented default: full mode up
to 1,024 GPUs. The simulator's size guard refused that plan (an estimated 6.6e5 instructions over the 5e5
limit) and the benchmark stopped with a ConfigError; it now lifts the guard for its own run only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import sim.compile
from tests.script_module import load_script
from traces.errors import ConfigError


def test_default_run_passes_the_size_guard_and_restores_it(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_script("benchmarks/sim_speed.py")
    simulated: list[tuple[str, bool]] = []

    def guarded_simulate(plan, full, resolved):  # the real guard, without the minutes of simulation
        sim.compile.check_size(plan, full=full)
        simulated.append((plan.name, full))
        return SimpleNamespace(iteration_s=1.0, events=1)

    monkeypatch.setattr(bench, "resolve_plan", lambda plan: None)
    monkeypatch.setattr(bench, "simulate", guarded_simulate)
    monkeypatch.setattr("sys.argv", ["sim_speed.py", "--repeats", "1"])
    limit = sim.compile.MAX_INSTRUCTIONS
    bench.main()
    assert ("gpt-175b-1024", True) in simulated and ("gpt-175b-4096", True) not in simulated
    assert limit == sim.compile.MAX_INSTRUCTIONS  # the guard is back for everyone else
    with pytest.raises(ConfigError):  # and still refuses the same plan outside the benchmark
        sim.compile.check_size(bench.plan_for(1024), full=True)
