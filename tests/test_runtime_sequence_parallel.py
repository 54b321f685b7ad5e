"""Sequence parallelism in the runtime (``workload_options: {sequence_parallel: true}``,
exec.parallel.sequence; Korthikanti et al. 2022, section 4.2.2), on real gloo ranks.

The same training as the single-process reference and as the TP run without it (the layernorm,
bias and residual region on 1/tp of the sequence changes only the order of some fp32 sums); the
layernorm weights and row-parallel biases, which see a sequence shard each, stay bit-identical on
the TP ranks (their gradients are all-reduced over the TP group before the step); each rank holds
the activations the ledger says, and they are fewer than without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from exec.contract import compile_for_run
from exec.launcher import run_plan
from exec.structure import StructuralCosts
from exec.workloads import get_workload
from sim.engine import Engine
from sim.plan import Plan
from sim.workloads import transformer_config, transformer_layers
from tests.test_runtime import check_against_reference, key_bias_mask, plan_of


def sequence_parallel(plan: Plan) -> Plan:
    return plan.replace(name=f"{plan.name}-sp", workload_options={**plan.workload_options, "sequence_parallel": True})


def ledger_peaks(plan: Plan) -> dict[int, int]:
    run = compile_for_run(plan)
    engine = Engine(run.program, run.resolved.costs, run.resolved.comm, run.resolved.policy, plan.micro_batch)
    engine.run()
    return {rank: engine.ledgers[rank].activation_peak for rank in range(plan.world_size)}


def measured_peaks(run_dir: Path, plan: Plan) -> dict[int, int]:
    return {rank: max(json.loads(line)["activation_peak"]
                      for line in (run_dir / "ranks" / f"rank{rank}.jsonl").read_text().splitlines() if line.strip())
            for rank in range(plan.world_size)}


def params_of(run_dir: Path, plan: Plan) -> dict[int, dict[str, torch.Tensor]]:
    return {rank: torch.load(run_dir / "params" / f"rank{rank}.pt") for rank in range(plan.world_size)}


@pytest.mark.slow
@pytest.mark.parametrize(("pp", "recompute"), [(1, "none"), (2, "none"), (2, "full")],
                         ids=["tp2", "tp2-pp2", "tp2-pp2-full-recompute"])
def test_sequence_parallel_trains_as_tp_and_holds_what_the_ledger_says(pp: int, recompute: str, tmp_path: Path) -> None:
    """Under full recomputation each checkpointed block keeps its input: with sequence parallelism
    the 1/t shard (Korthikanti et al.'s eq. 5), in the ledger and in the runtime alike."""
    tp = plan_of(tp=2, pp=pp, schedule="1f1b", microbatches=2 * pp, recompute=recompute)
    sp = sequence_parallel(tp)
    result = check_against_reference(sp, tmp_path)  # the derived fp32 bounds; replicas (layernorms) bit-equal
    # Stage boundaries carry one TP rank's sequence shard, whole, as the Program says (b s h / t, fp32).
    p2p = result.table[result.table["kind"].isin(["SEND_ACT", "SEND_GRAD", "RECV_ACT", "RECV_GRAD"])]
    lowered = {i.bytes for rp in compile_for_run(sp).program.ranks.values() for i in rp.instructions
               if i.kind.value in ("SEND_ACT", "SEND_GRAD")}
    assert set(p2p["bytes"]) == (lowered if pp > 1 else set()) == ({2 * 32 * 64 * 4 // 2} if pp > 1 else set())
    plain = run_plan(tp, iterations=2, warmup=1, out_dir=tmp_path / tp.name, timeout_s=120, save_params=True)
    assert result.losses == pytest.approx(plain.losses, rel=1e-6, abs=0)
    with_sp, without = params_of(tmp_path / sp.name, sp), params_of(tmp_path / tp.name, tp)
    for rank, params in without.items():
        assert params.keys() == with_sp[rank].keys()
        for name, value in params.items():
            keys = key_bias_mask(name, value, tp)  # zero true gradient: Adam steps rounding noise (test_runtime)
            keep = ~keys if keys is not None else torch.ones_like(value, dtype=torch.bool)
            torch.testing.assert_close(with_sp[rank][name][keep], value[keep], rtol=1e-4, atol=2e-6,
                                       msg=lambda m, name=name, rank=rank: f"rank {rank} {name}: {m}")
    # Layernorm weights see one sequence shard per rank; all-reduced, they stay equal on the TP ranks.
    for rank in range(0, sp.world_size, 2):
        lns = [name for name in with_sp[rank] if ".ln" in name]
        assert lns and all(torch.equal(with_sp[rank][n], with_sp[rank + 1][n]) for n in lns)
    # Each rank's activation peak is the ledger's, to the byte (exec.structure measures one rank's
    # sequence-parallel layers; the lowering and the engine hold them), and below the TP run's.
    # Under full recomputation the first stage's ranks also keep a checkpointed micro-batch's token ids
    # (int64), which the ledger does not count, with or without sequence parallelism.
    measured, ledger = measured_peaks(tmp_path / sp.name, sp), ledger_peaks(sp)
    token_ids = sp.micro_batch * 32 * 8 if recompute == "full" else 0  # gpt-tiny: 32 ids per sample
    assert measured == {rank: ledger[rank] + (token_ids if rank < sp.tp else 0) for rank in ledger}
    without_measured, without_ledger = measured_peaks(tmp_path / tp.name, tp), ledger_peaks(tp)
    assert {r: measured[r] - ledger[r] for r in ledger} == {r: without_measured[r] - without_ledger[r] for r in ledger}
    assert all(measured[rank] < without_measured[rank] for rank in measured)


def test_one_rank_of_a_sequence_parallel_block_saves_and_sends_one_tp_th_of_its_replicated_tensors() -> None:
    """exec.structure measures one TP rank's layers as the runtime runs them: under sequence parallelism
    a block keeps 1/t of every tensor it saves (the replicated layernorm inputs, column-parallel inputs
    and layernorm statistics now split by sequence: the closed form's saved_elems / t, as
    sim.analytic charges it, Korthikanti et al.'s eq. 3 for this block) and outputs 1/t of the
    sequence (what a pipeline stage sends), while each TP collective still moves the whole tensor."""
    b, t = 2, 2
    layers = transformer_layers(transformer_config("gpt-tiny"))
    plain = StructuralCosts(get_workload("gpt-tiny"), b, "fp32", t)
    split = StructuralCosts(get_workload("gpt-tiny", sequence_parallel=True), b, "fp32", t)
    for i, spec in enumerate(layers):
        if spec.kind != "block":
            continue
        tp_only, sp = plain.layer_costs(i, b, t), split.layer_costs(i, b, t)
        replicated = spec.saved_elems - spec.saved_elems_sharded
        assert tp_only.saved_bytes == 4 * b * (replicated + spec.saved_elems_sharded // t)
        assert sp.saved_bytes == 4 * b * spec.saved_elems // t
        assert sp.output_bytes == tp_only.output_bytes // t and sp.tp_comm_bytes == tp_only.tp_comm_bytes
        assert sp.tp_sequence_parallel and not tp_only.tp_sequence_parallel
    assert split.output_shape(0) == ((b, 32 // t, 64), torch.float32)  # the embedding's output: scattered


@pytest.mark.slow
def test_sequence_parallelism_beside_the_distributed_optimizer_trains_as_the_dense_all_reduce(tmp_path: Path) -> None:
    """dp 2 x tp 2 on four gloo ranks: the distributed optimizer's replicas sum the layernorm and row-bias
    gradients over TP after their reduce-scatter (the owned chunk; sums over DP and TP commute), so after
    three steps every parameter is the dense all-reduce run's within fp32 rounding, and the TP replicas'
    tagged parameters stay bit-identical."""
    base = sequence_parallel(plan_of(pp=1, tp=2, dp=2, microbatches=2))
    params = {}
    for method in ("allreduce", "distopt"):
        plan = base.replace(name=f"{base.name}-{method}", gradient_sync={"method": method, "bucket_mb": 0.05})
        result = run_plan(plan, iterations=2, warmup=1, out_dir=tmp_path / method, timeout_s=180, save_params=True)
        assert result.losses
        params[method] = params_of(tmp_path / method, plan)
    for rank in range(4):
        assert params["distopt"][rank].keys() == params["allreduce"][rank].keys()
        for name, value in params["allreduce"][rank].items():
            torch.testing.assert_close(params["distopt"][rank][name], value, rtol=1e-5, atol=1e-6, msg=name)
    tagged = [name for name in params["distopt"][0] if ".ln" in name or name.endswith(("proj.bias", "fc2.bias"))]
    assert tagged
    for dp_rank in range(2):  # rank = dp * tp + t
        a, b = params["distopt"][2 * dp_rank], params["distopt"][2 * dp_rank + 1]
        for name in tagged:
            assert torch.equal(a[name], b[name]), name
