"""The fast estimate (sim/estimate.py) agrees with the engine on a grid of simulated plans: every registered
schedule, pipelines shallower and deeper than the micro-batch count, TP and DP, and a heavy LM head on the
last stage (analysis/estimate_grid.py). The search ranks plans by the estimate, so a regime where the two
part is a regime where the search picks the wrong plan."""

from __future__ import annotations

import pytest

from analysis.estimate_grid import compare, estimate_plan
from sim.schedules import SCHEDULES
from sim.simulate import simulate

# The estimate leaves out contention between concurrent transfers and the engine's queueing of a rank's
# sends on one stream. On the full grid (python -m analysis.estimate_grid, session 9) the one-node and
# InfiniBand plans are exact (0.60% before issue 12g: the capped extension); over 25 Gbit/s Ethernet
# 19 of 1,216 plans (pp 4 and 8, mostly without recompute) are 2-11.2% under the engine (likely sends queued,
# not verified); the quick grid's Ethernet plans (pp 2 and 4, full recompute) are within 0.03%.
TOLERANCE = 0.02


@pytest.fixture(scope="module")
def grid():
    return compare(quick=True)


def test_the_estimate_is_within_tolerance_of_the_engine_on_every_grid_plan(grid) -> None:
    assert set(grid["schedule"]) == set(SCHEDULES)  # a newly registered schedule is covered
    assert {"m < pp", "m = pp", "m > pp"} <= set(grid["regime"])
    # hops short against the stages, and long enough that they set the steady state of a capped run
    # (extended by compute alone, 18 of these 36 plans were off, 11 beyond the tolerance, -7.5% at worst; issue 12g)
    assert {"ib", "eth"} <= set(grid["network"])
    worst = grid.loc[grid["rel"].abs().idxmax()]
    assert abs(worst["rel"]) <= TOLERANCE, worst.to_dict()


def test_the_vtrain_plans_with_two_microbatches_on_four_stages_are_priced_as_the_engine_prices_them() -> None:
    """The regime that exposed the bug: Megatron's partition (the LM head on the last stage beside six
    blocks), pp 4, 2 micro-batches; the old closed form was 4-14% slower than the engine here."""
    from analysis.calibrate import load_rows, row_to_plan

    rows = load_rows()
    rows = rows[(rows["pp"] == 4) & (rows["global_batch"] == 2 * rows["micro_batch"] * rows["dp"])]
    for row in rows.drop_duplicates(["tp", "hidden"]).head(4).to_dict("records"):
        plan = row_to_plan(row)
        engine = simulate(plan).iteration_s
        assert estimate_plan(plan).iteration_s == pytest.approx(engine, rel=0.005), row


@pytest.mark.parametrize("memory", ["none", "selective-attention"])
def test_sequence_parallel_plans_are_priced_and_held_as_the_engine_prices_and_holds_them(memory) -> None:
    """Sequence parallelism (reduce-scatter + all-gather per TP all-reduce, the layernorm / dropout region on
    1/t of the sequence) and Korthikanti's selective recomputation reach the estimate through the same
    LayerCosts and policy view as the engine: the same peak, and the iteration within the grid's tolerance."""
    from sim.plan import Plan

    def plan(sp: bool) -> Plan:
        return Plan.from_dict({"workload": "gpt2-medium",
                               "workload_options": {"attention": "unfused", "dropout": 0.1, "sequence_parallel": sp},
                               "cluster": {"preset": "dgx-a100-8"}, "dtype": "fp16",
                               "parallelism": {"pp": 2, "tp": 4, "dp": 1}, "memory": {"policy": memory},
                               "schedule": {"name": "1f1b", "micro_batch": 2, "microbatches": 4}})

    runs = {}
    for sp in (False, True):
        engine = simulate(plan(sp))
        fast = estimate_plan(plan(sp))
        assert fast.iteration_s == pytest.approx(engine.iteration_s, rel=0.005)
        assert max(fast.peak_bytes) == pytest.approx(max(m.peak_bytes for m in engine.memory.values()), rel=0.005)
        runs[sp] = engine
    # Sequence parallelism holds less. (Its time may go either way: the layernorm / dropout kernels on 1/t of
    # the elements against the backward's re-gather of the column-parallel inputs; here it is slower.)
    peak = {sp: max(m.peak_bytes for m in run.memory.values()) for sp, run in runs.items()}
    assert peak[True] < peak[False]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_autograd_accumulation_pass_is_priced_as_the_engine_prices_it(schedule) -> None:
    """``workload_options.grad_accumulation: autograd`` (docs/accuracy.md section 17): the engine charges the
    accumulation pass to every backward but micro-batch 0's (BWD_W when split); the estimate carries (m - 1) / m
    of it per backward. The bottleneck rank's compute grows by (m - 1) x its layers' passes, exactly; the
    iteration stays within the grid's tolerance and moves as the engine's does (a missing term moves it by 0)."""
    from sim.compile import resolve_plan
    from sim.plan import Plan

    def plan(mode: str) -> Plan:
        return Plan.from_dict({"workload": "gpt2-medium",
                               "workload_options": {"attention": "unfused", "grad_accumulation": mode},
                               "cluster": {"preset": "dgx-a100-8"}, "dtype": "fp16",
                               "parallelism": {"pp": 2, "tp": 2, "dp": 2},
                               "schedule": {"name": schedule, "micro_batch": 2, "microbatches": 4}})

    engine = {mode: simulate(plan(mode)).iteration_s for mode in ("fused", "autograd")}
    fast = {mode: estimate_plan(plan(mode)) for mode in ("fused", "autograd")}
    assert fast["autograd"].iteration_s == pytest.approx(engine["autograd"], rel=0.005)
    moved = fast["autograd"].iteration_s - fast["fused"].iteration_s
    assert moved == pytest.approx(engine["autograd"] - engine["fused"], rel=0.15)
    resolved = resolve_plan(plan("autograd"))
    passes = [(4 - 1) * sum(resolved.costs.layer_costs(layer, 2, 2).grad_accumulate_s for layer in layers)
              for layers in resolved.stage_layers]  # one stage per rank (chunks 1)
    added = fast["autograd"].compute_s - fast["fused"].compute_s
    assert min(passes) > 0 and any(added == pytest.approx(p, rel=1e-9) for p in passes), (added, passes)
    # One estimator, one stage, two micro-batch counts: the stage caches keep them apart.
    from sim.estimate import Estimator

    estimator = Estimator(resolved.costs, resolved.comm, "fp16")
    layers = tuple(resolved.stage_layers[0])
    one, four = (estimator.stage(layers, (), 2, 2, 0, 0.0, accumulate_share=share).compute_s for share in (0.0, 0.75))
    assert four - one == pytest.approx(passes[0] / 4, rel=1e-9)


def _engine_s(plan, gather_rule: bool = True) -> float:
    """The engine's iteration (symmetric, as ``simulate``); ``gather_rule`` False runs a blocking plan with
    its receives' all-gathers back on the receive stream (``Program.gather_after_exchange`` off), which
    leaves the blocking sends' share of the move from async to blocking."""
    import dataclasses

    from sim.compile import compile_plan
    from sim.engine import Engine

    compiled = compile_plan(plan)
    program = compiled.program if gather_rule else dataclasses.replace(compiled.program, gather_after_exchange=False)
    r = compiled.resolved
    return Engine(program, r.costs, r.comm, r.policy, plan.micro_batch, plan.parallelism.tp_overlap).run()


def _head_plan(shape: tuple, p2p: str, scatter_gather: bool = False):
    """gpt2-small at the grid's "head" width, micro-batch 4, full recompute, in ``shape``: (schedule, chunks,
    pp, tp, dp, micro-batches, network)."""
    from analysis.estimate_grid import WORKLOADS, _cluster
    from sim.plan import Plan

    schedule, chunks, pp, tp, dp, m, network = shape
    return Plan.from_dict({
        "workload": "gpt2-small", "workload_options": WORKLOADS["head"], "dtype": "fp16",
        "cluster": _cluster(network, tp * dp * pp, pp), "parallelism": {"tp": tp, "dp": dp, "pp": pp, "chunks": chunks},
        "schedule": {"name": schedule, "micro_batch": 4, "microbatches": m, "p2p": p2p,
                     "p2p_scatter_gather": scatter_gather},
        "memory": {"policy": "full"}})


# (schedule, chunks, pp, tp, dp, micro-batches, network): plain 1F1B and interleaved, inside one node (NVLink
# sends) and one node per pipeline rank (HDR InfiniBand), tp 2 and 4; DualPipeV and ZB-V (V placement: a
# rank's two chunks receive from both neighbours, and the middle boundary, stages pp - 1 and pp, is inside
# one rank, which gathers nothing there; on the pp 2 plan that boundary is on the critical path).
BLOCKING_PLANS = [("1f1b", 1, 2, 2, 2, 8, "node"), ("interleaved-1f1b", 2, 2, 4, 1, 4, "node"),
                  ("1f1b", 1, 4, 2, 1, 8, "ib"), ("interleaved-1f1b", 2, 4, 2, 1, 8, "ib"),
                  ("dualpipev", 2, 2, 2, 2, 4, "ib"), ("dualpipev", 2, 4, 2, 1, 8, "ib"),
                  ("zb-v", 2, 4, 2, 1, 8, "ib")]


@pytest.mark.parametrize("shape", BLOCKING_PLANS, ids=lambda s: "-".join(map(str, s)))
def test_a_blocking_exchange_gather_moves_the_estimate_as_it_moves_the_engine(shape) -> None:
    """Scatter/gather under ``schedule.p2p: blocking`` (docs/accuracy.md section 17): the engine runs a
    receive's TP all-gather after the compute before it and the sends of its exchange, so the gather joins
    the compute path; under async it runs on the receive stream once the pieces arrive (it lengthens the
    hop). The estimate prices both (``Estimator._gathered``, the async hop): its async iteration is the
    engine's, and its move from async to blocking is the engine's whole move (the gather rule's and the
    blocking sends', ``weighted_run(blocking=True)``), to float rounding (rel 1e-6): on these plans the
    weighted pipeline run and the engine take the same durations through the same dependencies (measured
    equal to 1e-13 of the move; a plan whose sends contend would not be exact). Exact because the lowering
    puts each receive right before its consumer (``sim.lower.p2p_pass``, every schedule), so the engine's
    gather waits for the compute before the consumer and the sends since, as the weighted run's stage time
    plus blocking edge do. Only the whole move is compared: the parts are not the same counterfactual in
    the two models (the engine's gather rule alone already holds the sends a receive follows, the
    estimate's does not), which is what left DualPipeV's gather part 17% apart (pp 2 on IB, 0.227 against
    0.272 ms) before the sends were priced (docs/accuracy.md section 17)."""
    def plan(p2p: str):
        return _head_plan(shape, p2p, scatter_gather=True)

    engine_async, engine_blocking = _engine_s(plan("async")), _engine_s(plan("blocking"))
    gather_move = engine_blocking - _engine_s(plan("blocking"), gather_rule=False)
    fast_async, fast_blocking = (estimate_plan(plan(p2p)).iteration_s for p2p in ("async", "blocking"))
    assert fast_async == pytest.approx(engine_async, rel=1e-6)
    assert 0 < gather_move < engine_blocking - engine_async  # both rules move the engine
    assert fast_blocking - fast_async == pytest.approx(engine_blocking - engine_async, rel=1e-6)
    assert abs(fast_blocking / engine_blocking - 1) <= TOLERANCE


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_each_receive_comes_right_before_its_consumer(schedule: str) -> None:
    """What makes ``Estimator._gathered`` the engine's gather rule on every schedule: a blocking exchange's
    all-gather waits for the compute before the receive and the sends since (``sim.engine.exchange_waits``),
    and the estimate puts it at the start of the stage's forward or backward. The two agree only where the
    compute after each receive is the one that consumes it (``sim.lower.p2p_pass``), which V placements,
    receiving from both neighbours, must keep too."""
    from sim.compile import compile_plan
    from sim.program import Stream

    chunks = SCHEDULES[schedule].min_chunks
    program = compile_plan(_head_plan((schedule, chunks, 4, 2, 1, 8, "ib"), "blocking", scatter_gather=True)).program
    receives = 0
    for rank in program.ranks.values():
        for at, ins in enumerate(rank.instructions):
            if ins.stream is Stream.P2P_RECV:
                receives += 1
                consumer = next(c for c in rank.instructions[at + 1:] if c.stream is Stream.COMPUTE)
                assert ins.index in consumer.deps, (ins.label, consumer.label)
    assert receives >= 2 * 3 * 8  # pp 4: at least 3 boundaries between ranks, both ways, 8 micro-batches


# Whole tensors (what the search's blocking plans send), one node and one node per pipeline rank over HDR
# InfiniBand: 1F1B, interleaved and DualPipeV (V placement: a rank's two chunks send both ways).
WHOLE_TENSOR_PLANS = [("1f1b", 1, 2, 2, 2, 8, "node"), ("interleaved-1f1b", 2, 2, 4, 1, 4, "node"),
                      ("1f1b", 1, 4, 2, 1, 8, "ib"), ("interleaved-1f1b", 2, 4, 2, 1, 8, "ib"),
                      ("dualpipev", 2, 4, 2, 1, 8, "ib")]


@pytest.mark.parametrize("shape", WHOLE_TENSOR_PLANS, ids=lambda s: "-".join(map(str, s)))
def test_a_blocking_send_moves_the_estimate_as_it_moves_the_engine(shape) -> None:
    """``schedule.p2p: blocking`` without scatter/gather: the compute after a send waits for its transfer
    (``sim.lower.blocking_p2p_pass``), so a rank's cycle holds its sends and, across nodes, the iteration
    grows (engine, these plans: +0.13%, +0.57%, +1.7%, +6.0%, +3.7%). The estimate puts each send on the
    edge from its sender to the sender's next action (``weighted_run(blocking=True)``): its move from
    async to blocking is the engine's to float rounding (rel 1e-6; measured within 1e-13 of the move:
    the same durations through the same dependencies; sends that contend or a rendezvous, which neither
    models, would part them), so it is within the grid's tolerance across nodes too (before: the move
    was 0, the interleaved IB plan 5.7% under the engine)."""
    engine = {p2p: _engine_s(_head_plan(shape, p2p)) for p2p in ("async", "blocking")}
    fast = {p2p: estimate_plan(_head_plan(shape, p2p)).iteration_s for p2p in ("async", "blocking")}
    assert engine["blocking"] > engine["async"]
    assert fast["blocking"] - fast["async"] == pytest.approx(engine["blocking"] - engine["async"], rel=1e-6)
    assert abs(fast["blocking"] / engine["blocking"] - 1) <= TOLERANCE
