"""HAP: Hierarchical Adaptive Pooling (Liu et al., IEEE TKDE 2021, arXiv 2104.05960), on dense graphs.

A graph batch is dense: node features X [B, N, F], adjacency A [B, N, N] and a node mask [B, N]
(``torch_geometric.utils.to_dense_batch`` / ``to_dense_adj``). HAP stacks coarsening levels; each
level runs

1. a GCN encoder on the level's graph (H = relu(Â H W), Â = D^-1/2 (A + I) D^-1/2);
2. GCont, the graph content: an attention readout of H into one vector g per graph;
3. MOA, the cross-level attention that assigns the level's nodes to the next level's clusters:
   a node-to-node attention whose logits carry log T, T = sum_k theta_k Â^k (k = 0..hops), so a
   node only attends within ``hops`` hops and, with the decaying prior on theta, mostly to its near
   neighbourhood, while the attention term and the higher powers of Â carry higher-order
   dependency; the resulting node context is matched against cluster queries (learned
   prototypes shared by all graphs, shifted by the graph's content g) to give a soft assignment
   S [B, N, K], softmax over clusters;
4. coarsening X' = S^T H, A' = S^T A S, with a content-stability loss 1 - cos(g, g') between the
   graph content before and after coarsening (g' is the same GCont readout of X').

A readout level (GCN, mean | max over nodes, MLP) gives the class logits.

This is an interpretation from the paper's abstract and design notes (see docs/hap.md): the paper's
exact MOA and GCont equations are not reproduced; the structure above keeps its three ideas
(cross-level attention focused on near neighbourhoods with higher-order reach; a learned graph
content that guides the coarsening and is kept stable across levels; hierarchical coarsening).

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


@dataclass(frozen=True)
class HAPConfig:
    in_features: int
    num_classes: int
    hidden: int = 64
    clusters: tuple[int, ...] = (16, 4)  # cluster count of each coarsened level, coarsest last
    gcn_layers: int = 2  # GCN layers in each level's encoder
    hops: int = 3  # MOA reach: attention restricted to nodes within this many hops
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


class GraphContent(nn.Module):
    """GCont: the graph's content as an attention-weighted sum of its node embeddings.

    The scoring weights are learned over all training graphs, so the same notion of "what matters in
    a graph" is applied at every graph and (through the stability loss) before and after coarsening.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.score = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, 1, bias=False))

    def forward(self, h: Tensor, mask: Tensor) -> Tensor:
        weights = masked_softmax(self.score(h).squeeze(-1), mask, dim=-1)  # [B, N]
        return (weights.unsqueeze(-1) * h).sum(1)


class MOA(nn.Module):
    """Cross-level attention: assigns the nodes of one level to the clusters of the next."""

    def __init__(self, dim: int, clusters: int, hops: int) -> None:
        super().__init__()
        self.hops = hops
        # Prior theta_k ~ exp(-k): nearer hops weigh more at the start; learned afterwards.
        self.hop_logits = nn.Parameter(-torch.arange(hops + 1, dtype=torch.float32))
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.prototypes = nn.Parameter(torch.randn(clusters, dim) / math.sqrt(dim))
        self.condition = nn.Linear(dim, dim)  # GCont -> shift of every cluster query
        self.assign = nn.Linear(dim, dim)

    def diffusion(self, a_hat: Tensor, mask: Tensor) -> Tensor:
        """T = sum_k theta_k Â^k, k = 0..hops: positive exactly on pairs within ``hops`` hops.

        The powers cost N^3 per graph, so a padded batch is done graph by graph on its real nodes
        (a batch padded to its largest graph would pay that graph's N^3 for every graph).
        """
        theta = torch.softmax(self.hop_logits, dim=0).to(a_hat.dtype)
        if a_hat.device.type == "meta":  # shapes only: no data to branch on
            return self._kernel(a_hat, theta)
        counts = mask.sum(1)
        n = a_hat.shape[-1]
        if bool((counts == n).all()):
            return self._kernel(a_hat, theta)
        if bool((mask == (torch.arange(n, device=mask.device) < counts.unsqueeze(1))).all()):
            # real nodes first (as to_dense_batch lays them out): slice, compute, pad back
            kernels = [self._kernel(a_hat[b, :c, :c], theta) for b, c in enumerate(counts.tolist())]
            return torch.stack([F.pad(k, (0, n - k.shape[-1], 0, n - k.shape[-1])) for k in kernels])
        kernel = torch.zeros_like(a_hat)
        for b in range(a_hat.shape[0]):
            idx = mask[b].nonzero().squeeze(1)
            kernel[b, idx.unsqueeze(1), idx.unsqueeze(0)] = self._kernel(a_hat[b][idx][:, idx], theta)
        return kernel

    def _kernel(self, a_hat: Tensor, theta: Tensor) -> Tensor:
        kernel = theta[0] * torch.eye(a_hat.shape[-1], dtype=a_hat.dtype, device=a_hat.device)
        power = a_hat
        for k in range(1, self.hops + 1):
            power = a_hat if k == 1 else power @ a_hat
            kernel = kernel + theta[k] * power
        return kernel

    def forward(self, h: Tensor, a_hat: Tensor, mask: Tensor, content: Tensor) -> Tensor:
        dim = h.shape[-1]
        kernel = self.diffusion(a_hat, mask)
        eye = torch.eye(kernel.shape[-1], dtype=torch.bool, device=kernel.device)
        reach = (kernel > 0) | eye  # the diagonal keeps every row (padding included) non-empty
        bias = torch.where(reach, kernel.clamp(min=1e-30).log(), torch.zeros_like(kernel))
        logits = self.query(h) @ self.key(h).transpose(1, 2) / math.sqrt(dim) + bias
        attention = masked_softmax(logits, reach, dim=-1)  # [B, N, N]
        context = h + attention @ self.value(h)
        queries = self.prototypes.to(h.dtype) + self.condition(content).unsqueeze(1)  # [B, K, d]
        scores = self.assign(context) @ queries.transpose(1, 2) / math.sqrt(dim)  # [B, N, K]
        return torch.softmax(scores, dim=-1) * mask.unsqueeze(-1).to(h.dtype)


class HAPLevel(nn.Module):
    """Encode one level's graph and coarsen it to ``clusters`` nodes.

    ``forward`` returns the coarsened (x, adj, mask); the content-stability loss of the last call is
    kept in ``self.content_loss`` (a tensor attached to the graph, or None before the first call).
    """

    def __init__(self, in_features: int, hidden: int, clusters: int, gcn_layers: int, hops: int) -> None:
        super().__init__()
        self.convs = nn.ModuleList(
            [DenseGCN(in_features if i == 0 else hidden, hidden) for i in range(gcn_layers)]
        )
        self.content = GraphContent(hidden)
        self.moa = MOA(hidden, clusters, hops)
        self.content_loss: Tensor | None = None

    def forward(self, x: Tensor, adj: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        a_hat = normalized_adjacency(adj, mask)
        h = x
        for conv in self.convs:
            h = conv(h, a_hat, mask)
        content = self.content(h, mask)
        s = self.moa(h, a_hat, mask, content)  # [B, N, K]
        x_next = s.transpose(1, 2) @ h
        adj_next = s.transpose(1, 2) @ adj.to(h.dtype) @ s
        mask_next = torch.ones(x_next.shape[:2], dtype=torch.bool, device=x.device)
        content_next = self.content(x_next, mask_next)
        self.content_loss = (1 - F.cosine_similarity(content, content_next, dim=-1, eps=1e-8)).mean()
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
    return HAPLevel(width, config.hidden, config.clusters[index], config.gcn_layers, config.hops)


def build_readout(config: HAPConfig) -> HAPReadout:
    return HAPReadout(config.hidden, config.num_classes, config.dropout)


class HAP(nn.Module):
    """The whole model: ``forward(x, adj, mask) -> logits``; ``content_loss`` after each forward."""

    def __init__(self, config: HAPConfig) -> None:
        super().__init__()
        if not config.clusters or min(config.clusters) < 1:
            raise ValueError(f"HAPConfig.clusters must be non-empty positive ints, got {config.clusters}")
        self.config = config
        self.levels = nn.ModuleList([build_level(config, i) for i in range(config.num_levels)])
        self.readout = build_readout(config)

    def coarsen(self, x: Tensor, adj: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        for level in self.levels:
            x, adj, mask = level(x, adj, mask)
        return x, adj, mask

    def embed(self, x: Tensor, adj: Tensor, mask: Tensor) -> Tensor:
        """The graph embedding [B, 2 * hidden] the classifier sees."""
        return self.readout.embed(*self.coarsen(x, adj, mask))

    def forward(self, x: Tensor, adj: Tensor, mask: Tensor) -> Tensor:
        return self.readout(*self.coarsen(x, adj, mask))

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
