"""Is the method ranking preserved where the measurement can tell (issue 12)?

A rank correlation over every plan counts pairs whose measured medians lie within each other's
noise: their measured order is a coin toss, and so is whether the prediction agrees with it. This
module decides, from the measured per-iteration times alone, which pairs of plans the measurement
orders, and only then asks the prediction about those pairs.

The rule (``rank_pairs``):

- Each plan's measured median gets a percentile bootstrap interval: ``BOOTSTRAP_DRAWS`` resamples of
  its iteration times with replacement, the median of each, the (1 - level) / 2 and (1 + level) / 2
  quantiles of those medians. Bootstrap rather than the exact order-statistic interval because the
  difference of two medians, which is what decides a pair, has no exact distribution-free interval
  of its own; the bootstrap gives the per-plan and the pairwise interval from the same draws.
- A pair (a, b) is *resolved* when the percentile interval of median(a) - median(b), over the
  independent bootstrap medians of a and of b (draw i of a against draw i of b), excludes 0. Level
  ``LEVEL`` per pair; no correction for the number of pairs (6 for 4 plans, 78 for 13): a reader
  who wants a family-wise level reads the interval bounds, which are reported.
- A plan measured over fewer than ``MIN_ITERATIONS`` iterations resolves no pair (its interval is
  still given).
- A resolved pair is *concordant* when the prediction orders it the same way (strictly: a predicted
  tie is discordant); the discordant ones are listed.

The prediction is never read to decide what is resolved. Each plan's draws come from a generator
seeded by ``SEED`` and the plan's times themselves, so a plan's interval depends on its measurement
only: not on which other plans are in the table, in what order, or what the plan is called.

Assumptions: iterations are treated as independent draws of one distribution. They are not quite
(the load of a shared machine drifts within a run, a slow iteration may follow a slow one), so the
intervals are too narrow when the drift is large; ``analysis.validation_suite`` reports the
profile drift beside them for that reason.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from traces.errors import ConfigError

LEVEL = 0.95
BOOTSTRAP_DRAWS = 10_000
SEED = 12  # fixed so that a stored run summarises to the same figures every time
# Below this many measured iterations a plan resolves no pair: two samples of one normal
# distribution resolved in 10% (3 iterations) and 7% (4) of 400 pairs at 95% nominal, 3.5-6% from
# 5 to 20 (docs/validation.md); a percentile bootstrap of a median of 3 or 4 values is too coarse.
MIN_ITERATIONS = 5


@dataclass(frozen=True)
class PairOrder:
    """One pair, ``faster`` the plan with the smaller measured median."""

    faster: str
    slower: str
    difference_s: float  # median(slower) - median(faster), >= 0
    low_s: float  # the interval of that difference
    high_s: float
    resolved: bool  # the interval excludes 0
    predicted_same_order: bool  # predicted(faster) < predicted(slower)


@dataclass(frozen=True)
class Ranking:
    level: float
    draws: int
    seed: int
    intervals: dict[str, tuple[float, float]]  # plan -> the interval of its measured median (s)
    pairs: list[PairOrder]

    @property
    def resolved(self) -> list[PairOrder]:
        return [p for p in self.pairs if p.resolved]

    @property
    def concordant(self) -> list[PairOrder]:
        return [p for p in self.resolved if p.predicted_same_order]

    @property
    def discordant(self) -> list[PairOrder]:
        return [p for p in self.resolved if not p.predicted_same_order]

    def to_dict(self) -> dict:
        return {"level": self.level, "draws": self.draws, "seed": self.seed,
                "rule": "percentile bootstrap interval of the difference of medians excludes 0, "
                        f"both plans measured over at least {MIN_ITERATIONS} iterations",
                "pairs": len(self.pairs), "resolved": len(self.resolved), "concordant": len(self.concordant),
                "discordant": [f"{p.faster} < {p.slower}" for p in self.discordant],
                "median_intervals_s": {k: list(v) for k, v in self.intervals.items()},
                "all_pairs": [asdict(p) for p in self.pairs]}

    def sentence(self) -> str:
        return describe(self.to_dict())


def describe(ranking: Mapping) -> str:
    """One line for a report from ``Ranking.to_dict()`` (as stored in suite.json): the counts and
    the discordant pairs with their measured gaps and intervals."""
    text = (f"{ranking['resolved']} of {ranking['pairs']} pairs resolved by the measurement "
            f"({ranking['level']:.0%} percentile bootstrap interval of the difference of medians excludes 0; "
            f"{ranking['draws']} draws, seed {ranking['seed']}); the prediction orders {ranking['concordant']} "
            f"of them the same way")
    discordant = [p for p in ranking["all_pairs"] if p["resolved"] and not p["predicted_same_order"]]
    if discordant:
        text += "; discordant: " + "; ".join(
            f"{p['faster']} < {p['slower']} measured by {p['difference_s'] * 1e3:.1f} ms "
            f"[{p['low_s'] * 1e3:.1f}, {p['high_s'] * 1e3:.1f}]" for p in discordant)
    return text + "."


def bootstrap_medians(times: Sequence[float], name: str, draws: int = BOOTSTRAP_DRAWS, seed: int = SEED) -> np.ndarray:
    """``draws`` medians of resamples (with replacement) of ``times``, from a generator seeded by
    ``seed`` and the bytes of ``times`` (crc32: stable across processes, unlike ``hash``); ``name``
    only names the plan in an error."""
    values = np.asarray(times, dtype=float)
    if values.ndim != 1 or values.size == 0 or not np.isfinite(values).all():
        raise ConfigError(f"times of {name}", f"{values.size} values, or not all finite",
                          "give the run's per-iteration times (report.json: iteration.measured.times_s)")
    rng = np.random.default_rng([seed, zlib.crc32(values.tobytes())])
    picks = rng.integers(0, values.size, size=(draws, values.size))
    return np.median(values[picks], axis=1)


def rank_pairs(times: Mapping[str, Sequence[float]], predicted: Mapping[str, float], level: float = LEVEL,
               draws: int = BOOTSTRAP_DRAWS, seed: int = SEED) -> Ranking:
    """Every pair of ``times``' plans, resolved or not by their measured times alone, and whether
    ``predicted`` (plan -> predicted iteration time) orders it as measured."""
    if not 0 < level < 1:
        raise ConfigError("level", f"{level} is not a probability", "give e.g. 0.95")
    missing = sorted(set(times) - set(predicted))
    if missing:
        raise ConfigError("predicted", f"no prediction for {', '.join(missing)}", "predict every measured plan")
    tail = (1 - level) / 2
    names = sorted(times)
    medians = {n: bootstrap_medians(times[n], n, draws, seed) for n in names}
    measured = {n: float(np.median(np.asarray(times[n], dtype=float))) for n in names}
    intervals = {n: (float(np.quantile(medians[n], tail)), float(np.quantile(medians[n], 1 - tail))) for n in names}
    pairs = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            # order the pair by the measured medians; a measured tie is never resolved (the interval holds 0)
            faster, slower = (a, b) if measured[a] <= measured[b] else (b, a)
            gap = medians[slower] - medians[faster]
            low, high = float(np.quantile(gap, tail)), float(np.quantile(gap, 1 - tail))
            pairs.append(PairOrder(faster, slower, measured[slower] - measured[faster], low, high,
                                   resolved=low > 0 and min(len(times[a]), len(times[b])) >= MIN_ITERATIONS,
                                   predicted_same_order=predicted[faster] < predicted[slower]))
    return Ranking(level, draws, seed, intervals, pairs)
