"""PyTorch's selective activation checkpointing as a memory policy (``sim.memory_selective``,
``exec.selective``): what a layer keeps (torch's own SAC measured against the closed form), the
refusals, the estimate, and real runs that train exactly like one process while the runtime's
saved bytes equal the simulator's ledger."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sim.compile import compile_plan
from sim.plan import Plan
from sim.simulate import simulate
from traces.errors import ConfigError


def selective(plan: Plan, name: str) -> Plan:
    memory = Plan.from_dict({"workload": plan.workload, "memory": {"policy": "selective"}}).memory
    return plan.model_copy(update={"name": name, "memory": memory})


def gpt_plan(policy: str, schedule: str = "1f1b") -> Plan:
    return Plan.from_dict({"name": f"gpt-8.3b-{policy}", "workload": "gpt-8.3b", "cluster": "a100-64",
                           "dtype": "fp16", "parallelism": {"dp": 2, "tp": 8, "pp": 4},
                           "schedule": {"name": schedule, "micro_batch": 8, "microbatches": 16},
                           "memory": {"policy": policy}})


def test_closed_form_is_what_torch_keeps() -> None:
    """The transformer closed form (sim.workloads) against torch's SAC measured on CPU for every
    layer of a GPT (embedding, blocks, head with its loss): equal to the element, the ids and
    targets (int64) aside, which the closed form counts as one element each, and nll_loss's 0-dim
    total weight (4 B), as the ordinary saved bytes' closed form does."""
    from exec.structure import StructuralCosts
    from exec.workloads import get_workload
    from sim.workloads import transformer_config, transformer_layers

    micro_batch = 2
    measured = StructuralCosts(get_workload("gpt-tiny"), micro_batch)
    cfg = transformer_config("gpt-tiny")
    ids = cfg.seq * micro_batch * (8 - 4)  # int64 ids / targets counted as 4-byte elements
    for layer, spec in enumerate(transformer_layers(cfg)):
        c = measured.layer_costs(layer, micro_batch, 1)
        closed = spec.selective_elems * micro_batch * 4
        extra = ids + (4 if spec.kind == "head" else 0) if spec.kind in ("embedding", "head") else 0
        assert c.selective_saved_bytes == closed + extra, spec.name
        assert c.selective_saved_bytes >= 0


def test_simulated_selective_sits_between_none_and_full() -> None:
    """GPT-8.3B at paper scale, analytic costs: selective keeps less than no policy and more than
    full recomputation, and costs less time than full recomputation (it recomputes only the
    memory-bound kernels) but more than none."""
    runs = {policy: simulate(gpt_plan(policy)) for policy in ("none", "selective", "full")}
    peak = {p: runs[p].memory[0].peak_bytes for p in runs}
    assert peak["full"] < peak["selective"] < peak["none"]
    assert runs["none"].iteration_s < runs["selective"].iteration_s < runs["full"].iteration_s


def test_estimate_prices_selective() -> None:
    """The plan search's estimate sees the policy (its peak and time move as the engine's do)."""
    from sim.compile import resolve_plan
    from sim.estimate import Estimator

    estimates = {}
    for policy in ("none", "selective"):
        plan = gpt_plan(policy)
        resolved = resolve_plan(plan)
        estimates[policy] = Estimator(resolved.costs, resolved.comm, plan.dtype).estimate(
            schedule="1f1b", dp=2, tp=8, pp=4, chunks=1, micro_batch=8, microbatches=16,
            stage_layers=resolved.stage_layers, policy=resolved.policy, tp_overlap=0, sync_method="allreduce",
            bucket_mb=25.0)
    engine = simulate(gpt_plan("selective"))
    assert estimates["selective"].peak_bytes[0] < estimates["none"].peak_bytes[0]
    assert estimates["selective"].iteration_s > estimates["none"].iteration_s
    assert estimates["selective"].peak_bytes[0] == pytest.approx(engine.memory[0].peak_bytes, rel=0.05)


def test_refusals() -> None:
    with pytest.raises(ConfigError, match="splits the backward"):
        compile_plan(gpt_plan("selective", schedule="zb-h1"))
    with pytest.raises(ConfigError, match="fixes its own recomputation"):
        compile_plan(gpt_plan("selective", schedule="merak-shifted"))
    swapping = Plan.from_dict({**gpt_plan("none").model_dump(), "memory": {"policy": "selective", "swap": [0.5] * 4}})
    with pytest.raises(ConfigError, match="drop memory.swap"):
        compile_plan(swapping)


def test_old_profile_without_selective_columns_is_refused(gpt_tiny_profile: Path, tmp_path: Path) -> None:
    """The profiler measures what each layer keeps under selective checkpointing; a bundle taken
    before it did reads as unknown (-1) and the policy asks for a new profile instead of pricing it
    as no policy."""
    from exec.structure import StructuralCosts
    from exec.workloads import get_workload
    from tests.test_runtime import plan_of
    from traces.bundle import read_bundle, write_bundle

    bundle = read_bundle(gpt_tiny_profile)  # the session's fresh profile (micro-batch 1), read into memory
    # A fresh profile measures both (the bytes exactly as the structural model does).
    structural = StructuralCosts(get_workload("gpt-tiny"), 1)
    assert list(bundle.layers["selective_saved_bytes"]) == [
        structural.layer_costs(i, 1, 1).selective_saved_bytes for i in range(structural.num_layers)]
    assert (bundle.layers["selective_recompute_s"] >= 0).all()
    assert (bundle.layers["selective_recompute_s"] <= bundle.layers["recompute_s"]).all()
    bundle.layers["selective_saved_bytes"] = -1
    path = write_bundle(bundle, tmp_path / "old")
    plan = selective(plan_of(microbatches=2, micro_batch=1), "old-profile").model_copy(update={"profile": str(path)})
    with pytest.raises(ConfigError, match="re-profile"):
        compile_plan(plan)


# ---------------------------------------------------------------------------------------------
# Real runs (gloo ranks): parameters equal one process's; saved bytes equal the ledger's.


@pytest.mark.slow
@pytest.mark.parametrize(("workload", "pp", "policy"), [("gpt-tiny", 2, "selective"), ("gpt-tiny", 1, "selective"),
                                                        ("resnet-tiny", 2, "selective"), ("resnet-tiny", 2, "none"),
                                                        ("gpt-tiny", 2, "full"), ("resnet-tiny", 2, "per-stage"),
                                                        ("resnet-tiny", 2, "full")])
def test_selective_run_equals_one_process_and_ledger(workload: str, pp: int, policy: str, tmp_path: Path) -> None:
    """fp32, GPipe, four micro-batches of two: the parameters after three Adam steps equal the
    single-process reference's (tests.test_runtime's bounds); every rank's measured activation
    bytes at their peak equal the engine ledger's (the runtime's exact structural costs: same
    bytes, torch's own SAC). The ResNet without a policy guards the ledger's count of a storage
    two layers save (a ReLU output and the next convolution's input: LayerCosts.shared_input_bytes);
    full and half recompute guard the checkpointed bytes (each recomputed layer keeps its input, the
    loss is recomputed with the last layer). A checkpointed first layer keeps the batch input, which
    the cost model does not size: on the first rank up to one per micro-batch is allowed."""
    from exec.contract import compile_for_run
    from sim.engine import Engine
    from tests.test_runtime import check_against_reference, plan_of
    from traces.runrecord import read_run_record

    plan = plan_of(workload=workload, pp=pp, schedule="gpipe", microbatches=4, micro_batch=2).model_copy(
        update={"name": f"{workload}-pp{pp}-{policy}"})
    if policy == "selective":
        plan = selective(plan, plan.name)
    elif policy != "none":
        memory = {"policy": policy, **({"recompute": [0.5, 0.5]} if policy == "per-stage" else {})}
        plan = plan.model_copy(update={"memory": Plan.from_dict({"workload": workload, "memory": memory}).memory})
    check_against_reference(plan, tmp_path)
    run = compile_for_run(plan)
    assert run.resolved.policy.selective == (policy == "selective")
    engine = Engine(run.program, run.resolved.costs, run.resolved.comm, run.resolved.policy, plan.micro_batch)
    engine.run()
    from exec.workloads import get_workload

    inputs = get_workload(workload).make_batch(plan.micro_batch).inputs
    unsized = plan.microbatches * inputs.numel() * inputs.element_size() if policy in ("full", "per-stage") else 0
    measured = read_run_record(tmp_path / plan.name / "record").summary["activation_peak"]
    for rank, ledger in engine.ledgers.items():
        extra = measured[str(rank)] - ledger.activation_peak
        assert 0 <= extra <= (unsized if rank == 0 else 0), \
            f"rank {rank}: runtime {measured[str(rank)]} B, ledger {ledger.activation_peak} B"


@pytest.mark.slow
@pytest.mark.parametrize(("workload", "recomputed"), [("resnet-tiny", [[], [4]]), ("rnn-tiny", [[1], []])])
def test_recomputed_head_after_a_kept_layer_run_equals_ledger(workload: str, recomputed: list[list[int]]) -> None:
    """pp 2 (GPipe, four micro-batches of two, fp32), one layer that saves none of its input
    recomputed after a kept layer (sim.memory.input_saved_by_previous):

    - resnet-tiny, the last stage (3, 4) recomputing only the head (pool + linear + loss): its
      checkpoint is layer 3's saved ReLU output, one storage, so the forward holds layer 3's saves
      alone (rank 1: 1,987,684 B; the ledger counted the checkpoint twice, 2,248,704 B);
    - rnn-tiny, the first stage (0, 1) recomputing only the RNN (which saves a batch-first copy of
      its input, not the input) after the embedding, which saves none of its output: the checkpoint
      is a storage of its own (rank 0: 9,344 B; the rule took it for the embedding's, 5,248 B).

    Every rank's runtime activation peak equals the ledger's. The policy is test-only, so the run is
    a script of its own (tests/recompute_after_kept_run.py)."""
    from tests.kept_run_subprocess import run_recompute_after_kept

    result = run_recompute_after_kept(workload, [layer for stage in recomputed for layer in stage])
    assert result["recompute_layers"] == recomputed
    assert all(stage[0] - 1 in layers for stage, layers in zip(recomputed, result["stage_layers"], strict=True)
               if stage)  # each after a kept layer of its stage
    assert result["runtime"] == result["ledger"]


def test_sac_gradients_equal_plain_backward() -> None:
    """One GPT block: torch's SAC under our policy gives the same input and weight gradients as
    the plain layer (fp32, equal to the bit on CPU), and keeps fewer bytes."""
    from exec.selective import SelectiveRecord
    from exec.workloads import get_workload

    wl = get_workload("gpt-tiny")
    embed, block = wl.build_layers(0, 2)
    x = embed(wl.make_batch(2).inputs).detach().requires_grad_()
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    plain = torch.autograd.grad(block(x), [x, *block.parameters()], g)
    record = SelectiveRecord()
    kept = torch.autograd.grad(record.run(block, x), [x, *block.parameters()], g)
    for a, b in zip(plain, kept, strict=True):
        assert torch.equal(a, b)
    assert record.kept  # the matmul and attention outputs were kept
