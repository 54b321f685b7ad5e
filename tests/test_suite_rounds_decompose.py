"""scripts/suite_rounds_decompose.py (issue 12, eighth session): the parts of an iteration add up to
it on a real simulated EmbRace 2D table, the synchronous exchanges are the ids/rows all-to-alls, and
the time beside collectives is a union (overlapping collectives counted once)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from sim.costs import UniformCosts
from sim.plan import Plan
from sim.simulate import simulate
from tests.script_module import load_script

ROOT = Path(__file__).resolve().parents[1]


def _module():
    return load_script("scripts/suite_rounds_decompose.py")


def test_union_of_intervals_counts_overlaps_once() -> None:
    m = _module()
    assert m._covered(0.0, 10.0, [(1.0, 4.0), (3.0, 6.0), (8.0, 12.0), (-5.0, -1.0)]) == pytest.approx(7.0)
    assert m._covered(0.0, 10.0, []) == 0.0


def test_parts_add_up_on_a_simulated_embrace_2d_iteration() -> None:
    m = _module()
    plan = Plan.load(ROOT / "examples/validation/embedding/emb-embrace-2d-dp2.yaml").replace(profile=None)
    costs = UniformCosts(num_layers=6, fwd_s=1e-3, bwd_input_s=1e-3, bwd_weight_s=1e-3)  # no CPU profile needed
    table = simulate(plan, costs=costs, full=True).table
    parts = m.decompose(table).iloc[0]
    assert sum(parts[p] for p in m.PARTS) == pytest.approx(parts["iter"])
    top = table[(table.parent < 0) & (table["rank"] == table.groupby("rank").end_s.max().idxmax())]
    sync = top[(top.kind == "ALLTOALL") & top.name.str.contains("emb:ids|emb:rows")]
    assert len(sync) == 4  # 2D: ids and rows of both micro-batches of the next iteration
    assert parts["sync_exch"] == pytest.approx(float((sync.end_s - sync.start_s).sum()))
    assert parts["idle"] >= -1e-9
    # against itself every forward and backward is at 1.0
    ratios = m.compute_beside_transfers(table.assign(iteration=0), table)
    assert len(ratios) == 8 and ratios.ratio.tolist() == pytest.approx([1.0] * 8)
    assert isinstance(ratios, pd.DataFrame)
