"""Communication benchmark: time collectives and point-to-point over a size sweep, fit alpha-beta.

``run_commbench`` times all_reduce, all_gather, reduce_scatter, all_to_all and send_recv on the
current backend (gloo on CPUs, NCCL when every rank has its own GPU) and fits
``time = alpha + bytes / bandwidth`` per primitive. It spawns ``nproc`` local ranks on a free
localhost port, or runs inside an existing process group / torchrun job.

What "bytes" means (the nccl-tests convention, so fits of different primitives compare):
- all_reduce, all_to_all: the buffer each rank holds (all_to_all: ``bytes / world`` to each peer);
- all_gather: the gathered output (each rank contributes ``bytes / world``);
- reduce_scatter: the input (each rank keeps ``bytes / world``);
- send_recv: one message; ranks 2k and 2k+1 ping-pong and half the round trip is the time.
- send, recv (measured only when asked for): one message one way, rank 2k to 2k+1; the time is the
  slower side's call, the CPU the senders' (send) or the receivers' (recv) alone, where the
  ping-pong's is the mean of a send and a receive (issue 12: what receiving costs its host).
Sizes are rounded up to whole float32 elements divisible by the world size; the table holds the
bytes actually moved.

Timing: warm-up calls first, then per repeat a barrier and one call. Each repeat's time is the
slowest rank's (an all_reduce(MAX) after the loop), so it includes barrier-exit skew; the table
keeps median, min and max over repeats. On NCCL the device is synchronised before the clock stops.

CPU: each call's process CPU time (``getrusage``: every thread of the rank, the backend's workers
and the kernel's copies in their system calls; waiting costs none, gloo blocks) is kept too,
``cpu_s`` (median over repeats, mean over ranks), and fitted like the times (``cpu_alpha_s``,
``cpu_bandwidth_Bps``). On a host whose cores the ranks share this is what a transfer takes from
the ranks' compute (``sim.host_cpu``); CPU seconds depend less on other load than wall times.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import socket
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from traces.bundle import check_replaceable, environment_info, read_table_dir, write_table_dir
from traces.errors import ConfigError
from traces.outdir import OutputLock
from traces.schema import COMM_BENCH_FORMAT, COMM_BENCH_VERSION, COMM_FIT_TABLE, COMM_SAMPLE_TABLE
from traces.tables import conform

PRIMITIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
# One-way messages whose CPU is one side's (see the module docstring); measured only when asked for.
ONE_WAY = ("send", "recv")
DEFAULT_SIZES = [1024 * 4**k for k in range(10)]  # 1 KiB, 4 KiB, ..., 256 MiB
FLOAT_BYTES = 4

# How a backend implements a primitive, where that changes what the fit means. Source: PyTorch
# torch/csrc/distributed/c10d/ProcessGroupGloo.cpp (reduce_scatter_tensor_coalesced clones the
# input, all-reduces all of it and copies out this rank's chunk).
IMPLEMENTATION_NOTES = {
    ("gloo", "reduce_scatter"): "gloo: torch runs it as an all_reduce of the whole input plus a local "
    "copy of this rank's chunk, so it costs about an all_reduce of the same bytes",
    ("gloo", "send_recv"): "one-way time = half a ping-pong round trip",
    ("nccl", "send_recv"): "one-way time = half a ping-pong round trip",
    ("gloo", "send"): "one way, rank 2k to 2k+1; cpu: the sender's alone",
    ("gloo", "recv"): "one way, rank 2k to 2k+1; cpu: the receiver's alone",
}


def run_commbench(
    nproc: int = 2,
    sizes: list[int] | None = None,
    primitives: list[str] | None = None,
    backend: str | None = None,
    repeats: int = 10,
    out: Path | None = None,
    warmup: int = 2,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Measure and fit; returns (samples, fits) and writes both to ``out`` when given."""
    sizes = _check_sizes(DEFAULT_SIZES if sizes is None else sizes)
    primitives = _check_primitives(list(PRIMITIVES) if primitives is None else primitives)
    if repeats < 1:
        raise ConfigError("repeats", f"must be at least 1, got {repeats}", "use 5 or more for stable medians")
    if warmup < 0:
        raise ConfigError("warmup", f"must be 0 or more, got {warmup}")
    import torch.distributed as dist

    in_group = dist.is_available() and dist.is_initialized()
    if not in_group and not _launched_by_torchrun() and nproc < 2:
        raise ConfigError("nproc", f"must be at least 2, got {nproc}", "use --nproc 2")
    if not in_group:  # an existing group already has its backend
        _check_backend(backend, nproc)
    # One process per job stores the results: rank 0 of a group or a torchrun job, or this launcher of the ranks.
    if in_group:
        measure, writer = lambda: _measure(sizes, primitives, repeats, warmup), dist.get_rank() == 0
    elif _launched_by_torchrun():
        measure = lambda: _measure_in_new_group(backend, None, sizes, primitives, repeats, warmup)
        writer = os.environ["RANK"] == "0"
    else:
        measure, writer = lambda: _spawn(nproc, backend, sizes, primitives, repeats, warmup), True
    if out is not None and writer:
        check_replaceable(Path(out))  # before minutes of measuring, not after
    # The writer holds the folder's lock while it measures, as every command that writes a folder does: a
    # second commbench into it is refused at once (the last one to finish replaced the other's results).
    with OutputLock(Path(out)) if out is not None and writer else contextlib.nullcontext():
        samples = measure()
        fits = fit_alpha_beta(samples)
        if out is not None and writer:
            settings = {"sizes": sizes, "primitives": primitives, "repeats": repeats, "warmup": warmup}
            write_comm_results(out, samples, fits, settings)
    return samples, fits


def fit_alpha_beta(samples: pd.DataFrame, statistic: str = "median_s") -> pd.DataFrame:
    """Fit time = alpha + bytes / bandwidth per (primitive, backend, world size).

    ``statistic`` is the sample column fitted (median_s, or min_s for the uncontended best case).
    The residual is log(predicted / measured), with a soft-L1 loss beyond about 25%, and
    alpha, 1/bandwidth >= 0. Why: over five decades of sizes, absolute residuals let the largest
    sizes decide everything and leave alpha meaningless; relative residuals (pred - y) / y are
    lopsided (a measurement far above the line counts at most 1); log ratios are symmetric; and
    on a shared machine a few sizes catch scheduler stalls that a plain fit would chase.
    r2 is computed on the absolute times. A group with fewer than two distinct sizes gets NaN.
    """
    if statistic not in ("median_s", "min_s", "max_s"):
        raise ConfigError("statistic", f"unknown column {statistic!r}", "use median_s, min_s or max_s")
    samples = conform(samples, COMM_SAMPLE_TABLE, "comm samples")
    rows = []
    for (primitive, backend, world), group in samples.groupby(
        ["primitive", "backend", "world_size"], sort=False
    ):
        x = group["bytes"].to_numpy(dtype=float)
        y = group[statistic].to_numpy(dtype=float)
        alpha, bandwidth, r2 = _fit_one(x, y)
        note = IMPLEMENTATION_NOTES.get((str(backend), str(primitive)), "")
        cpu = group["cpu_s"].to_numpy(dtype=float)
        measured = np.isfinite(cpu)
        cpu_alpha, cpu_bandwidth, _ = _fit_one(x[measured], cpu[measured]) if measured.any() \
            else (math.nan, math.nan, math.nan)
        rows.append([primitive, backend, int(world), alpha, bandwidth, r2, note, cpu_alpha, cpu_bandwidth])
    fits = pd.DataFrame(rows, columns=COMM_FIT_TABLE.column_names)
    return conform(fits, COMM_FIT_TABLE, "comm fits")


def _fit_one(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """(alpha_s, bandwidth_Bps, r2) of y = alpha + x / bandwidth; NaNs when it cannot be fitted."""
    from scipy.optimize import least_squares

    if len(np.unique(x)) < 2 or not np.all(y > 0):
        return math.nan, math.nan, math.nan
    order = np.argsort(x)
    slope0 = max((y[order[-1]] - y[order[0]]) / (x[order[-1]] - x[order[0]]), 1e-15)
    log_y = np.log(y)
    result = least_squares(
        lambda p: np.log(np.maximum(p[0] + x * p[1], 1e-300)) - log_y,
        x0=[max(float(y.min()) / 2, 1e-9), slope0],
        bounds=([0.0, 0.0], [np.inf, np.inf]),
        x_scale=[max(float(y.min()), 1e-9), slope0],
        loss="soft_l1",
        f_scale=0.25,  # log ratios beyond ~0.25 (about 28%) count linearly, not quadratically
    )
    alpha, inverse_bandwidth = (float(v) for v in result.x)
    bandwidth = 1.0 / inverse_bandwidth if inverse_bandwidth > 0 else math.inf
    predicted = alpha + x * inverse_bandwidth
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - predicted) ** 2)) / total if total > 0 else math.nan
    return alpha, bandwidth, r2


# Below this r2 a fit's line explains too little of the swept times to say what the link's bandwidth is (a
# sweep of small messages is latency and noise): commbench prints a note beside such a fit, and a
# validation report beside the fits it used (analysis.validation.comm.poor_fit_notes).
POOR_FIT_R2 = 0.5


def fit_quality_note(r2: float) -> str:
    """What commbench says of a fit of ``r2``: "" unless the fit is poor (NaN, no fit at all, is not judged)."""
    return "poor fit: sweep larger sizes" if r2 < POOR_FIT_R2 else ""


def write_comm_results(out: Path, samples: pd.DataFrame, fits: pd.DataFrame, settings: dict) -> Path:
    """Store a benchmark as a directory: samples, fits and a manifest with the environment."""
    tables = {"comm_samples": (samples, COMM_SAMPLE_TABLE), "comm_fits": (fits, COMM_FIT_TABLE)}
    meta = environment_info() | {"settings": settings}
    return write_table_dir(Path(out), COMM_BENCH_FORMAT, COMM_BENCH_VERSION, tables, {"meta": meta})


def read_comm_results(directory: Path) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    manifest, tables = read_table_dir(
        directory,
        COMM_BENCH_FORMAT,
        COMM_BENCH_VERSION,
        {"comm_samples": COMM_SAMPLE_TABLE, "comm_fits": COMM_FIT_TABLE},
        required=("comm_samples", "comm_fits"),
    )
    return tables["comm_samples"], tables["comm_fits"], manifest.get("meta", {})


# --- launching -----------------------------------------------------------------------------------


def _spawn(nproc: int, backend: str | None, sizes, primitives, repeats: int, warmup: int) -> pd.DataFrame:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="paratwin-commbench-") as tmp:
        result = Path(tmp) / "samples.pkl"
        init = f"tcp://127.0.0.1:{_free_port()}"
        mp.start_processes(
            _worker,
            args=(nproc, init, backend, sizes, primitives, repeats, warmup, str(result)),
            nprocs=nproc,
            join=True,
            start_method="spawn",  # fork after torch has started threads is unsafe
        )
        return pd.read_pickle(result)


def _worker(rank, world, init, backend, sizes, primitives, repeats, warmup, result) -> None:
    import torch

    torch.set_num_threads(1)  # ranks share the cores; one thread each keeps timings comparable
    samples = _measure_in_new_group(backend, (init, rank, world), sizes, primitives, repeats, warmup)
    if rank == 0:
        samples.to_pickle(result)


def _measure_in_new_group(backend, init, sizes, primitives, repeats, warmup) -> pd.DataFrame:
    import torch
    import torch.distributed as dist

    world = init[2] if init else int(os.environ["WORLD_SIZE"])
    local_rank = init[1] if init else int(os.environ.get("LOCAL_RANK", 0))
    local_world = world if init else int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend = backend or _default_backend(local_world)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if init:
        dist.init_process_group(backend, init_method=init[0], rank=init[1], world_size=world)
    else:
        dist.init_process_group(backend)
    try:
        return _measure(sizes, primitives, repeats, warmup)
    finally:
        dist.destroy_process_group()


def _default_backend(local_world: int) -> str:
    import torch

    # NCCL refuses two ranks on one GPU, so it needs a GPU per local rank.
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        return "nccl"
    return "gloo"


def _launched_by_torchrun() -> bool:
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- measuring -----------------------------------------------------------------------------------


def _measure(sizes: list[int], primitives: list[str], repeats: int, warmup: int) -> pd.DataFrame:
    """Run the sweep in the current process group; every rank returns the same table."""
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend())
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    rows = []
    for primitive in primitives:
        for size in sizes:
            elements = _elements(size, world)
            call = _operation(primitive, elements, device)
            for _ in range(warmup):
                call()
            elapsed, cpu = [], []
            for _ in range(repeats):
                dist.barrier()
                _sync(device)
                cpu0, start = _process_cpu_s(), time.perf_counter()
                call()
                _sync(device)
                elapsed.append(time.perf_counter() - start)
                cpu.append(_process_cpu_s() - cpu0)
            times = torch.tensor(elapsed, dtype=torch.float64, device=device)
            if primitive == "send_recv":
                times /= 2  # a ping-pong is two messages
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a repeat lasts until its slowest rank ends
            values = times.cpu().numpy()
            # the mean over ranks of each rank's median CPU per call (send_recv: per message; send,
            # recv: over the ranks on that side only)
            side = _one_way_side(primitive, dist.get_rank(), world)
            cpu_s = torch.tensor([float(np.median(cpu)) / (2 if primitive == "send_recv" else 1) * side[0]],
                                 dtype=torch.float64, device=device)
            dist.all_reduce(cpu_s)
            cpu_s /= side[1]
            rows.append(
                [
                    primitive,
                    backend,
                    world,
                    elements * FLOAT_BYTES,
                    float(np.median(values)),
                    float(values.min()),
                    float(values.max()),
                    repeats,
                    float(cpu_s.item()),
                ]
            )
            del call
    table = pd.DataFrame(rows, columns=COMM_SAMPLE_TABLE.column_names)
    return conform(table, COMM_SAMPLE_TABLE, "comm samples")


def _one_way_side(primitive: str, rank: int, world: int) -> tuple[int, int]:
    """(whether ``rank``'s CPU counts, how many ranks' do): for ``send`` the senders' (even ranks
    with a partner), for ``recv`` the receivers' (odd ranks), for any other primitive every rank's."""
    if primitive not in ONE_WAY:
        return 1, world
    pairs = world // 2
    if rank >= 2 * pairs:  # odd world size: the last rank sits this out
        return 0, pairs
    return int((rank % 2 == 0) == (primitive == "send")), pairs


def _process_cpu_s() -> float:
    """CPU seconds of this process so far, every thread, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _elements(size: int, world: int) -> int:
    per_rank = math.ceil(size / FLOAT_BYTES / world)
    return max(per_rank, 1) * world


def _operation(primitive: str, elements: int, device) -> Callable[[], None]:
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    buffer = torch.zeros(elements, dtype=torch.float32, device=device)  # sums stay finite
    if primitive == "all_reduce":
        return lambda: dist.all_reduce(buffer)
    if primitive == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        shard = buffer[: elements // world].clone()
        return lambda: _quiet(gather, buffer, shard)
    if primitive == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        shard = torch.empty(elements // world, dtype=torch.float32, device=device)
        return lambda: _quiet(scatter, shard, buffer)
    if primitive == "all_to_all":
        received = torch.empty_like(buffer)
        return lambda: dist.all_to_all_single(received, buffer)
    if primitive == "send_recv":
        peer = rank + 1 if rank % 2 == 0 else rank - 1
        if peer >= world:  # odd world size: the last rank has no partner and sits this out
            return lambda: None
        if rank % 2 == 0:
            return lambda: (dist.send(buffer, peer), dist.recv(buffer, peer))
        return lambda: (dist.recv(buffer, peer), dist.send(buffer, peer))
    if primitive in ONE_WAY:
        peer = rank + 1 if rank % 2 == 0 else rank - 1
        if peer >= world:
            return lambda: None
        return (lambda: dist.send(buffer, peer)) if rank % 2 == 0 else (lambda: dist.recv(buffer, peer))
    choices = ", ".join(PRIMITIVES + ONE_WAY)
    raise ConfigError("primitives", f"unknown primitive {primitive!r}", f"choose from {choices}")


def _quiet(function, *args) -> None:
    # torch 2.13 deprecates the *_into_tensor / *_tensor names that older versions need.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        function(*args)


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _check_sizes(sizes: list[int]) -> list[int]:
    if not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s > 0 for s in sizes):
        raise ConfigError("sizes", f"must be positive byte counts, got {sizes!r}", "e.g. 1024,65536,1048576")
    unique = sorted({int(s) for s in sizes})
    if len(unique) < 2:
        raise ConfigError("sizes", "need at least two different sizes to fit alpha and bandwidth")
    return unique


def _check_backend(backend: str | None, nproc: int) -> None:
    if backend is None or backend == "gloo":
        return
    if backend != "nccl":
        raise ConfigError("backend", f"unknown backend {backend!r}", "use gloo or nccl")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # Spawned ranks all live here; under torchrun only this rank's GPU must exist.
    needed = 1 if _launched_by_torchrun() else nproc
    if gpus < needed:
        raise ConfigError(
            "backend", f"nccl needs one GPU per local rank; {gpus} visible for {needed} rank(s)", "use gloo"
        )


def _check_primitives(primitives: list[str]) -> list[str]:
    unknown = [p for p in primitives if p not in PRIMITIVES + ONE_WAY]
    if unknown or not primitives:
        problem = f"unknown primitive(s) {', '.join(map(repr, unknown))}" if unknown else "none given"
        raise ConfigError("primitives", problem, f"choose from {', '.join(PRIMITIVES + ONE_WAY)}")
    return list(dict.fromkeys(primitives))
