"""The cluster as the engine sees it: routes for point-to-point messages, collective costs, the
host link and device capacity.

Costs come from the cluster's links and ``sim.collectives`` (alpha-beta per link class, ring /
tree / hierarchical algorithms), or, when a trace bundle carries a communication benchmark
(``paratwin commbench``) of the same machine, from it directly: a measured all-reduce of the same
group size beats any formula. Every collective the engine prices (all-reduce, all-gather,
reduce-scatter, all-to-all) and point-to-point have a benchmark name (``_FIT_NAMES``); a primitive the
bundle did not measure (bundles benchmarked before the ninth session's validation measured
all-gather and reduce-scatter: all-reduce, all-to-all and send/recv only) is priced from the
cluster's links (``sim.collectives``), so such a plan mixes measured and modelled collectives
(docs/traces.md, "Communication benchmark"). A collective is priced from the benchmark's samples, interpolated
between the measured sizes (``sim.comm_curve``: a shaped link is not one alpha-beta line), and
from the fitted line where only a fit exists. Point-to-point routes keep the fit's latency and
bandwidth (the engine shares a route's bandwidth among concurrent messages, which needs a rate);
a message weighs on its route what the sampled curve says it takes alone (``p2p_weight``, issue 12,
eighth session).

Collectives of one rank launched together (the runtime's gradient buckets) share its link: on
gloo each runs on a worker thread of its own and lasts about as long as all of them, and they end
together no later than one after the other would (scripts/probe_concurrent_allreduce.py,
docs/embrace.md "Concurrent all-reduces"). The engine's collective stream and the estimate run
them one after the other at these prices: the same end, different intervals per instruction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from sim.cluster import ClusterSpec
from sim.collectives import collective_time, p2p_transfer
from sim.comm_curve import MeasuredCurve

# The engine's and the gradient-sync phases' names (sim.gradient_sync.Collective) -> the commbench's
# (exec.commbench.PRIMITIVES); names already the commbench's pass through.
_FIT_NAMES = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
              "alltoall": "all_to_all", "p2p": "send_recv"}


class ClusterComm:
    # What a message costs in a run beyond the benchmark (a thread woken when the peer arrives
    # late): measured by a validation calibration on its own plans (analysis.validation.calibration
    # .CalibratedComm), nothing without one.
    message_overhead_s = 0.0

    def __init__(self, cluster: ClusterSpec, fits: pd.DataFrame | None = None,
                 samples: pd.DataFrame | None = None) -> None:
        self.cluster = cluster
        self.capacity_bytes = cluster.memory_per_rank_bytes
        self._fits = {}
        self._cpu_fits: dict[tuple[str, int], tuple[float, float]] = {}  # exec.commbench cpu_s fits
        if fits is not None and len(fits):
            for row in fits.to_dict("records"):
                self._fits[(row["primitive"], int(row["world_size"]))] = (row["alpha_s"], row["bandwidth_Bps"])
                cpu = (float(row.get("cpu_alpha_s", math.nan)), float(row.get("cpu_bandwidth_Bps", math.nan)))
                if math.isfinite(cpu[0]) and cpu[1] > 0:  # NaN compares False: not measured
                    self._cpu_fits[(row["primitive"], int(row["world_size"]))] = cpu
        self._curves = _curves(samples, self._fits)
        self._collective_cache: dict[tuple[str, int, tuple[int, ...]], float] = {}

    def _fit(self, primitive: str, group_size: int) -> tuple[float, float] | None:
        return self._fits.get((_FIT_NAMES.get(primitive, primitive), group_size))

    def p2p_route(self, src: int, dst: int, concurrent: int = 1) -> tuple[str, float, float]:
        """(link class, latency, bandwidth) of a message from ``src`` to ``dst`` while ``concurrent``
        senders of ``src``'s node (this one included) send off the node (``concurrent_senders``)."""
        fit = self._fit("p2p", 2)
        if fit is not None:
            return "measured", fit[0], fit[1]
        (hop,) = p2p_transfer(0, src, dst, self.cluster, concurrent)
        return hop.link_class, hop.alpha_s, hop.bandwidth_Bps

    def p2p_weight(self, nbytes: int) -> float:
        """The bytes a message of ``nbytes`` weighs on its route (``p2p_route``'s channel): where the
        benchmark sampled point-to-point sizes, the bytes that at the fitted bandwidth take the
        samples' time less the fitted latency, so that alone it takes the curve's time (a tbf
        link's burst makes a small message lighter than its bytes); else its bytes. A size whose
        curve is below the fitted latency (only below the smallest sample) weighs nothing: the
        latency alone."""
        curve = self._curves.get(("send_recv", 2))
        if curve is None:
            return float(nbytes)
        return max(curve.seconds(nbytes) - curve.alpha_s, 0.0) * curve.bandwidth_Bps

    def collective_s(self, primitive: str, nbytes: int, ranks: Sequence[int], concurrent: int = 1) -> float:
        """Seconds of the collective while ``concurrent`` groups like it run on the same nodes."""
        key = (primitive, int(nbytes), tuple(ranks), concurrent)
        cached = self._collective_cache.get(key)
        if cached is None:
            key_fit = (_FIT_NAMES.get(primitive, primitive), len(ranks))
            curve, fit = self._curves.get(key_fit), self._fits.get(key_fit)
            if curve is not None:
                cached = curve.seconds(nbytes)
            elif fit is not None:
                cached = fit[0] + nbytes / fit[1]
            else:
                cached = collective_time(primitive, int(nbytes), list(ranks), self.cluster, concurrent=concurrent)
            self._collective_cache[key] = cached
        return cached

    def cpu_s(self, primitive: str, nbytes: int, group_size: int) -> float:
        """CPU seconds one rank spends on the collective (its measured fit; 0 where none was measured)."""
        fit = self._cpu_fits.get((_FIT_NAMES.get(primitive, primitive), group_size))
        return fit[0] + nbytes / fit[1] if fit is not None else 0.0

    @property
    def measures_cpu(self) -> bool:
        return bool(self._cpu_fits)

    def host_copy(self) -> tuple[float, float]:
        link = self.cluster.host_link
        if link is None:
            # A CPU rank's "host" memory is its own memory: swapping costs a memory copy, which reads
            # and writes every byte; the catalog's memory bandwidth counts both (sim/data/hardware.yaml:
            # "counting read + write"), so a copy of B bytes takes 2 B / bandwidth.
            return 0.0, self.cluster.device.memory_bandwidth_Bps / 2
        return link.latency_s, link.effective_bandwidth_Bps


def _curves(samples: pd.DataFrame | None,
            fits: dict[tuple[str, int], tuple[float, float]]) -> dict[tuple[str, int], MeasuredCurve]:
    """(primitive, group size) -> the samples' curve, for every fitted primitive with samples."""
    curves: dict[tuple[str, int], MeasuredCurve] = {}
    if samples is None or not len(samples):
        return curves
    for (primitive, world), group in samples.groupby(["primitive", "world_size"], sort=False):
        fit = fits.get((str(primitive), int(world)))
        if fit is None:  # the line that extends the curve beyond its samples is missing
            continue
        curve = MeasuredCurve.from_samples(group["bytes"].to_numpy(), group["median_s"].to_numpy(), *fit)
        if curve is not None:
            curves[(str(primitive), int(world))] = curve
    return curves


# ---------------------------------------------------------------------------------------------
# Who shares a node's network adapters. Ranks are pipeline-stage-major (``sim.program``: rank =
# (pp x dp + dp) x tp + tp), so the dp x tp ranks of one stage are consecutive, and every rank of a
# stage runs the same instructions at the same time. Their inter-node traffic therefore leaves a
# node together: the point-to-point sends of a stage's ranks to the next stage, and the
# data-parallel all-reduces of its tensor-parallel ranks (one group per TP rank).


def _stage_ranks_on_node(cluster: ClusterSpec, stage_ranks: int, rank: int) -> range:
    """The ranks of ``rank``'s node that hold the same pipeline stage (``stage_ranks`` = dp x tp)."""
    stage_start = rank // stage_ranks * stage_ranks
    node_start = cluster.node_of(rank) * cluster.devices_per_node
    return range(max(stage_start, node_start),
                 min(stage_start + stage_ranks, node_start + cluster.devices_per_node))


def concurrent_senders(cluster: ClusterSpec, stage_ranks: int, src: int, dst: int) -> int:
    """Ranks of ``src``'s node sending off the node at the same time as ``src`` sends to ``dst``:
    its stage peers whose matching peer (the same rank offset) is on another node."""
    offset = dst - src
    return max(1, sum(1 for q in _stage_ranks_on_node(cluster, stage_ranks, src)
                      if 0 <= q + offset < cluster.world_size and cluster.node_of(q + offset) != cluster.node_of(q)))


def concurrent_groups(cluster: ClusterSpec, stage_ranks: int, group: Sequence[int]) -> int:
    """Groups shaped like ``group`` (a collective among one stage's ranks) that run at the same
    time on its first rank's node: that node's stage ranks over the group's ranks there."""
    if not group:
        return 1
    node = cluster.node_of(group[0])
    mine = sum(1 for r in group if cluster.node_of(r) == node)
    return max(1, len(_stage_ranks_on_node(cluster, stage_ranks, group[0])) // max(mine, 1))

