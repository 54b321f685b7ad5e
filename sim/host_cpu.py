"""Communication that takes CPU from compute on a host whose cores the ranks share (issue 12,
seventh session).

On a GPU the collective runs on the device's copy engines and SMs and the host's proxy thread has
a core of its own; on a CPU cluster (gloo over TCP) the ranks' compute threads, the backend's
worker threads and the kernel's socket copies share the host's cores. A transfer then costs CPU
seconds: ``exec.commbench`` measures them per call (every thread of a rank, ``getrusage``) and fits
them like the times, ``cpu_s = cpu_alpha_s + bytes / cpu_bandwidth_Bps`` (``ClusterComm.cpu_s``).
Waiting for a peer costs none (gloo blocks), so only the time a transfer moves data counts.

While a rank's transfers move data they keep ``u`` cores busy (their CPU seconds over their
duration, measured alone). **A shared slowdown** (issue 12, eighth session): while the rank also
computes, its compute thread wants a core and its transfers want ``u``; with R ranks doing the
same on a host of C cores, each rank has ``c = C / R`` of them. When ``1 + u <= c`` every thread
has what it wants and nothing slows. Otherwise the cores are shared in proportion to what each
wants (processor sharing: every runnable thread is as likely to hold a core; a transfer's threads,
runnable ``u`` of the time, hold it ``u`` as often as the always-runnable compute thread): the
compute gets ``c / (1 + u)`` cores and the transfers ``u c / (1 + u)``. Each side's stretch is
what it got alone over what it gets now: the compute alone got ``min(1, c)`` (the profile measured
it with the R compute threads together, exec.lockstep), the transfers alone ``u`` (the benchmark
measured them without compute), so

    compute stretch  = min(1, c) (1 + u) / c,      transfer stretch = (1 + u) / c.

On the 2-rank, 2-core host (c = 1) both are ``1 + u``, which is also what fair sharing between
two threads gives exactly: a transfer of duration d alone is u d of CPU work and (1 - u) d of
waiting; beside the compute its CPU work shares the core half and half (2 u d), its waits do not,
so it lasts d (1 + u), and the compute does u d + (1 - u) d = d of work in that time. The engine
re-times both sides whenever either starts or ends (``sim.engine.Engine._advance``; a send's
bytes through ``sim.channel.SharedChannel.set_slowdown``), the estimate prices the same by
``overlap``. No constant is fitted: ``u`` is the benchmark's per-call CPU fit at the
transfer's bytes.

Against the measurement (``scripts/probe_concurrent_allreduce.py --repeats 60``, quiet host,
runs/quiet7-concurrent-allreduce.log, docs/host_cpu.md): 3.94 ms of one-thread matmuls started
with a 7.46 ms all-reduce of 8.5 MB whose ranks used u = 0.74 cores (CPU/wall, mean of the two)
took 5.61 ms (1.42x) and the two together 10.40 ms (1.39x the all-reduce). The shared rule gives
6.86 ms (1.74x) and 10.38 ms (1.39x): the end of both right, the compute's share too small (it
got 0.70 of a core where the rule gives it 0.57; the transfer got less than its proportion).
The rule it replaces (the transfers take their cores first, the compute shares what is left)
gave 9.46 ms (2.4x) and left the all-reduce unslowed.

``EngineOptions.overlap_slowdown`` (a what-if: compute 1 / (1 + s) as fast while its rank moves
data, on any cluster) is the floor of the compute's stretch; the transfer keeps the shared rule's.
``overlap_stretch`` is the one function that combines them, for the engine and the estimate.

The fast estimate (``sim.estimate``) prices the same terms: where its closed form knows a compute
runs beside transfers (EmbRace 2D: the next micro-batch's forward beside a gradient exchange, the
tables' optimizer step beside the buckets, the dense step beside the last rows exchange),
``overlap`` gives both ends as the engine's re-timing would; its pipeline run times each rank's
compute beside its sends, gradient buckets and optimizer step with ``RankTransfers`` (ninth
session: ``sim.estimate_pipeline._sends_beside``). Receiving costs no CPU here, though a receive
costs its host about what a send does (``scripts/probe_recv_cpu.py``, docs/host_cpu.md).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple


def phases_cpu_s(comm: Any, phases: Iterable[tuple[str, int]], group_size: int) -> float:
    """CPU seconds one rank spends on a collective's phases (0 for phases without a measured CPU
    cost, e.g. a codec's memory pass, or a cluster whose benchmark did not measure the CPU)."""
    cpu_s = getattr(comm, "cpu_s", None)
    if cpu_s is None:
        return 0.0
    from sim.embedding import COUNTS_PHASE  # here: sim.embedding's methods import this module

    return sum(cpu_s("all_to_all" if kind == COUNTS_PHASE else kind, nbytes, group_size)
               for kind, nbytes in phases if kind != "memory")


def cores_taken(cpu_seconds: float, duration_s: float) -> float:
    """Cores a transfer keeps busy while it moves data."""
    return cpu_seconds / duration_s if duration_s > 0 else 0.0


class Stretch(NamedTuple):
    """How many times as long each side takes while a rank computes and moves data at once."""

    compute: float
    transfer: float


NO_STRETCH = Stretch(1.0, 1.0)


def shared_stretch(ranks_on_host: int, cores: int | None, comm_cores: float) -> Stretch:
    """The shared slowdown (module docstring) of a rank's compute and of its transfers that keep
    ``comm_cores`` busy, while both run, ``ranks_on_host`` ranks doing the same on ``cores`` cores
    (``None``: the cores are not shared, e.g. a GPU's compute: nothing slows)."""
    if cores is None or comm_cores <= 0:
        return NO_STRETCH
    per_rank = cores / ranks_on_host
    wanted = 1.0 + comm_cores
    if wanted <= per_rank:
        return NO_STRETCH
    return Stretch(min(1.0, per_rank) * wanted / per_rank, wanted / per_rank)


def overlap_stretch(ranks_on_host: int, cores: int | None, comm_cores: float,
                    overlap_slowdown: float = 0.0) -> Stretch:
    """Both sides' stretch while a rank computes beside its moving transfers, as the engine and the
    estimate price it: the shared slowdown, the compute at least ``1 + overlap_slowdown``
    (``sim.engine.EngineOptions``)."""
    shared = shared_stretch(ranks_on_host, cores, comm_cores)
    return Stretch(max(1.0 + overlap_slowdown, shared.compute), shared.transfer)


def host_share(comm: Any, world_size: int, devices_per_node: int) -> tuple[int, int | None]:
    """(ranks sharing a host, the host's cores) as the engine and the estimate price them: the cores
    only where the cluster says how many its hosts have and its benchmark measured the CPU of
    communicating (``None`` otherwise: the cores are not shared, nothing is stretched)."""
    cores = comm.cluster.host_cores if getattr(comm, "measures_cpu", False) else None
    return min(devices_per_node, world_size), cores


class Moving:
    """One transfer of a rank's while the estimate times it (``RankTransfers``): the seconds it has
    left to move at its own speed, the cores it keeps busy meanwhile, and when it ended (once known)."""

    __slots__ = ("left", "cores", "end")

    def __init__(self, seconds: float, cores: float = 0.0) -> None:
        self.left, self.cores = seconds, cores
        self.end: float | None = None


class RankTransfers:
    """One rank's transfers as the estimate times them beside its compute: each of its streams (the
    engine's send stream, its collective stream) moves its transfers one after the other in the
    order they were added, the streams at once; alone a transfer moves at its own speed, beside the
    rank's compute both progress at 1 / ``stretch(cores of every transfer moving)`` (the engine's
    ``_advance`` over a sequence known in advance: the rates change only when the compute or a
    transfer ends). ``now``: how far the rank has been timed."""

    def __init__(self, stretch: Callable[[float], Stretch], streams: int = 1) -> None:
        self.stretch = stretch
        self.queues: list[deque[Moving]] = [deque() for _ in range(streams)]
        self.now = 0.0

    def add(self, stream: int, seconds: float, cores: float = 0.0) -> Moving:
        """A transfer ready now, moving once those added before it on ``stream`` have moved."""
        moving = Moving(seconds, cores)
        self.queues[stream].append(moving)
        return moving

    def idle(self, until: float) -> None:
        """No compute until ``until``: each stream moves at its transfers' own speed."""
        for queue in self.queues:
            t = self.now
            while queue and t + queue[0].left <= until:
                t += queue[0].left
                self._ended(queue.popleft(), t)
            if queue:
                queue[0].left -= until - t
        self.now = max(self.now, until)

    def compute(self, seconds: float) -> float:
        """``seconds`` of compute from ``now`` beside what moves; returns its end (the new ``now``)."""
        t = self.now
        while seconds > 0.0:
            heads = [queue[0] for queue in self.queues if queue]
            if not heads:
                t += seconds
                break
            k = self.stretch(sum(m.cores for m in heads))
            first = min(heads, key=lambda m: m.left)
            if seconds * k.compute <= first.left * k.transfer:  # the compute ends beside them
                t += seconds * k.compute
                for m in heads:
                    m.left -= seconds * k.compute / k.transfer
                break
            step = first.left * k.transfer  # a transfer ends first: the next on its stream starts
            seconds -= step / k.compute
            t += step
            for m in heads:
                m.left = 0.0 if m is first else m.left - step / k.transfer
            for queue in self.queues:
                while queue and queue[0].left <= 0.0:
                    self._ended(queue.popleft(), t)
        self.now = t
        return t

    def ends_alone(self, moving: Moving) -> float:
        """When ``moving`` ends if the rank computes no more: its end, or a lower bound of it (more
        compute only slows it)."""
        if moving.end is not None:
            return moving.end
        for queue in self.queues:
            t = self.now
            for m in queue:
                t += m.left
                if m is moving:
                    return t
        raise ValueError("not one of this rank's transfers")

    @staticmethod
    def _ended(moving: Moving, at: float) -> None:
        if moving.end is None:  # an end fixed before (``ends_alone``, taken as final) stays
            moving.end = at


def overlap(seconds: float, beside: Iterable[tuple[float, Stretch]]) -> tuple[float, float]:
    """(wall time of ``seconds`` of compute, end of the transfers) when the compute starts as
    transfers begin to move data one after the other, each ``(its duration alone, the stretch of
    both sides while they overlap)``: while both run each progresses at 1 / its stretch, the
    compute at full speed after the transfers, a transfer at its own after the compute
    (``RankTransfers`` with one stream, each transfer its own stretch)."""
    given: dict[Moving, Stretch] = {}
    rank = RankTransfers(lambda _cores: given[rank.queues[0][0]])
    for duration, k in beside:
        given[rank.add(0, duration)] = k
    moved = list(given)
    compute_end = rank.compute(seconds)
    rank.idle(math.inf)
    return compute_end, max((m.end or 0.0 for m in moved), default=0.0)
