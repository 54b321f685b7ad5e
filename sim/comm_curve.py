"""A collective's measured time against its size: the benchmark's samples, interpolated (issue 12).

``exec.commbench`` times each primitive at a few sizes (median over repeats) and fits
``alpha + bytes / bandwidth``. One line does not describe every link: a ``tbf``-shaped link
(scripts/netns_lib.sh, 100 Mbit/s with a 256 KB burst) lets small messages through at line speed
and the rest at the rate, so the fitted line is 1.6-6x too slow for the 5-135 KB all-to-alls and
1.6x too fast for the 3.5-17.9 MB ones (runs/netns-embedding-7, docs/embrace.md). Where the samples
exist, ``sim.comm.ClusterComm`` prices a collective from this curve instead of the line:

- **between two samples**, the straight line through them (linear in bytes): each segment is an
  alpha-beta line of its own, exact for a link that is alpha-beta piecewise (a token bucket is:
  burst, then rate). The samples are spaced geometrically (``analysis.validation.comm.sweep_sizes``),
  so the segments are even in log size; interpolating the time linearly in log size instead would
  overstate a plain alpha-beta link by up to 37% mid-segment (sizes 5x apart);
- **monotone**: a larger message never costs less than a smaller one. Medians that fall with size
  (scheduler noise at the small sizes on a shared machine) are pooled to their mean (pool adjacent
  violators), so the curve is exact at every sample of a non-decreasing series;
- **beyond the samples**, the fitted line's bandwidth from the end sample (above: the samples end
  at twice the plans' largest message, so this is a what-if's size); below the smallest sample
  (the ids' few-byte counts all-to-all), the same slope down to the fitted latency, never below it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def pooled_monotone(times: np.ndarray) -> np.ndarray:
    """The non-decreasing series nearest ``times`` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled block
    for t in times:
        blocks.append([float(t), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return np.concatenate([np.full(int(count), total / count) for total, count in blocks])


@dataclass(frozen=True)
class MeasuredCurve:
    """Seconds of a collective of ``nbytes`` from samples (sizes ascending) and the fitted line."""

    sizes: tuple[float, ...]
    times: tuple[float, ...]  # pooled to be non-decreasing
    alpha_s: float
    bandwidth_Bps: float

    @classmethod
    def from_samples(cls, sizes: np.ndarray, times: np.ndarray, alpha_s: float,
                     bandwidth_Bps: float) -> MeasuredCurve | None:
        """None when fewer than two distinct sizes were measured (nothing to interpolate)."""
        order = np.argsort(sizes, kind="stable")
        sizes, times = np.asarray(sizes, dtype=float)[order], np.asarray(times, dtype=float)[order]
        unique = np.unique(sizes)
        if len(unique) < 2:
            return None
        # one median per size (a benchmark folder measures each size once; merged ones may not)
        times = np.array([float(np.median(times[sizes == s])) for s in unique])
        return cls(tuple(unique.tolist()), tuple(pooled_monotone(times).tolist()), float(alpha_s),
                   float(bandwidth_Bps))

    def seconds(self, nbytes: float) -> float:
        sizes, times = self.sizes, self.times
        if nbytes > sizes[-1]:
            return times[-1] + (nbytes - sizes[-1]) / self.bandwidth_Bps
        if nbytes < sizes[0]:
            floor = min(self.alpha_s, times[0])
            return max(times[0] - (sizes[0] - nbytes) / self.bandwidth_Bps, floor)
        return float(np.interp(nbytes, sizes, times))
