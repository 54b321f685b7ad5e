"""Megatron-LM's tied word embedding (``workload_options: {tied_embedding: true}``, sim.tied_embedding):
the lowering all-reduces its gradient between the first and the last stage before the step, the
engine and the fast estimate price it alike, and the runtime refuses the option."""

from __future__ import annotations

import pytest

from sim.compile import compile_plan, resolve_plan
from sim.estimate import Estimator
from sim.plan import Plan
from sim.program import Kind
from sim.simulate import simulate
from sim.tied_embedding import TIED_TAG, tied_embedding_bytes
from traces.errors import ConfigError


def plan(tied: bool, pp: int = 2, dtype: str = "fp16") -> Plan:
    return Plan.from_dict({
        "name": f"tied-{tied}-pp{pp}", "workload": "gpt2-medium", "cluster": {"preset": "dgx-a100-8"},
        "workload_options": {"tied_embedding": tied}, "dtype": dtype,
        "parallelism": {"dp": 8 // (2 * pp), "tp": 2, "pp": pp},
        "schedule": {"name": "1f1b", "micro_batch": 1, "microbatches": 4}, "memory": {"policy": "full"}})


def estimate(p: Plan) -> float:
    r = resolve_plan(p)
    return Estimator(r.costs, r.comm, p.dtype, p.workload, p.workload_options).estimate(
        schedule="1f1b", dp=p.dp, tp=p.tp, pp=p.pp, chunks=1, micro_batch=1, microbatches=4,
        stage_layers=r.stage_layers, policy=r.policy, tp_overlap=0, sync_method="allreduce", bucket_mb=25.0,
        sync=p.gradient_sync).iteration_s


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_the_first_and_last_stage_all_reduce_the_tied_gradient_before_their_step(dtype: str) -> None:
    p = plan(True, dtype=dtype)
    compiled = compile_plan(p, symmetric=False)
    program, costs = compiled.program, compiled.resolved.costs
    head = program.stage_layers[-1][-1]
    held = 2 if dtype == "bf16" else 1  # bf16 gradients are held (and all-reduced) in fp32 (sim.model_state)
    for rank, rp in program.ranks.items():
        tied = [i for i in rp.instructions if i.tag.startswith(TIED_TAG)]
        assert len(tied) == 1, rank
        (ins,) = tied
        c = program.coords_of(rank)
        assert ins.kind is Kind.ALLREDUCE and ins.group == (program.rank_of(c.dp, 0, c.tp),
                                                            program.rank_of(c.dp, 1, c.tp))
        assert ins.phases == (("allreduce", held * costs.layer_costs(head, 1, 2).grad_bytes),)
        assert ins.phases[0][1] == tied_embedding_bytes(costs.layer_costs(head, 1, 2), held)
        step = next(i for i in rp.instructions if i.kind is Kind.OPTIMIZER_STEP)
        assert ins.index in step.deps
        assert all(i.index in ins.deps for i in rp.instructions if i.kind is Kind.ALLREDUCE and i is not ins)
    for untied in (plan(False), plan(True, pp=1)):  # untied, or one stage holding the one matrix
        assert not any(i.tag.startswith(TIED_TAG) for rp in compile_plan(untied).program.ranks.values()
                       for i in rp.instructions)


def test_engine_and_estimate_price_it_alike() -> None:
    tied, untied = plan(True), plan(False)
    engine = {p.name: simulate(p).iteration_s for p in (tied, untied)}
    full = simulate(tied, full=True).iteration_s
    est = {p.name: estimate(p) for p in (tied, untied)}
    added = engine[tied.name] - engine[untied.name]
    assert added > 0
    assert est[tied.name] - est[untied.name] == pytest.approx(added, rel=1e-6)
    assert est[tied.name] == pytest.approx(engine[tied.name], rel=1e-9)
    assert full == pytest.approx(engine[tied.name], rel=1e-9)


def test_the_runtime_refuses_what_it_cannot_tie() -> None:
    from exec.contract import compile_for_run
    from tests.test_runtime import plan_of

    for pp, tp in ((1, 2), (2, 2), (1, 1)):  # one rank holds both, or TP splits the head but not the table
        with pytest.raises(ConfigError) as error:
            compile_for_run(plan_of(pp=pp, tp=tp).replace(workload_options={"tied_embedding": True}))
        assert error.value.field == "workload_options.tied_embedding"


def test_the_two_stages_copies_stay_equal_on_two_gloo_ranks(tmp_path) -> None:  # noqa: ANN001
    """gpt-tiny, pp 2 (the token table on rank 0, the head on rank 1), three Adam steps: the two copies
    start equal, their gradients are summed before each step, so they stay equal (untied, the two
    matrices are unrelated)."""
    import torch

    from exec.launcher import run_plan
    from tests.test_runtime import plan_of

    final, losses = {}, {}
    for tied in (True, False):
        p = plan_of(pp=2, microbatches=2, micro_batch=2).replace(name=f"tied-{tied}",
                                                                 workload_options={"tied_embedding": tied})
        result = run_plan(p, iterations=2, warmup=1, out_dir=tmp_path / p.name, timeout_s=120, save_params=True)
        final[tied] = [torch.load(result.paths["params"] / f"rank{r}.pt") for r in range(2)]
        losses[tied] = result.losses
    head = max(int(k.split(".")[0]) for k in final[True][1])
    table, projection = final[True][0]["0.tok.weight"], final[True][1][f"{head}.out.weight"]
    torch.testing.assert_close(projection, table, rtol=0, atol=1e-7)
    assert not torch.allclose(final[False][1][f"{head}.out.weight"], final[False][0]["0.tok.weight"])
    assert losses[True] != losses[False]  # the head starts as the table: another model
    assert losses[True][-1] < losses[True][0]  # which trains
