"""Compute slowed while its rank moves data (issue 12, seventh session): ``EngineOptions.overlap_slowdown``
counts only the time a transfer overlaps the compute, and only while data moves (not while a
collective waits for its group); on a host whose cores the ranks share, a measured communication
CPU cost slows the overlapped compute by the cores it takes (``sim.host_cpu``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.costs import UniformCosts
from sim.engine import EngineOptions
from sim.plan import Plan
from sim.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "examples" / "validation" / "embedding"
COSTS = UniformCosts(num_layers=6, fwd_s=1e-3, bwd_input_s=1e-3, bwd_weight_s=1e-3, saved_bytes=1 << 20,
                     output_bytes=1 << 16, param_bytes=1 << 22)


def rank0(plan: Plan, full: bool, **options: object) -> tuple[float, dict[int, tuple[float, float]]]:
    result = simulate(plan, costs=COSTS, full=full, options=EngineOptions(**options))  # type: ignore[arg-type]
    rows = result.table[(result.table["rank"] == 0) & (result.table["parent"] < 0)]
    return result.iteration_s, {int(i): (float(b), float(e)) for i, b, e in zip(rows["index"], rows["start_s"],
                                                                                 rows["end_s"], strict=True)}


@pytest.mark.parametrize("full", [False, True])
def test_the_2d_forward_is_slowed_only_while_the_gradient_exchange_moves_data(full: bool) -> None:
    plan = Plan.load(PLANS / "emb-embrace-2d-dp2.yaml").replace(profile=None)
    _, before = rank0(plan, full)
    s = 1.0
    _, after = rank0(plan, full, overlap_slowdown=s)
    fwd, exchange = 3, 2  # FWD mb1 starts with the gradient exchange of mb0 (docs/embrace.md, 2D schedule)
    assert plan.embedding.schedule == "2d"
    assert before[fwd][0] == before[exchange][0]
    moving = before[exchange][1] - before[exchange][0]
    compute = before[fwd][1] - before[fwd][0]
    assert 0 < moving < compute
    # while it moves, the forward progresses 1 / (1 + s) as fast: it ends moving x s / (1 + s) later
    assert after[fwd][1] - after[fwd][0] == pytest.approx(compute + moving * s / (1 + s), rel=1e-9)
    assert after[0] == before[0] and after[1] == before[1]  # nothing overlaps the first micro-batch


@pytest.mark.parametrize("name", ["dense", "embrace-seq"])
def test_a_schedule_whose_compute_overlaps_no_transfer_is_not_slowed(name: str) -> None:
    plan = Plan.load(PLANS / f"emb-{name}-dp2.yaml").replace(profile=None)
    assert rank0(plan, True, overlap_slowdown=2.0)[0] == rank0(plan, True)[0]
