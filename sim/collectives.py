"""Alpha-beta costs of collectives over a group of ranks placed on a cluster.

Message sizes follow the nccl-tests convention: ``nbytes`` is the size of the full buffer, i.e. the
all-reduce buffer, the all-gather *output*, the reduce-scatter *input*, the all-to-all send buffer of
one rank (nbytes / n to each peer), the broadcast buffer, the p2p message.

Formulas (alpha = per-step latency, B = per-flow bandwidth, n ranks, S = nbytes), from Thakur,
Rabenseifner and Gropp, "Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005)
and Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations"
(JPDC 2009):

  ring all-reduce       2(n-1) alpha + 2(n-1)/n S/B   (reduce-scatter then all-gather)
  ring all-gather       (n-1) alpha + (n-1)/n S/B
  ring reduce-scatter   (n-1) alpha + (n-1)/n S/B
  tree all-reduce       2 ceil(log2 n) alpha + 2 S/B  (pipelined reduce then broadcast; NCCL's double
                        binary tree, Sanders, Speck and Traeff, "Two-tree algorithms for full bandwidth
                        broadcast, reduction and scan", Parallel Computing 2009, reaches the 2 S/B
                        bandwidth term only with a pipeline of chunks much smaller than S: the
                        formula ignores the pipeline fill of about log2(n) chunk times)
  hierarchical all-red. intra-node reduce-scatter + inter-node all-reduce of S/L (L local ranks, each
                        on its own shard, concurrently) + intra-node all-gather
  all-to-all            n-1 peers, S/n each (pairwise exchange, Thakur et al. 2005, section 4.5), the
                        peers of a link class ``p2p_channels`` at a time (NCCL's grouped send/recv:
                        sim.cluster.ClusterSpec.p2p_channels): ceil((L-1)/c) intra-node latencies and
                        ceil((n-L)/c) inter-node ones; the bytes are the same
  broadcast             pipelined chain: (n-1) alpha + S/B
  p2p send              alpha + S/B

Placement (ranks are node-major, see sim.cluster):
- A group inside one node uses the intra-node link.
- A flat ring or tree across nodes is one logical ring/tree: each step waits for its slowest hop, so
  alpha = max(intra, inter latency) and B = min(intra bandwidth, the group's network bandwidth). NCCL
  runs it as several rings (channels), each entering and leaving a node once through the adapter
  next to the GPU where it crosses, and spreads the channels over the adapters its local ranks reach
  (``_ring_network_Bps``): one ring's volume, 2(n-1)/n S, leaves each node in all, so the bus
  bandwidth is the node's network bandwidth when the group fills the node (nccl-tests on DGX A100 with
  8 x HDR: 192 GB/s, NVIDIA/nccl issue 812; 2 nodes with 4 x HDR: 86 GB/s, issue 1048), one adapter
  when it has one rank per node, and a share of the node when groups like it cross together.
- Concurrent inter-node flows from the same node share the node's adapters: a flow gets
  min(one adapter, nics_per_node x adapter / flows_per_node). Hierarchical all-reduce and all-to-all
  run one such flow per local rank at the same time. ``concurrent`` says how many groups of the
  same shape run the same collective at the same time on the same nodes (the data-parallel groups
  of a stage's tensor-parallel ranks: ``sim.comm.concurrent_groups``); their flows share the
  adapters too, so each group's flows are multiplied by it.

``collective_transfers`` returns this plan as a list of sequential phases (``Transfer``), so an
event-driven engine can charge each phase to its link class and model contention with other traffic;
``collective_time`` is exactly the sum of the phases' times.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from sim.cluster import ClusterSpec
from traces.errors import ConfigError

PRIMITIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
ALGORITHMS = ("auto", "ring", "tree", "hierarchical")
_ALGORITHMS_OF = {
    "all_reduce": ("ring", "tree", "hierarchical"),
    "all_gather": ("ring",),
    "reduce_scatter": ("ring",),
    "all_to_all": ("pairwise",),
    "broadcast": ("ring",),
}


@dataclass(frozen=True)
class Transfer:
    """One sequential phase of a collective, as seen by one participating rank.

    ``nbytes`` is what the rank sends over ``link_class`` ("intra" or "inter") in this phase,
    ``alpha_s`` the phase's total latency (steps x per-step latency), ``bandwidth_Bps`` the per-flow
    bandwidth without outside traffic, ``flows_per_node`` how many flows of this phase leave each node
    at once (they share the node's network adapters).
    """

    phase: str
    link_class: str
    nbytes: float
    alpha_s: float
    bandwidth_Bps: float
    flows_per_node: int = 1

    @property
    def time_s(self) -> float:
        return self.alpha_s + self.nbytes / self.bandwidth_Bps


@dataclass(frozen=True)
class _Group:
    n: int
    nodes: int
    local: int  # most group ranks on any one node
    concurrent: int = 1  # groups like this one running at the same time on the same nodes


def _normalize_primitive(primitive: str) -> str:
    key = primitive.strip().lower().replace("-", "_").replace(" ", "_")
    key = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
           "alltoall": "all_to_all", "all2all": "all_to_all", "bcast": "broadcast"}.get(key, key)
    if key not in PRIMITIVES:
        raise ConfigError("primitive", f"unknown collective {primitive!r}",
                          f"use one of {', '.join(PRIMITIVES)}")
    return key


def _group(ranks: Sequence[int], cluster: ClusterSpec, concurrent: int = 1) -> _Group:
    ranks = [cluster.check_rank(r, field="ranks") for r in ranks]
    if len(set(ranks)) != len(ranks):
        raise ConfigError("ranks", f"duplicate ranks in {list(ranks)}", "list each rank once")
    per_node = Counter(cluster.node_of(r) for r in ranks)
    if concurrent < 1:
        raise ConfigError("concurrent", f"{concurrent} concurrent groups", "pass 1 or more")
    return _Group(n=len(ranks), nodes=len(per_node), local=max(per_node.values(), default=0),
                  concurrent=concurrent)


def _intra(cluster: ClusterSpec) -> tuple[float, float]:
    link = cluster.intra_node_link
    assert link is not None
    return link.latency_s, link.effective_bandwidth_Bps


def _inter(cluster: ClusterSpec, flows_per_node: int) -> tuple[float, float]:
    link = cluster.inter_node_link
    assert link is not None
    return link.latency_s, min(link.effective_bandwidth_Bps, cluster.node_network_Bps / flows_per_node)


def _ring_network_Bps(group: _Group, cluster: ClusterSpec) -> float:
    """Network bandwidth a ring (or tree) over ``group`` gets out of each node. Its channels leave a
    node through the adapters next to the group's ranks there: on a node of D devices and A adapters,
    L local ranks reach ceil(L A / D) of them (DGX A100: one per GPU; 4-adapter nodes: one per GPU
    pair). Groups like it that cross at the same time share the node's adapters."""
    link = cluster.inter_node_link
    assert link is not None
    reach = min(cluster.nics_per_node,
                max(1, math.ceil(group.local * cluster.nics_per_node / cluster.devices_per_node)))
    return min(reach * link.effective_bandwidth_Bps, cluster.node_network_Bps / group.concurrent)


def _bottleneck(group: _Group, cluster: ClusterSpec) -> tuple[str, float, float]:
    """(link class, per-step alpha, bandwidth) of a single logical ring or tree over the group."""
    if group.nodes == 1:
        return ("intra", *_intra(cluster))
    assert cluster.inter_node_link is not None
    alpha, bw = cluster.inter_node_link.latency_s, _ring_network_Bps(group, cluster)
    if group.local > 1:
        a_in, b_in = _intra(cluster)
        alpha, bw = max(alpha, a_in), min(bw, b_in)
    return "inter", alpha, bw


def _ring(primitive: str, S: float, g: _Group, cluster: ClusterSpec) -> list[Transfer]:
    link_class, alpha, bw = _bottleneck(g, cluster)
    n = g.n
    if primitive == "all_reduce":
        return [Transfer("ring all-reduce", link_class, 2 * (n - 1) / n * S, 2 * (n - 1) * alpha, bw)]
    if primitive == "broadcast":
        return [Transfer("pipelined-chain broadcast", link_class, S, (n - 1) * alpha, bw)]
    name = "ring all-gather" if primitive == "all_gather" else "ring reduce-scatter"
    return [Transfer(name, link_class, (n - 1) / n * S, (n - 1) * alpha, bw)]


def _tree(S: float, g: _Group, cluster: ClusterSpec) -> list[Transfer]:
    link_class, alpha, bw = _bottleneck(g, cluster)
    steps = 2 * math.ceil(math.log2(g.n))
    return [Transfer("tree all-reduce", link_class, 2 * S, steps * alpha, bw)]


def _hierarchical(S: float, g: _Group, cluster: ClusterSpec) -> list[Transfer]:
    L, N = g.local, g.nodes
    a_x, b_x = _inter(cluster, flows_per_node=L * g.concurrent)
    inter = Transfer("inter-node ring all-reduce", "inter", 2 * (N - 1) / N * S / L, 2 * (N - 1) * a_x, b_x,
                     flows_per_node=L * g.concurrent)
    if L == 1:
        return [inter]
    a_i, b_i = _intra(cluster)
    return [
        Transfer("intra-node reduce-scatter", "intra", (L - 1) / L * S, (L - 1) * a_i, b_i),
        inter,
        Transfer("intra-node all-gather", "intra", (L - 1) / L * S, (L - 1) * a_i, b_i),
    ]


def _all_to_all(S: float, g: _Group, cluster: ClusterSpec) -> list[Transfer]:
    n, L = g.n, g.local
    plan = []
    if L > 1:
        a_i, b_i = _intra(cluster)
        steps = math.ceil((L - 1) / cluster.p2p_channels)
        plan.append(Transfer("all-to-all intra-node steps", "intra", (L - 1) * S / n, steps * a_i, b_i))
    if g.nodes > 1:
        # All L local ranks exchange with off-node peers at the same time: they share the adapters.
        a_x, b_x = _inter(cluster, flows_per_node=L * g.concurrent)
        steps = math.ceil((n - L) / cluster.p2p_channels)
        plan.append(Transfer("all-to-all inter-node steps", "inter", (n - L) * S / n, steps * a_x, b_x,
                             flows_per_node=L * g.concurrent))
    return plan


def collective_transfers(primitive: str, nbytes: int | float, ranks: Sequence[int], cluster: ClusterSpec,
                         algorithm: str = "auto", concurrent: int = 1) -> list[Transfer]:
    """The phases one rank goes through in a collective; ``auto`` picks the fastest algorithm."""
    prim = _normalize_primitive(primitive)
    if nbytes < 0:
        raise ConfigError("nbytes", f"negative message size {nbytes}", "pass a size in bytes >= 0")
    g = _group(ranks, cluster, concurrent)
    if g.n <= 1:
        return []
    algorithm = algorithm.strip().lower()
    valid = _ALGORITHMS_OF[prim]
    if algorithm not in ("auto", *valid):
        raise ConfigError("algorithm", f"{algorithm!r} is not available for {prim}",
                          f"use auto or one of {', '.join(valid)}")
    S = float(nbytes)
    if prim == "all_to_all":
        return _all_to_all(S, g, cluster)
    if prim != "all_reduce":
        return _ring(prim, S, g, cluster)
    candidates = {"ring": lambda: _ring(prim, S, g, cluster), "tree": lambda: _tree(S, g, cluster)}
    if g.nodes > 1:
        candidates["hierarchical"] = lambda: _hierarchical(S, g, cluster)
    if algorithm == "auto":
        # NCCL's tuner does the same: cost every algorithm and take the fastest (tuning.cc).
        return min((build() for build in candidates.values()), key=lambda p: sum(t.time_s for t in p))
    if algorithm == "hierarchical" and g.nodes == 1:
        return _ring(prim, S, g, cluster)  # one node: hierarchical degenerates to the intra-node ring
    return candidates[algorithm]()


def collective_time(primitive: str, nbytes: int | float, ranks: Sequence[int], cluster: ClusterSpec,
                    algorithm: str = "auto", concurrent: int = 1) -> float:
    """Seconds the collective takes on a cluster where only ``concurrent`` groups like it (this one
    included) use the network."""
    return sum(t.time_s for t in collective_transfers(primitive, nbytes, ranks, cluster, algorithm, concurrent))


def p2p_transfer(nbytes: int | float, src: int, dst: int, cluster: ClusterSpec,
                 concurrent: int = 1) -> list[Transfer]:
    """``concurrent``: senders on ``src``'s node sending off the node at the same time (this one
    included); they share the node's adapters."""
    if src == dst:
        cluster.check_rank(src, field="src")
        return []
    link = cluster.link_between(src, dst)
    if cluster.node_of(src) == cluster.node_of(dst):
        return [Transfer("p2p", "intra", float(nbytes), link.latency_s, link.p2p_bandwidth_Bps)]
    # One stream's own limit (LinkSpec.p2p_efficiency) or its share of the node's adapters, the lower.
    alpha, share = _inter(cluster, flows_per_node=concurrent)
    bw = min(link.p2p_bandwidth_Bps, share)
    return [Transfer("p2p", "inter", float(nbytes), alpha, bw, flows_per_node=concurrent)]


def p2p_time(nbytes: int | float, src: int, dst: int, cluster: ClusterSpec, concurrent: int = 1) -> float:
    """Seconds to send one message from src to dst (a rank to itself costs nothing)."""
    return sum(t.time_s for t in p2p_transfer(nbytes, src, dst, cluster, concurrent))
