"""Both engines interpret every instruction kind a Program can hold: a kind added to
``sim.program.Kind`` without a simulator and a runtime handler fails here."""

from __future__ import annotations

from exec.interpreter import RankRuntime
from sim.costs import UniformCosts
from sim.plan import Plan
from sim.program import Kind
from sim.simulate import simulate

COSTS = UniformCosts(num_layers=4, saved_bytes=1 << 16, output_bytes=1 << 12, param_bytes=1 << 20)
PLANS = [  # between them, every kind
    {"parallelism": {"pp": 2}, "schedule": {"name": "zb-h1", "microbatches": 4},
     "memory": {"policy": "none", "swap": [0.5, 0.5]}},
    {"parallelism": {"pp": 2, "dp": 2}, "cluster": {"preset": "local-cpu-2", "devices_per_node": 4},
     "schedule": {"name": "1f1b", "microbatches": 4}, "memory": {"policy": "full"}},
    {"parallelism": {"dp": 2}, "schedule": {"microbatches": 2}, "embedding": {"method": "embrace"}},
    {"parallelism": {"dp": 2}, "schedule": {"microbatches": 2}, "embedding": {"method": "ps"}},
    # DELTA deciding at run time: DECIDE instructions (prefetch, return). The budget is above the 8 MiB
    # of model state a rank holds (DELTA refuses a budget its optimizer step cannot meet) and below
    # its 8.5 MiB with every activation kept.
    {"parallelism": {"pp": 2}, "schedule": {"name": "gpipe", "microbatches": 4},
     "memory": {"policy": "delta", "budget_gb": 0.008, "decide": "runtime", "tiny_mb": 0}},
]


def test_the_simulator_executes_every_kind() -> None:
    executed: set[str] = set()
    for fields in PLANS:
        result = simulate(Plan.from_dict({"workload": "gpt-tiny", **fields}), full=True, costs=COSTS)
        top = result.table[result.table["parent"] == -1]
        assert (top["end_s"] >= top["start_s"]).all()
        executed |= set(top["kind"])
    assert executed == {kind.value for kind in Kind}


def test_the_runtime_has_a_handler_for_every_kind() -> None:
    assert set(RankRuntime.HANDLERS) == set(Kind)
    assert all(callable(getattr(RankRuntime, name)) for name in RankRuntime.HANDLERS.values())
