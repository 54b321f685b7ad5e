"""Branch and bound for the plan search: estimate only the plans that can be among the best.

The search hands the engine the estimate's best ``top_k`` plans and builds optimising memory policies
for the first ``refine_shapes`` plan shapes of the estimate's order (``sim.search``). Both depend only
on the plans whose estimated time is at most a threshold T: the larger of the ``top_k``-th best time
and the time at which the ``refine_shapes``-th distinct plan shape appears. Any set of estimated
plans gives an upper bound of T (its own such times: a subset reaches K plans, and R shapes, no
earlier), so the threshold taken from the plans estimated so far is safe to prune with, and it only
falls as more are estimated.

Every plan has a lower bound of its estimate (``sim.estimate.pipeline_lower_bound``): per group of
plans sharing micro-batch, schedule, chunks and partition from the layers' raw costs
(``Estimator.group_bound``), per plan from its stages (``Estimator.screen``, which also gives the
estimate's exact peak memory, so a plan that does not fit is dropped before its time is bounded).
Groups are taken in order of their bound; a group whose bound is above the threshold, and every
later one, is not expanded; in an expanded group a plan whose bound is above it is not estimated.
Every plan whose estimate is at most T is therefore estimated, and the best ``top_k`` (ties in
enumeration order, ``Ranked.order``) and the first ``refine_shapes`` shapes are those of the
exhaustive search (``tests/test_search_bound.py`` compares the two).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sim.search import PlanGroup, Ranked, _ShapePlans

# A bound and an estimate sum the same seconds in different orders; a plan is pruned only when its bound
# exceeds the threshold by more than this relative margin (float rounding is ~1e-16 per operation).
MARGIN = 1e-9
BOUNDED = "lower bound above the best plans' estimates (not estimated: sim.search_bound)"


def beyond(bound: float, limit: float) -> bool:
    """Whether a plan with this lower bound cannot reach ``limit`` (seconds)."""
    return bound > limit * (1 + MARGIN)


class Cutoff:
    """The threshold T from the plans estimated so far: the larger of the ``top_k``-th best estimate and
    the best estimate of the ``shapes``-th best plan shape (shape: the plan less its memory policy);
    infinite until both are known."""

    def __init__(self, top_k: int, shapes: int, shape_of: Callable[[Any], Any]) -> None:
        self.top_k, self.shapes, self.shape_of = top_k, shapes, shape_of
        self._best: list[float] = []  # the top_k smallest times, negated (a max-heap)
        self._shape_best: dict[Any, float] = {}
        self.limit = math.inf

    def add(self, ranked: Iterable[Ranked]) -> None:
        for r in ranked:
            t = r.estimate.iteration_s
            if len(self._best) < self.top_k:
                heapq.heappush(self._best, -t)
            elif self.top_k and -self._best[0] > t:
                heapq.heapreplace(self._best, -t)
            key = self.shape_of(r.candidate)
            if t < self._shape_best.get(key, math.inf):
                self._shape_best[key] = t
        kth = -self._best[0] if len(self._best) == self.top_k and self.top_k else (math.inf if self.top_k else 0.0)
        shape_th = 0.0
        if self.shapes:
            firsts = heapq.nsmallest(self.shapes, self._shape_best.values())
            shape_th = firsts[-1] if len(firsts) == self.shapes else math.inf
        self.limit = max(kth, shape_th)


def best_first(groups: Sequence[PlanGroup], cutoff: Cutoff,
               expand: Callable[[PlanGroup, float], _ShapePlans]) -> tuple[Counter, list[Ranked], int]:
    """Expand ``groups`` in order of their bound, each with the threshold as it stands, until the next
    group's bound is beyond it. Returns the prune counts (``BOUNDED`` for the groups left), the
    estimated plans and how many groups were expanded.

    One process: the threshold falls after every group, and the caches (stages, unit runs, memory
    policies) serve every group; two worker processes took 1.6x the wall time of one on the GPT-175B
    space (each rebuilds the caches, and a group started early runs with an older threshold)."""
    ordered = sorted(groups, key=lambda g: (g.bound, g.order))
    pruned: Counter = Counter()
    survivors: list[Ranked] = []
    taken = 0
    while taken < len(ordered) and not beyond(ordered[taken].bound, cutoff.limit):
        part = expand(ordered[taken], cutoff.limit)
        taken += 1
        pruned.update(part.pruned)
        survivors += part.survivors
        cutoff.add(part.survivors)
    for group in ordered[taken:]:
        pruned[BOUNDED] += group.leaves
    return pruned, survivors, taken
