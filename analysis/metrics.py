"""Rank agreement of predictions with measurements, and how to say it for a small table.

A Spearman correlation of 1.000 on three rows is one of 3! = 6 possible orders coming out right: a
random guess does that one time in six. ``spearman_text`` therefore names the row count, and for up to
``SMALL_TABLE_ROWS`` rows the number of possible orders, next to the value; below three rows it gives
no value at all (two rows have only two orders, and one or none has no order to check).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from sim.estimate import spearman as estimate_spearman
from traces.errors import ConfigError

# Rank correlation needs at least this many rows to be reported (with two, it is +1 or -1 by construction).
MIN_SPEARMAN_ROWS = 3
# Up to this many rows the text names the number of possible orders (6! = 720); beyond it the count
# is so large that a high correlation is meaningful and the number adds nothing.
SMALL_TABLE_ROWS = 6


def spearman(predicted: Sequence[float] | np.ndarray, reported: Sequence[float] | np.ndarray) -> float:
    """Spearman's rank correlation of predicted vs reported (``sim.estimate.spearman``, the search's own):
    nan below ``MIN_SPEARMAN_ROWS`` rows or when either side is constant (no order to compare)."""
    predicted, reported = _paired(predicted, reported)
    return estimate_spearman(predicted.tolist(), reported.tolist())


def spearman_text(predicted: Sequence[float] | np.ndarray, reported: Sequence[float] | np.ndarray) -> str:
    """E.g. "Spearman 0.982 (10 rows)", "Spearman 1.000 (3 rows, 6 orders)", "Spearman – (2 rows)"."""
    rho = spearman(predicted, reported)
    rows = len(predicted)
    detail = f"{rows} rows"
    if MIN_SPEARMAN_ROWS <= rows <= SMALL_TABLE_ROWS:
        detail += f", {math.factorial(rows)} orders"
    return f"Spearman {rho_text(rho)} ({detail})"


def rho_text(rho: float) -> str:
    """A rank correlation as printed: three decimals, or "–" where it is undefined (fewer than two rows,
    or one side tied throughout), never "nan"."""
    return "–" if math.isnan(rho) else f"{rho:.3f}"


def _paired(predicted: Sequence[float] | np.ndarray,
            reported: Sequence[float] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    predicted, reported = np.asarray(predicted, dtype=float), np.asarray(reported, dtype=float)
    if predicted.shape != reported.shape or predicted.ndim != 1:
        raise ConfigError("predicted", f"{predicted.size} predictions for {reported.size} reported values",
                          "pass one prediction per reported row")
    return predicted, reported
