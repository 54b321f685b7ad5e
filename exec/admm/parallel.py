"""P-ADMMiRNN: synchronous (SP) and asynchronous (AP) data-parallel ADMMiRNN over torch.distributed.

The training samples are split into contiguous shards, one per worker. Everything per sample
(a, s, o and their duals) lives only on the worker that owns the sample; the weights U, W, b, V, c
are shared. The weight updates need the data only through sums over samples (the Gram-matrix
statistics of ``rnn_admm.recurrent_stats`` / ``output_stats``), which is what travels.

SP-ADMMiRNN (``run_sp``): every rank runs the serial iteration on its shard and all-reduces
(sum) the two statistics tensors at the two points where the serial algorithm updates weights.
Every rank then takes the identical step, so SP computes the serial algorithm's iterates on the
union of the shards (up to the order of floating-point sums).

AP-ADMMiRNN (``run_ap``): a parameter server (rank 0) and ``workers`` worker ranks. The protocol:

1. Every worker builds the same initial weights from the seed, runs the forward pass on its
   shard and sends its initial statistics (clock 0). The server waits for all of them.
2. Worker loop, iteration i = 1..I, with the weights it last received: update a, s, o and the
   duals of its shard, compute its statistics, ``send`` [i, statistics, sums] to rank 0, then
   block in ``recv`` for new weights.
3. Server loop: ``recv`` from any source. It replaces that worker's stored statistics (the sum
   over workers always uses the newest statistics of every worker, some of them stale), takes
   one weight update (U, W linearized, b closed form, V linearized, c closed form) and records
   the new version. It then replies with the newest weights to every waiting worker whose clock
   is at most ``staleness`` ahead of the slowest worker's clock (stale synchronous parallel,
   Ho et al., NIPS 2013); other workers wait until the slowest catches up. So no worker starts an
   iteration more than ``staleness`` iterations ahead of any other, and the server's sum mixes
   statistics at most that many iterations apart. The slowest worker is never held back, so the
   protocol cannot deadlock. The server stops after I messages from every worker.

Processes are started with ``torch.multiprocessing.spawn`` on localhost with gloo, one thread each.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from traces.errors import ConfigError

from .data import SequenceData
from .rnn_admm import (
    ADMMConfig,
    RNNParams,
    admm_iteration,
    init_params,
    init_state,
    local_sums,
    output_stats,
    recurrent_stats,
    update_local,
    update_output_params,
    update_recurrent_params,
)


@dataclass
class ParallelResult:
    """Outcome of a parallel run.

    ``snapshots``: (version, seconds since the start, data passes, flat weights) after every weight
    update; a data pass is one iteration of every worker (AP: sum of worker clocks / workers).
    ``compute_s``: per worker, the seconds of local computation of each iteration (no
    communication, no waiting). ``comm_s``: SP only, per iteration the seconds rank 0 spent in
    all-reduces (including waiting for the slower rank). ``staleness``: AP only, per update the
    clock gap between the fastest and the slowest worker.
    """

    mode: str
    workers: int
    params: RNNParams
    snapshots: list[tuple[int, float, float, torch.Tensor]]
    compute_s: list[list[float]]
    comm_s: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    bytes_per_iteration: int = 0
    sums: list[torch.Tensor] = field(default_factory=list)  # rnn_admm.local_sums over all shards, per update


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _init_process(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)  # many ranks share few cores
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, whatever the hostname resolves to
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def stats_bytes(data: SequenceData, hidden: int) -> int:
    """Bytes of the two statistics tensors one worker contributes per iteration."""
    f1, f3 = data.input_dim + hidden + 1, hidden + 1
    elems = f1 * f1 + f1 * hidden + f3 * f3 + f3 * data.num_classes
    return elems * data.x.element_size()


# --------------------------------------------------------------------------------------- SP


def _sp_worker(rank: int, world: int, port: int, train: SequenceData, hidden: int, iterations: int,
               cfg: ADMMConfig, seed: int, init_scale: float, out_dir: str) -> None:
    _init_process(rank, world, port)
    try:
        data = train.shards(world)[rank]
        params = init_params(train.input_dim, hidden, train.num_classes, seed, train.x.dtype, init_scale)
        state = init_state(params, data)
        comm = [0.0]

        def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            dist.all_reduce(tensor)
            comm[0] += time.perf_counter() - start
            return tensor

        dist.barrier()
        t0 = time.perf_counter()
        snapshots = [(0, 0.0, 0.0, params.flat())]
        compute, comm_times, sums = [], [], []
        for it in range(1, iterations + 1):
            comm[0] = 0.0
            start = time.perf_counter()
            params = admm_iteration(params, state, data, cfg, all_reduce_sum)
            total = time.perf_counter() - start
            compute.append(total - comm[0])
            comm_times.append(comm[0])
            snapshots.append((it, time.perf_counter() - t0, float(it), params.flat()))
            sums.append(local_sums(params, state, data, cfg))
        torch.save({"compute": compute, "comm": comm_times, "snapshots": snapshots, "sums": sums,
                    "wall": time.perf_counter() - t0}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_sp(train: SequenceData, hidden: int, iterations: int, cfg: ADMMConfig = ADMMConfig(),
           workers: int = 2, seed: int = 0, init_scale: float = 1.0) -> ParallelResult:
    """SP-ADMMiRNN with ``workers`` gloo ranks on this machine."""
    _check_workers(workers, train)
    with tempfile.TemporaryDirectory(prefix="admm-sp-") as out_dir:
        mp.spawn(_sp_worker, args=(workers, free_port(), train, hidden, iterations, cfg, seed, init_scale, out_dir),
                 nprocs=workers, join=True)
        ranks = [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(workers)]
    snapshots = ranks[0]["snapshots"]
    template = init_params(train.input_dim, hidden, train.num_classes, seed, train.x.dtype, init_scale)
    sums = [torch.stack(per_rank).sum(0) for per_rank in zip(*(r["sums"] for r in ranks), strict=True)]
    return ParallelResult("sp", workers, template.load_flat(snapshots[-1][3]), snapshots,
                          [r["compute"] for r in ranks], ranks[0]["comm"], wall_s=ranks[0]["wall"],
                          bytes_per_iteration=stats_bytes(train, hidden), sums=sums)


# --------------------------------------------------------------------------------------- AP


def _ap_message(clock: int, params: RNNParams, state, data: SequenceData, cfg: ADMMConfig) -> torch.Tensor:
    return torch.cat([torch.tensor([float(clock)], dtype=data.x.dtype), recurrent_stats(data, state, cfg),
                      output_stats(data, state, cfg), local_sums(params, state, data, cfg)])


def _ap_worker(rank: int, world: int, train: SequenceData, hidden: int, iterations: int,
               cfg: ADMMConfig, seed: int, init_scale: float, delays: list[float], out_dir: str) -> None:
    data = train.shards(world - 1)[rank - 1]
    params = init_params(train.input_dim, hidden, train.num_classes, seed, train.x.dtype, init_scale)
    state = init_state(params, data)
    dist.send(_ap_message(0, params, state, data, cfg), dst=0)
    buffer = params.flat()
    compute = []
    for it in range(1, iterations + 1):
        start = time.perf_counter()
        update_local(params, state, data, cfg)
        message = _ap_message(it, params, state, data, cfg)
        compute.append(time.perf_counter() - start)
        if delays[rank - 1] > 0:
            time.sleep(delays[rank - 1])  # injected straggler
        dist.send(message, dst=0)
        dist.recv(buffer, src=0)
        params = params.load_flat(buffer)
    torch.save({"compute": compute}, Path(out_dir) / f"rank{rank}.pt")


def _ap_server(world: int, train: SequenceData, hidden: int, iterations: int, cfg: ADMMConfig,
               seed: int, init_scale: float, staleness: int, out_dir: str) -> None:
    workers = world - 1
    params = init_params(train.input_dim, hidden, train.num_classes, seed, train.x.dtype, init_scale)
    f1, f3 = train.input_dim + hidden + 1, hidden + 1
    n1, n3 = f1 * f1 + f1 * hidden, f3 * f3 + f3 * train.num_classes
    message = torch.empty(1 + n1 + n3 + 5, dtype=train.x.dtype)
    latest: dict[int, torch.Tensor] = {}
    for w in range(1, world):  # step 1: initial statistics from everyone
        dist.recv(message, src=w)
        latest[w] = message.clone()
    clocks = dict.fromkeys(latest, 0)
    waiting: set[int] = set()
    t0 = time.perf_counter()
    snapshots = [(0, 0.0, 0.0, params.flat())]
    gaps, sums = [], []
    for version in range(1, iterations * workers + 1):
        source = dist.recv(message)  # any worker
        latest[source] = message.clone()
        clocks[source] = int(message[0])
        waiting.add(source)
        total = torch.stack(list(latest.values())).sum(0)
        params = update_recurrent_params(params, total[1 : 1 + n1], cfg)
        params = update_output_params(params, total[1 + n1 : 1 + n1 + n3], cfg)
        slowest = min(clocks.values())
        gaps.append(max(clocks.values()) - slowest)
        snapshots.append((version, time.perf_counter() - t0, sum(clocks.values()) / workers, params.flat()))
        sums.append(total[1 + n1 + n3 :].clone())
        flat = params.flat()
        for w in sorted(waiting):
            if clocks[w] - slowest <= staleness:
                dist.send(flat, dst=w)
                waiting.discard(w)
    torch.save({"snapshots": snapshots, "staleness": gaps, "sums": sums, "wall": time.perf_counter() - t0},
               Path(out_dir) / "rank0.pt")


def _ap_process(rank: int, world: int, port: int, train: SequenceData, hidden: int, iterations: int,
                cfg: ADMMConfig, seed: int, init_scale: float, staleness: int, delays: list[float],
                out_dir: str) -> None:
    _init_process(rank, world, port)
    try:
        if rank == 0:
            _ap_server(world, train, hidden, iterations, cfg, seed, init_scale, staleness, out_dir)
        else:
            _ap_worker(rank, world, train, hidden, iterations, cfg, seed, init_scale, delays, out_dir)
    finally:
        dist.destroy_process_group()


def run_ap(train: SequenceData, hidden: int, iterations: int, cfg: ADMMConfig = ADMMConfig(),
           workers: int = 2, staleness: int = 2, seed: int = 0,
           delays: list[float] | None = None, init_scale: float = 1.0) -> ParallelResult:
    """AP-ADMMiRNN: one server rank plus ``workers`` worker ranks (world size workers + 1).

    The block order is always ``local-first`` (``cfg.sweep`` is not used): a worker updates a, s, o
    and its duals with the weights it holds, then the server updates U, W, b, V, c from the summed
    statistics. With one worker and staleness 0 this is exactly the serial algorithm with
    ``ADMMConfig(sweep="local-first")`` (tests/test_admm_rnn.py); the paper's forward order would
    need two round trips per iteration (U, W, b before a and s; V, c after s).

    ``delays``: optional extra seconds each worker sleeps per iteration (an injected straggler).
    """
    _check_workers(workers, train)
    if staleness < 0:
        raise ConfigError("staleness", f"{staleness} is negative", "use 0 (lock-step) or more")
    delays = list(delays) if delays is not None else [0.0] * workers
    if len(delays) != workers:
        raise ConfigError("delays", f"{len(delays)} delays for {workers} workers",
                          "give one delay per worker")
    with tempfile.TemporaryDirectory(prefix="admm-ap-") as out_dir:
        mp.spawn(_ap_process, args=(workers + 1, free_port(), train, hidden, iterations, cfg, seed, init_scale,
                                    staleness, delays, out_dir), nprocs=workers + 1, join=True)
        server = torch.load(Path(out_dir) / "rank0.pt")
        compute = [torch.load(Path(out_dir) / f"rank{r}.pt")["compute"] for r in range(1, workers + 1)]
    template = init_params(train.input_dim, hidden, train.num_classes, seed, train.x.dtype, init_scale)
    return ParallelResult("ap", workers, template.load_flat(server["snapshots"][-1][3]), server["snapshots"],
                          compute, staleness=server["staleness"], wall_s=server["wall"],
                          bytes_per_iteration=stats_bytes(train, hidden), sums=server["sums"])


def _check_workers(workers: int, train: SequenceData) -> None:
    if not 1 <= workers <= min(64, train.samples):
        raise ConfigError("workers", f"{workers} workers", f"use 1..{min(64, train.samples)}")
