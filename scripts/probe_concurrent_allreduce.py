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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PLAN_BUCKETS = (8_519_680, 8_927_232)  # bytes; see the module docstring for the source


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _variant(name: str, a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Run one variant; returns its named times (seconds from the start)."""
    t0 = time.perf_counter()
    if name == "one-A":
        dist.all_reduce(a)
        return {"one-A": time.perf_counter() - t0}
    if name == "one-B":
        dist.all_reduce(b)
        return {"one-B": time.perf_counter() - t0}
    if name == "serial":
        dist.all_reduce(a)
        dist.all_reduce(b)
        return {"serial": time.perf_counter() - t0}
    work_a = dist.all_reduce(a, async_op=True)
    work_b = dist.all_reduce(b, async_op=True)
    work_a.wait()
    done_a = time.perf_counter() - t0
    work_b.wait()
    done_b = time.perf_counter() - t0
    return {"together": done_b, "together-A": done_a, "together-B": done_b}


def _worker(rank: int, port: int, sizes: tuple[int, int], repeats: int, out: dict) -> None:
    torch.set_num_threads(1)  # as exec's ranks
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    a = torch.ones(sizes[0] // 4)
    b = torch.ones(sizes[1] // 4)
    variants = ["one-A", "one-B", "serial", "together"]
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for r in range(-3, repeats):  # three warm-up rounds
        order = variants[r % 4:] + variants[:r % 4]
        for name in order:
            dist.barrier()
            c0 = _cpu_s()
            got = _variant(name, a, b)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--bytes", type=int, nargs=2, default=PLAN_BUCKETS, metavar=("A", "B"))
    args = parser.parse_args()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(_free_port(), tuple(args.bytes), args.repeats, out), nprocs=2)
        med = out["slow_median"]
        print(f"buckets {args.bytes[0]:,} + {args.bytes[1]:,} bytes, gloo, 2 ranks, {args.repeats} repeats; "
              f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores")
        print(f"{'variant':<12} {'median ms (slower rank)':>24} {'CPU/wall rank0':>15} {'rank1':>6}")
        for key in ["one-A", "one-B", "serial", "together", "together-A", "together-B"]:
            c0, c1 = out["cpu0"].get(key), out["cpu1"].get(key)
            cpu = f"{c0:>15.2f} {c1:>6.2f}" if c0 is not None else ""
            print(f"{key:<12} {med[key] * 1e3:>24.2f} {cpu}")
        one = med["one-A"] + med["one-B"]
        print(f"together / (one-A + one-B) = {med['together'] / one:.2f}; serial / (one-A + one-B) = "
              f"{med['serial'] / one:.2f}; together-A / one-A = {med['together-A'] / med['one-A']:.2f}")


if __name__ == "__main__":
    main()
