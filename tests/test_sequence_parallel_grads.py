"""Sequence parallelism's TP all-reduce of the partial gradients before the step (the split region's
LayerNorms and the row-parallel biases see one TP rank's 1/t of the sequence each): the simulator
prices the bytes the runtime reduces (exec.parallel.sequence.allreduce_sequence_parallel_grads), as
one all-reduce over the TP group before the optimizer step, in the engine and the fast estimate alike
(sim.costs.sequence_parallel_grads_s)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from analysis.estimate_grid import estimate_plan
from exec.parallel.tp import apply_tensor_parallel
from exec.structure import StructuralCosts
from exec.workloads import get_workload
from sim.analytic_costs import AnalyticCosts
from sim.cluster import load_cluster
from sim.comm import concurrent_groups
from sim.compile import resolve_plan
from sim.model_state import gradient_buffer_scale
from sim.plan import Plan
from sim.simulate import simulate
from sim.workloads import transformer_config, transformer_layers


def runtime_reduced_bytes(tp: int, tp_rank: int) -> int:
    """What the runtime's interpreter hands to allreduce_sequence_parallel_grads on one rank (the whole
    model on one pipeline stage, fp32): its parameters tagged ``sequence_parallel``, built and sharded
    as exec.interpreter builds them."""
    workload = get_workload("gpt-tiny", sequence_parallel=True)
    modules = workload.build_layers(0, workload.num_layers, device="meta", dtype=torch.float32)
    apply_tensor_parallel(modules, tp_rank, tp, None, sequence_parallel=True)
    tagged = [p for p in modules.parameters() if getattr(p, "sequence_parallel", False)]
    return sum(p.numel() * p.element_size() for p in tagged)


@pytest.mark.parametrize("tp", [2, 4])
def test_the_priced_bytes_are_what_the_runtime_reduces(tp: int) -> None:
    cfg = transformer_config("gpt-tiny", sequence_parallel=True)
    analytic = AnalyticCosts(transformer_layers(cfg), load_cluster("dgx-a100-8").device, "fp32")
    layers = range(analytic.num_layers)
    priced = sum(analytic.layer_costs(layer, 2, tp).sp_grad_bytes for layer in layers)
    measured = StructuralCosts(get_workload("gpt-tiny", sequence_parallel=True), 2, "fp32", tp)
    structural = sum(measured.layer_costs(layer, 2, tp).sp_grad_bytes for layer in layers)
    reduced = {runtime_reduced_bytes(tp, rank) for rank in range(tp)}
    # 4 blocks x (2 LayerNorms of 2 h + 2 row-parallel biases of h) + the head's final LayerNorm (2 h), fp32
    h = cfg.hidden
    assert reduced == {(cfg.num_layers * 6 * h + 2 * h) * 4}
    assert priced == structural == reduced.pop()
    # without sequence parallelism, or at tp 1, nothing is reduced over TP
    plain = AnalyticCosts(transformer_layers(transformer_config("gpt-tiny")), analytic.model.device, "fp32")
    assert sum(plain.layer_costs(layer, 2, tp).sp_grad_bytes for layer in layers) == 0
    assert sum(analytic.layer_costs(layer, 2, 1).sp_grad_bytes for layer in layers) == 0


def plan(sp: bool, sync: str = "allreduce") -> Plan:
    return Plan.from_dict({"workload": "gpt2-medium",
                           "workload_options": {"attention": "unfused", "dropout": 0.1, "sequence_parallel": sp},
                           "cluster": {"preset": "dgx-a100-8"}, "dtype": "fp16",
                           "parallelism": {"pp": 2, "tp": 2, "dp": 2},
                           "gradient_sync": {"method": sync},
                           "schedule": {"name": "1f1b", "micro_batch": 2, "microbatches": 4}})


class WithoutTheSum:
    """The plan's own costs with sequence parallelism's partial gradients left out (the sum removed)."""

    def __init__(self, costs: object) -> None:
        self.costs, self.num_layers = costs, costs.num_layers

    def layer_costs(self, layer: int, micro_batch: int, tp: int) -> object:
        return replace(self.costs.layer_costs(layer, micro_batch, tp), sp_grad_bytes=0)

    def __getattr__(self, name: str) -> object:
        return getattr(self.costs, name)


def step_seconds(result: object) -> dict[int, float]:
    steps = result.table[result.table["kind"] == "OPTIMIZER_STEP"]
    return {int(r.rank): float(r.end_s - r.start_s) for r in steps.itertuples()}


@pytest.mark.parametrize("sync", ["allreduce", "distopt"])
def test_the_engine_and_the_estimate_price_the_same_all_reduce_before_the_step(sync: str) -> None:
    p = plan(True, sync)
    r = resolve_plan(p)
    engine, fast = simulate(p), estimate_plan(p)
    # to the rounding (the all-reduce is ~4e-5 of the iteration here, so a price in one only would show)
    assert fast.iteration_s == pytest.approx(engine.iteration_s, rel=1e-12)
    bare = simulate(p, costs=WithoutTheSum(r.costs))
    # each rank's step is longer by one all-reduce, over its TP group, of its layers' partial gradients
    # in the gradient buffer's dtype (fp32 main gradients here)
    scale = gradient_buffer_scale(p.gradient_sync, p.dtype)
    for rank, seconds in step_seconds(engine).items():
        group = tuple(range(rank - rank % p.tp, rank - rank % p.tp + p.tp))  # tp is the fastest coordinate
        sharing = concurrent_groups(r.comm.cluster, p.dp * p.tp, group)
        stage = rank // (p.dp * p.tp)
        nbytes = round(sum(r.costs.layer_costs(layer, p.micro_batch, p.tp).sp_grad_bytes
                           for layer in r.stage_layers[stage]) * scale)
        assert nbytes > 0
        priced = r.comm.collective_s("allreduce", nbytes, group, sharing)
        assert seconds - step_seconds(bare)[rank] == pytest.approx(priced, rel=1e-9)
        assert priced > 0
    assert engine.iteration_s > bare.iteration_s
    # without sequence parallelism nothing is added
    plain = plan(False, sync)
    assert simulate(plain).iteration_s == simulate(plain, costs=WithoutTheSum(resolve_plan(plain).costs)).iteration_s
