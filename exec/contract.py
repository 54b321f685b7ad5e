"""What a run is: the compiled plan every rank executes, the run's options, and what every rank
and the single-process reference of the tests must agree on (data seeds, optimizer, workload)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from exec.structure import Measured, StructuralCosts
from exec.workloads import Workload, get_workload
from sim.compile import ResolvedPlan, compile_plan
from sim.memory import MEMORY_POLICIES
from sim.plan import Plan
from sim.program import Program
from sim.tied_embedding import TIED_TAG
from traces.errors import ConfigError

# Adam's learning rate: a constant of the runtime (a Plan has no optimizer settings yet); the
# single-process reference of the tests uses the same through ``make_optimizer``.
LEARNING_RATE = 1e-3


def batch_seed(iteration: int, replica: int, microbatch: int, dp: int, microbatches: int) -> int:
    """Seed of the micro-batch ``microbatch`` of data-parallel replica ``replica`` in ``iteration``."""
    return (iteration * dp + replica) * microbatches + microbatch


def make_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LEARNING_RATE)


def load_workload(plan: Plan) -> Workload:
    return get_workload(plan.workload, **plan.workload_options)


@dataclass
class ExecutablePlan:
    """A compiled plan (every rank) with the real workload it runs and that workload's exact costs."""

    plan: Plan
    resolved: ResolvedPlan
    workload: Workload
    structure: StructuralCosts
    program: Program


def compile_for_run(plan: Plan, measured: Measured | None = None) -> ExecutablePlan:
    """Compile ``plan`` exactly as the simulator does, lowered for every rank.

    With ``profile`` set the costs are the profile's (the simulator's own); otherwise the exact
    structural costs, which give the same partition for ``uniform`` and ``parameters`` and exact
    message and bucket bytes. ``measured``: the structural measurements of an earlier
    ``compile_for_run`` of this plan (``.structure.measured``), so that they are not taken again.
    """
    if not MEMORY_POLICIES[plan.memory.policy].runtime:
        raise ConfigError("memory.policy", f"the runtime does not run memory policy {plan.memory.policy!r} "
                          "(simulated only: docs/sequence-parallel.md)",
                          "simulate the plan (paratwin simulate), or run it with another policy")
    workload = load_workload(plan)  # refuses what the runtime's modules cannot run (sequence parallelism)
    structure = StructuralCosts(workload, plan.micro_batch, plan.dtype, plan.tp, measured=measured)
    compiled = compile_plan(plan, costs=None if plan.profile else structure, symmetric=False)
    if plan.workload_options.get("tied_embedding"):
        _check_tied(plan, compiled.program)
    return ExecutablePlan(plan, compiled.resolved, workload, structure, compiled.program)


def _check_tied(plan: Plan, program: Program) -> None:
    """The runtime ties the word embedding as Megatron-LM does across stages: a copy on the first and
    one on the last stage, equal at the start (exec.workloads.gpt) and summing their gradients before
    the step (the lowering's all-reduce). It does not share one matrix on one rank, split a tied table
    over TP ranks (its table is replicated, its head column-parallel), or reduce-scatter first."""
    from sim.gradient_sync import GRADIENT_SYNC

    field = "workload_options.tied_embedding"
    if plan.pp == 1 or not any(i.tag.startswith(TIED_TAG) for rp in program.ranks.values() for i in rp.instructions):
        raise ConfigError(field, "the runtime ties the word embedding across pipeline stages only (a copy on the "
                          "first and on the last stage); here both are on one rank", "use pp > 1, or drop it")
    if plan.tp > 1:
        raise ConfigError(field, "the runtime's token table is replicated over TP ranks and its head split, so "
                          "their copies differ in shape", "use tp 1 with tied_embedding, or drop it")
    if GRADIENT_SYNC[plan.gradient_sync.method].shards_optimizer:
        raise ConfigError(field, "the distributed optimizer reduce-scatters the gradients before the tied "
                          "all-reduce runs", "use gradient_sync.method allreduce with tied_embedding")


@dataclass
class RunOptions:
    iterations: int = 5
    warmup: int = 1
    backend: str | None = None
    timeout_s: float = 300.0
    save_params: bool = False
    threads: int = 1


BACKENDS = ("gloo", "nccl")


def pick_backend(requested: str | None) -> str:
    """``requested`` checked against this machine, or nccl with CUDA and gloo without."""
    if not requested:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested not in BACKENDS:
        raise ConfigError("--backend", f"unknown backend {str(requested)[:50]!r}", "use gloo or nccl")
    if requested == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--backend", "nccl needs CUDA GPUs and torch sees none on this machine",
                          "use --backend gloo (the default without CUDA), or run on a machine with GPUs")
    return requested

