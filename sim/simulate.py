"""From a Plan to a SimResult: compile the plan (``sim.compile``), run the engine, summarise."""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd

from sim.compile import ResolvedPlan, compile_plan
from sim.costs import CostModel
from sim.engine import Engine, EngineOptions
from sim.plan import Plan
from sim.program import Program
from sim.result import RankMemory, SimResult
from traces.errors import ConfigError
from traces.schema import INSTRUCTION_TABLE
from traces.tables import conform


def simulate(plan: Plan | str | Path, full: bool = False, costs: CostModel | None = None,
             options: EngineOptions | None = None, resolved: ResolvedPlan | None = None) -> SimResult:
    """Simulate ``plan`` (a Plan, or the path of a plan file, as ``exec.launcher.run_plan`` takes it)."""
    started = time.perf_counter()
    if isinstance(plan, (str, Path)):
        plan = Plan.load(plan)
    elif not isinstance(plan, Plan):  # a dict or None was an AttributeError ('dict' object has no 'cluster')
        raise ConfigError("plan", f"simulate takes a Plan or a plan file's path, not a {type(plan).__name__}",
                          "Plan.load(path), or Plan.from_dict(mapping)")
    compiled = compile_plan(plan, costs, symmetric=not full, resolved=resolved)
    resolved, program = compiled.resolved, compiled.program
    if options is None:
        options = EngineOptions(layer_rows=len(program.ranks) <= 64)
    engine = Engine(program, resolved.costs, resolved.comm, resolved.policy, plan.micro_batch,
                    plan.parallelism.tp_overlap,
                    options)
    iteration = engine.run()
    return _summarise(resolved, program, engine, iteration, time.perf_counter() - started)


def _summarise(resolved: ResolvedPlan, program: Program, engine: Engine, iteration: float, wall: float) -> SimResult:
    plan = resolved.plan
    table = conform(pd.DataFrame(engine.rows), INSTRUCTION_TABLE, "simulator")
    table = table.sort_values(["rank", "start_s", "parent", "index"], kind="stable").reset_index(drop=True)
    samples = plan.global_batch / iteration
    seq = resolved.transformer.seq if resolved.transformer else 0
    model_flops = 3 * sum(resolved.costs.layer_costs(layer, plan.micro_batch, 1).flops_fwd
                          for layer in range(resolved.costs.num_layers)) * plan.microbatches * plan.dp
    per_device = model_flops / plan.world_size / iteration
    try:
        mfu = per_device / resolved.cluster.device.peak(plan.dtype)
    except ConfigError:
        mfu = float("nan")
    bubbles = {program.coords_of(rank).pp: 1.0 - engine.compute_busy[rank] / iteration
               for rank in program.ranks}
    memory = {
        rank: RankMemory(rank, ledger.peak, ledger.peak_breakdown, ledger.capacity, ledger.oom_at_s is not None,
                         ledger.oom_at_s, ledger.oom_instruction)
        for rank, ledger in engine.ledgers.items()
    }
    notes = []
    if plan.profile and plan.micro_batch != getattr(resolved.costs, "profiled_micro_batch", plan.micro_batch):
        notes.append("micro-batch differs from the profiled one: times scaled linearly")
    return SimResult(plan.name, iteration, samples, samples * seq, per_device, mfu, bubbles, memory, table,
                     program.symmetric, wall, len(engine.rows), notes)


def simulate_file(path: str | Path, full: bool = False) -> SimResult:
    return simulate(Plan.load(path), full=full)
