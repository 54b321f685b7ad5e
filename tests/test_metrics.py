"""Spearman's rank correlation and its text for small tables (analysis/metrics.py)."""

from __future__ import annotations

import math

import pytest

from analysis.metrics import spearman, spearman_text
from analysis.search_report import agreement_lines
from sim.search import Agreement
from traces.errors import ConfigError


def test_a_small_table_names_its_rows_and_how_many_orders_it_could_have() -> None:
    assert spearman_text([3.0, 1.0, 2.0], [30.0, 10.0, 20.0]) == "Spearman 1.000 (3 rows, 6 orders)"
    assert spearman_text([1, 2, 3, 4], [1, 2, 4, 3]) == "Spearman 0.800 (4 rows, 24 orders)"
    assert spearman_text(range(6), range(6)).endswith("(6 rows, 720 orders)")
    # Past six rows the count adds nothing (7! = 5,040) and the text gives the rows only.
    assert spearman_text(range(7), [0, 1, 2, 3, 4, 6, 5]) == "Spearman 0.964 (7 rows)"


def test_fewer_than_three_rows_or_a_constant_side_has_no_rank_correlation() -> None:
    assert math.isnan(spearman([1.0, 2.0], [2.0, 1.0]))
    assert spearman_text([1.0, 2.0], [2.0, 1.0]) == "Spearman – (2 rows)"
    assert spearman_text([], []) == "Spearman – (0 rows)"
    assert spearman_text([5.0, 5.0, 5.0], [1.0, 2.0, 3.0]) == "Spearman – (3 rows, 6 orders)"
    assert spearman([1.0, 3.0, 2.0], [10.0, 20.0, 30.0]) == pytest.approx(0.5)


def test_unpaired_values_are_refused() -> None:
    with pytest.raises(ConfigError, match="predicted"):
        spearman_text([1.0, 2.0, 3.0], [1.0, 2.0])


def test_a_search_whose_estimates_tie_prints_no_nan() -> None:
    """The search's agreement lines (analysis.search_report): where the best plans' estimates all tie, the
    rank correlation is undefined and reads "–" (a CPU search printed "Spearman nan")."""
    tied = Agreement(sample_size=5, spearman_sample=float("nan"), spearman_top=0.5, estimate_best_engine_rank=1,
                     engine_best_estimate_rank=1, estimate_best_slowdown=0.0, top10_overlap=5,
                     memory_error_median=0.01, time_error_median=0.02)
    lines = agreement_lines(tied, top_k=5)
    assert "nan" not in " ".join(lines)
    assert lines[0].startswith("estimate vs engine: Spearman – on a random sample of 5 plans")
    assert "Spearman 0.500 within the estimate's best 5" in lines[0]
