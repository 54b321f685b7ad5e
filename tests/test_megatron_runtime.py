"""``workload_options: {implementation: megatron-lm}`` end to end on two gloo ranks (gpt-tiny, pp 2):
the run executes the simulator's instruction table for the plan, the ranks build Megatron-LM's model
(unfused attention, dropout 0.1 in its four places, a head tied to the token table) and the two
copies of the tied matrix stay equal; an option set next to the line wins in the run too."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from exec.contract import compile_for_run
from exec.interpreter import RankRuntime
from exec.launcher import run_plan
from exec.workloads.gpt import Attention, Block, Embedding, Head
from sim.implementations import MEGATRON_DROPOUT, MEGATRON_LM
from sim.plan import Plan
from sim.simulate import simulate
from sim.tied_embedding import TIED_TAG
from tests.test_runtime import plan_of

pytestmark = pytest.mark.slow

# The columns a run and the simulator share that do not depend on time or memory: which instruction.
SPINE = ["rank", "index", "kind", "stage", "microbatch", "stream", "name"]


def megatron_plan(**options: object) -> Plan:
    """gpt-tiny as Megatron-LM ran GPT, dp 1 tp 1 pp 2 on local-cpu-2: pp 2 is where the runtime can tie
    (exec.contract.compile_for_run refuses a tied head at pp 1, at tp > 1 and with the distributed optimizer)."""
    return plan_of(pp=2, microbatches=2, micro_batch=2).replace(
        name="megatron-" + "-".join(f"{k}{v}" for k, v in options.items()),
        workload_options={"implementation": MEGATRON_LM, **options})


def as_a_rank_reads_it(plan: Plan) -> Plan:
    """The plan as ``exec.launcher._spawned`` hands it to ``run_rank``: dumped, then read back."""
    return Plan.from_dict(plan.model_dump())


def built_modules(plan: Plan, rank: int) -> dict[int, torch.nn.Module]:
    """The layers ``run_rank`` builds on ``rank`` (``compile_for_run`` then ``RankRuntime``), before any
    step. Built here, in this process: a forked rank's modules cannot be looked at from outside."""
    return RankRuntime(compile_for_run(plan), rank, torch.device("cpu")).layer_modules


def spine(table: pd.DataFrame) -> list[tuple]:
    top = table[table["parent"] == -1]  # child rows are a run-time policy's decisions
    return sorted(top[SPINE].itertuples(index=False, name=None))


def test_a_megatron_lm_plan_runs_as_the_simulator_lowers_it(tmp_path: Path) -> None:
    plan = megatron_plan()
    received = as_a_rank_reads_it(plan)
    assert "implementation" not in received.workload_options

    # What the ranks build: Megatron-LM's unfused attention, dropout 0.1 where Megatron-LM has it,
    # and the head's projection starting as the token table (on the other stage's rank).
    modules = {rank: built_modules(received, rank) for rank in range(plan.world_size)}
    layers = {i: m for per_rank in modules.values() for i, m in per_rank.items()}
    attention = [m for layer in layers.values() for m in layer.modules() if isinstance(m, Attention)]
    blocks = [m for m in layers.values() if isinstance(m, Block)]
    (embedding,) = [m for m in layers.values() if isinstance(m, Embedding)]
    (head,) = [m for m in layers.values() if isinstance(m, Head)]
    assert attention and len(attention) == len(blocks)
    assert {(a.implementation, a.dropout) for a in attention} == {("unfused", MEGATRON_DROPOUT)}
    assert {b.dropout for b in blocks} == {MEGATRON_DROPOUT} and embedding.dropout == MEGATRON_DROPOUT
    assert embedding in modules[0].values() and head in modules[1].values()  # one copy on each stage
    torch.testing.assert_close(head.out.weight, embedding.tok.weight, rtol=0, atol=0)

    result = run_plan(plan, iterations=1, warmup=1, out_dir=tmp_path / plan.name, timeout_s=120, save_params=True)

    # The project's spine: every measured iteration runs exactly the simulator's instruction table,
    # the tied embedding's all-reduce (one on each stage) included.
    run = compile_for_run(plan)
    simulated = simulate(plan, costs=run.resolved.costs, full=True).table
    tied = simulated[simulated["name"].str.contains(f" {TIED_TAG}:", regex=False)]
    assert sorted(tied["rank"]) == [0, 1] and set(tied["kind"]) == {"ALLREDUCE"}
    expected = spine(simulated)
    # Bytes: a point-to-point row's as the simulator's. The simulator's table leaves a collective's at 0
    # (its sizes are the instruction's phases, which price the head's whole gradient, final LayerNorm
    # included: sim.tied_embedding_bytes), so the tied all-reduce's are checked against the tied matrix.
    p2p = simulated[(simulated["parent"] == -1) & simulated["stream"].str.startswith("p2p")]
    p2p_bytes = sorted(p2p[["rank", "index", "bytes"]].itertuples(index=False, name=None))
    matrix = head.out.weight.numel() * head.out.weight.element_size()
    tied_bytes = sorted((int(r), int(i), matrix) for r, i in tied[["rank", "index"]].itertuples(index=False))
    assert all(b > 0 for *_, b in tied_bytes + p2p_bytes)
    for _, rows in result.table.groupby("iteration"):
        assert spine(rows) == expected
        ran = rows.set_index(["rank", "index"])["bytes"]
        assert sorted((r, i, int(ran[(r, i)])) for r, i, _ in p2p_bytes) == p2p_bytes
        assert sorted((r, i, int(ran[(r, i)])) for r, i, _ in tied_bytes) == tied_bytes

    # The two copies of the tied matrix, summed gradients and the same Adam steps: equal after them,
    # and moved from where they started (so equal is not "never stepped").
    params = [torch.load(result.paths["params"] / f"rank{r}.pt") for r in range(plan.world_size)]
    table = params[0]["0.tok.weight"]
    projection = params[1][f"{max(layers)}.out.weight"]
    torch.testing.assert_close(projection, table, rtol=0, atol=1e-7)
    assert not torch.equal(table, embedding.tok.weight.detach())

    # An option set next to the line wins in the ranks too: the same plan with dropout 0 builds no
    # dropout and trains differently from the first step on (so the first run's ranks did drop).
    no_dropout = megatron_plan(dropout=0.0)
    assert no_dropout.workload_options["attention"] == "unfused" and no_dropout.workload_options["tied_embedding"]
    assert {a.dropout for m in built_modules(as_a_rank_reads_it(no_dropout), 0).values()
            for a in m.modules() if isinstance(a, Attention)} == {0.0}
    plain = run_plan(no_dropout, iterations=1, warmup=1, out_dir=tmp_path / no_dropout.name, timeout_s=120)
    assert plain.losses[0] != result.losses[0]
