"""Why the sharded embedding methods' compute runs over its profile while dense's does not (issue 12):
the runtime's own forwards and backwards of the embedding suite's plans, in one process, with the
exchanges replaced by local copies, interleaved, beside the profile's per-layer rows.

    python scripts/probe_sharded_compute.py --rounds 40          # about 1-2 min on a quiet host

One process, one torch thread (as every CPU rank runs), a gloo group of one (the runtime's
barrier and the dense buckets' all-reduces run, locally). For every plan of
``examples/validation/embedding/`` (dense, EmbRace 2D, EmbRace sequential, ps) the real
``exec.interpreter.RankRuntime`` of rank 0 runs whole iterations: the same modules, the same
saved-tensor hooks, the same optimizer steps; its sharded tables' all-to-alls
(``exec.embedding`` / ``exec.embedding_ps``: ``dist.all_to_all_single``) are replaced by a local
copy (``LocalExchange``): every peer is taken to send what this rank sends to itself, tiled to the
split sizes the runtime asked for, so the runtime does all its own index, unique, gather,
reorder and ``index_add_`` work on tensors of the run's sizes, and only the transfer is gone.

Every round runs one iteration of each plan, in an order rotated each round (A B C D, B C D A,
...). Per compute instruction it records the duration (the runtime's own row), Python's garbage
collection time inside it (``gc.callbacks``) and the process's minor page faults
(``getrusage``); per layer, the forward (module hooks) and the backward (a hook on each layer
output's gradient: the backward of layer i runs between the gradient of its output and that of
its input). The profile (``exec.profiler.profile_workload``, this process, alone, one thread) is
taken before and after the rounds; the engine charges a forward sum(fwd_s) and a backward
sum(bwd_input_s + bwd_weight_s) (``sim.costs.LayerCosts.bwd_s``).

Printed: per plan, median ms over rounds (p10-p90) of each part; each sharded plan's paired
per-round ratio to dense (median and the rounds above 1); and the profile's rows. Timings on a
loaded machine are comparable only side by side within one invocation.

Modes: ``--processes 2`` runs two replicas at once (each its own group of one; every iteration
started together); ``--processes 2 --real`` two ranks of one gloo group with the real exchanges
(the suite's run without its launcher); ``--plans NAME`` one plan alone, so each process holds one
runtime and its own allocation history, as in the suite (the interleaved processes hold all four,
whose freed memory serves each other). Page-fault counts do not depend on the machine's load:

    python scripts/probe_sharded_compute.py --processes 2 --real --plans emb-embrace-2d-dp2 \
        --rounds 10 --profile-repeats 0          # per plan, ~15 s; docs/embrace.md, "Page faults"
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import resource
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

PLANS = ("emb-dense-dp2", "emb-embrace-2d-dp2", "emb-embrace-seq-dp2", "emb-ps-dp2")
PLAN_DIR = Path(__file__).resolve().parent.parent / "examples" / "validation" / "embedding"


class _Done:
    """A collective that already completed (the local copy ran inline)."""

    def wait(self, *_: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class LocalExchange:
    """Stands in for ``torch.distributed`` in the embedding runtimes: ``all_to_all_single`` becomes a
    local copy of what this rank sends to itself, tiled into every peer's chunk (the runtime always
    passes flat tensors); everything else is the real module."""

    def __init__(self, real: Any, rank: int) -> None:
        self.real, self.rank = real, rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def all_to_all_single(self, output: Any, input: Any, output_split_sizes: list[int] | None = None,  # noqa: A002
                          input_split_sizes: list[int] | None = None, group: Any = None,
                          async_op: bool = False) -> Any:
        peers = len(output_split_sizes) if output_split_sizes else len(input_split_sizes or []) or 2
        ins = input_split_sizes or [input.numel() // peers] * peers
        outs = output_split_sizes or [output.numel() // peers] * peers
        own = input.reshape(-1).split(ins)[self.rank]
        for chunk in output.reshape(-1).split(outs):
            if chunk.numel() == 0:
                continue
            if own.numel() == 0:
                chunk.zero_()
            else:
                times = math.ceil(chunk.numel() / own.numel())
                chunk.copy_((own.repeat(times) if times > 1 else own)[:chunk.numel()])
        return _Done() if async_op else None


class Meter:
    """Wall time, garbage-collection time and minor page faults of the process."""

    def __init__(self) -> None:
        self.gc_s = 0.0
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_start

    def read(self) -> tuple[float, float, int, int]:
        """(time, gc seconds so far, this thread's minor page faults, the whole process's)."""
        return (time.perf_counter(), self.gc_s, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt,
                resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def _instrument(runtime: Any, meter: Meter, sink: dict[str, list[float]]) -> None:
    """Per compute instruction: time, gc time, faults; per layer: forward and backward times."""
    from sim.program import Kind

    layers = sorted(runtime.layer_modules)
    marks: dict[str, float] = {}

    def pre(layer: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            marks[f"fwd{layer}"] = time.perf_counter()
        return hook

    def post(layer: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            now = time.perf_counter()
            if not hasattr(runtime, "_probe_kind") or runtime._probe_kind != "FWD":
                return
            sink[f"fwd.L{layer}.mb{runtime.current.microbatch}"].append(now - marks[f"fwd{layer}"])
            marks["fwd_end"] = now
            if output.requires_grad:
                output.register_hook(lambda g, layer=layer: marks.__setitem__(f"grad{layer}", time.perf_counter()))
        return hook

    for layer in layers:
        runtime.layer_modules[layer].register_forward_pre_hook(pre(layer))
        runtime.layer_modules[layer].register_forward_hook(post(layer))
    execute = runtime._execute

    def timed_execute(ins: Any) -> None:
        if not ins.kind.is_compute:
            execute(ins)
            return
        runtime._probe_kind = ins.kind.value
        for key in [k for k in marks if k.startswith("grad")]:
            del marks[key]
        t0, g0, f0, p0 = meter.read()
        execute(ins)
        t1, g1, f1, p1 = meter.read()
        tag = f"{ins.kind.value}.mb{ins.microbatch}" if ins.kind is not Kind.OPTIMIZER_STEP \
            else f"STEP.{ins.method or 'dense'}"
        sink[tag].append(t1 - t0)
        sink[f"gc:{tag}"].append(g1 - g0)
        sink[f"faults:{tag}"].append(f1 - f0)
        sink[f"faults-process:{tag}"].append(p1 - p0)
        mb = ins.microbatch
        if ins.kind is Kind.FWD:
            sink[f"fwd.loss.mb{mb}"].append(t1 - marks["fwd_end"])
        elif ins.kind is Kind.BWD and all(f"grad{layer}" in marks for layer in layers):
            # layer i's backward: from its output's gradient to its input's (the last: from the start)
            edges = [t0] + [marks[f"grad{layer}"] for layer in reversed(layers)] + [t1]
            sink[f"bwd.loss.mb{mb}"].append(edges[1] - edges[0])
            for position, layer in enumerate(reversed(layers)):
                sink[f"bwd.L{layer}.mb{mb}"].append(edges[position + 2] - edges[position + 1])
        runtime._probe_kind = None

    runtime._execute = timed_execute


def _profile_rows(plan: Any, repeats: int, together: Any) -> dict[str, float]:
    from exec.contract import load_workload
    from exec.profiler import profile_workload

    bundle = profile_workload(load_workload(plan), micro_batch=plan.micro_batch, device="cpu", repeats=repeats,
                              with_ops=False, together=together)
    out = {}
    for row in bundle.layers.itertuples(index=False):
        out[f"fwd.L{row.layer}"] = row.fwd_s
        out[f"bwd.L{row.layer}"] = row.bwd_s
        out[f"bwd_iw.L{row.layer}"] = row.bwd_input_s + row.bwd_weight_s
    return out


def profile_faults(plan: Any, layer: int, repeats: int) -> dict[str, tuple[float, float, int]]:
    """The profiler's own rounds of ``layer`` (``exec.profiler.profile_workload``, this process): per
    timed quantity (forward, whole backward, recompute, B, W), the median milliseconds, the median
    and the largest page faults of a call."""
    import exec.profiler as profiler
    from exec.contract import load_workload

    names = ("fwd", "bwd", "recompute", "B", "W")
    seen: dict[str, list[tuple[float, int]]] = defaultdict(list)
    plain_round, plain_call = profiler._round, profiler._Timer.__call__

    def counted_call(timer: Any, fn: Any) -> tuple[float, Any]:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        elapsed, out = plain_call(timer, fn)
        timer.calls.append((elapsed, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
        return elapsed, out

    def counted_round(probe: Any, timer: Any) -> Any:
        timer.calls = []
        out = plain_round(probe, timer)
        for name, call in zip(names, timer.calls, strict=False):
            seen[name].append(call)
        return out

    profiler._round, profiler._Timer.__call__ = counted_round, counted_call
    try:
        profiler.profile_workload(load_workload(plan), micro_batch=plan.micro_batch, device="cpu", repeats=repeats,
                                  with_ops=False, layers=range(layer, layer + 1))
    finally:
        profiler._round, profiler._Timer.__call__ = plain_round, plain_call
    return {name: (statistics.median(t for t, _ in calls) * 1e3, statistics.median(f for _, f in calls),
                   max(f for _, f in calls)) for name, calls in seen.items()}


def fault_cost_us(megabytes: int = 17, repeats: int = 60) -> tuple[float, int]:
    """Microseconds one minor page fault adds here, and the faults per fill: filling ``megabytes``
    of fresh anonymous memory (each 4 KB page faulted and zeroed by the kernel) against filling the
    same amount already mapped; medians over ``repeats``."""
    import mmap

    size = megabytes * 2**20
    warm = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
    warm.fill(1)
    fresh_s, warm_s, faults = [], [], 0
    for _ in range(repeats):
        region = mmap.mmap(-1, size)
        fresh = np.frombuffer(region, dtype=np.uint8)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        fresh.fill(1)
        fresh_s.append(time.perf_counter() - start)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        del fresh
        region.close()
        start = time.perf_counter()
        warm.fill(1)
        warm_s.append(time.perf_counter() - start)
    return (statistics.median(fresh_s) - statistics.median(warm_s)) / max(faults, 1) * 1e6, faults


def plan_layers(plan: Any) -> list[str]:
    from exec.contract import load_workload

    return load_workload(plan).layer_names()


def _stats(values: list[float]) -> tuple[float, float, float]:
    p10, p50, p90 = np.percentile(values, [10, 50, 90])
    return float(p50), float(p10), float(p90)


def _probe(index: int, processes: int, barrier: Any, votes: Any, args: argparse.Namespace) -> dict:
    """One process's rounds (``processes`` > 1: each iteration started together, as ranks do)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as the runtime runs every CPU rank (exec.rank)
    if args.keep_freed_memory:  # as exec.rank does (the probe builds its runtimes itself)
        from exec.host_memory import keep_freed_memory

        keep_freed_memory()
    import exec.embedding
    import exec.embedding_ps
    from exec.contract import compile_for_run
    from exec.interpreter import RankRuntime
    from exec.lockstep import Alone, Lockstep
    from exec.rank import _groups
    from sim.plan import Plan

    together = Lockstep(barrier, votes, index) if processes > 1 else Alone()
    with tempfile.TemporaryDirectory() as own:
        store = f"file://{args.store}" if args.real else f"file://{own}/store"
        world, rank = (processes, index) if args.real else (1, 0)
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world,
                                timeout=dt.timedelta(seconds=300))
        if not args.real:
            local = LocalExchange(dist, rank=index)
            exec.embedding.dist = local
            exec.embedding_ps.dist = local
        meter = Meter()
        plans = {name: Plan.load(PLAN_DIR / f"{name}.yaml") for name in args.plans}
        started = time.perf_counter()
        profiles = [_profile_rows(next(iter(plans.values())), args.profile_repeats, together)] \
            if args.profile_repeats else []
        samples: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in plans}
        runtimes = {}
        for name, plan in plans.items():
            # replica ``index`` of the plan (its own batches); a group of one: no peer to wait for
            run = compile_for_run(plan)
            groups = _groups(run.program, rank, dt.timedelta(seconds=300)) if args.real else (None, None)
            runtimes[name] = RankRuntime(run, index, torch.device("cpu"), *groups)
            for iteration in range(args.warmup):
                runtimes[name].run_iteration(iteration)
            _instrument(runtimes[name], meter, samples[name])
        names = list(plans)
        for number in range(args.rounds):
            order = names[number % len(names):] + names[:number % len(names)]
            for name in order:
                if barrier is not None:
                    barrier.wait()
                runtimes[name].run_iteration(args.warmup + number)
        if args.profile_repeats:
            profiles.append(_profile_rows(next(iter(plans.values())), args.profile_repeats, together))
        wall = time.perf_counter() - started
        dist.destroy_process_group()
    return {"samples": {n: dict(s) for n, s in samples.items()}, "profiles": profiles, "wall_s": wall}


def _worker(index: int, processes: int, barrier: Any, votes: Any, args: argparse.Namespace, queue: Any) -> None:
    queue.put((index, _probe(index, processes, barrier, votes, args)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3, help="iterations of each plan before the rounds")
    parser.add_argument("--profile-repeats", type=int, default=10, help="0: no profile")
    parser.add_argument("--processes", type=int, default=1,
                        help="2: two replicas at once, each iteration started together (no exchanges between "
                             "them); the table is process 0's")
    parser.add_argument("--real", action="store_true",
                        help="the real exchanges: --processes ranks in one gloo group (as a run); for page-fault "
                             "counts and the like, which a loaded machine does not change")
    parser.add_argument("--profile-faults", action="store_true",
                        help="only the profiler's rounds of the last layer: per quantity ms and page faults")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="apply exec.host_memory.keep_freed_memory in the probe's processes first, as every "
                             "rank and validation profile does (without: glibc's default)")
    parser.add_argument("--plans", nargs="*", default=list(PLANS), help="plan names in " + str(PLAN_DIR))
    parser.add_argument("--json", type=Path, default=None, help="write every sample here")
    args = parser.parse_args(argv)
    if args.real and args.processes < 2:
        parser.error("--real needs --processes 2 (the plans have dp 2)")
    if args.profile_faults:
        import torch

        from sim.plan import Plan

        torch.set_num_threads(1)
        if args.keep_freed_memory:
            from exec.host_memory import keep_freed_memory

            keep_freed_memory()
        plan = Plan.load(PLAN_DIR / f"{args.plans[0]}.yaml")
        last = len(plan_layers(plan)) - 1
        for name, (ms, median, most) in profile_faults(plan, last, args.profile_repeats).items():
            print(f"layer {last} {name}: {ms:.2f} ms, page faults median {median:.0f}, max {most}")
        return 0
    store_dir = tempfile.mkdtemp(prefix="probe-sharded-")
    args.store = f"{store_dir}/store"
    if args.processes == 1:
        result = _probe(0, 1, None, None, args)
    else:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        barrier, votes, queue = context.Barrier(args.processes), context.Array("i", args.processes), context.Queue()
        workers = [context.Process(target=_worker, args=(i, args.processes, barrier, votes, args, queue))
                   for i in range(args.processes)]
        for w in workers:
            w.start()
        results = dict(queue.get() for _ in workers)
        for w in workers:
            w.join()
        result = results[0]
    _report(result["samples"], result["profiles"], args.rounds, result["wall_s"])
    cost, faults = fault_cost_us()
    print(f"\na minor page fault costs {cost:.2f} us here (17 MB filled fresh, {faults} faults, against "
          "filled again; medians of 60)")
    if args.json:
        args.json.write_text(json.dumps({**result, "rounds": args.rounds, "processes": args.processes}, indent=1))
    return 0


def _report(samples: dict[str, dict[str, list[float]]], profiles: list[dict[str, float]], rounds: int,
            wall: float) -> None:
    names = list(samples)
    keys = sorted({k for s in samples.values() for k in s}, key=lambda k: (k.split(":")[0] if ":" in k else "", k))
    print(f"{rounds} rounds, {wall:.0f} s; median ms over rounds (p10-p90); faults: minor page faults")
    print("| part | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for key in keys:
        cells = []
        for name in names:
            values = samples[name].get(key)
            if not values:
                cells.append("-")
            elif key.startswith("faults"):
                cells.append(f"{statistics.median(values):.0f}")
            else:
                p50, p10, p90 = _stats(values)
                cells.append(f"{p50 * 1e3:.3f} ({p10 * 1e3:.2f}-{p90 * 1e3:.2f})")
        print(f"| {key} | " + " | ".join(cells) + " |")
    base = names[0]
    print(f"\npaired per-round ratio to {base} (median; rounds above 1 of {rounds}):")
    for key in ("FWD.mb0", "FWD.mb1", "BWD.mb0", "BWD.mb1", "compute"):
        parts = []
        for name in names[1:]:
            a, b = (_compute(samples[n]) if key == "compute" else samples[n].get(key, []) for n in (name, base))
            if len(a) != len(b) or not a:
                continue
            ratios = [x / y for x, y in zip(a, b, strict=True)]
            parts.append(f"{name} {statistics.median(ratios):.3f} ({sum(r > 1 for r in ratios)})")
        print(f"  {key}: " + ", ".join(parts))
    if not profiles:
        return
    print("\nprofile (this process, alone; before / after the rounds), ms: layer fwd_s, bwd_s, B+W")
    layers = sorted({int(k.split("L")[1]) for k in profiles[0]})
    for layer in layers:
        print(f"  L{layer}: " + " / ".join(f"{p[f'fwd.L{layer}'] * 1e3:.3f}, {p[f'bwd.L{layer}'] * 1e3:.3f}, "
                                          f"{p[f'bwd_iw.L{layer}'] * 1e3:.3f}" for p in profiles))
    for p in profiles:
        fwd = sum(p[f"fwd.L{i}"] for i in layers)
        bwd = sum(p[f"bwd_iw.L{i}"] for i in layers)
        print(f"  a micro-batch priced: forward {fwd * 1e3:.2f} ms, backward (B+W) {bwd * 1e3:.2f} ms, "
              f"whole backward {sum(p[f'bwd.L{i}'] for i in layers) * 1e3:.2f} ms")


def _compute(s: dict[str, list[float]]) -> list[float]:
    """Per round: both micro-batches' forwards and backwards."""
    parts = [s.get(k, []) for k in ("FWD.mb0", "FWD.mb1", "BWD.mb0", "BWD.mb1")]
    return [sum(v) for v in zip(*parts, strict=True)] if all(parts) else []


if __name__ == "__main__":
    raise SystemExit(main())
