"""Do two gloo all-reduces launched together share the link and the CPU? (issue 12)

    python scripts/probe_concurrent_allreduce.py --repeats 40

The dense embedding plan (examples/validation/embedding/emb-dense-dp2.yaml) launches its two
gradient buckets at once after the last backward (``exec.parallel.dp``: ``async_op=True``), while
``exec.commbench`` times one collective at a time. This spawns two gloo ranks (one torch thread
each, as the runtime's ranks) and times, per round in a rotating order, a barrier before each:

- ``one-A`` / ``one-B``: each bucket alone (launch, wait);
- ``serial``: A, wait, B, wait (what the simulator's collective stream assumes);
- ``together``: launch A and B, wait both (what the runtime does); ``together-A`` / ``together-B``
  are the times at which each one's ``wait`` returned (what the run records per instruction).

- ``compute`` / ``A+compute``: about 10 ms of one-thread matmuls alone, and with bucket A in
  flight (``compute-with-A``: the matmuls' own time then): whether a collective slows the rank's
  compute, i.e. whether compute and communication share the cores.

torch's gloo process group runs each collective on one of its worker threads (2 by default:
``ProcessGroupGloo._Options()._threads``), so the two run at once; ``--gloo-threads 1`` queues
them on one thread, which separates what running at once changes from what sharing costs.

Then what ``sim.host_cpu``'s shared slowdown predicts for ``compute-with-A`` and ``A+compute``
from the measured ``one-A`` and ``compute`` times and the all-reduce's cores ``u``: its CPU/wall
here (mean of the ranks), and with ``--comm DIR`` (a commbench folder or profile bundle with
``comm_fits.parquet`` and ``comm_samples.parquet``) the benchmark's own time and per-call CPU fit
at bucket A's bytes, as the engine prices it (``sim.comm.ClusterComm``).

Per variant: the median over repeats of the slower rank's wall time, and the process CPU time
(user + system, all threads, ``getrusage``) over wall time: above 1 means more than one core busy
in the rank. Defaults: the plan's two bucket sizes (bytes of the lowered ALLREDUCE instructions,
runs/suite-embedding/plans/emb-dense-dp2/prediction/instructions.parquet: 8,519,680 and
8,927,232). Times on a loaded machine are only comparable side by side within one invocation.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sim.cluster import load_cluster
from sim.comm import ClusterComm
from sim.host_cpu import overlap, shared_stretch

PLAN_BUCKETS = (8_519_680, 8_927_232)  # bytes; see the module docstring for the source


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_MATRIX = torch.ones(160, 160)  # 40 x 2 x 160^3 = 0.33 GFLOP


def _compute() -> None:
    """About 10 ms of one-thread matmuls on an idle core (a stand-in for a layer's backward)."""
    for _ in range(40):
        torch.mm(_MATRIX, _MATRIX)


def _variant(name: str, a: torch.Tensor, b: torch.Tensor, group: Any) -> dict[str, float]:
    """Run one variant; returns its named times (seconds from the start)."""
    def launch(t: torch.Tensor) -> Any:
        return group.allreduce([t]) if group is not None else dist.all_reduce(t, async_op=True)

    t0 = time.perf_counter()
    if name in ("one-A", "one-B"):
        launch(a if name == "one-A" else b).wait()
        return {name: time.perf_counter() - t0}
    if name == "serial":
        launch(a).wait()
        launch(b).wait()
        return {"serial": time.perf_counter() - t0}
    if name == "compute":
        _compute()
        return {"compute": time.perf_counter() - t0}
    if name == "A+compute":  # the bucket in flight while the rank computes (overlap with a backward)
        work = launch(a)
        _compute()
        computed = time.perf_counter() - t0
        work.wait()
        return {"A+compute": time.perf_counter() - t0, "compute-with-A": computed}
    work_a, work_b = launch(a), launch(b)
    work_a.wait()
    done_a = time.perf_counter() - t0
    work_b.wait()
    done_b = time.perf_counter() - t0
    return {"together": done_b, "together-A": done_a, "together-B": done_b}


def _gloo_group(rank: int, threads: int) -> Any:
    """A gloo process group with ``threads`` worker threads (init_process_group and new_group ignore
    ``pg_options._threads`` in torch 2.13: the thread count of the process does not change)."""
    from torch.distributed.distributed_c10d import _get_default_store

    options = dist.ProcessGroupGloo._Options()
    options._threads = threads
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(dist.PrefixStore("probe", _get_default_store()), rank, 2, options)


def _worker(rank: int, port: int, sizes: tuple[int, int], repeats: int, out: dict, threads: int) -> None:
    torch.set_num_threads(1)  # as exec's ranks
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    # gloo's worker threads per process group (torch's default: 2, what the runtime uses)
    group = _gloo_group(rank, threads) if threads else None
    a = torch.ones(sizes[0] // 4)
    b = torch.ones(sizes[1] // 4)
    variants = ["one-A", "one-B", "serial", "together", "compute", "A+compute"]
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for r in range(-3, repeats):  # three warm-up rounds
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for name in order:
            dist.barrier()
            c0 = _cpu_s()
            got = _variant(name, a, b, group)
            used = _cpu_s() - c0
            if r < 0:
                continue
            for key, value in got.items():
                times.setdefault(key, []).append(value)
            cpu.setdefault(name, []).append(used / got[name])
    keys = sorted(times)
    out[f"cpu{rank}"] = {k: statistics.median(v) for k, v in cpu.items()}
    # per repeat, the slower rank: gather every repeat's value
    table = torch.tensor([times[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    if rank == 0:
        out["slow_median"] = {k: float(table[i].median()) for i, k in enumerate(keys)}
    dist.barrier()
    dist.destroy_process_group()


def predicted(compute_s: float, transfer_s: float, u: float, cores: int) -> tuple[float, float]:
    """(compute-with-A, A+compute) seconds by the shared slowdown: 2 ranks on ``cores`` cores, each
    computing beside its all-reduce of ``transfer_s`` alone that keeps ``u`` cores busy."""
    compute_end, transfer_end = overlap(compute_s, [(transfer_s, shared_stretch(2, cores, u))])
    return compute_end, max(compute_end, transfer_end)


def benchmark_prices(directory: Path, nbytes: int) -> tuple[float, float]:
    """(seconds, CPU seconds) of a 2-rank all-reduce of ``nbytes`` by a benchmark's samples and fits."""
    fits = pd.read_parquet(directory / "comm_fits.parquet")
    samples = pd.read_parquet(directory / "comm_samples.parquet")
    comm = ClusterComm(load_cluster("local-cpu-2"), fits, samples)  # the cluster only names the link
    return comm.collective_s("all_reduce", nbytes, [0, 1]), comm.cpu_s("all_reduce", nbytes, 2)


def print_predictions(med: dict[str, float], u: float, cores: int, comm: Path | None, nbytes: int) -> None:
    rows = [("u from this probe's CPU/wall", med["one-A"], u)]
    if comm is not None:
        seconds, cpu = benchmark_prices(comm, nbytes)
        rows.append((f"u and one-A from {comm}", seconds, cpu / seconds))
    print(f"shared slowdown (sim.host_cpu; 2 ranks, {cores} cores) against compute-with-A "
          f"{med['compute-with-A'] * 1e3:.2f} ms, A+compute {med['A+compute'] * 1e3:.2f} ms measured:")
    for label, transfer_s, cores_used in rows:
        with_a, both = predicted(med["compute"], transfer_s, cores_used, cores)
        print(f"  {label}: u = {cores_used:.2f}, one-A {transfer_s * 1e3:.2f} ms -> compute-with-A "
              f"{with_a * 1e3:.2f} ms ({with_a / med['compute']:.2f}x), A+compute {both * 1e3:.2f} ms "
              f"({both / transfer_s:.2f}x one-A)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--bytes", type=int, nargs=2, default=PLAN_BUCKETS, metavar=("A", "B"))
    parser.add_argument("--gloo-threads", type=int, default=0,
                        help="gloo worker threads per process group (0: torch's default, 2, as the runtime)")
    parser.add_argument("--comm", type=Path, default=None,
                        help="a commbench folder or profile bundle: predict with its time and CPU fit too")
    args = parser.parse_args()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(_free_port(), tuple(args.bytes), args.repeats, out, args.gloo_threads), nprocs=2)
        med = out["slow_median"]
        threads = args.gloo_threads or "default (2)"
        print(f"buckets {args.bytes[0]:,} + {args.bytes[1]:,} bytes, gloo ({threads} threads), 2 ranks, "
              f"{args.repeats} repeats; "
              f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores")
        print(f"{'variant':<12} {'median ms (slower rank)':>24} {'CPU/wall rank0':>15} {'rank1':>6}")
        for key in ["one-A", "one-B", "serial", "together", "together-A", "together-B", "compute", "A+compute",
                    "compute-with-A"]:
            c0, c1 = out["cpu0"].get(key), out["cpu1"].get(key)
            cpu = f"{c0:>15.2f} {c1:>6.2f}" if c0 is not None else ""
            print(f"{key:<12} {med[key] * 1e3:>24.2f} {cpu}")
        one = med["one-A"] + med["one-B"]
        print(f"together / (one-A + one-B) = {med['together'] / one:.2f}; serial / (one-A + one-B) = "
              f"{med['serial'] / one:.2f}; together-A / one-A = {med['together-A'] / med['one-A']:.2f}")
        print(f"compute-with-A / compute = {med['compute-with-A'] / med['compute']:.2f}; A+compute / "
              f"(one-A + compute) = {med['A+compute'] / (med['one-A'] + med['compute']):.2f} (1: no overlap at all)")
        u = (out["cpu0"]["one-A"] + out["cpu1"]["one-A"]) / 2
        print_predictions(dict(med), u, os.cpu_count() or 1, args.comm, args.bytes[0])


if __name__ == "__main__":
    main()
