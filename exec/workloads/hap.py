"""HAP (hierarchical adaptive graph pooling) as cuttable layers: level0, ..., readout.

A dense graph batch travels between layers as one packed tensor (``exec.hap.model.pack_graph``):

* ``level{i}``  [B, N_i, F_i + N_i + 1] -> [B, K_i, hidden + K_i + 1]   encode, MOA-assign, coarsen
* ``readout``   [B, K_last, hidden + K_last + 1] -> logits [B, classes]

with the last dimension = node features | adjacency row | mask. Batches are padded to a fixed
``max_nodes`` so every micro-batch has the same shapes (pipeline sends need static shapes).

Presets: ``hap-tiny`` is synthetic random graphs whose class sets their edge density (for tests);
``hap-mutag`` reads real MUTAG graphs (188 molecules, 7 one-hot atom types, at most 28 atoms).
Only the cross-entropy is in the pipeline loss; HAP's content-stability term is a per-level
regulariser the experiment (``analysis.hap_experiment``) adds, not part of this workload.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from exec.hap.model import HAPConfig, build_pipeline_layer, pack_graph
from sim.workloads import preset_with_overrides
from traces.errors import ConfigError

from .base import Batch, Workload


@dataclass(frozen=True)
class HAPWorkloadConfig:
    in_features: int
    classes: int
    hidden: int
    clusters: tuple[int, ...]
    max_nodes: int  # every batch is padded to this many nodes
    data: str  # "synthetic" or "mutag"
    gcn_layers: int = 2
    hops: int = 3
    masked: bool = True
    content: str = "global"
    data_root: str = ""  # TU root for "mutag" ("" = the package's copy, see traces.paths)
    source: str = ""

    def model_config(self) -> HAPConfig:
        # no dropout: runs agree bit for bit
        return HAPConfig(self.in_features, self.classes, self.hidden, tuple(self.clusters),
                         self.gcn_layers, self.hops, self.masked, self.content, dropout=0.0)


HAP_PRESETS: dict[str, HAPWorkloadConfig] = {
    "hap-tiny": HAPWorkloadConfig(in_features=4, classes=2, hidden=16, clusters=(4, 2), max_nodes=12,
                                  data="synthetic", source="test model"),
    # MUTAG: 7 node labels, 2 classes, 28 nodes at most (TU dataset README); clusters 1/2 and 1/8 of
    # the mean of 17.9 nodes, as in analysis/hap_experiment.py.
    "hap-mutag": HAPWorkloadConfig(in_features=7, classes=2, hidden=64, clusters=(9, 3), max_nodes=28,
                                   data="mutag", source="HAP MUTAG experiment (analysis/hap_experiment.py)"),
}

# Edge probability of the two synthetic classes (hap-tiny): sparse vs dense random graphs.
SYNTHETIC_EDGE_PROB = (0.2, 0.5)


class HAPWorkload(Workload):
    def __init__(self, name: str, cfg: HAPWorkloadConfig) -> None:
        self.name = name
        self.cfg = cfg
        self.model_config = cfg.model_config()
        self._dataset = None  # MUTAG, loaded on first use

    def layer_names(self) -> list[str]:
        return [*(f"level{i}" for i in range(len(self.cfg.clusters))), "readout"]

    def build_layer(self, index: int) -> nn.Module:
        if not 0 <= index < self.num_layers:
            raise ValueError(f"layer {index} is outside 0..{self.num_layers - 1}")
        return build_pipeline_layer(self.model_config, index)

    def make_batch(self, micro_batch: int, seed: int = 0, device: str | torch.device = "cpu") -> Batch:
        gen = torch.Generator().manual_seed(seed)
        if self.cfg.data == "mutag":
            x, adj, mask, y = self._mutag(micro_batch, gen)
        else:
            x, adj, mask, y = self._synthetic(micro_batch, gen)
        return Batch(pack_graph(x, adj, mask).to(device), y.to(device))

    def _synthetic(self, micro_batch: int, gen: torch.Generator):
        cfg = self.cfg
        n = cfg.max_nodes
        y = torch.randint(0, cfg.classes, (micro_batch,), generator=gen)
        sizes = torch.randint(max(2, n // 2), n + 1, (micro_batch,), generator=gen)
        mask = torch.arange(n) < sizes.unsqueeze(1)
        prob = torch.tensor(SYNTHETIC_EDGE_PROB)[y % len(SYNTHETIC_EDGE_PROB)].view(-1, 1, 1)
        upper = (torch.rand(micro_batch, n, n, generator=gen) < prob).float().triu(diagonal=1)
        adj = (upper + upper.transpose(1, 2)) * mask.unsqueeze(1) * mask.unsqueeze(2)
        labels = torch.randint(0, cfg.in_features, (micro_batch, n), generator=gen)
        x = F.one_hot(labels, cfg.in_features).float() * mask.unsqueeze(-1)
        return x, adj, mask, y

    def _mutag(self, micro_batch: int, gen: torch.Generator):
        from torch_geometric.data import Batch as GraphBatch
        from torch_geometric.utils import to_dense_adj, to_dense_batch

        from exec.hap.data import load_tu

        if self._dataset is None:
            self._dataset = load_tu("MUTAG", data_root=self.cfg.data_root or None)
        dataset = self._dataset
        pick = torch.randint(0, len(dataset), (micro_batch,), generator=gen)
        graphs = GraphBatch.from_data_list([dataset[int(i)] for i in pick])
        x, mask = to_dense_batch(graphs.x, graphs.batch, max_num_nodes=self.cfg.max_nodes)
        adj = to_dense_adj(graphs.edge_index, graphs.batch, max_num_nodes=self.cfg.max_nodes)
        return x, adj, mask, graphs.y.view(-1)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, targets)

    def describe(self) -> dict[str, object]:
        return {
            **super().describe(),
            "family": "hap",
            "config": asdict(self.cfg),
            "packed_layout": "[B, N, features | adjacency (N) | mask (1)]",
            "definition": "paratwin exec.hap.model (HAP: GCN levels, MOA assignment, GCont; dense graphs)",
        }


def from_preset(name: str, **overrides: object) -> HAPWorkload:
    """``hap-tiny`` or ``hap-mutag``; overrides are HAPWorkloadConfig fields."""
    if "clusters" in overrides:
        overrides["clusters"] = tuple(overrides["clusters"])  # type: ignore[arg-type]
    cfg = preset_with_overrides("HAP", HAP_PRESETS, name, overrides)
    if cfg.data not in ("synthetic", "mutag"):
        raise ConfigError("workload.data", f"unknown HAP data {cfg.data!r}", "use 'synthetic' or 'mutag'")
    if not cfg.clusters or min(cfg.clusters) < 1:
        raise ConfigError("workload.clusters", f"need positive cluster counts, got {cfg.clusters}",
                          "give one positive count per coarsened level, e.g. (9, 3)")
    if cfg.data == "mutag" and ((cfg.in_features, cfg.classes) != (7, 2) or cfg.max_nodes < 28):
        raise ConfigError("workload", "MUTAG graphs have 7 node features, 2 classes and up to 28 nodes",
                          "change only hidden, clusters, hops, masked, content, gcn_layers or max_nodes (>= 28) "
                          "for hap-mutag")
    return HAPWorkload(name, cfg)
