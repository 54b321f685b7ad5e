"""What do EmbRace's synchronous ids exchange and the parameter server's push cost on gloo? (issue 12)

    python scripts/probe_ids_exchange.py --repeats 100

The runtime sends a micro-batch's unique ids on its own thread (exec.embedding.EmbraceExchange.
_request, called here as it is, on the micro-batch's token ids): host work (unique, owners, argsort,
bincount), an all-to-all of the per-peer counts, ``tolist()``, then an all-to-all of the ids with
those splits. The simulator prices the two all-to-alls from commbench (sim.embedding.exchange_phases).
The parameter server's push (exec.embedding_ps._push) launches two all-to-alls asynchronously, the
indices (int64) and the values (float32 rows), then waits for both. This spawns two gloo ranks on
loopback (one torch thread each, as the runtime's ranks) and times, per round in a rotating order
with a barrier before each (as commbench times one call):

- ``a2a``: one all_to_all_single of the ids' bytes, even splits (what commbench times);
- ``counts``: the counts all-to-all alone (2 int64);
- ``two-a2a``: ``counts`` then ``a2a``, back to back (the two messages, nothing else);
- ``host``: the request's host work alone (no communication); ``host+two-a2a``: it, then ``two-a2a``;
- ``request``: the runtime's request; ``request-phased`` the same, split into ``phase-host``,
  ``phase-counts`` (the counts all-to-all), ``phase-ids`` (``tolist`` and the ids all-to-all);
- ``bucket``: an all-reduce of ``--bucket`` bytes alone; ``bucket+request``: the bucket launched
  asynchronously, then the request at once (``request-behind``, ``bucket-behind``: its end);
- ``push-together``: the push as the runtime issues it; ``push-serial``: the same two all-to-alls one
  after the other, each waited on; ``push-one``: one all-to-all of both byte counts;
  ``push-indices`` and ``push-values``: each alone.

Per variant: the median and the mean over rounds of the slower rank's wall time, and the minimum.
On a shared machine the stalls are heavy-tailed: the median of a sequence of steps exceeds the sum
of its steps' medians, the mean does not (means add), so compare sums of means. Times on a loaded
machine are comparable side by side within one invocation only. Defaults: the emb-embrace plans'
micro-batch (4 x 32 tokens of WikiText-2's 33,278-word vocabulary, about 89 unique ids), width 64,
the dense plan's 8.5 MB bucket.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from exec.embedding import EmbraceExchange

VOCAB = 33278


def _request(ids: torch.Tensor) -> None:
    """The runtime's own request (exec.embedding.EmbraceExchange._request) by rows over 2 ranks."""
    exchange = SimpleNamespace(dp=2, group=None)
    EmbraceExchange._request(exchange, SimpleNamespace(shard="rows"), ids)  # type: ignore[arg-type]


def _host(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The request's work before its first all-to-all, as exec.embedding runs it by rows."""
    uniq, _ = torch.unique(ids, return_inverse=True)
    owner = uniq % 2
    order = torch.argsort(owner, stable=True)
    return uniq[order], torch.bincount(owner, minlength=2)


def _phased(ids: torch.Tensor) -> dict[str, float]:
    """``_request`` split into its steps (the same calls, clocked between them)."""
    t0 = time.perf_counter()
    send, send_counts = _host(ids)
    t1 = time.perf_counter()
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    t2 = time.perf_counter()
    requested = torch.empty(int(recv_counts.sum()), dtype=torch.int64)
    dist.all_to_all_single(requested, send, recv_counts.tolist(), send_counts.tolist())
    t3 = time.perf_counter()
    return {"request-phased": t3 - t0, "phase-host": t1 - t0, "phase-counts": t2 - t1, "phase-ids": t3 - t2}


def _push(indices: torch.Tensor, values: torch.Tensor, how: str) -> None:
    """exec.embedding_ps._push's two all-to-alls (``together``: both async, then both waited on, as
    the runtime does; ``serial``: one after the other), or one of both byte counts (``one``)."""
    if how == "one":
        both = torch.cat([indices.view(torch.float32), values.view(-1)])
        dist.all_to_all_single(torch.empty_like(both), both)
        return
    works = [dist.all_to_all_single(torch.empty_like(t), t, async_op=how == "together")
             for t in (indices, values.view(-1))]
    for work in works:
        if work is not None:
            work.wait()


def _worker(rank: int, port: int, repeats: int, tokens: int, bucket_bytes: int, width: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    generator = torch.Generator().manual_seed(rank)
    # token ids with WikiText-like repeats: a Zipf-ish draw over the vocabulary
    weights = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64)
    ids = torch.multinomial(weights, tokens, replacement=True, generator=generator).view(-1, 32)
    most = torch.tensor([torch.unique(ids).numel()])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the even buffers: one size on both ranks
    unique = int(most)
    even = torch.zeros(2 * ((unique + 1) // 2), dtype=torch.int64)
    received = torch.empty_like(even)
    counts = torch.ones(2, dtype=torch.int64)
    counts_in = torch.empty_like(counts)
    bucket = torch.zeros(bucket_bytes // 4)
    push_indices = torch.arange(even.numel(), dtype=torch.int64)  # even splits, as commbench's
    push_values = torch.zeros(even.numel(), width)

    def behind() -> dict[str, float]:
        start = time.perf_counter()
        work = dist.all_reduce(bucket, async_op=True)
        _request(ids)
        request = time.perf_counter() - start
        work.wait()
        return {"request-behind": request, "bucket-behind": time.perf_counter() - start}

    def two_a2a() -> None:
        dist.all_to_all_single(counts_in, counts)
        dist.all_to_all_single(received, even)

    def host_two_a2a() -> None:
        _host(ids)
        two_a2a()

    variants = {
        "a2a": lambda: dist.all_to_all_single(received, even),
        "counts": lambda: dist.all_to_all_single(counts_in, counts),
        "two-a2a": two_a2a,
        "host": lambda: _host(ids),
        "host+two-a2a": host_two_a2a,
        "request": lambda: _request(ids),
        "bucket": lambda: dist.all_reduce(bucket),
        "push-together": lambda: _push(push_indices, push_values, "together"),
        "push-serial": lambda: _push(push_indices, push_values, "serial"),
        "push-one": lambda: _push(push_indices, push_values, "one"),
        "push-indices": lambda: dist.all_to_all_single(torch.empty_like(push_indices), push_indices),
        "push-values": lambda: dist.all_to_all_single(torch.empty_like(push_values.view(-1)), push_values.view(-1)),
    }
    composite = {"bucket+request": behind, "request-phased": lambda: _phased(ids)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = [*variants, *composite]
    for r in range(repeats + 2):  # 2 warm-up rounds
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            if name in composite:
                values = composite[name]()
            else:
                start = time.perf_counter()
                variants[name]()
                values = {name: time.perf_counter() - start}
            for key, value in values.items():
                slowest = torch.tensor([value], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                if r >= 2:
                    times.setdefault(key, []).append(float(slowest))
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"# {unique} unique ids of {tokens} tokens; ids {unique * 8} B, push values "
                    f"{even.numel() * width * 4} B + indices {even.numel() * 8} B\n")
            for key, values in times.items():
                f.write(f"{key}\t{statistics.median(values) * 1e3:.3f}\t{statistics.mean(values) * 1e3:.3f}\t"
                        f"{min(values) * 1e3:.3f}\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=128, help="tokens of one micro-batch (4 x 32)")
    parser.add_argument("--bucket", type=int, default=8_519_680)
    parser.add_argument("--width", type=int, default=64, help="row width of the push's values (float32)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = f"/tmp/probe_ids_{os.getpid()}.tsv"
    mp.start_processes(_worker, args=(port, args.repeats, args.tokens, args.bucket, args.width, out), nprocs=2,
                       start_method="spawn")
    print(f"load average {os.getloadavg()[0]:.1f} (1 min) at the end")
    with open(out) as f:
        print(f.readline(), end="")
        print("variant\tmedian ms\tmean ms\tmin ms (slower rank per round)")
        print(f.read(), end="")
    os.remove(out)


if __name__ == "__main__":
    main()
