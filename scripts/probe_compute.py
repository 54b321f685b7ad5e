"""Why a plan's compute takes longer in its run than in its profile: time the last layer (+ loss)
and the optimizer step the profiler's way and the runtime's way, side by side (issue 12).

    python scripts/probe_compute.py examples/validation/embedding/emb-dense-dp2.yaml --rounds 20

Spawns as many processes as the plan has data-parallel ranks (one torch thread each, as the
ranks run). Every round runs each variant once, in a rotating order, all processes together
(a barrier before every variant, so they overlap as the ranks of a run do); on every other
round only process 0 times and the others wait at the barrier ("solo"). Per variant and mode it
prints the median milliseconds and the median minor page faults of the timed call (getrusage
per thread). Variants:

- ``profile-fwd`` / ``profile-bwd``: ``exec.profiler._LayerProbe`` on the last layer: its forward
  + loss, then ``autograd.grad`` (fresh gradients, as the profile times it);
- ``run-fwd`` / ``run-bwd``: as ``exec.interpreter`` runs it: the forward under the run's
  saved-tensor hooks, loss / micro-batches, ``autograd.backward`` accumulating into ``.grad``,
  two micro-batches per round (gradients set to None before the first, as ``zero_grad`` does);
- ``run-nohooks-*``: the same without the saved-tensor hooks;
- ``opt-profile``: Adam over each layer alone, summed (``_measure_optimizer_step``'s way: the same
  layer stepped again and again, its state warm); ``opt-run``: one Adam over the whole model right
  after the run-style backward (the run's way).

Times on a loaded machine are only comparable side by side within one invocation.
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _timed(fn: Any) -> tuple[float, int, Any]:
    f0 = _faults()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, _faults() - f0, out


def _worker(index: int, processes: int, barrier: Any, plan_path: str, rounds: int, queue: Any) -> None:
    import torch

    torch.set_num_threads(1)
    from exec.activations import SavedStore, storage_key
    from exec.contract import batch_seed, load_workload
    from exec.profiler import _LayerProbe
    from sim.plan import Plan

    plan = Plan.load(plan_path)
    wl = load_workload(plan)
    last = wl.num_layers - 1
    model = wl.build_layers(0, wl.num_layers, device="cpu", dtype=torch.float32)
    model.train()
    params = [p for p in model.parameters()]
    mbs = plan.microbatches
    batches = [wl.make_batch(plan.micro_batch, seed=batch_seed(0, index, mb, plan.dp, mbs)) for mb in range(mbs)]
    with torch.no_grad():  # what enters the last layer, per micro-batch
        entering = []
        for b in batches:
            h = b.inputs
            for layer in model[:last]:
                h = layer(h)
            entering.append(h)
    head = model[last]
    probe = _LayerProbe(last, head, entering[0], batches[0].targets, wl.loss, 0)
    storages = {storage_key(p) for p in params}
    optimizer = torch.optim.Adam(params, lr=1e-6)

    class Releasing(SavedStore):
        """Drops its reference when autograd unpacks a tensor (a backward without retain_graph
        unpacks each once), so autograd frees it as it would without hooks."""

        def unpack(self, handle: Any) -> torch.Tensor:
            if isinstance(handle, torch.Tensor):
                return handle
            t, self.tensors[handle] = self.tensors[handle], None
            return t

    def run_style(hooks: bool, out: dict[str, list[tuple[float, int]]], tag: str, release: bool = False) -> None:
        for p in params:
            p.grad = None
        for mb in range(mbs):
            x = entering[mb].detach().requires_grad_(True)
            store = (Releasing if release else SavedStore)(storages)

            def fwd(x: torch.Tensor = x, store: SavedStore = store, mb: int = mb) -> torch.Tensor:
                if hooks:
                    with store.hooks():
                        return wl.loss(head(x), batches[mb].targets) / mbs
                return wl.loss(head(x), batches[mb].targets) / mbs

            t, f, loss = _timed(fwd)
            out[f"{tag}-fwd"].append((t, f))
            t, f, _ = _timed(lambda loss=loss: torch.autograd.backward(loss))
            out[f"{tag}-bwd"].append((t, f))
            store.release()

    def profile_style(out: dict[str, list[tuple[float, int]]]) -> None:
        t, f, y = _timed(probe.forward)
        out["profile-fwd"].append((t, f))
        t, f, _ = _timed(lambda: probe.backward(y))
        out["profile-bwd"].append((t, f))

    # The profiler's way: one Adam per layer, kept across rounds (its state warm), random gradients.
    per_layer = [(torch.optim.Adam(list(layer.parameters()), lr=1e-6),
                  [(p, torch.randn_like(p) * 1e-3) for p in layer.parameters()]) for layer in model]

    def optimizer_profile(out: dict[str, list[tuple[float, int]]]) -> None:
        total_t, total_f = 0.0, 0
        for opt, grads in per_layer:
            for p, g in grads:
                p.grad = g
            t, f, _ = _timed(opt.step)
            total_t, total_f = total_t + t, total_f + f
        for p in params:
            p.grad = None
        out["opt-profile"].append((total_t, total_f))

    random_grads = {id(p): g for _, grads in per_layer for p, g in grads}

    def optimizer_run(out: dict[str, list[tuple[float, int]]]) -> None:
        run_style(True, defaultdict(list), "scratch")  # the head's gradients, as the run leaves them
        for p in params:  # the layers below the head (not run here) get the profile's random ones
            if p.grad is None:
                p.grad = random_grads[id(p)]
        t, f, _ = _timed(optimizer.step)
        out["opt-run"].append((t, f))

    variants = {"profile": profile_style, "run": lambda o: run_style(True, o, "run"),
                "run-nohooks": lambda o: run_style(False, o, "run-nohooks"),
                "run-release": lambda o: run_style(True, o, "run-release", release=True),
                "opt-profile": optimizer_profile, "opt-run": optimizer_run}
    names = list(variants)
    results: dict[str, dict[str, list[tuple[float, int]]]] = {"pair": defaultdict(list), "solo": defaultdict(list)}
    for warm in (True, False):
        for r in range(2 if warm else rounds):
            mode = "solo" if (r % 2 and processes > 1) else "pair"
            for k in range(len(names)):
                name = names[(r + k) % len(names)]
                barrier.wait()
                if mode == "solo" and index != 0:
                    continue
                sink: dict[str, list[tuple[float, int]]] = defaultdict(list) if warm else results[mode]
                variants[name](sink)
    barrier.wait()
    queue.put((index, {m: dict(v) for m, v in results.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--processes", type=int, default=None, help="default: the plan's world size")
    args = parser.parse_args()
    from sim.plan import Plan

    processes = args.processes or Plan.load(args.plan).world_size
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(processes), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(i, processes, barrier, str(args.plan), args.rounds, queue))
               for i in range(processes)]
    for w in workers:
        w.start()
    got = dict(queue.get() for _ in workers)
    for w in workers:
        w.join()
    print(f"{args.plan.name}: {processes} processes, {args.rounds} rounds (half of them solo when > 1 process)")
    print("| variant | mode | process | median ms | p25-p75 ms | median minor faults |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for mode in ("pair", "solo"):
        for index in sorted(got):
            for name, samples in sorted(got[index][mode].items()):
                times = sorted(t * 1e3 for t, _ in samples)
                q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
                print(f"| {name} | {mode} | {index} | {statistics.median(times):.2f} | {q[0]:.2f}-{q[2]:.2f} | "
                      f"{statistics.median(f for _, f in samples):.0f} |")


if __name__ == "__main__":
    main()
