"""The cluster as the engine sees it: routes for point-to-point messages, collective costs, the
host link and device capacity.

Costs come from the cluster's links and ``sim.collectives`` (alpha-beta per link class, ring /
tree / hierarchical algorithms), or, when a trace bundle carries communication fits measured by
``paratwin commbench`` on the same machine, from those fits directly: a measured all-reduce of
the same group size beats any formula.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from sim.cluster import ClusterSpec
from sim.collectives import collective_time

# commbench primitive names -> the engine's names
_FIT_NAMES = {"allreduce": "all_reduce", "alltoall": "all_to_all", "p2p": "send_recv"}


class ClusterComm:
    def __init__(self, cluster: ClusterSpec, fits: pd.DataFrame | None = None) -> None:
        self.cluster = cluster
        self.capacity_bytes = cluster.memory_per_rank_bytes
        self._fits = {}
        if fits is not None and len(fits):
            for row in fits.to_dict("records"):
                self._fits[(row["primitive"], int(row["world_size"]))] = (row["alpha_s"], row["bandwidth_Bps"])
        self._collective_cache: dict[tuple[str, int, tuple[int, ...]], float] = {}

    def _fit(self, primitive: str, group_size: int) -> tuple[float, float] | None:
        return self._fits.get((_FIT_NAMES.get(primitive, primitive), group_size))

    def p2p_route(self, src: int, dst: int) -> tuple[str, float, float]:
        fit = self._fit("p2p", 2)
        if fit is not None:
            return "measured", fit[0], fit[1]
        link = self.cluster.link_between(src, dst)
        same_node = self.cluster.node_of(src) == self.cluster.node_of(dst)
        return ("intra" if same_node else "inter"), link.latency_s, link.effective_bandwidth_Bps

    def collective_s(self, primitive: str, nbytes: int, ranks: Sequence[int]) -> float:
        key = (primitive, int(nbytes), tuple(ranks))
        cached = self._collective_cache.get(key)
        if cached is None:
            fit = self._fit(primitive, len(ranks))
            if fit is not None:
                cached = fit[0] + nbytes / fit[1]
            else:
                cached = collective_time(primitive, int(nbytes), list(ranks), self.cluster)
            self._collective_cache[key] = cached
        return cached

    def host_copy(self) -> tuple[float, float]:
        link = self.cluster.host_link
        if link is None:
            # A CPU rank's "host" memory is its own memory: swapping costs a memory copy.
            return 0.0, self.cluster.device.memory_bandwidth_Bps
        return link.latency_s, link.effective_bandwidth_Bps
