"""Cutting a layer list into contiguous pipeline stages."""

from __future__ import annotations

from collections.abc import Sequence

from traces.errors import ConfigError


def uniform_partition(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Equal layer counts; the first stages take the remainder."""
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        end = start + base + (1 if stage < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def balanced_partition(weights: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Contiguous stages minimising the heaviest stage (linear partition, exact DP).

    Ties are broken towards earlier cuts, so the result is deterministic.
    """
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][i]: smallest possible heaviest stage when the first i layers form k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    ranges, end = [], n
    for k in range(num_stages, 0, -1):
        start = cut[k][end]
        ranges.append((start, end))
        end = start
    return ranges[::-1]


def check_partition(ranges: Sequence[Sequence[int]], num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """An explicit partition must give every layer to exactly one stage, in order."""
    if len(ranges) != num_stages:
        raise ConfigError("partition", f"has {len(ranges)} stages but pp x chunks = {num_stages}",
                          f"give {num_stages} [first, end) ranges")
    expected_start = 0
    for stage, (start, end) in enumerate(ranges):
        if start != expected_start:
            problem = "overlaps the previous stage" if start < expected_start else "leaves a gap before it"
            raise ConfigError(f"partition[{stage}]", f"[{start}, {end}) {problem}",
                              f"start stage {stage} at layer {expected_start}")
        expected_start = end
    if expected_start != num_layers:
        raise ConfigError("partition", f"covers layers 0..{expected_start} but the workload has {num_layers}",
                          f"end the last stage at {num_layers}")
    return [(int(a), int(b)) for a, b in ranges]
