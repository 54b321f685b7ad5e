"""EmbRace's (and the parameter server's) synchronous ids exchange, as the Program models it.

The runtime sends a micro-batch's unique ids on its one thread (exec.embedding.EmbraceExchange.
_request: an all-to-all of the per-peer counts, then one of the ids; no async_op), while it walks the
Program in order (exec.interpreter). So the exchange starts only after the compute before it, the
compute after it waits for it, and it costs two all-to-alls (sim.embedding.synchronous_exchange_pass,
exchange_phases). Behaviour, not timing: the dependencies in the lowering, the engine's schedule,
and the estimate's share of it (EmbeddingTerms.blocking_s), all from the same prices.
"""

from __future__ import annotations

import pytest

from analysis.validation.calibration import ValidationCalibration, with_calibration
from exec.contract import compile_for_run
from sim.compile import compile_plan
from sim.embedding import embedding_tables
from sim.embedding_embrace import alltoall_imbalance, alltoall_s, estimate_terms, exchange_bytes
from sim.embedding_ps import estimate_terms as ps_terms
from sim.embedding_ps import exchange_bytes as ps_bytes
from sim.plan import Plan
from sim.program import Kind
from sim.simulate import simulate

BASE = {"workload": "lstm-tiny", "cluster": {"preset": "local-cpu-2"}, "parallelism": {"dp": 2},
        "schedule": {"micro_batch": 2, "microbatches": 3}}
GPU = {"workload": "gpt-wordlm", "workload_options": {"data": "wikitext-2"}, "dtype": "fp32",
       "cluster": {"preset": "a100-64", "nodes": 2}, "parallelism": {"dp": 16},
       "schedule": {"micro_batch": 8, "microbatches": 3}}
ROWS = "sim/data/embrace_rows_wikitext2.json"
METHODS = [{"method": "embrace", "schedule": "sequential"}, {"method": "embrace", "schedule": "2d"},
           {"method": "ps"}]


def plan(base: dict, embedding: dict) -> Plan:
    return Plan.from_dict({**base, "name": "emb-sync", "embedding": embedding})


@pytest.mark.parametrize("embedding", METHODS, ids=["sequential", "2d", "ps"])
def test_the_ids_exchange_holds_the_thread_between_the_computes_around_it(embedding: dict) -> None:
    p = plan(BASE, embedding)
    program = compile_for_run(p).program.ranks[0].instructions
    ids = [i for i in program if i.kind is Kind.ALLTOALL and i.tag.startswith("emb:ids:")]
    assert ids
    for exchange in ids:
        before = [i for i in program[:exchange.index] if i.kind.is_compute]
        after = next(i for i in program[exchange.index + 1:] if i.kind.is_compute)
        if before:  # the thread reaches it once the compute before it has ended
            assert before[-1].index in exchange.deps
        assert exchange.index in after.deps  # and runs nothing else until it has ended
        assert exchange.phases == (("counts", 2 * 8), ("all_to_all", exchange.bytes))
    others = [i for i in program if i.kind is Kind.ALLTOALL and not i.tag.startswith("emb:ids:")]
    for i in others:  # rows, gradients: one each; the push: its indices, then its values
        if i.tag.startswith("emb:push:"):
            index_bytes = next(e.bytes for e in ids)  # the pull's ids, 8 bytes each: the push's indices
            assert i.phases == (("all_to_all", index_bytes), ("all_to_all", i.bytes - index_bytes))
        else:
            assert i.phases == (("all_to_all", i.bytes),)
    if embedding.get("schedule") == "2d":  # the dense step waits for every prefetched ids exchange
        dense = [i for i in program if i.kind is Kind.OPTIMIZER_STEP and not i.method]
        assert {i.index for i in ids} <= set(dense[0].deps)


def _rows(table, label: str):
    return table[table["name"] == label].iloc[0]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_sequential_looks_up_once_the_thread_gets_there(schedule: str) -> None:
    # GPipe runs every forward first: the thread reaches micro-batch mb's lookup when the forward of
    # mb - 1 ends (asynchronous, it would run under that forward). 1F1B at pp 1 runs each micro-batch's
    # forward and backward in turn: the lookup queues behind the backward's gradient exchange.
    base = {**GPU, "schedule": {**GPU["schedule"], "name": schedule}}
    result = simulate(plan(base, {"method": "embrace", "schedule": "sequential", "row_stats": ROWS}))
    t = result.table[(result.table["rank"] == 0) & (result.table["parent"] == -1)]
    for mb in (1, 2):
        ids = _rows(t, f"ALLTOALL s0 mb{mb} emb:ids:{mb}:0:0:0")
        before = _rows(t, f"FWD s0 mb{mb - 1}") if schedule == "gpipe" else \
            _rows(t, f"ALLTOALL s0 mb{mb - 1} emb:grads:{mb - 1}:0:0:0")
        assert ids["start_s"] == pytest.approx(before["end_s"])


def test_a_synchronous_exchange_pays_the_calibrations_message_overhead_once() -> None:
    # The ids request meets the other rank's thread after unaligned work; a calibration measures what
    # a message costs in a run beyond the benchmark (analysis.validation.runtime_costs) and the ids
    # exchange pays it once, in the engine and the estimate. Rows and gradients are not meetings.
    p = plan(GPU, {"method": "embrace", "schedule": "sequential", "row_stats": ROWS})
    compiled = compile_plan(p)
    overhead = 5e-4
    calibrated = with_calibration(compiled.resolved, ValidationCalibration(p2p_overhead_s=overhead))

    def durations(resolved) -> dict[str, float]:
        t = simulate(p, resolved=resolved).table
        t = t[(t["rank"] == 0) & (t["parent"] == -1) & (t["kind"] == "ALLTOALL")]
        return dict(zip(t["name"], t["end_s"] - t["start_s"], strict=True))

    plain, paid = durations(compiled.resolved), durations(calibrated)
    assert len(plain) == 9
    for name, seconds in plain.items():
        assert paid[name] == pytest.approx(seconds + (overhead if "emb:ids:" in name else 0.0)), name
    sizes = exchange_bytes(p, embedding_tables(p.workload, p.workload_options))
    imbalance = alltoall_imbalance(p)
    assert alltoall_s(p, calibrated.comm, "ids", sizes["ids"], imbalance) == \
        pytest.approx(alltoall_s(p, compiled.resolved.comm, "ids", sizes["ids"], imbalance) + overhead)


def test_the_push_costs_its_two_all_to_alls_one_after_the_other() -> None:
    # exec.embedding_ps._push launches the indices and the values asynchronously, together; on a
    # shared link they end when one after the other would: engine and estimate price both.
    p = plan({**GPU, "schedule": {"micro_batch": 8, "microbatches": 2}}, {"method": "ps", "row_stats": ROWS})
    result, compiled = simulate(p), compile_plan(p)
    t = result.table[(result.table["rank"] == 0) & (result.table["parent"] == -1)]
    push = t[t["name"].str.contains("emb:push:")].iloc[0]
    comm, group = compiled.resolved.comm, tuple(range(16))
    imbalance = compiled.program.alltoall_imbalance
    sizes = ps_bytes(p, embedding_tables(p.workload, p.workload_options))
    two = sum(comm.collective_s("all_to_all", round(b * imbalance), group)
              for b in (sizes["ids"], sizes["push"] - sizes["ids"]))
    assert push["end_s"] - push["start_s"] == pytest.approx(two)
    assert two > comm.collective_s("all_to_all", round(sizes["push"] * imbalance), group)  # one latency more
    resolved = compiled.resolved
    terms = ps_terms(p, [tuple(range(resolved.costs.num_layers))], comm, resolved.costs, [0], [(0,)])
    assert terms.last_grads_s == pytest.approx(two)


def test_2d_dense_step_waits_for_the_ids_chain_the_estimate_charges() -> None:
    p = plan(GPU, {"method": "embrace", "schedule": "2d", "row_stats": ROWS})
    result = simulate(p)
    t = result.table[(result.table["rank"] == 0) & (result.table["parent"] == -1)]
    ids = t[t["name"].str.contains("emb:ids:")].sort_values("start_s")
    steps = t[t["kind"] == "OPTIMIZER_STEP"].sort_values("start_s")
    dense = steps.iloc[-1]
    assert len(ids) == 3 and len(steps) == 2
    assert dense["start_s"] == pytest.approx(ids["end_s"].max())
    # m ids exchanges and the m - 1 rows between them, back to back on the collective stream
    comm = compile_plan(p).resolved.comm
    sizes = exchange_bytes(p, embedding_tables(p.workload, p.workload_options))
    imbalance = alltoall_imbalance(p)
    chain = 3 * alltoall_s(p, comm, "ids", sizes["ids"], imbalance) + 2 * alltoall_s(p, comm, "rows", sizes["rows"],
                                                                                   imbalance)
    assert ids["end_s"].max() - ids["start_s"].min() == pytest.approx(chain)
    resolved = compile_plan(p).resolved
    terms = estimate_terms(p, [tuple(range(resolved.costs.num_layers))], comm, resolved.costs, [0], [(0,)])
    assert terms.blocking_s == pytest.approx(chain)  # the estimate adds it before the dense step
