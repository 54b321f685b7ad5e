"""Graph-classification baselines from torch_geometric, and one entry point for every method.

Every classifier takes a torch_geometric mini-batch and returns ``(logits, aux_loss)``; aux_loss is
the method's own regulariser (DiffPool's link-prediction + entropy losses, HAP's content-stability
loss) and zero for the others. All methods use the same hidden width and a two-layer classifier.

Architectures follow the papers' usual graph-classification set-ups:
- gcn-mean / gcn-max: three GCNConv layers, then global mean / max pooling.
- topk / sag: three (conv -> pool with ratio 0.5) blocks, mean | max readout after each, summed
  (the hierarchical set-up of SAGPool, Lee et al. ICML 2019).
- asap / edge: the same hierarchical set-up with ASAPooling (Ranjan et al. AAAI 2020, ratio 0.5)
  and EdgePooling (Diehl 2019, which merges about half the nodes per block).
- sort: DGCNN-style (Zhang et al. AAAI 2018): three GCNConv layers, SortAggregation keeps the k
  top-sorted nodes, then the classifier on the k x hidden block; k = twice HAP's first cluster count,
  about the mean graph size.
- diffpool / mincut: DenseGCNConv embedding GNN and an assignment GNN (DiffPool) or MLP (MinCutPool,
  Bianchi et al. ICML 2020), ``dense_diff_pool`` / ``dense_mincut_pool`` per coarsened level, same
  cluster counts as HAP; aux = the method's own losses.
- mem: MemPooling (Khasahmadi et al. ICLR 2020): three GCNConv layers, then two memory layers (4
  heads; HAP's first cluster count, then 1 cluster); aux = its KL clustering loss.
PANPooling is not here: PANConv needs torch-sparse's SparseTensor, which is not installed.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from traces.errors import ConfigError

from .data import dense_batch
from .edge_matching import make_edge_pooling
from .model import HAP, HAPConfig, edge_hop_distances

METHODS = ("hap", "gcn-mean", "gcn-max", "topk", "sag", "asap", "edge", "sort", "diffpool", "mincut", "mem")
HIERARCHICAL = ("topk", "sag", "asap", "edge")


def _classifier(in_dim: int, hidden: int, num_classes: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(in_dim, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, num_classes)
    )


# GCN stacks whose layers all see the input graph (gcn-mean, gcn-max, sort, mem) normalise its edges
# once per batch (``gcn_edges``) instead of once per layer: GCNConv's own ``gcn_norm`` is then skipped,
# and its propagation gets the same edges and weights, so every number is unchanged (docs/hap.md,
# "Speed"). False: every layer normalises, as GCNConv does by default (the tests' reference).
SHARED_GCN_NORM = True


def _gcn_stack(in_features: int, hidden: int, layers: int = 3, shared_norm: bool = False) -> nn.ModuleList:
    """``layers`` GCNConv layers; ``shared_norm``: they take edges normalised by ``gcn_edges``."""
    from torch_geometric.nn import GCNConv

    normalize = not (shared_norm and SHARED_GCN_NORM)
    return nn.ModuleList(
        [GCNConv(in_features if i == 0 else hidden, hidden, normalize=normalize) for i in range(layers)]
    )


def gcn_edges(batch, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The batch's edges with self-loops and GCN weights D^-1/2 (A + I) D^-1/2, as GCNConv computes them.

    Kept on the batch object: a training batch is convolved by three layers, an evaluation batch
    (built once per fit, ``exec/hap/batching.py``) every epoch.
    """
    from torch_geometric.nn.conv.gcn_conv import gcn_norm

    cached = batch.__dict__.get("_paratwin_gcn_edges")
    if cached is None or cached[1].dtype != dtype:
        cached = gcn_norm(batch.edge_index, None, batch.x.size(0), False, True, "source_to_target", dtype)
        batch._paratwin_gcn_edges = cached
    return cached


def run_gcn_stack(convs: nn.ModuleList, x: Tensor, batch) -> Tensor:
    """``x`` through the layers of ``_gcn_stack`` on the batch's graph, ReLU after each."""
    edge_index, weight = (batch.edge_index, None) if convs[0].normalize else gcn_edges(batch, x.dtype)
    for conv in convs:
        x = conv(x, edge_index, weight).relu()
    return x


class GCNGlobalPool(nn.Module):
    def __init__(self, in_features: int, num_classes: int, hidden: int, pool: str, dropout: float) -> None:
        super().__init__()
        from torch_geometric.nn import global_max_pool, global_mean_pool

        self.convs = _gcn_stack(in_features, hidden, shared_norm=True)
        self.pool = {"mean": global_mean_pool, "max": global_max_pool}[pool]
        self.classifier = _classifier(hidden, hidden, num_classes, dropout)

    def forward(self, batch) -> tuple[Tensor, Tensor]:
        x = run_gcn_stack(self.convs, batch.x, batch)
        logits = self.classifier(self.pool(x, batch.batch))
        return logits, logits.new_zeros(())


class HierarchicalPoolNet(nn.Module):
    """conv -> pool blocks with a mean | max readout after each (TopK, SAG, ASAP or Edge pooling)."""

    def __init__(self, in_features: int, num_classes: int, hidden: int, pool: str, dropout: float) -> None:
        super().__init__()
        from torch_geometric.nn import ASAPooling, SAGPooling, TopKPooling

        make = {
            "topk": lambda: TopKPooling(hidden, ratio=0.5),
            "sag": lambda: SAGPooling(hidden, ratio=0.5),
            "asap": lambda: ASAPooling(hidden, ratio=0.5),
            "edge": lambda: make_edge_pooling(hidden),
        }[pool]
        self.kind = pool
        self.convs = _gcn_stack(in_features, hidden)
        self.pools = nn.ModuleList([make() for _ in range(3)])
        self.classifier = _classifier(2 * hidden, hidden, num_classes, dropout)

    def _pool(self, pool: nn.Module, x: Tensor, edge_index: Tensor, weight: Tensor | None, graph: Tensor):
        """One pooling step in a common form: (x, edge_index, edge_weight or None, batch)."""
        if self.kind == "asap":
            x, edge_index, weight, graph, _ = pool(x, edge_index, edge_weight=weight, batch=graph)
            return x, edge_index, weight, graph
        if self.kind == "edge":
            x, edge_index, graph, _ = pool(x, edge_index, graph)
            return x, edge_index, None, graph
        x, edge_index, _, graph, _, _ = pool(x, edge_index, batch=graph)
        return x, edge_index, None, graph

    def forward(self, batch) -> tuple[Tensor, Tensor]:
        from torch_geometric.nn import global_max_pool, global_mean_pool

        x, edge_index, graph, weight = batch.x, batch.edge_index, batch.batch, None
        total = 0
        for conv, pool in zip(self.convs, self.pools, strict=True):
            x = conv(x, edge_index, weight).relu()
            x, edge_index, weight, graph = self._pool(pool, x, edge_index, weight, graph)
            total = total + torch.cat([global_mean_pool(x, graph), global_max_pool(x, graph)], dim=-1)
        logits = self.classifier(total)
        return logits, logits.new_zeros(())


class SortPoolNet(nn.Module):
    """GCN layers, SortAggregation to k nodes, classifier on the flattened k x hidden block."""

    def __init__(self, in_features: int, num_classes: int, hidden: int, k: int, dropout: float) -> None:
        super().__init__()
        from torch_geometric.nn.aggr import SortAggregation

        self.convs = _gcn_stack(in_features, hidden, shared_norm=True)
        self.sort = SortAggregation(k)
        self.classifier = _classifier(k * hidden, hidden, num_classes, dropout)

    def forward(self, batch) -> tuple[Tensor, Tensor]:
        x = run_gcn_stack(self.convs, batch.x, batch)
        logits = self.classifier(self.sort(x, batch.batch, dim_size=batch.num_graphs))
        return logits, logits.new_zeros(())


class MemPoolNet(nn.Module):
    """GCN layers, then two MemPooling layers (to ``clusters`` nodes, then 1); aux = their KL losses."""

    def __init__(self, in_features: int, num_classes: int, hidden: int, clusters: int, dropout: float) -> None:
        super().__init__()
        from torch_geometric.nn import MemPooling

        self.convs = _gcn_stack(in_features, hidden, shared_norm=True)
        self.mem1 = MemPooling(hidden, hidden, heads=4, num_clusters=clusters)
        self.mem2 = MemPooling(hidden, hidden, heads=4, num_clusters=1)
        self.classifier = _classifier(hidden, hidden, num_classes, dropout)

    def forward(self, batch) -> tuple[Tensor, Tensor]:
        from torch_geometric.nn import MemPooling

        x = run_gcn_stack(self.convs, batch.x, batch)
        x, s1 = self.mem1(x, batch.batch)
        x, s2 = self.mem2(torch.nn.functional.leaky_relu(x))
        logits = self.classifier(x.squeeze(1))
        return logits, MemPooling.kl_loss(s1) + MemPooling.kl_loss(s2)


class DensePoolNet(nn.Module):
    """DiffPool or MinCutPool: dense embedding GNN + assignment, pooled level by level."""

    def __init__(
        self, in_features: int, num_classes: int, hidden: int, clusters: tuple[int, ...], dropout: float,
        kind: str = "diffpool",
    ) -> None:
        super().__init__()
        from torch_geometric.nn import DenseGCNConv

        self.kind = kind
        self.embeds = nn.ModuleList()
        self.assigns = nn.ModuleList()
        for i, k in enumerate(clusters):
            width = in_features if i == 0 else hidden
            self.embeds.append(nn.ModuleList([DenseGCNConv(width, hidden), DenseGCNConv(hidden, hidden)]))
            if kind == "diffpool":  # assignment GNN (Ying et al.)
                self.assigns.append(nn.ModuleList([DenseGCNConv(width, hidden), DenseGCNConv(hidden, k)]))
            else:  # MinCutPool: an MLP on the embedding (Bianchi et al.)
                self.assigns.append(nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, k)))
        self.final = DenseGCNConv(hidden, hidden)
        self.classifier = _classifier(2 * hidden, hidden, num_classes, dropout)

    def forward(self, batch) -> tuple[Tensor, Tensor]:
        from torch_geometric.nn import dense_diff_pool, dense_mincut_pool

        x, adj, mask = dense_batch(batch)
        aux = x.new_zeros(())
        for embed, assign in zip(self.embeds, self.assigns, strict=True):
            z = embed[1](embed[0](x, adj, mask).relu(), adj, mask).relu()
            if self.kind == "diffpool":
                s = assign[1](assign[0](x, adj, mask).relu(), adj, mask)
                x, adj, first, second = dense_diff_pool(z, adj, s, mask)
            else:
                x, adj, first, second = dense_mincut_pool(z, adj, assign(z), mask)
            mask = None  # every cluster is real after the first coarsening
            aux = aux + first + second
        h = self.final(x, adj).relu()
        logits = self.classifier(torch.cat([h.mean(1), h.amax(1)], dim=-1))
        return logits, aux


class DenseHAP(nn.Module):
    """HAP behind the common interface: densify the mini-batch, return logits and content loss."""

    def __init__(self, config: HAPConfig) -> None:
        super().__init__()
        self.model = HAP(config)

    def forward(self, batch) -> tuple[Tensor, Tensor]:
        x, adj, mask = dense_batch(batch)
        # the first level's hop distances from the edge list: equal to MOA's dense product, cheaper
        dist = edge_hop_distances(batch.edge_index, batch.batch, batch.ptr, x.shape[1], self.model.config.hops)
        logits = self.model(x, adj, mask, dist)
        return logits, self.model.content_loss


def build_classifier(
    method: str,
    in_features: int,
    num_classes: int,
    hidden: int = 64,
    clusters: tuple[int, ...] = (16, 4),
    dropout: float = 0.5,
    hap: dict[str, object] | None = None,
) -> nn.Module:
    """A graph classifier for ``method`` (one of METHODS): ``model(batch) -> (logits, aux_loss)``.

    ``hap`` holds HAPConfig options for ``hap`` (hops, masked, content); other methods ignore it.
    """
    if method == "hap":
        options = dict(hap or {})
        config = HAPConfig(in_features, num_classes, hidden=hidden, clusters=clusters, dropout=dropout, **options)
        return DenseHAP(config)
    if method in ("gcn-mean", "gcn-max"):
        return GCNGlobalPool(in_features, num_classes, hidden, method.split("-")[1], dropout)
    if method in HIERARCHICAL:
        return HierarchicalPoolNet(in_features, num_classes, hidden, method, dropout)
    if method in ("diffpool", "mincut"):
        return DensePoolNet(in_features, num_classes, hidden, clusters, dropout, kind=method)
    if method == "sort":
        return SortPoolNet(in_features, num_classes, hidden, 2 * clusters[0], dropout)
    if method == "mem":
        return MemPoolNet(in_features, num_classes, hidden, clusters[0], dropout)
    raise ConfigError("method", f"unknown graph classification method {method!r}",
                      f"choose from {', '.join(METHODS)}")
