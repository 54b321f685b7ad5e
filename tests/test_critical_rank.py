"""The rule that picks which rank's breakdown a plan reports (sim.critical_rank, docs/search.md)."""

from __future__ import annotations

import pytest

from sim.critical_rank import TIE_REL, critical_rank


def test_the_rank_that_finishes_last_is_critical() -> None:
    assert critical_rank({0: 1.0, 1: 1.5, 2: 1.2}) == 1


def test_ranks_finishing_together_give_the_lowest() -> None:
    # replicas of a pipeline rank finish together; the estimate and the engine add in another order
    latest = 0.173
    assert critical_rank({4: latest, 2: latest * (1 - TIE_REL / 2), 3: latest * (1 - 10 * TIE_REL)}) == 2
    assert critical_rank({1: latest, 0: latest * (1 - 10 * TIE_REL)}) == 1


def test_no_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="finish_s is empty"):
        critical_rank({})
