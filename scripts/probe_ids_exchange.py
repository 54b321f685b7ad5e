"""What does EmbRace's synchronous ids exchange cost on gloo, alone and behind a bucket? (issue 12)

    python scripts/probe_ids_exchange.py --repeats 40

The runtime sends a micro-batch's unique ids on its own thread (exec.embedding.EmbraceExchange.
_request): an all-to-all of the per-peer counts, ``tolist()``, then an all-to-all of the ids with
those splits. The simulator prices that as two all-to-alls of commbench's fit (sim.embedding.
exchange_phases). This spawns two gloo ranks on loopback (one torch thread each, as the runtime's
ranks) and times, per round in a rotating order with a barrier before each:

- ``a2a``: one all_to_all_single of the ids' bytes, even splits (what commbench times);
- ``counts``: the counts all-to-all alone (2 int64);
- ``request``: the runtime's sequence (counts, tolist, ids with splits);
- ``bucket``: an all-reduce of ``--bucket`` bytes alone (launch, wait);
- ``bucket+request``: the bucket launched asynchronously, then the request at once: the request's
  own time (``request-behind``) and the bucket's end (``bucket-behind``), as in the 2D schedule where
  the next iteration's lookups follow the buckets.

Per variant: the median over repeats of the slower rank's wall time. Times on a loaded machine are
comparable side by side within one invocation only. Defaults: 89 unique ids (the emb-embrace
plans' micro-batch of 4 x 32 tokens, measured here) and the dense plan's 8.5 MB bucket.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _request(ids: torch.Tensor, dp: int) -> None:
    owner = ids % dp
    send = ids[torch.argsort(owner, stable=True)]
    send_counts = torch.bincount(owner, minlength=dp)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    requested = torch.empty(int(recv_counts.sum()), dtype=torch.int64)
    dist.all_to_all_single(requested, send, recv_counts.tolist(), send_counts.tolist())


def _worker(rank: int, port: int, repeats: int, unique: int, bucket_bytes: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    generator = torch.Generator().manual_seed(rank)
    ids = torch.randperm(33278, generator=generator)[:unique]
    even = torch.zeros(2 * ((unique + 1) // 2), dtype=torch.int64)
    received = torch.empty_like(even)
    counts = torch.ones(2, dtype=torch.int64)
    counts_in = torch.empty_like(counts)
    bucket = torch.zeros(bucket_bytes // 4)

    def behind() -> tuple[float, float]:
        start = time.perf_counter()
        work = dist.all_reduce(bucket, async_op=True)
        _request(ids, 2)
        request = time.perf_counter() - start
        work.wait()
        return request, time.perf_counter() - start

    variants = {
        "a2a": lambda: dist.all_to_all_single(received, even),
        "counts": lambda: dist.all_to_all_single(counts_in, counts),
        "request": lambda: _request(ids, 2),
        "bucket": lambda: dist.all_reduce(bucket),
    }
    times: dict[str, list[float]] = {k: [] for k in [*variants, "request-behind", "bucket-behind"]}
    names = [*variants, "bucket+request"]
    for r in range(repeats + 2):  # 2 warm-up rounds
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            if name == "bucket+request":
                request, end = behind()
                values = {"request-behind": request, "bucket-behind": end}
            else:
                start = time.perf_counter()
                variants[name]()
                values = {name: time.perf_counter() - start}
            for key, value in values.items():
                slowest = torch.tensor([value], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                if r >= 2:
                    times[key].append(float(slowest))
    if rank == 0:
        with open(out, "w") as f:
            for key, values in times.items():
                f.write(f"{key}\t{statistics.median(values) * 1e3:.3f}\t{min(values) * 1e3:.3f}\t"
                        f"{max(values) * 1e3:.3f}\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--unique", type=int, default=89)
    parser.add_argument("--bucket", type=int, default=8_519_680)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = f"/tmp/probe_ids_{os.getpid()}.tsv"
    mp.start_processes(_worker, args=(port, args.repeats, args.unique, args.bucket, out), nprocs=2,
                       start_method="spawn")
    print("variant\tmedian ms\tmin ms\tmax ms (slower rank per round)")
    with open(out) as f:
        print(f.read(), end="")
    os.remove(out)


if __name__ == "__main__":
    main()
