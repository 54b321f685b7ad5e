"""Buckets launched together (issue 12, docs/embrace.md "Concurrent all-reduces").

The runtime launches a plan's gradient buckets at once; on gloo they share the link and the CPU
(scripts/probe_concurrent_allreduce.py), so the last one ends about when one after the other would
have, while each lasts about as long as all of them. The engine's collective stream runs them one
after the other, each at the cluster's price: the same end, the same time in flight. These tests
hold the engine to that and the decomposition to comparing the time in flight, not instruction by
instruction.
"""

from __future__ import annotations

import pandas as pd
import pytest

from sim.compile import compile_plan
from sim.plan import Plan
from sim.simulate import simulate
from tests.script_module import load_script

# The dense validation plan's model, buckets and schedule (examples/validation/embedding/
# emb-dense-dp2.yaml) on one 8-GPU node: the analytic model does not price CPUs.
DENSE = {"name": "emb-dense-gpu", "workload": "gpt-wordlm",
         "workload_options": {"data": "wikitext-2", "hidden": 64, "heads": 2, "seq": 32}, "dtype": "fp32",
         "cluster": {"preset": "a100-64", "nodes": 1}, "parallelism": {"dp": 8},
         "schedule": {"micro_batch": 4, "microbatches": 2},
         "gradient_sync": {"method": "allreduce", "bucket_mb": 4}, "embedding": {"method": "dense"}}


def _decompose():
    return load_script("scripts/suite_decompose.py")


def test_buckets_launched_together_end_when_one_after_the_other_would() -> None:
    plan = Plan.from_dict(DENSE)
    comm = compile_plan(plan).resolved.comm
    rows = simulate(plan).table
    buckets = rows[(rows["rank"] == 0) & (rows["kind"] == "ALLREDUCE") & (rows["parent"] == -1)].sort_values("start_s")
    assert len(buckets) == 2  # the plan's two 4 MB buckets, launched together after the last backward
    priced = sum(comm.collective_s("all_reduce", int(b), tuple(range(8))) for b in buckets["bytes"])
    assert buckets["end_s"].max() - buckets["start_s"].min() == pytest.approx(priced, rel=1e-9)
    assert _decompose().busy_s(buckets) == pytest.approx(priced, rel=1e-9)


def test_the_time_in_flight_counts_overlapping_collectives_once() -> None:
    busy_s = _decompose().busy_s
    together = pd.DataFrame({"start_s": [0.0, 0.001, 0.030], "end_s": [0.012, 0.013, 0.031]})
    assert busy_s(together) == pytest.approx(0.013 + 0.001)  # [0, 13 ms) and [30, 31 ms)
    assert busy_s(together.iloc[:0]) == 0.0
