"""Our runtime against torch.distributed.pipelining's own runtime, on the same stages and schedule.

Both sides build the same stage modules (same partition, same seeded weights), train on the same
micro-batches (``exec.contract.batch_seed``) with the same Adam, one CPU thread per rank, gloo.
torch runs its schedule class (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble for ZB-H1); we run the Program that paratwin lowers for the same
schedule. Printed: the losses of both (they must agree), and the throughput ratio ours / torch's
from the medians of the per-iteration times (slowest rank), with the spread (max - min) / median.

    .venv/bin/python benchmarks/runtime_vs_torch.py                      # gpt-tiny, all four schedules
    .venv/bin/python benchmarks/runtime_vs_torch.py --hidden 256 --layers 8 --seq 128 --iterations 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exec.contract import batch_seed, compile_for_run, make_optimizer  # noqa: E402
from exec.launcher import run_plan  # noqa: E402
from sim.plan import Plan  # noqa: E402
from traces.forkserver import forkserver_context  # noqa: E402

TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
}


def make_plan(schedule: str, pp: int = 2, microbatches: int = 4, micro_batch: int = 2,
              workload_options: dict | None = None) -> Plan:
    chunks = 2 if schedule == "interleaved-1f1b" else 1
    return Plan(name=f"gpt-{schedule}", workload="gpt-tiny", workload_options=workload_options or {},
                parallelism={"pp": pp, "chunks": chunks},
                schedule={"name": schedule, "microbatches": microbatches, "micro_batch": micro_batch},
                cluster={"preset": "local-cpu-2", "devices_per_node": pp})


def _global_batch(workload, plan: Plan, iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    batches = [workload.make_batch(plan.micro_batch, seed=batch_seed(iteration, 0, mb, 1, plan.microbatches))
               for mb in range(plan.microbatches)]
    return torch.cat([b.inputs for b in batches]), torch.cat([b.targets for b in batches])


def _torch_rank(rank: int, world: int, plan_data: dict, steps: int, init: str, out: str) -> None:
    import torch.distributed.pipelining as pipelining

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    plan = Plan.from_dict(plan_data)
    run = compile_for_run(plan)
    workload, program = run.workload, run.program
    stages, params = [], []
    for s in program.ranks[rank].stages:
        layers = program.stage_layers[s]
        module = nn.Sequential(*workload.build_layers(layers[0], layers[-1] + 1))
        params += list(module.parameters())
        stages.append(pipelining.PipelineStage(module, s, plan.num_stages, torch.device("cpu")))
    optimizer = make_optimizer(params)
    schedule_class = getattr(pipelining, TORCH_SCHEDULES[plan.schedule.name])
    loss_fn = workload.loss
    schedule = schedule_class(stages if plan.chunks > 1 or plan.schedule.name == "zb-h1" else stages[0],
                              n_microbatches=plan.microbatches, loss_fn=loss_fn)
    first = 0 in program.ranks[rank].stages
    last = plan.num_stages - 1 in program.ranks[rank].stages
    times, losses = [], []
    for iteration in range(steps):
        inputs, targets = _global_batch(workload, plan, iteration)
        optimizer.zero_grad(set_to_none=True)
        mb_losses: list[torch.Tensor] = []
        dist.barrier()
        t0 = time.perf_counter()
        args = (inputs,) if first else ()
        kwargs = {"target": targets, "losses": mb_losses} if last else {}
        schedule.step(*args, **kwargs)
        optimizer.step()
        times.append(time.perf_counter() - t0)
        if last:
            losses.append(sum(float(x.detach()) for x in mb_losses) / len(mb_losses))
    Path(out, f"rank{rank}.json").write_text(json.dumps({"times": times, "losses": losses}))
    # Parameters after the last step, named "<layer>.<name>" with global layer indices, as ours.
    named = {}
    for s, stage in zip(program.ranks[rank].stages, stages, strict=True):
        first_layer = program.stage_layers[s][0]
        for name, p in stage.submod.named_parameters():
            local, rest = name.split(".", 1)
            named[f"{first_layer + int(local)}.{rest}"] = p.detach().clone()
    torch.save(named, Path(out, f"params{rank}.pt"))
    dist.destroy_process_group()


def torch_run(plan: Plan, steps: int) -> dict:
    """torch.distributed.pipelining on ``plan``'s stages: per-iteration times per rank and losses."""
    out = tempfile.mkdtemp(prefix="paratwin-torchpp-")
    init = f"file://{out}/store"
    context = forkserver_context()  # the launcher's preload: run_plan forks from it next
    processes = [context.Process(target=_torch_rank,
                                 args=(r, plan.world_size, plan.model_dump(), steps, init, out))
                 for r in range(plan.world_size)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(600)
    if any(p.exitcode != 0 for p in processes):
        raise RuntimeError(f"torch pipelining run failed: exit codes {[p.exitcode for p in processes]}")
    results = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(plan.world_size)]
    losses = next(r["losses"] for r in results if r["losses"])
    params = {k: v for r in range(plan.world_size) for k, v in torch.load(Path(out, f"params{r}.pt")).items()}
    return {"times": [r["times"] for r in results], "losses": losses, "params": params}


def compare(plan: Plan, iterations: int, warmup: int) -> dict:
    steps = warmup + iterations
    theirs = torch_run(plan, steps)
    ours = run_plan(plan, iterations=iterations, warmup=warmup, timeout_s=300, save_params=True,
                    out_dir=tempfile.mkdtemp(prefix="paratwin-ours-"))
    our_params = {k: v for r in range(plan.world_size)
                  for k, v in torch.load(ours.paths["params"] / f"rank{r}.pt").items()}
    our_times = ours.iteration_times
    their_times = [max(ts) for ts in zip(*(t[warmup:] for t in theirs["times"]), strict=True)]
    return {"schedule": plan.schedule.name, "our_losses": ours.losses, "torch_losses": theirs["losses"],
            "our_times": our_times, "torch_times": their_times,
            "our_params": our_params, "torch_params": theirs["params"]}


def _spread(values: list[float]) -> float:
    median = statistics.median(values)
    return (max(values) - min(values)) / median if median else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=list(TORCH_SCHEDULES))
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    args = parser.parse_args()
    sizes = (("hidden", args.hidden), ("num_layers", args.layers), ("seq", args.seq))
    options = {k: v for k, v in sizes if v}
    print(f"gpt-tiny {options or ''} pp=2, {args.microbatches} micro-batches of {args.micro_batch}, "
          f"{args.iterations} iterations after {args.warmup} warm-up, gloo, 1 thread per rank, "
          f"{os.cpu_count()} CPUs")
    print(f"{'schedule':<18} {'max |loss diff|':>15} {'ours ms':>9} {'spread':>7} {'torch ms':>9} "
          f"{'spread':>7} {'ours/torch throughput':>22}")
    for schedule in args.schedules:
        plan = make_plan(schedule, microbatches=args.microbatches, micro_batch=args.micro_batch,
                         workload_options=options)
        r = compare(plan, args.iterations, args.warmup)
        diff = max(abs(a - b) for a, b in zip(r["our_losses"], r["torch_losses"], strict=True))
        ours, theirs = statistics.median(r["our_times"]), statistics.median(r["torch_times"])
        print(f"{schedule:<18} {diff:>15.2e} {ours * 1e3:>9.2f} {_spread(r['our_times']):>7.0%} "
              f"{theirs * 1e3:>9.2f} {_spread(r['torch_times']):>7.0%} {theirs / ours:>22.2f}")


if __name__ == "__main__":
    main()
