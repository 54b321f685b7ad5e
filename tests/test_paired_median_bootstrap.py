"""The paired bootstrap docs/accuracy.md section 13 judges "beyond noise" with."""

from __future__ import annotations

import numpy as np
import pytest

from tests.script_module import load_script

boot = load_script("scripts/paired_median_bootstrap.py")


def test_equal_runs_differ_by_nothing_and_a_shift_is_seen() -> None:
    errors = np.random.default_rng(1).uniform(0.0, 0.3, 500)
    assert boot.paired_median_difference(errors, errors, 200, 0) == (0.0, 0.0)
    lo, hi = boot.paired_median_difference(errors, errors + 0.01, 200, 0)
    assert (lo, hi) == (pytest.approx(0.01), pytest.approx(0.01))  # every row 1 point worse: exactly that
    noisy = errors + np.random.default_rng(2).normal(0.0, 0.05, 500)
    lo, hi = boot.paired_median_difference(errors, noisy, 200, 0)
    assert lo < 0.0 < hi  # unbiased noise: no difference
