"""Graph-classification baselines from torch_geometric, and one entry point for every method.

Every classifier takes a torch_geometric mini-batch and returns ``(logits, aux_loss)``; aux_loss is
the method's own regulariser (DiffPool's link-prediction + entropy losses, HAP's content-stability
loss) and zero for the others. All methods use the same hidden width and a two-layer classifier.

Architectures follow the papers' usual graph-classification set-ups:
- gcn-mean / gcn-max: three GCNConv layers, then global mean / max pooling.
- topk / sag: three (conv -> pool with ratio 0.5) blocks, mean | max readout after each, summed
  (the hierarchical set-up of SAGPool, Lee et al. ICML 2019).
- diffpool: DenseGCNConv embedding and assignment GNNs, ``dense_diff_pool`` per coarsened level
  (Ying et al. NeurIPS 2018), same cluster counts as HAP.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from traces.errors import ConfigError

from .data import dense_batch
from .model import HAP, HAPConfig

METHODS = ("hap", "gcn-mean", "gcn-max", "topk", "sag", "diffpool")


def _classifier(in_dim: int, hidden: int, num_classes: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(in_dim, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, num_classes)
    )


class GCNGlobalPool(nn.Module):
    def __init__(self, in_features: int, num_classes: int, hidden: int, pool: str, dropout: float) -> None:
        super().__init__()
        from torch_geometric.nn import GCNConv, global_max_pool, global_mean_pool

        self.convs = nn.ModuleList([GCNConv(in_features if i == 0 else hidden, hidden) for i in range(3)])
        self.pool = {"mean": global_mean_pool, "max": global_max_pool}[pool]
        self.classifier = _classifier(hidden, hidden, num_classes, dropout)

    def forward(self, batch) -> tuple[Tensor, Tensor]:
        x = batch.x
        for conv in self.convs:
            x = conv(x, batch.edge_index).relu()
        logits = self.classifier(self.pool(x, batch.batch))
        return logits, logits.new_zeros(())


class HierarchicalPoolNet(nn.Module):
    """conv -> pool blocks with a mean | max readout after each (TopKPooling or SAGPooling)."""

    def __init__(self, in_features: int, num_classes: int, hidden: int, pool: str, dropout: float) -> None:
        super().__init__()
        from torch_geometric.nn import GCNConv, SAGPooling, TopKPooling

        pool_cls = {"topk": TopKPooling, "sag": SAGPooling}[pool]
        self.convs = nn.ModuleList([GCNConv(in_features if i == 0 else hidden, hidden) for i in range(3)])
        self.pools = nn.ModuleList([pool_cls(hidden, ratio=0.5) for _ in range(3)])
        self.classifier = _classifier(2 * hidden, hidden, num_classes, dropout)

    def forward(self, batch) -> tuple[Tensor, Tensor]:
        from torch_geometric.nn import global_max_pool, global_mean_pool

        x, edge_index, graph = batch.x, batch.edge_index, batch.batch
        total = 0
        for conv, pool in zip(self.convs, self.pools, strict=True):
            x = conv(x, edge_index).relu()
            x, edge_index, _, graph, _, _ = pool(x, edge_index, batch=graph)
            total = total + torch.cat([global_mean_pool(x, graph), global_max_pool(x, graph)], dim=-1)
        logits = self.classifier(total)
        return logits, logits.new_zeros(())


class DiffPoolNet(nn.Module):
    def __init__(
        self, in_features: int, num_classes: int, hidden: int, clusters: tuple[int, ...], dropout: float
    ) -> None:
        super().__init__()
        from torch_geometric.nn import DenseGCNConv

        self.embeds = nn.ModuleList()
        self.assigns = nn.ModuleList()
        for i, k in enumerate(clusters):
            width = in_features if i == 0 else hidden
            self.embeds.append(nn.ModuleList([DenseGCNConv(width, hidden), DenseGCNConv(hidden, hidden)]))
            self.assigns.append(nn.ModuleList([DenseGCNConv(width, hidden), DenseGCNConv(hidden, k)]))
        self.final = DenseGCNConv(hidden, hidden)
        self.classifier = _classifier(2 * hidden, hidden, num_classes, dropout)

    def forward(self, batch) -> tuple[Tensor, Tensor]:
        from torch_geometric.nn import dense_diff_pool

        x, adj, mask = dense_batch(batch)
        aux = x.new_zeros(())
        for embed, assign in zip(self.embeds, self.assigns, strict=True):
            z = embed[1](embed[0](x, adj, mask).relu(), adj, mask).relu()
            s = assign[1](assign[0](x, adj, mask).relu(), adj, mask)
            x, adj, link_loss, entropy_loss = dense_diff_pool(z, adj, s, mask)
            mask = None  # every cluster is real after the first coarsening
            aux = aux + link_loss + entropy_loss
        h = self.final(x, adj).relu()
        logits = self.classifier(torch.cat([h.mean(1), h.amax(1)], dim=-1))
        return logits, aux


class DenseHAP(nn.Module):
    """HAP behind the common interface: densify the mini-batch, return logits and content loss."""

    def __init__(self, config: HAPConfig) -> None:
        super().__init__()
        self.model = HAP(config)

    def forward(self, batch) -> tuple[Tensor, Tensor]:
        logits = self.model(*dense_batch(batch))
        return logits, self.model.content_loss


def build_classifier(
    method: str,
    in_features: int,
    num_classes: int,
    hidden: int = 64,
    clusters: tuple[int, ...] = (16, 4),
    dropout: float = 0.5,
) -> nn.Module:
    """A graph classifier for ``method`` (one of METHODS): ``model(batch) -> (logits, aux_loss)``."""
    if method == "hap":
        config = HAPConfig(in_features, num_classes, hidden=hidden, clusters=clusters, dropout=dropout)
        return DenseHAP(config)
    if method in ("gcn-mean", "gcn-max"):
        return GCNGlobalPool(in_features, num_classes, hidden, method.split("-")[1], dropout)
    if method in ("topk", "sag"):
        return HierarchicalPoolNet(in_features, num_classes, hidden, method, dropout)
    if method == "diffpool":
        return DiffPoolNet(in_features, num_classes, hidden, clusters, dropout)
    raise ConfigError("method", f"unknown graph classification method {method!r}",
                      f"choose from {', '.join(METHODS)}")
