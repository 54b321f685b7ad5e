"""TU graph-classification datasets (MUTAG, PROTEINS, PTC_MR, NCI1, ENZYMES) from a read-only copy.

torch_geometric's ``TUDataset`` writes ``processed/`` next to ``raw/``, and the shared dataset
folder is read-only in CI, so the raw text files are first copied into a scratch cache directory
and the dataset is built there. Node features are the node attributes (where the dataset has
them) followed by the one-hot node labels (``use_node_attr=True``). Continuous node attributes
are z-scored per column over all nodes of the dataset (label-free statistics): PROTEINS' attribute
spans -538..798 and would otherwise swamp the one-hot labels.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from traces.errors import ConfigError
from traces.paths import datasets_root

TU_NAMES = ("MUTAG", "PROTEINS", "PTC_MR", "NCI1", "ENZYMES")


def default_tu_root() -> Path:
    """Where the raw TU folders live: $PARATWIN_TU_ROOT, else the shared datasets' TU/."""
    env = os.environ.get("PARATWIN_TU_ROOT")
    return Path(env) if env else datasets_root() / "TU"


def default_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / "paratwin-tu-cache"


def load_tu(
    name: str, data_root: Path | None = None, cache_dir: Path | None = None, standardize: bool = True
):
    """Load TU dataset ``name`` as a ``torch_geometric.datasets.TUDataset`` built in a scratch copy.

    ``data_root`` holds ``<name>/raw/<name>_A.txt`` etc. (never written to); ``cache_dir`` is
    where the copy and ``processed/`` go (default: the system temp dir).
    """
    from torch_geometric.datasets import TUDataset

    source = Path(data_root) if data_root is not None else default_tu_root()
    raw = source / name / "raw"
    if not (raw / f"{name}_A.txt").is_file() or not (raw / f"{name}_graph_indicator.txt").is_file():
        found = source.iterdir() if source.is_dir() else []
        available = sorted(p.name for p in found if (p / "raw").is_dir())
        raise ConfigError(
            "dataset",
            f"no TU dataset {name!r} under {source} (expected {raw}/{name}_A.txt)",
            f"choose one of {', '.join(available) or 'none found'} or pass data_root / set PARATWIN_TU_ROOT",
        )
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / name / "raw"
    if not _same_files(raw, target):
        shutil.rmtree(cache / name, ignore_errors=True)  # stale copy: rebuild processed/ too
        target.mkdir(parents=True, exist_ok=True)
        for path in raw.iterdir():
            if path.is_file():
                shutil.copyfile(path, target / path.name)
    dataset = TUDataset(str(cache), name, use_node_attr=True)
    attributes = dataset.num_node_attributes  # they come first in x, before the one-hot labels
    if standardize and attributes:
        x = dataset._data.x
        values = x[:, :attributes]
        scaled = (values - values.mean(0)) / values.std(0).clamp(min=1e-6)
        dataset._data.x = torch.cat([scaled, x[:, attributes:]], dim=1)
    return dataset


def _same_files(source: Path, target: Path) -> bool:
    if not target.is_dir():
        return False
    for path in source.iterdir():
        copy = target / path.name
        if path.is_file() and (not copy.is_file() or copy.stat().st_size != path.stat().st_size):
            return False
    return True


def graph_labels(dataset) -> Tensor:
    """The class label of every graph, as a 1-D long tensor."""
    return dataset._data.y.view(-1).long() if hasattr(dataset, "_data") else dataset.data.y.view(-1).long()


def dense_batch(batch) -> tuple[Tensor, Tensor, Tensor]:
    """A torch_geometric mini-batch as dense tensors: X [B, N, F], A [B, N, N], mask [B, N]."""
    from torch_geometric.utils import to_dense_adj, to_dense_batch

    x, mask = to_dense_batch(batch.x, batch.batch)
    adj = to_dense_adj(batch.edge_index, batch.batch, max_num_nodes=x.shape[1])
    return x, adj, mask


def majority_accuracy(labels: Tensor) -> float:
    """Accuracy of always predicting the most frequent class of ``labels``."""
    return torch.bincount(labels).max().item() / labels.numel()
