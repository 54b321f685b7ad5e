"""EdgePooling with its greedy edge matching computed in rounds of tensor operations.

torch_geometric's ``EdgePooling._merge_edges`` (2.8.1) visits the edges one by one in order of
decreasing score, in Python, and keeps an edge when neither end is matched yet. On ENZYMES and
PROTEINS that loop was two thirds of the ``edge`` baseline's time and the largest single cost of
the HAP protocol (docs/hap.md, "Speed").

The matching it computes is the greedy matching for a strict order of the edges (the argsort's
order, ties included, so the same permutation is used here). That matching is also what the
"locally dominant edge" rounds give (Preis, STACS 1999; Hoepman 2004): an unmatched edge whose
rank is the best among the live edges at both its ends is picked by the greedy visit too, because
every edge visited before it touches neither end. Each round picks every such edge at once, then
drops the edges that touch a matched node; the rounds stop when no edge is live. The clusters are
then numbered as the one-by-one visit numbers them (picked edges in visiting order, then the
unmatched nodes in node order), so the pooled graph is the same, not merely isomorphic.
``tests/test_hap.py`` checks the equality against the library's own loop.
"""

from __future__ import annotations

import torch
from torch import Tensor


def greedy_matching(edge_index: Tensor, order: Tensor, num_nodes: int) -> Tensor:
    """Ids of the edges the one-by-one greedy visit of ``order`` keeps, in visiting order."""
    count = order.numel()
    rank = torch.empty_like(order)
    rank[order] = torch.arange(count, device=order.device)
    source, target = edge_index
    live = torch.ones(count, dtype=torch.bool, device=order.device)
    free = torch.ones(num_nodes, dtype=torch.bool, device=order.device)
    picked = []
    while bool(live.any()):
        live_rank = torch.where(live, rank, count)  # dead edges rank behind every live one
        best = torch.full((num_nodes,), count, dtype=rank.dtype, device=rank.device)
        best = best.scatter_reduce(0, source, live_rank, "amin").scatter_reduce(0, target, live_rank, "amin")
        chosen = live & (best[source] == rank) & (best[target] == rank)
        picked.append(chosen.nonzero().view(-1))
        free[source[chosen]] = False
        free[target[chosen]] = False
        live = live & free[source] & free[target]
    if not picked:
        return order.new_empty(0)
    ids = torch.cat(picked)
    return ids[torch.argsort(rank[ids])]


def make_edge_pooling(channels: int):
    """``EdgePooling(channels)`` whose matching runs as tensor rounds (same outputs, same gradients)."""
    from torch_geometric.nn import EdgePooling
    from torch_geometric.nn.pool.edge_pool import UnpoolInfo
    from torch_geometric.utils import coalesce, scatter

    class RoundsEdgePooling(EdgePooling):
        def _merge_edges(self, x: Tensor, edge_index: Tensor, batch: Tensor, edge_score: Tensor):
            order = torch.argsort(edge_score, descending=True)  # the library's call: the same order
            picked = greedy_matching(edge_index, order, x.size(0))
            pairs = picked.numel()
            cluster = torch.empty_like(batch)
            ids = torch.arange(pairs, device=x.device)
            cluster[edge_index[1, picked]] = ids
            cluster[edge_index[0, picked]] = ids
            unmatched = torch.ones(x.size(0), dtype=torch.bool, device=x.device)
            unmatched[edge_index[:, picked].reshape(-1)] = False
            singles = int(unmatched.sum())
            cluster[unmatched] = torch.arange(pairs, pairs + singles, device=x.device)
            size = pairs + singles
            score = edge_score[picked]
            if singles:  # a kept node's features pass with weight 1
                score = torch.cat([score, x.new_ones(singles)])
            new_x = scatter(x, cluster, dim=0, dim_size=size, reduce="sum") * score.view(-1, 1)
            new_edge_index = coalesce(cluster[edge_index], num_nodes=size)
            new_batch = batch.new_empty(size).scatter_(0, cluster, batch)
            info = UnpoolInfo(edge_index=edge_index, cluster=cluster, batch=batch, new_edge_score=score)
            return new_x, new_edge_index, new_batch, info

    return RoundsEdgePooling(channels)
