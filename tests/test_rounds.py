"""Interleaved rounds (analysis.rounds): the orders, the paired statistics on per-round figures
whose answer is known, and their record; no timing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from analysis.rounds import (
    ORDER_FILE,
    ROUNDS_FILE,
    collect,
    main,
    paired_ranking,
    per_round_medians,
    round_orders,
    sign_interval,
)
from traces.errors import ConfigError
from traces.runrecord import RunRecord, write_run_record
from traces.schema import INSTRUCTION_TABLE
from traces.tables import empty_table

METHODS = ["dense", "embrace-2d", "embrace-seq", "ps"]


def test_every_round_is_a_permutation_drawn_afresh_and_reproducible_by_seed() -> None:
    orders = round_orders(METHODS, 12, seed=3)
    assert len(orders) == 12 and all(sorted(o) == sorted(METHODS) for o in orders)
    assert len({tuple(o) for o in orders}) > 1  # not one order repeated (24 permutations, 12 draws)
    assert orders == round_orders(METHODS, 12, seed=3)
    assert orders != round_orders(METHODS, 12, seed=4)
    # no seed: the given order every round (R = 1 is the suite as it was)
    assert round_orders(METHODS, 1) == [METHODS] and round_orders(METHODS, 3) == [METHODS] * 3
    with pytest.raises(ConfigError) as error:
        round_orders(METHODS, 0)
    assert error.value.field == "--rounds"
    with pytest.raises(ConfigError):
        round_orders(["a", "a"], 2, seed=1)


def test_the_sign_test_interval_has_its_exact_order_statistics_and_coverage() -> None:
    values = list(range(10, 0, -1))  # 1..10, unsorted
    low, high, coverage = sign_interval(values)
    # n = 10: P(B <= 1) = 11/1024 <= 0.025 < P(B <= 2) = 56/1024, so k = 2: x_(2), x_(9)
    assert (low, high) == (2.0, 9.0) and coverage == pytest.approx(1 - 2 * 11 / 1024)
    # n = 5: even the extremes cover only 1 - 2/32 = 93.75% < 95%
    low, high, coverage = sign_interval([5, 1, 4, 2, 3])
    assert (low, high) == (1.0, 5.0) and coverage == pytest.approx(0.9375)
    low, high, coverage = sign_interval(list(range(1, 7)))  # n = 6: the extremes, 1 - 2/64
    assert (low, high) == (1.0, 6.0) and coverage == pytest.approx(1 - 2 / 64)


def drifting_rounds(rounds: int, drift: float, gaps: dict[str, float], noise: float, seed: int) -> dict[str, list]:
    """Per-round medians: every method of round r scaled by the round's own factor (uniform within
    +-drift), method m by its gap, each figure by an independent +-noise."""
    rng = np.random.default_rng(seed)
    factors = rng.uniform(1 - drift, 1 + drift, rounds)
    return {m: list(0.1 * (1 + g) * factors * rng.uniform(1 - noise, 1 + noise, rounds)) for m, g in gaps.items()}


def test_a_method_slower_in_every_round_is_resolved_though_the_rounds_drift_30_percent() -> None:
    per_round = drifting_rounds(10, 0.30, {"fast": 0.0, "slow": 0.10, "twin": 0.0}, noise=0.01, seed=1)
    ranking = paired_ranking(per_round, {"fast": 1.0, "slow": 2.0, "twin": 1.5})
    slow = next(p for p in ranking.pairs if {p.faster, p.slower} == {"fast", "slow"})
    assert (slow.faster, slow.slower) == ("fast", "slow") and slow.slower_in == 10
    assert slow.resolved and slow.predicted_same_order
    assert 1.07 < slow.low <= slow.ratio <= slow.high < 1.13
    assert next(p for p in ranking.pairs if {p.faster, p.slower} == {"twin", "slow"}).resolved
    # the drift is 30%: unpaired, the two methods' intervals over rounds overlap widely
    assert ranking.intervals_s["slow"][0] < ranking.intervals_s["fast"][1]
    # two methods with no difference but the noise are not resolved
    twins = next(p for p in ranking.pairs if {p.faster, p.slower} == {"fast", "twin"})
    assert not twins.resolved and twins.low <= 1 <= twins.high
    # the prediction is only asked about resolved pairs, and a reversed one is counted discordant
    reversed_ = paired_ranking(per_round, {"fast": 2.0, "slow": 1.0, "twin": 1.5}).to_dict()
    assert reversed_["resolved"] == 2 and "fast < slow" in reversed_["discordant"]


def test_five_rounds_resolve_nothing_at_95_percent_whatever_they_say() -> None:
    per_round = drifting_rounds(5, 0.30, {"fast": 0.0, "slow": 0.5}, noise=0.0, seed=2)
    pair = paired_ranking(per_round, {"fast": 1.0, "slow": 2.0}).pairs[0]
    assert pair.slower_in == 5 and pair.low > 1 and pair.coverage < 0.95 and not pair.resolved


def test_per_round_figures_are_block_medians_and_rounds_must_align() -> None:
    assert per_round_medians({"a": [[3.0, 1.0, 2.0], [5.0]]}) == {"a": [2.0, 5.0]}
    with pytest.raises(ConfigError):
        per_round_medians({"a": [[1.0], [2.0]], "b": [[1.0]]})
    with pytest.raises(ConfigError) as error:
        paired_ranking({"a": [1.0], "b": [2.0]}, {"a": 1.0})
    assert error.value.field == "predicted"


def write_run(run: Path, times: list[float]) -> None:
    """A run record as exec.runtime writes it: per rank, per measured iteration, its seconds."""
    summary = {"iteration_s": {"0": times, "1": [t * 0.99 for t in times]}, "peak_memory": {"0": 1, "1": 1},
               "warmup": 1}
    write_run_record(RunRecord(empty_table(INSTRUCTION_TABLE), summary), run / "record", chrome=False)


def test_a_shaped_network_folder_records_its_orders_times_and_paired_ranking(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "1gbit"
    folder.mkdir()  # the plans' folder, as netns_validate_plans passes it
    methods = ["dense", "ps"]
    main(["orders", str(folder), *methods, "--rounds", "6", "--seed", "5", "--iterations", "3"])
    printed = capsys.readouterr().out.split("\n")[:6]
    spec = json.loads((folder / ORDER_FILE).read_text())
    assert spec["orders"] == round_orders(methods, 6, 5) == [line.split() for line in printed]
    for m, scale in {"dense": 1.2, "ps": 1.0}.items():
        (folder / m / "report").mkdir(parents=True)
        (folder / m / "report" / "report.json").write_text(json.dumps({"iteration": {"predicted_s": scale}}))
        for r in range(6):
            run = folder / m / "run" if r == 0 else folder / m / "rounds" / f"r{r}" / "run"
            write_run(run, [scale * (1 + 0.2 * r) * t for t in (0.10, 0.11, 0.12)])  # every round drifts
    record = collect(folder)
    stored = json.loads((folder / ROUNDS_FILE).read_text())
    assert stored == json.loads(json.dumps(record))
    assert stored["seed"] == 5 and stored["orders"] == spec["orders"] and stored["iterations"] == 3
    assert stored["times_s"]["ps"][2] == pytest.approx([0.14, 0.154, 0.168])  # the slower rank's
    assert stored["ranking"]["resolved"] == 1 and stored["ranking"]["concordant"] == 1
    pair = stored["ranking"]["all_pairs"][0]
    assert (pair["faster"], pair["slower"]) == ("ps", "dense") and pair["ratio"] == pytest.approx(1.2)
    main(["show", str(tmp_path)])
    assert "ps < dense | 1.200" in capsys.readouterr().out
