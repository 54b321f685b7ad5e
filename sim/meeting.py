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

**A systematic difference between processes** (issue 12, seventh session). Two ranks doing the
same work on the same host ran 11-36 ms apart per iteration, in streaks, against the 1-8 ms the
per-repeat spreads explain (docs/embrace.md): one process is slower at the same layers round after
round. That is not a per-repeat spread. Model each rank r's compute between two meetings as
T_r = mu + O_r + e_r: e_r the per-repeat noise, independent between layers, so its variance adds
up layer by layer (the sum above); O_r the process's own offset, the same every round, so it adds
up *linearly* over the layers and micro-batches the rank runs between meetings (a process slower
by d at each of k layers is k d late, not sqrt(k) d). Which rank of a run gets which offset is not
known in advance (the profile's processes are not the run's ranks; the slower rank changes from
run to run), so the offsets are a random effect: O_r drawn from a normal of variance tau^2, which
the profile's P co-located processes estimate as the sample variance (P - 1 in the denominator) of
their offsets summed over the same stretch of compute. O and e independent: T_r - mu is normal
with variance sigma^2 + tau^2, and the wait at the meeting is e_n sqrt(sigma^2 + tau^2). Each
process's per-layer medians come from the bundle (``process_layers``; ``LayerCosts.*_offsets_s``,
each process's median minus the merged median); ``instruction_offsets`` sums them per process
over an instruction's layers, ``offset_variance`` is tau^2 of a stretch. Bundles without the table
(every bundle profiled before it, every analytic model) give no offsets, so no change. With two
profiling processes tau^2 rests on one difference: an estimate with one degree of freedom.

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


def phase_offsets(kind: Kind, c: LayerCosts, whole_backward_in_w: bool = False) -> tuple[float, ...]:
    """Each profiling process's offset (s) of one layer's share of a compute instruction of ``kind``
    (as ``phase_variance`` prices the phase; () where the profile kept no per-process times)."""
    if kind is Kind.FWD:
        return c.fwd_offsets_s
    if kind is Kind.RECOMPUTE:
        return c.recompute_offsets_s
    if kind is Kind.BWD:
        return c.bwd_offsets_s
    if kind is Kind.BWD_I:
        return () if whole_backward_in_w else c.bwd_input_offsets_s
    if kind is Kind.BWD_W:
        return c.bwd_offsets_s if whole_backward_in_w else c.bwd_weight_offsets_s
    return ()


def add_offsets(a: Sequence[float], b: Sequence[float], times: float = 1.0) -> tuple[float, ...]:
    """``a + times x b`` per process (() is zero; processes counted differently: ``a`` kept)."""
    if not b:
        return tuple(a)
    if not a:
        return tuple(times * y for y in b)
    if len(a) != len(b):
        return tuple(a)
    return tuple(x + times * y for x, y in zip(a, b, strict=True))


def instruction_offsets(kind: Kind, layers: Sequence[LayerCosts], whole_backward_in_w: bool = False
                        ) -> tuple[float, ...]:
    """Each process's offset over an instruction's layers: the same process at every layer, so the sum."""
    total: tuple[float, ...] = ()
    for c in layers:
        total = add_offsets(total, phase_offsets(kind, c, whole_backward_in_w))
    return total


def offset_variance(offsets: Sequence[float]) -> float:
    """tau^2: the sample variance over the profiling processes of their offsets summed over a stretch
    of compute (0 with fewer than two)."""
    n = len(offsets)
    if n < 2:
        return 0.0
    mean = sum(offsets) / n
    return sum((x - mean) ** 2 for x in offsets) / (n - 1)
