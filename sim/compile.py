"""Compile a Plan: resolve and check it against its workload and cluster, then lower it.

``resolve_plan`` does every check that needs the workload and the cluster and returns the resolved
pieces (costs, communication model, partition, memory policy); ``compile_plan`` adds the lowered
Program. The simulator, the runtime, validation and calibration all compile through here, so the
runtime executes exactly the Program that was simulated. Imports neither torch nor simpy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from sim.bundle_costs import BundleCostModel, plan_profile_command
from sim.cluster import ClusterSpec, load_cluster
from sim.comm import ClusterComm
from sim.costs import CostModel
from sim.embedding import EMBEDDING_METHODS, TableTPCosts, sharded_table_layers
from sim.gradient_sync import GRADIENT_SYNC
from sim.lower import lower
from sim.memory import MemoryPolicy, build_memory_policy
from sim.partition import balanced_partition, check_partition, uniform_partition
from sim.plan import Plan
from sim.program import Program
from sim.schedules import check_preconditions
from sim.workloads import (
    USER,
    TransformerConfig,
    transformer_layers,
    transformer_of,
    workload_config,
    workload_family,
)
from traces.bundle import MANIFEST_NAME
from traces.errors import ConfigError


@dataclass
class ResolvedPlan:
    """A plan checked against its workload and cluster, with everything lowering needs."""

    plan: Plan
    cluster: ClusterSpec
    costs: CostModel
    comm: ClusterComm
    stage_layers: list[tuple[int, ...]]
    policy: MemoryPolicy
    transformer: TransformerConfig | None


def resolve_plan(plan: Plan, costs: CostModel | None = None) -> ResolvedPlan:
    cluster = load_cluster(plan.cluster)
    if plan.world_size != cluster.world_size:
        raise ConfigError("parallelism: dp x tp x pp",
                          f"{plan.dp} x {plan.tp} x {plan.pp} = {plan.world_size} but cluster {cluster.name} "
                          f"has {cluster.world_size} devices",
                          "change the degrees so that their product is the cluster's device count")
    config = workload_config(plan.workload, plan.workload_options)  # checks every option
    embedding = EMBEDDING_METHODS[plan.embedding.method]
    if embedding.check is not None:
        embedding.check(plan)
    transformer = transformer_of(plan.workload, plan.workload_options)
    check_tp(plan.tp, transformer, plan.workload)
    check_size(plan, full=False)
    # A profile measured on this hardware brings its communication fits, whatever computes the costs.
    if plan.profile is not None:
        _check_profile_folder(plan, cluster.device.kind)
    specs = transformer_layers(transformer) if transformer is not None else None
    bundle_costs = BundleCostModel.load(plan.profile, _accumulation_pass(transformer, cluster, plan.dtype), specs) \
        if plan.profile is not None else None
    if bundle_costs is not None:
        bundle_costs.check_describes(plan.workload, plan.workload_options, config,
                                     len(specs) if specs is not None else None, plan.dtype, cluster.device.kind)
    fits = bundle_costs.bundle.comm_fits if bundle_costs is not None else None
    samples = bundle_costs.bundle.comm_samples if bundle_costs is not None else None
    if costs is None:
        profile_it = (f"profile it on this machine: {_profile_command(plan, cluster.device.kind)}, then set "
                      "profile: DIR in the plan")
        if bundle_costs is not None:
            costs = bundle_costs
        elif transformer is not None and cluster.device.kind == "cpu":
            # The analytic model knows a CPU's matmul rate but not its per-operator overheads, which
            # dominate small models (gpt-tiny: 4 ms predicted, 54 ms measured): no guess is printed.
            raise ConfigError("profile", f"no profile for a plan on CPU devices ({cluster.device.name}); the "
                              "analytic model does not predict CPU times", profile_it)
        elif transformer is not None:
            from sim.analytic_costs import AnalyticCosts

            costs = AnalyticCosts(specs, cluster.device, plan.dtype, cluster,
                                  attention=transformer.attention,
                                  grad_accumulation=transformer.grad_accumulation)
        else:
            raise ConfigError("profile", f"workload {plan.workload!r} has no closed-form cost model", profile_it)
    if plan.num_stages > costs.num_layers:
        raise ConfigError("parallelism: pp x chunks",
                          f"{plan.num_stages} stages but the workload has {costs.num_layers} layers",
                          f"use at most {costs.num_layers} stages")
    tables = sharded_table_layers(plan)
    if tables and plan.tp > 1 and not isinstance(costs, TableTPCosts):  # what the sharded tables' TP costs
        costs = TableTPCosts(costs, tables)
    stage_layers = _partition(plan, costs)
    check_schedule(plan.schedule.name, plan.pp, plan.microbatches, plan.chunks)
    _check_per_stage_lists(plan)
    sync = GRADIENT_SYNC[plan.gradient_sync.method]
    if sync.check is not None:
        sync.check(plan)
    comm = ClusterComm(cluster, fits, samples)
    policy = build_memory_policy(plan, stage_layers, costs, comm.capacity_bytes)
    return ResolvedPlan(plan, cluster, costs, comm, stage_layers, policy, transformer)


def _profile_command(plan: Plan, device_kind: str) -> str:
    return plan_profile_command(plan.workload, plan.workload_options, plan.micro_batch, plan.dtype, device_kind)


def _check_profile_folder(plan: Plan, device_kind: str) -> None:
    """Refuse a ``profile:`` that names no bundle folder as an error on the plan's field, with the command
    that writes one. A bundle that is there but unreadable stays a ``BundleError`` naming its file."""
    folder = Path(plan.profile)
    if (folder / MANIFEST_NAME).is_file():
        return
    where = "" if folder.is_absolute() else f" (a relative path is read from the current directory, {Path.cwd()})"
    found = "no such folder" if not folder.exists() else \
        "a file, not a bundle folder" if not folder.is_dir() else f"a folder without {MANIFEST_NAME}, not a bundle"
    raise ConfigError("profile", f"{plan.profile!r}: {found}{where}",
                      f"point profile: (or --profile) at the folder written by {_profile_command(plan, device_kind)}")


def _accumulation_pass(transformer: TransformerConfig | None, cluster: ClusterSpec,
                       dtype: str) -> Callable[[int], float] | None:
    """A profiled plan's weight-gradient accumulation pass, priced as the analytic model prices it (the
    device's bandwidth at the memory-bound rate of its default curve, ``sim.analytic.default_for``); None
    where the plan's accumulation is fused (or the workload has no such option)."""
    if transformer is None or transformer.grad_accumulation == "fused":
        return None
    from sim.analytic import default_for, grad_accumulation_s

    mem_eff = default_for(cluster.device, dtype).mem_eff
    return partial(grad_accumulation_s, mode=transformer.grad_accumulation, device=cluster.device, mem_eff=mem_eff)


# The most instructions (as estimated below) one simulation may hold. Measured on the 2-core
# development VM, gpt2-medium pp 8 1f1b on dgx-a100-8: the engine keeps ~1.9 kB per instruction
# with its per-layer rows (tracemalloc peak, 11k and 45k instructions), and ran 45k instructions in
# 8 s and 180k in 111 s (estimate 328k). An estimate of 500k is then ~1 GB and minutes; beyond it a
# plan would run out of memory or for a very long time instead of answering.
MAX_INSTRUCTIONS = 500_000
# Instructions per (rank, virtual stage, micro-batch) at most: FWD, BWD (or BWD_I + BWD_W),
# RECOMPUTE, a send and a receive each way, SWAP_OUT and SWAP_IN.
_INSTRUCTIONS_PER_MICROBATCH = 10


def estimate_instructions(plan: Plan, full: bool) -> int:
    """An upper estimate of the instructions a simulation lowers (only one rank per pipeline
    position unless full)."""
    return instructions_upper_bound(plan.world_size if full else plan.pp, plan.chunks, plan.microbatches)


def instructions_upper_bound(ranks: int, chunks: int, microbatches: int) -> int:
    """ranks x stages per rank x micro-batches x instructions per micro-batch."""
    return ranks * chunks * microbatches * _INSTRUCTIONS_PER_MICROBATCH


def check_size(plan: Plan, full: bool) -> None:
    """Refuse, up front, a plan too large to simulate in reasonable memory and time."""
    count = estimate_instructions(plan, full)
    if count > MAX_INSTRUCTIONS:
        ranks = "parallelism (dp x tp x pp)" if full else "parallelism.pp"
        raise ConfigError(f"{ranks}, chunks, schedule.microbatches", f"about {count:.3g} instructions to simulate "
                          f"({'every rank' if full else 'one rank per pipeline position'}), more than the "
                          f"limit of {MAX_INSTRUCTIONS:,}", "simulate fewer micro-batches or stages"
                          + (", or drop --full" if full else ""))


def check_tp(tp: int, transformer: TransformerConfig | None, workload: str) -> None:
    if transformer is not None and transformer.sequence_parallel:
        # Sequence parallelism splits the sequence over the TP group (Korthikanti et al. 2022, 4.2.2).
        if tp == 1:
            raise ConfigError("workload_options.sequence_parallel", "sequence parallelism splits the sequence over "
                              "the tensor-parallel group, and this plan has tp 1",
                              "set parallelism.tp > 1 or drop sequence_parallel")
        if transformer.seq % tp:
            raise ConfigError("workload_options.sequence_parallel",
                              f"tp={tp} does not divide the sequence length {transformer.seq} of {workload}",
                              "use a tp that divides the sequence, or drop sequence_parallel")
    if tp == 1:
        return
    if transformer is None:
        # exec.parallel.tp splits a transformer block's attention and MLP; the Workload interface has no way
        # to say how another model's layers would split, so a workload of one's own runs at tp 1 too.
        own = " (a workload named by import path runs data- and pipeline-parallel only)" \
            if workload_family(workload) == USER else ""
        raise ConfigError("parallelism.tp",
                          f"tensor parallelism is defined for transformer workloads, not {workload}",
                          f"set tp: 1{own}")
    for what, value in (("heads", transformer.heads), ("hidden size", transformer.hidden)):
        if value % tp:
            divisors = [d for d in range(1, value + 1) if value % d == 0 and d <= 64]
            raise ConfigError("parallelism.tp", f"tp={tp} does not divide the {what} ({value}) of {workload}",
                              f"use a divisor of {value}, e.g. {divisors[-4:]}")


def _partition(plan: Plan, costs: CostModel) -> list[tuple[int, ...]]:
    partition = plan.parallelism.partition
    if isinstance(partition, list):
        try:
            ranges = check_partition(partition, costs.num_layers, plan.num_stages)
        except ConfigError as exc:
            raise ConfigError(f"parallelism.{exc.field}", exc.problem, exc.fix) from None
    elif partition == "uniform":
        ranges = uniform_partition(costs.num_layers, plan.num_stages)
    else:
        ranges = balanced_partition(costs.layer_weights(partition), plan.num_stages)
    return [tuple(range(a, b)) for a, b in ranges]


# ``paratwin run`` starts one process per rank on this machine; more than this many per usable CPU
# core would only oversubscribe it (a policy, not a measurement: each rank runs one thread).
MAX_LOCAL_RANKS_PER_CORE = 4


def check_local_run(plan: Plan) -> None:
    """Refuse, before any process starts, a plan that one host cannot run: too many ranks for its
    cores, or too many instructions to lower for every rank."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if plan.world_size > MAX_LOCAL_RANKS_PER_CORE * cores:
        raise ConfigError("parallelism: dp x tp x pp",
                          f"{plan.world_size} ranks on one machine with {cores} usable cores "
                          f"(at most {MAX_LOCAL_RANKS_PER_CORE} ranks per core)",
                          "run fewer ranks here, or launch under torchrun/SLURM across hosts")
    check_size(plan, full=True)


# Where the schedule's preconditions live in a plan's sections.
_SECTION_OF = {"pp": "parallelism.pp", "chunks": "parallelism.chunks", "microbatches": "schedule.microbatches",
               "schedule": "schedule.name", "recompute": "memory"}


def check_schedule(name: str, pp: int, microbatches: int, chunks: int) -> None:
    """The schedule's preconditions, the refused field named by its place in a plan's sections."""
    try:
        check_preconditions(name, pp, microbatches, chunks)
    except ConfigError as exc:
        raise ConfigError(_SECTION_OF.get(exc.field, exc.field), exc.problem, exc.fix) from None


def _check_per_stage_lists(plan: Plan) -> None:
    lists = {"memory.swap": plan.memory.swap, "memory.recompute": getattr(plan.memory, "recompute", None)}
    for field, values in lists.items():
        if values is None:
            continue
        if len(values) != plan.num_stages:
            raise ConfigError(field, f"has {len(values)} entries for {plan.num_stages} stages",
                              f"give one fraction per virtual stage ({plan.num_stages} = pp x chunks)")
        for stage, value in enumerate(values):
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{field}[{stage}]", f"{value} is not a fraction", "use a value in [0, 1]")


@dataclass
class CompiledPlan:
    """A resolved plan and its Program (every rank, or one per symmetric group)."""

    resolved: ResolvedPlan
    program: Program

    @property
    def plan(self) -> Plan:
        return self.resolved.plan


def compile_plan(plan: Plan, costs: CostModel | None = None, symmetric: bool = True,
                 resolved: ResolvedPlan | None = None) -> CompiledPlan:
    """Resolve ``plan`` (unless ``resolved`` is given) and lower it."""
    resolved = resolved or resolve_plan(plan, costs)
    check_size(resolved.plan, full=not symmetric)
    program = lower(resolved.plan, resolved.stage_layers, resolved.costs, resolved.policy, symmetric=symmetric)
    return CompiledPlan(resolved, program)
