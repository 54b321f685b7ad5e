"""Unit checks of the simulator's building blocks against hand-computed answers."""

from __future__ import annotations

import pytest
import simpy

from sim.channel import SharedChannel
from sim.partition import balanced_partition, check_partition, uniform_partition
from sim.tp_overlap import tp_segments_time
from traces.errors import ConfigError


def test_uniform_partition_gives_remainder_to_first_stages() -> None:
    assert uniform_partition(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_balanced_partition_minimises_heaviest_stage() -> None:
    weights = [1, 1, 1, 1, 8, 1, 1, 1, 1]
    ranges = balanced_partition(weights, 3)
    sums = [sum(weights[a:b]) for a, b in ranges]
    assert max(sums) == 8  # the heavy layer alone; nothing better exists
    assert ranges[0][0] == 0 and ranges[-1][1] == len(weights)


@pytest.mark.parametrize(
    ("ranges", "field", "fragment"),
    [
        ([[0, 3], [4, 6]], "partition[1]", "gap"),
        ([[0, 3], [2, 6]], "partition[1]", "overlaps"),
        ([[0, 3], [3, 5]], "partition", "covers layers 0..5"),
        ([[0, 6]], "partition", "has 1 stages"),
    ],
)
def test_bad_partitions_name_the_stage(ranges: list[list[int]], field: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as error:
        check_partition(ranges, 6, 2)
    assert error.value.field == field
    assert fragment in str(error.value)


def test_tp_overlap_levels() -> None:
    layer = [(4.0, 2.0, 2)]  # 4 s compute, 2 s of all-reduce, in two pieces
    assert tp_segments_time(layer, 0) == [6.0]
    # Level 1, per piece (2, 1): halves 1 + max(1, 0.5) + 0.5 = 2.5; two pieces = 5.
    assert tp_segments_time(layer, 1) == [5.0]
    # Level 2 chains the pieces: compute 4 s is never idle after the first half's all-reduce
    # (0.5 s each) is hidden, so only the last all-reduce half (0.5 s) sticks out: 4.5 s.
    assert tp_segments_time(layer, 2) == [4.5]
    two = [(4.0, 2.0, 2), (4.0, 2.0, 2)]
    level3 = tp_segments_time(two, 3)
    assert sum(level3) == pytest.approx(8.5)
    assert sum(tp_segments_time(two, 2)) == pytest.approx(9.0)


def test_tp_overlap_cannot_beat_the_busier_resource() -> None:
    layers = [(1.0, 3.0, 2), (2.0, 5.0, 2)]
    for level in range(4):
        assert sum(tp_segments_time(layers, level)) >= 8.0 - 1e-12  # comm is the bottleneck


def test_shared_channel_splits_bandwidth_fairly() -> None:
    env = simpy.Environment()
    channel = SharedChannel(env, bandwidth_Bps=100.0)
    finished: dict[str, float] = {}

    def send(name: str, start: float, nbytes: float):
        yield env.timeout(start)
        yield channel.transfer(nbytes)
        finished[name] = env.now

    env.process(send("a", 0.0, 100.0))
    env.process(send("b", 0.5, 100.0))
    env.run()
    # a alone for 0.5 s (50 B), then both at 50 B/s: a ends at 1.5 s; b has 50 B left at 100 B/s.
    assert finished["a"] == pytest.approx(1.5)
    assert finished["b"] == pytest.approx(2.0)
