"""Communication that takes CPU from compute on a host whose cores the ranks share (issue 12,
seventh session).

On a GPU the collective runs on the device's copy engines and SMs and the host's proxy thread has
a core of its own; on a CPU cluster (gloo over TCP) the ranks' compute threads, the backend's
worker threads and the kernel's socket copies share the host's cores. A transfer then costs CPU
seconds: ``exec.commbench`` measures them per call (every thread of a rank, ``getrusage``) and fits
them like the times, ``cpu_s = cpu_alpha_s + bytes / cpu_bandwidth_Bps`` (``ClusterComm.cpu_s``).
Waiting for a peer costs none (gloo blocks), so only the time a transfer moves data counts.

While a rank's transfers move data they keep ``u`` cores busy (their CPU seconds over their
duration). With R ranks on a host of C cores, each with one compute thread, the runnable threads
want R (1 + u) cores; when that is more than C the scheduler shares the cores evenly and each
compute thread runs R (1 + u) / C as slow. The profile already measured the compute with the R
compute threads running together (exec.lockstep), so only the part the transfers add is charged:
``stretch = max(1, R (1 + u) / C) / max(1, R / C)``. Assumes the host's other ranks move data at
the same time (a collective moves data once its whole group is there). Not modelled: the transfer
itself slowed by the compute (it keeps its fitted price).
"""

from __future__ import annotations

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
    each (1 when the host has a core for every thread, or its cores are not shared: ``None``)."""
    if cores is None or comm_cores <= 0:
        return 1.0
    return max(1.0, ranks_on_host * (1.0 + comm_cores) / cores) / max(1.0, ranks_on_host / cores)
