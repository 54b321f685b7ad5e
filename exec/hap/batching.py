"""Mini-batches of TU graphs straight from the dataset's flat storage, equal to torch_geometric's.

A fit draws every training batch anew each epoch and scores the same validation batches every
epoch. torch_geometric's ``DataLoader`` builds each batch by slicing one ``Data`` object per graph out
of the ``InMemoryDataset`` and merging them again (``Batch.from_data_list``): on PROTEINS that
bookkeeping was about a quarter of a GCN+mean epoch (cProfile, docs/hap.md "Speed"). Here a batch is
cut from the flat tensors the dataset already holds (``dataset._data`` and its ``slices``) with one
index per attribute (an attribute with one row per graph, the label, is indexed by the graph ids
directly), and the evaluation batches, which never change, are built once per fit.

The batches are the library's, tensor for tensor (same keys, values, dtypes, graph order;
``tests/test_hap_speed.py`` compares them), and ``GraphLoader`` makes the one draw on torch's
global generator that every ``DataLoader`` iteration makes (the base seed of its workers, drawn
even with none), so the dropout masks, and therefore every loss and accuracy, are those of a run
with the library's loader.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor

from traces.errors import ConfigError


def _ranges(ptr: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Indices of the rows ptr[i]..ptr[i+1] of every id, in order, and each id's count."""
    starts, counts = ptr[ids], ptr[ids + 1] - ptr[ids]
    first = torch.cumsum(counts, 0) - counts  # where each id's rows begin in the result
    owner = torch.repeat_interleave(torch.arange(len(ids)), counts)
    return starts[owner] + torch.arange(int(counts.sum())) - first[owner], counts


class FlatGraphs:
    """Cuts batches of graphs out of an ``InMemoryDataset``'s concatenated tensors.

    Every attribute is stored concatenated along dim 0 (``edge_index`` along dim 1, with node ids
    local to their graph, as ``InMemoryDataset.collate`` keeps them); a batch takes each graph's rows
    in order and shifts ``edge_index`` by the nodes before the graph, as ``Batch.from_data_list`` does.
    """

    def __init__(self, dataset) -> None:
        data, slices = dataset._data, dataset.slices
        if slices is None or "x" not in slices or "edge_index" not in slices:
            raise ConfigError("dataset", "FlatGraphs needs an InMemoryDataset with x and edge_index",
                              "load the graphs with exec.hap.data.load_tu")
        self.keys = list(slices)
        self.tensors = {key: data[key] for key in self.keys}
        self.slices = dict(slices)
        # attributes with one row per graph (the label y): a batch's rows are its graph ids
        self.per_graph = {key for key, ptr in self.slices.items()
                          if key != "edge_index" and torch.equal(ptr, torch.arange(len(ptr)))}

    def batch(self, ids: Sequence[int] | Tensor):
        """The ``torch_geometric.data.Batch`` of graphs ``ids`` (ids into the whole dataset)."""
        from torch_geometric.data import Batch

        ids = torch.as_tensor(ids, dtype=torch.long)
        nodes, node_counts = _ranges(self.slices["x"], ids)
        values = {}
        for key in self.keys:
            if key in self.per_graph:
                values[key] = self.tensors[key][ids]
                continue
            rows, counts = (nodes, node_counts) if key == "x" else _ranges(self.slices[key], ids)
            if key == "edge_index":
                offset = torch.cumsum(node_counts, 0) - node_counts
                values[key] = self.tensors[key][:, rows] + torch.repeat_interleave(offset, counts)
            else:
                values[key] = self.tensors[key][rows]
        graphs = len(ids)
        values["batch"] = torch.repeat_interleave(torch.arange(graphs), node_counts)
        values["ptr"] = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(node_counts, 0)])
        batch = Batch(**values)
        batch._num_graphs = graphs
        return batch


def draw_loader_seed() -> None:
    """The draw of ``torch.utils.data.DataLoader.__iter__`` (its workers' base seed) on the global RNG."""
    torch.empty((), dtype=torch.int64).random_()


class GraphLoader:
    """Iterates batches of ``FlatGraphs`` like a ``DataLoader`` over ``dataset[index]``.

    ``batches`` yields lists of positions into ``index`` (a batch sampler, re-iterated every epoch);
    with ``fixed`` the batches are built on the first pass and reused (evaluation: same graphs, same
    order every epoch).
    """

    def __init__(self, graphs: FlatGraphs, index: Tensor, batches: Iterable[list[int]], fixed: bool) -> None:
        self.graphs, self.index, self.batches, self.fixed = graphs, torch.as_tensor(index), batches, fixed
        self._built: list | None = None

    def __iter__(self) -> Iterator:
        draw_loader_seed()
        if self._built is not None:
            return iter(self._built)
        built = [self.graphs.batch(self.index[torch.as_tensor(b, dtype=torch.long)]) for b in self.batches]
        if self.fixed:
            self._built = built
        return iter(built)
