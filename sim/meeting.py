"""The expected wait at a meeting point of ranks whose compute times vary (issue 12, sixth session).

A collective (a gradient bucket's all-reduce, an embedding all-to-all) starts only once every
member has arrived. The simulator's compute has no variance, so the members of a group arrive
together and it charges no wait. In a run each rank's compute since the ranks last met takes a
random time; the collective starts at the *latest* arrival, whose expectation over n ranks with
independent normal arrival times of mean mu and standard deviation sigma is mu + e_n sigma, with e_n
the expected maximum of n standard normals (e_2 = 1/sqrt(pi) = 0.564, e_4 = 1.029, e_8 = 1.424).

sigma comes from the profile (never from a validation run): each layer's spread is its timed
rounds' interquartile range over their median (``exec.profiler``, ``*_spread``), and a normal's
interquartile range is 1.349 sigma, so a layer phase's standard deviation is its median time x
spread / 1.349 (``LayerCosts.*_sd_s``, ``sim.bundle_costs``). Layers and micro-batches are taken as
independent: the variance of a rank's compute between two meetings is the sum of its phases'
variances. A cost model without spreads (the analytic models) has zero variance, so no wait.

The engine (``sim.engine``, ``EngineOptions.meeting_waits``) and the fast estimate
(``sim.estimate``) both take the wait from here: ``instruction_variance`` per compute instruction,
``lateness_s`` at a meeting.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from sim.costs import LayerCosts
from sim.program import Kind

# A normal's interquartile range in standard deviations: 2 x the 75th percentile, 2 x 0.6745.
IQR_PER_SD = 1.3489795003921634


def sd_from_spread(median_s: object, spread: object) -> float:
    """The standard deviation of a timed quantity whose profile gives its median and its spread
    (interquartile range / median); 0 where the spread is unknown (None, NA, NaN) or not finite."""
    try:
        median_s, spread = float(median_s), float(spread)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    if not (math.isfinite(spread) and math.isfinite(median_s)) or spread <= 0 or median_s <= 0:
        return 0.0
    return median_s * spread / IQR_PER_SD


@lru_cache(maxsize=256)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals]: the integral of x n phi(x) Phi(x)^(n-1), by the
    trapezoidal rule on [-12, 12] (exact to ~1e-9; e_1 = 0, e_2 = 1/sqrt(pi))."""
    if n <= 1:
        return 0.0
    steps, lo, hi = 24_000, -12.0, 12.0
    h = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * h
        pdf = math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        cdf = 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))
        term = x * n * pdf * cdf ** (n - 1)
        total += term * (0.5 if i in (0, steps) else 1.0)
    return total * h


def lateness_s(variance_s2: float, members: int) -> float:
    """Expected seconds from a member's mean arrival to the last member's arrival at a meeting of
    ``members`` ranks, each arriving after compute of variance ``variance_s2`` since they last met."""
    if variance_s2 <= 0 or members <= 1:
        return 0.0
    return expected_max_normal(members) * math.sqrt(variance_s2)


def phase_variance(kind: Kind, c: LayerCosts, whole_backward_in_w: bool = False) -> float:
    """Variance (s^2) of one layer's share of a compute instruction of ``kind``, as the engine
    prices it (``whole_backward_in_w``: a first stage's split backward does all its work in W)."""
    if kind is Kind.FWD:
        return c.fwd_sd_s ** 2
    if kind is Kind.RECOMPUTE:
        return c.recompute_sd_s ** 2
    if kind is Kind.BWD:
        return c.bwd_sd_s ** 2
    if kind is Kind.BWD_I:
        return 0.0 if whole_backward_in_w else c.bwd_input_sd_s ** 2
    if kind is Kind.BWD_W:
        return c.bwd_sd_s ** 2 if whole_backward_in_w else c.bwd_weight_sd_s ** 2
    return 0.0  # the optimizer step: its time is priced per byte, no spread is measured for it


def instruction_variance(kind: Kind, layers: Sequence[LayerCosts], whole_backward_in_w: bool = False) -> float:
    """Variance of a compute instruction over ``layers`` (independent layers: the sum)."""
    return sum(phase_variance(kind, c, whole_backward_in_w) for c in layers)
