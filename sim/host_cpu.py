"""Communication that takes CPU from compute on a host whose cores the ranks share (issue 12,
seventh session).

On a GPU the collective runs on the device's copy engines and SMs and the host's proxy thread has
a core of its own; on a CPU cluster (gloo over TCP) the ranks' compute threads, the backend's
worker threads and the kernel's socket copies share the host's cores. A transfer then costs CPU
seconds: ``exec.commbench`` measures them per call (every thread of a rank, ``getrusage``) and fits
them like the times, ``cpu_s = cpu_alpha_s + bytes / cpu_bandwidth_Bps`` (``ClusterComm.cpu_s``).
Waiting for a peer costs none (gloo blocks), so only the time a transfer moves data counts.

While a rank's transfers move data they keep ``u`` cores busy (their CPU seconds over their
duration). With R ranks on a host of C cores, each with one compute thread, the transfers want
R u cores. They get them first: gloo's threads sleep on every socket read and write and the
scheduler runs a woken, mostly sleeping thread ahead of a thread that has been computing, so the
compute threads share what is left, (C - R u) / R of a core each (at most one). Measured
(``scripts/probe_concurrent_allreduce.py``, two ranks on the 2-core host, the invocations in which
the lone compute ran at CPU/wall 1.00, docs/embrace.md): one-thread matmuls took 2.08-2.33x as
long beside an 8.5 MB all-reduce whose ranks used u = 0.43-0.71 cores; sharing the cores evenly
(compute at 1 / (1 + u)) would give 1.5-1.6x, the rest-after-communication rule 2.2-2.6x; and the
two together took 0.93-1.10x as long as one after the other. The profile already measured the
compute with the R compute threads running together (exec.lockstep), so the charge is relative to
that: ``stretch = min(1, C / R) / min(1, (C - R u) / R)``, infinite (no progress) while the
transfers want every core. Not modelled: the transfer itself slowed by the compute (it keeps its
fitted price, measured alone).

**Refuted in size on a quiet host** (the same probe, 60 repeats, nothing else running, load 1.6,
runs/quiet7-concurrent-allreduce.log, docs/embrace.md): u = 0.70-0.78, so this rule has the 3.9 ms
of matmuls beside the 7.5 ms all-reduce take about 2.4x as long; they took 1.42x, and the all-reduce
itself 1.39x (10.4 ms against 7.5): on an idle host the two share the cores, the transfer yields too.
The loaded invocations' 2.1-2.3x included other jobs' threads. The rule stays as written because on
the validation plans it moves predictions by 0.1-0.2 points (the overlapped time is short); a shared
slowdown of both sides is the model to build (issue 12, left open).

The fast estimate (``sim.estimate``) prices the same term with the same ``stretch``: where its
closed form knows a compute runs beside a transfer (EmbRace 2D: the next micro-batch's forward
beside a gradient exchange, the tables' optimizer step beside the buckets, the dense step beside
the last rows exchange), ``overlapped_s`` gives the compute's wall time as the engine's
``_progress`` would.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from sim.embedding import COUNTS_PHASE


def phases_cpu_s(comm: Any, phases: Iterable[tuple[str, int]], group_size: int) -> float:
    """CPU seconds one rank spends on a collective's phases (0 for phases without a measured CPU
    cost, e.g. a codec's memory pass, or a cluster whose benchmark did not measure the CPU)."""
    cpu_s = getattr(comm, "cpu_s", None)
    if cpu_s is None:
        return 0.0
    return sum(cpu_s("all_to_all" if kind == COUNTS_PHASE else kind, nbytes, group_size)
               for kind, nbytes in phases if kind != "memory")


def cores_taken(cpu_seconds: float, duration_s: float) -> float:
    """Cores a transfer keeps busy while it moves data."""
    return cpu_seconds / duration_s if duration_s > 0 else 0.0


def stretch(ranks_on_host: int, cores: int | None, comm_cores: float) -> float:
    """How many times as long compute takes while the host's ranks move data with ``comm_cores``
    each (1 when the cores left after communication still give every compute thread a core, or
    the cores are not shared: ``None``; infinite while communication wants them all)."""
    if cores is None or comm_cores <= 0:
        return 1.0
    left = min(1.0, (cores - ranks_on_host * comm_cores) / ranks_on_host)
    return math.inf if left <= 0 else min(1.0, cores / ranks_on_host) / left


def host_share(comm: Any, world_size: int, devices_per_node: int) -> tuple[int, int | None]:
    """(ranks sharing a host, the host's cores) as the engine and the estimate price them: the cores
    only where the cluster says how many its hosts have and its benchmark measured the CPU of
    communicating (``None`` otherwise: the cores are not shared, nothing is stretched)."""
    cores = comm.cluster.host_cores if getattr(comm, "measures_cpu", False) else None
    return min(devices_per_node, world_size), cores


def overlapped_s(seconds: float, beside: Iterable[tuple[float, float]]) -> float:
    """Wall time of ``seconds`` of compute that starts as transfers begin to move data one after the
    other, each ``(its duration, the stretch while it moves)``, and runs at full speed after them
    (the engine's ``_progress`` over a known sequence of transfers)."""
    elapsed = 0.0
    for duration, k in beside:
        if seconds <= 0.0:
            break
        done = duration / k  # compute done while this transfer moves (none while k is infinite)
        if done >= seconds:
            return elapsed + seconds * k
        seconds -= done
        elapsed += duration
    return elapsed + seconds
