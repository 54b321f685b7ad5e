"""HAP: Hierarchical Adaptive Pooling (Liu et al., IEEE TKDE 2021, arXiv 2104.05960), on dense graphs.

A graph batch is dense: node features X [B, N, F], adjacency A [B, N, N] and a node mask [B, N]
(``torch_geometric.utils.to_dense_batch`` / ``to_dense_adj``). HAP stacks coarsening levels; each
level runs

1. a GCN encoder on the level's graph (H = relu(Â H W), Â = D^-1/2 (A + I) D^-1/2);
2. GCont, the graph content (``ContentGuide``): by default a learned matrix C [K, d] shared by all
   graphs; a graph's content is its attention readout by C (ablations: a per-graph readout vector,
   or no content);
3. MOA, the cross-level attention that assigns the level's nodes to the next level's clusters:
   node-to-node attention with a learned bias per hop distance (near nodes first), restricted to
   ``hops`` hops or (``masked=False``) over the whole graph; the node context is matched against
   GCont's cluster queries (C itself for ``global``) to give a soft assignment S [B, N, K];
4. coarsening X' = S^T H, A' = S^T A S, with a content-stability loss 1 - cos(c, c') between the
   graph content before and after coarsening (c' is the same GCont readout of X').

A readout level (GCN, mean | max over nodes, MLP) gives the class logits.

The paper's equations are not in the public record this project could read (the arXiv abstract
and TKDE extended abstract only; docs/hap.md says what was searched), so this follows the abstract's
wording: "a global graph content GCont" learned across graphs that "provides global guidance in
graph coarsening" and keeps "pre- and post-coarsening graph content stable", and a cross-level
attention MOA that "focuses more on close neighborhood while capturing higher-order dependency".

For pipelining, ``pack_graph`` packs one dense batch into a single tensor [B, N, F + N + 1]
(features | adjacency | mask), and ``PackedLevel`` / ``PackedReadout`` map one packed tensor to the
next, so the model is an ordered list of one-tensor-in, one-tensor-out layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from traces.errors import ConfigError


@dataclass(frozen=True)
class HAPConfig:
    in_features: int
    num_classes: int
    hidden: int = 64
    clusters: tuple[int, ...] = (16, 4)  # cluster count of each coarsened level, coarsest last
    gcn_layers: int = 2  # GCN layers in each level's encoder
    hops: int = 3  # MOA: hop distances 0..hops get their own learned bias
    masked: bool = True  # MOA: attend only within ``hops`` hops (False: whole graph, one "far" bias)
    content: str = "global"  # GCont form, one of CONTENT_MODES (ablation: per-graph, none)
    dropout: float = 0.0  # before the classifier's hidden layer (train mode only)

    @property
    def num_levels(self) -> int:
        return len(self.clusters)


# --- dense graph helpers -------------------------------------------------------------------------


def pack_graph(x: Tensor, adj: Tensor, mask: Tensor) -> Tensor:
    """One tensor [B, N, F + N + 1] = features | adjacency | mask (1.0 for a real node)."""
    m = mask.to(x.dtype).unsqueeze(-1)
    return torch.cat([x * m, adj.to(x.dtype), m], dim=-1)


def unpack_graph(packed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of ``pack_graph``: the feature width is what is left after N adjacency columns + 1."""
    n = packed.shape[1]
    features = packed.shape[2] - n - 1
    if features < 0:
        raise ValueError(f"packed graph tensor of shape {tuple(packed.shape)} has fewer than N + 1 columns")
    return packed[..., :features], packed[..., features : features + n], packed[..., -1] > 0.5


def normalized_adjacency(adj: Tensor, mask: Tensor) -> Tensor:
    """Â = D^-1/2 (A + I) D^-1/2 over the real nodes; rows and columns of padding are zero."""
    m = mask.to(adj.dtype)
    eye = torch.eye(adj.shape[-1], dtype=adj.dtype, device=adj.device)
    a = (adj + eye) * m.unsqueeze(-1) * m.unsqueeze(-2)
    deg_inv_sqrt = a.sum(-1).clamp(min=1e-12).pow(-0.5) * m
    return deg_inv_sqrt.unsqueeze(-1) * a * deg_inv_sqrt.unsqueeze(-2)


def masked_softmax(logits: Tensor, keep: Tensor, dim: int) -> Tensor:
    return torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=dim)


class DenseGCN(nn.Module):
    """One GCN layer on a dense batch: relu(Â X W + b), zero on padding nodes."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: Tensor, a_hat: Tensor, mask: Tensor) -> Tensor:
        return F.relu(a_hat @ self.linear(x)) * mask.unsqueeze(-1).to(x.dtype)


# --- HAP's parts ---------------------------------------------------------------------------------


CONTENT_MODES = ("global", "per-graph", "none")


class ContentGuide(nn.Module):
    """GCont: the graph content that guides the coarsening, in one of three forms (``CONTENT_MODES``).

    - ``global`` (the paper's wording: "a global graph content GCont that extracts the graph pattern
      properties", learned once and shared by all graphs): a learned matrix C [K, d] of K content
      patterns. C is the cluster query set of MOA, the same for every graph, and a graph's content
      is its attention readout by C, softmax_nodes(C H^T / sqrt d) H -> [K, d].
    - ``per-graph`` (this project's first interpretation): a learned attention readout gives one
      content vector g per graph; the cluster queries are learned prototypes shifted by a projection
      of g.
    - ``none``: the cluster queries are the learned prototypes alone, and there is no content to
      keep stable (the ablation without GCont).

    ``summarize`` gives the content of a graph (None for ``none``); ``queries`` the cluster queries
    [B or 1, K, d] built from it.
    """

    def __init__(self, dim: int, clusters: int, mode: str) -> None:
        super().__init__()
        if mode not in CONTENT_MODES:
            raise ConfigError("content", f"unknown GCont mode {mode!r}", f"choose from {', '.join(CONTENT_MODES)}")
        self.mode = mode
        # C or the prototypes, entries of unit variance: matched against a unit-variance node key and
        # divided by sqrt(d) (MOA), the assignment logits start with unit variance. The first version
        # divided C by sqrt(d) as well, so the logits started ~0.02 apart and S uniform (docs/hap.md).
        self.patterns = nn.Parameter(torch.randn(clusters, dim))
        if mode == "per-graph":
            self.score = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, 1, bias=False))
            self.condition = nn.Linear(dim, dim)  # g -> shift of every cluster query

    def summarize(self, h: Tensor, mask: Tensor) -> Tensor | None:
        if self.mode == "none":
            return None
        if self.mode == "global":
            logits = self.patterns.to(h.dtype) @ h.transpose(1, 2) / math.sqrt(h.shape[-1])  # [B, K, N]
            return masked_softmax(logits, mask.unsqueeze(1), dim=-1) @ h  # [B, K, d]
        weights = masked_softmax(self.score(h).squeeze(-1), mask, dim=-1)  # [B, N]
        return (weights.unsqueeze(-1) * h).sum(1)  # [B, d]

    def queries(self, content: Tensor | None) -> Tensor:
        patterns = self.patterns.unsqueeze(0)
        if self.mode == "per-graph":
            return patterns.to(content.dtype) + self.condition(content).unsqueeze(1)
        return patterns


def hop_distances(adj: Tensor, hops: int) -> Tensor:
    """Shortest-path hop count between nodes, capped at ``hops + 1`` (= "farther", or unreachable).

    An edge is any positive entry, so on a coarsened (dense, soft) adjacency every pair is one hop.
    """
    linked = (adj > 0).to(adj.dtype)
    n = adj.shape[-1]
    eye = torch.eye(n, dtype=adj.dtype, device=adj.device).expand_as(adj)
    dist = torch.full(adj.shape, hops + 1, dtype=torch.long, device=adj.device)
    dist = dist.masked_fill(eye > 0, 0)
    reached = eye
    for k in range(1, hops + 1):
        grown = ((reached @ linked + reached) > 0).to(adj.dtype)
        dist = dist.masked_fill((grown > 0) & (reached == 0), k)
        reached = grown
    return dist


def edge_hop_distances(edge_index: Tensor, batch: Tensor, ptr: Tensor, n: int, hops: int) -> Tensor:
    """``hop_distances`` of the dense batch ``to_dense_batch``/``to_dense_adj`` build, from the edge list.

    Equal to ``hop_distances(to_dense_adj(edge_index, batch, n), hops)`` (an integer result, so
    exactly; ``tests/test_hap_speed.py``), at E x N work per hop instead of the N x N x N product per
    graph: node m's row of the transposed reach matrix is added to node j's for every edge m -> j.
    HAP's first level runs it on the input graph (2-3x the cost of the rest of its forward on
    PROTEINS' 620-node graphs otherwise; docs/hap.md "Speed").
    """
    graphs = ptr.numel() - 1
    owner = batch[edge_index[0]]
    src = owner * n + edge_index[0] - ptr[owner]  # row of the [graphs * n, n] flattened matrices
    dst = owner * n + edge_index[1] - ptr[owner]
    # reach[b, j, i] = 1 when i reaches j (the transpose of hop_distances' ``reached``)
    reach = torch.eye(n).expand(graphs, n, n).reshape(graphs * n, n).clone()
    dist = torch.full((graphs * n, n), hops + 1, dtype=torch.long)
    dist = dist.masked_fill(reach > 0, 0)
    for k in range(1, hops + 1):
        grown = reach.index_add(0, dst, reach[src])
        dist = dist.masked_fill((grown > 0) & (reach == 0), k)
        reach = (grown > 0).to(reach.dtype)
    return dist.view(graphs, n, n).transpose(1, 2).contiguous()


class MOA(nn.Module):
    """Cross-level attention: assigns the nodes of one level to the clusters of the next.

    Node-to-node attention whose logits carry a learned bias per hop distance b[d(i, j)] (starting
    at -d, so near nodes weigh more at first). With ``masked`` a node attends only within ``hops``
    hops; unmasked, every node of the graph is reachable and the nodes beyond ``hops`` share one
    learned "far" bias, so the attention can reach the high-order dependency the paper is about
    while still favouring the close neighbourhood. The node context is matched against the
    cluster queries of GCont to give a soft assignment S [B, N, K], softmax over the clusters.
    """

    def __init__(self, dim: int, hops: int, masked: bool) -> None:
        super().__init__()
        self.hops, self.masked = hops, masked
        self.hop_bias = nn.Parameter(-torch.arange(hops + 2, dtype=torch.float32))  # d = 0..hops, far
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.assign = nn.Linear(dim, dim)
        # The assignment's logit scale (docs/hap.md, "Why the assignment was uniform"): the node key
        # is centred over the nodes the node attends to, then layer-normalised, so key . C_k / sqrt(d)
        # has unit variance whatever the level's feature magnitude (the scaled dot-product argument,
        # Vaswani et al. 2017, sec. 3.2.1) and varies with how a node differs from its neighbourhood.
        # A component shared by the nodes (ReLU outputs' mean, the biases) shifts their logits alike
        # and cannot split them into clusters; uncentred it dominates and every node gets the same
        # row of S. Without both, S starts uniform (logits ~0.02 apart), and a uniform S is a
        # stationary point: every cluster is the mean of the nodes, the later layers treat clusters
        # alike and the gradient on the logits cancels.
        self.assign_norm = nn.LayerNorm(dim)

    def forward(self, h: Tensor, adj: Tensor, mask: Tensor, queries: Tensor, dist: Tensor | None = None) -> Tensor:
        """``dist``: the hop distances of ``adj`` capped at ``hops + 1`` when known (else computed)."""
        dim = h.shape[-1]
        dist = hop_distances(adj.to(h.dtype), self.hops) if dist is None else dist
        pair = mask.unsqueeze(-1) & mask.unsqueeze(-2)
        keep = pair & (dist <= self.hops) if self.masked else pair
        eye = torch.eye(dist.shape[-1], dtype=torch.bool, device=dist.device)
        keep = keep | eye  # the diagonal keeps every row (padding included) non-empty
        logits = self.query(h) @ self.key(h).transpose(1, 2) / math.sqrt(dim) + self.hop_bias.to(h.dtype)[dist]
        attention = masked_softmax(logits, keep, dim=-1)  # [B, N, N]
        context = h + attention @ self.value(h)
        # The key says how a node differs from the nodes its attention reaches (the whole graph
        # unmasked): the mean over that reach is removed, so the hop mask still bounds what a node's
        # assignment depends on (centring over the whole graph would let node 4 move node 0's row).
        reach = keep.to(h.dtype)
        key = self.assign(context)
        key = key - reach @ key / reach.sum(-1, keepdim=True)
        scores = self.assign_norm(key) @ queries.to(h.dtype).transpose(1, 2) / math.sqrt(dim)  # [B, N, K]
        return torch.softmax(scores, dim=-1) * mask.unsqueeze(-1).to(h.dtype)


class HAPLevel(nn.Module):
    """Encode one level's graph and coarsen it to ``clusters`` nodes.

    ``forward`` returns the coarsened (x, adj, mask); the content-stability loss of the last call is
    kept in ``self.content_loss`` (a tensor attached to the graph, or None before the first call).
    """

    def __init__(self, in_features: int, hidden: int, clusters: int, config: HAPConfig) -> None:
        super().__init__()
        self.convs = nn.ModuleList(
            [DenseGCN(in_features if i == 0 else hidden, hidden) for i in range(config.gcn_layers)]
        )
        self.content = ContentGuide(hidden, clusters, config.content)
        self.moa = MOA(hidden, config.hops, config.masked)
        self.content_loss: Tensor | None = None

    def forward(
        self, x: Tensor, adj: Tensor, mask: Tensor, dist: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        a_hat = normalized_adjacency(adj, mask)
        h = x
        for conv in self.convs:
            h = conv(h, a_hat, mask)
        content = self.content.summarize(h, mask)
        s = self.moa(h, adj, mask, self.content.queries(content), dist)  # [B, N, K]
        x_next = s.transpose(1, 2) @ h
        adj_next = s.transpose(1, 2) @ adj.to(h.dtype) @ s
        mask_next = torch.ones(x_next.shape[:2], dtype=torch.bool, device=x.device)
        if content is None:
            self.content_loss = h.new_zeros(())
        else:
            content_next = self.content.summarize(x_next, mask_next)
            similarity = F.cosine_similarity(content.flatten(1), content_next.flatten(1), dim=-1, eps=1e-8)
            self.content_loss = (1 - similarity).mean()
        return x_next, adj_next, mask_next


class HAPReadout(nn.Module):
    """Last GCN on the coarsest graph, mean | max over its nodes, and a two-layer classifier."""

    def __init__(self, hidden: int, num_classes: int, dropout: float) -> None:
        super().__init__()
        self.conv = DenseGCN(hidden, hidden)
        self.classifier = nn.Sequential(
            nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, num_classes)
        )

    def embed(self, x: Tensor, adj: Tensor, mask: Tensor) -> Tensor:
        h = self.conv(x, normalized_adjacency(adj, mask), mask)
        m = mask.unsqueeze(-1)
        mean = (h * m).sum(1) / m.sum(1).clamp(min=1).to(h.dtype)
        top = h.masked_fill(~m, float("-inf")).amax(1)
        return torch.cat([mean, top], dim=-1)

    def forward(self, x: Tensor, adj: Tensor, mask: Tensor) -> Tensor:
        return self.classifier(self.embed(x, adj, mask))


def build_level(config: HAPConfig, index: int) -> HAPLevel:
    width = config.in_features if index == 0 else config.hidden
    return HAPLevel(width, config.hidden, config.clusters[index], config)


def build_readout(config: HAPConfig) -> HAPReadout:
    return HAPReadout(config.hidden, config.num_classes, config.dropout)


class HAP(nn.Module):
    """The whole model: ``forward(x, adj, mask) -> logits``; ``content_loss`` after each forward."""

    def __init__(self, config: HAPConfig) -> None:
        super().__init__()
        if not config.clusters or min(config.clusters) < 1:
            raise ValueError(f"HAPConfig.clusters must be non-empty positive ints, got {config.clusters}")
        if config.hops < 1:
            raise ConfigError("hops", f"MOA needs at least 1 hop, got {config.hops}",
                              "pass hops >= 1 (masked=False for attention over the whole graph)")
        self.config = config
        self.levels = nn.ModuleList([build_level(config, i) for i in range(config.num_levels)])
        self.readout = build_readout(config)

    def coarsen(
        self, x: Tensor, adj: Tensor, mask: Tensor, dist: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``dist``: the input graph's hop distances (``edge_hop_distances``), used by the first level."""
        for index, level in enumerate(self.levels):
            x, adj, mask = level(x, adj, mask, dist if index == 0 else None)
        return x, adj, mask

    def embed(self, x: Tensor, adj: Tensor, mask: Tensor) -> Tensor:
        """The graph embedding [B, 2 * hidden] the classifier sees."""
        return self.readout.embed(*self.coarsen(x, adj, mask))

    def forward(self, x: Tensor, adj: Tensor, mask: Tensor, dist: Tensor | None = None) -> Tensor:
        return self.readout(*self.coarsen(x, adj, mask, dist))

    @property
    def content_loss(self) -> Tensor:
        """Mean content-stability loss over the levels of the last forward pass."""
        losses = [level.content_loss for level in self.levels if level.content_loss is not None]
        if not losses:
            raise RuntimeError("content_loss is defined only after a forward pass")
        return torch.stack(losses).mean()


# --- pipeline form: one packed tensor in, one out --------------------------------------------------


class PackedLevel(nn.Module):
    """A HAP level on packed graphs: [B, N, F + N + 1] -> [B, K, hidden + K + 1]."""

    def __init__(self, level: HAPLevel) -> None:
        super().__init__()
        self.level = level

    def forward(self, packed: Tensor) -> Tensor:
        return pack_graph(*self.level(*unpack_graph(packed)))


class PackedReadout(nn.Module):
    """HAP's readout on a packed graph: [B, K, hidden + K + 1] -> logits [B, classes]."""

    def __init__(self, readout: HAPReadout) -> None:
        super().__init__()
        self.readout = readout

    def forward(self, packed: Tensor) -> Tensor:
        return self.readout(*unpack_graph(packed))


def build_pipeline_layer(config: HAPConfig, index: int) -> nn.Module:
    """Layer ``index`` of HAP as a pipeline: levels 0..L-1, then the readout (L + 1 layers)."""
    if index < config.num_levels:
        return PackedLevel(build_level(config, index))
    if index == config.num_levels:
        return PackedReadout(build_readout(config))
    raise IndexError(f"HAP has {config.num_levels + 1} pipeline layers, asked for {index}")
