"""Which rank's time breakdown a plan reports: the critical rank (docs/search.md, "The breakdown").

The estimate (``sim.estimate.Estimator._finish``) and the engine's breakdown (``sim.search.simulate_candidate``)
both report one rank's compute, recompute, bubble, gradient sync and optimizer step. Both pick it with this
rule, so that the two breakdowns are of the same rank: the rank whose finish (the end of the last thing it
does in the iteration, its optimizer step and what follows it included) sets the iteration. Ranks that
finish together (within ``TIE_REL`` of the iteration) are tied, and the lowest rank of them is taken:
a data- or tensor-parallel replica of a pipeline rank finishes with it, and the lowest global rank is the
lowest pipeline rank (``rank // (tp x dp)``), so the estimate's pipeline rank and the engine's global
rank name the same stage.

Until session 16 (issue-9v) the estimate reported its bottleneck rank's compute and its tail rank's step,
the engine its busiest rank's, and at pp > 1 the two moved time between kinds (docs/search.md).
"""

from __future__ import annotations

from collections.abc import Mapping

# Finishes this close (relative to the latest) are one finish: the estimate and the engine add the same
# seconds in another order (float rounding, about 1e-15 relative), and branch and bound uses the same
# margin for the same reason (sim.search_bound). Far below any real difference between two ranks' finishes.
TIE_REL = 1e-9


def critical_rank(finish_s: Mapping[int, float]) -> int:
    """The lowest rank whose finish is within ``TIE_REL`` of the latest one (``finish_s``: rank -> seconds)."""
    if not finish_s:
        raise ValueError("critical_rank: no rank finishes (finish_s is empty)")
    latest = max(finish_s.values())
    return min(rank for rank, end in finish_s.items() if end >= latest - TIE_REL * abs(latest))
