"""Sequence parallelism in the runtime (``workload_options: {sequence_parallel: true}``,
exec.parallel.sequence; Korthikanti et al. 2022, section 4.2.2), on real gloo ranks.

The same training as the single-process reference and as the TP run without it (the layernorm,
bias and residual region on 1/tp of the sequence changes only the order of some fp32 sums); the
layernorm weights and row-parallel biases, which see a sequence shard each, stay bit-identical on
the TP ranks (their gradients are all-reduced over the TP group before the step); each rank holds
the activations the ledger says, and they are fewer than without it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from exec.contract import compile_for_run
from exec.launcher import run_plan
from exec.parallel.sequence import SEQUENCE_RNG_SEED, SequenceParallelRng, forked
from exec.parallel.tp import apply_tensor_parallel
from exec.structure import StructuralCosts
from exec.workloads import get_workload
from sim.engine import Engine
from sim.plan import Plan
from sim.workloads import transformer_config, transformer_layers
from tests.test_runtime import check_against_reference, key_bias_mask, plan_of

# How far the sequence-parallel dropout run's losses may be from the TP run's (other masks, same p): a
# bound on the mask noise of gpt-tiny's loss after three steps, not a fitted figure.
LOSS_TOLERANCE = 0.02


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


def test_the_regions_edges_keep_one_tp_th_of_what_sim_analytic_splits() -> None:
    """The runtime is the ground truth for the analytic model's edges of the region: the head's final
    LayerNorm keeps its input and statistics (the closed form's ``sequence_split_elems``) on 1/t of the
    sequence, the embedding's output dropout its mask; everything else they keep is unchanged."""
    b, t = 2, 2
    head = transformer_layers(transformer_config("gpt-tiny"))[-1]
    assert head.kind == "head" and head.sequence_split_elems == 32 * 64 + 2 * 32  # s h + 2 s
    measured = {(sp, p): StructuralCosts(get_workload("gpt-tiny", sequence_parallel=sp, dropout=p), b, "fp32", t)
                for sp in (False, True) for p in (0.0, 0.1)}
    last = len(transformer_layers(transformer_config("gpt-tiny"))) - 1

    def saved(sp: bool, p: float, layer: int) -> int:
        return measured[(sp, p)].layer_costs(layer, b, t).saved_bytes

    for p in (0.0, 0.1):
        assert saved(False, p, last) - saved(True, p, last) == 4 * b * head.sequence_split_elems * (t - 1) // t
    mask = saved(False, 0.1, 0) - saved(False, 0.0, 0)  # the embedding dropout's, on the whole sequence
    assert mask > 0 and saved(True, 0.0, 0) == saved(False, 0.0, 0)
    assert saved(True, 0.1, 0) == saved(False, 0.0, 0) + mask // t


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


def test_each_tp_rank_draws_its_own_masks_in_the_sequence_parallel_region() -> None:
    """Megatron-LM's model-parallel RNG: the TP ranks' shards get different masks (a shared generator
    would drop the same positions of every shard), and the same rank draws the same masks again."""
    workload = get_workload("gpt-tiny", sequence_parallel=True, dropout=0.5)
    x = torch.randn(2, 16, 64)

    def block_out(tp_rank: int) -> torch.Tensor:
        layers = workload.build_layers(1, 2)
        torch.manual_seed(0)  # the shared generator at the same state on both ranks
        apply_tensor_parallel(layers, tp_rank, 2, None, sequence_parallel=True,
                              rng=SequenceParallelRng(SEQUENCE_RNG_SEED, tp_rank, torch.device("cpu")))
        layers.train()
        block = layers[0]  # the masks its dropouts would draw (with group None nothing is communicated)
        with forked(block.sequence_rng):
            return torch.nn.functional.dropout(torch.ones_like(x), 0.5, True)

    assert not torch.equal(block_out(0), block_out(1))
    assert torch.equal(block_out(0), block_out(0))
    assert isinstance(block_layers_with_rng().sequence_rng, SequenceParallelRng)


def block_layers_with_rng() -> torch.nn.Module:
    layers = get_workload("gpt-tiny", sequence_parallel=True, dropout=0.1).build_layers(0, 2)
    apply_tensor_parallel(layers, 0, 2, None, sequence_parallel=True,
                          rng=SequenceParallelRng(SEQUENCE_RNG_SEED, 0, torch.device("cpu")))
    assert layers[0].sequence_rng is layers[1].sequence_rng is not None  # the embedding and the block share it
    return layers[1]


@pytest.mark.slow
def test_sequence_parallelism_with_dropout_trains_and_recomputes_the_same_masks(tmp_path: Path) -> None:
    """tp 2 x pp 2, dropout 0.1, each TP rank drawing the region's masks from its own generator:
    training runs close to the TP run without sequence parallelism (other masks, so not bit-equal),
    the TP replicas' replicated parameters stay bit-identical, each rank holds the ledger's activations
    (masks on 1/t of the sequence), and full recomputation replays the forward's masks."""
    def plan(sp: bool, recompute: str) -> Plan:
        base = plan_of(tp=2, pp=2, schedule="1f1b", microbatches=4, recompute=recompute)
        base = base.replace(name=f"{base.name}-dropout-{recompute}", workload_options={"dropout": 0.1})
        return sequence_parallel(base) if sp else base

    runs = {}
    for key in [(False, "none"), (True, "none"), (True, "full")]:
        p = plan(*key)
        runs[key] = run_plan(p, iterations=2, warmup=1, out_dir=tmp_path / p.name, timeout_s=180, save_params=True)
    losses = {key: run.losses for key, run in runs.items()}
    assert all(math.isfinite(x) for run in losses.values() for x in run)
    # other masks than the TP run's: close, not equal (gpt-tiny starts at ln 512 = 6.24)
    assert losses[(True, "none")] != losses[(False, "none")]
    assert losses[(True, "none")] == pytest.approx(losses[(False, "none")], rel=LOSS_TOLERANCE)
    # full recomputation re-draws the forward's masks from the rank's generator state
    assert losses[(True, "full")] == pytest.approx(losses[(True, "none")], rel=1e-6, abs=0)
    sp = plan(True, "none")
    params = params_of(tmp_path / sp.name, sp)
    recomputed = params_of(tmp_path / plan(True, "full").name, sp)
    for rank in range(0, sp.world_size, 2):  # TP peers: ranks 2k and 2k + 1
        replicated = [n for n, v in params[rank].items() if v.shape == params[rank + 1][n].shape
                      and (".ln" in n or n.endswith(("proj.bias", "fc2.bias")) or n.startswith(("0.", "5.")))]
        assert replicated and all(torch.equal(params[rank][n], params[rank + 1][n]) for n in replicated)
        for name, value in params[rank].items():
            torch.testing.assert_close(recomputed[rank][name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert measured_peaks(tmp_path / sp.name, sp) == ledger_peaks(sp)
