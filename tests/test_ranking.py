"""The ranking judged on the pairs the measurement resolves (analysis.ranking, issue 12)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from analysis.compression_validate import summary
from analysis.ranking import LEVEL, MIN_ITERATIONS, rank_pairs
from analysis.validation_suite import resummarise
from traces.errors import ConfigError

DATA = Path(__file__).parent / "data" / "ranking"


def test_well_separated_plans_resolve_and_one_distribution_does_not() -> None:
    # 40 pairs of 20 iterations each (as a suite measures), spread 10% like a quiet run here
    rng = np.random.default_rng(0)
    separated, same = 0, 0
    for _ in range(40):
        base = rng.normal(0.100, 0.010, 20)
        slower = rng.normal(0.130, 0.010, 20)  # 3 sigma of one iteration apart
        twin = rng.normal(0.100, 0.010, 20)
        separated += rank_pairs({"a": base, "b": slower}, {"a": 1.0, "b": 2.0}, draws=2000).pairs[0].resolved
        same += rank_pairs({"a": base, "b": twin}, {"a": 1.0, "b": 2.0}, draws=2000).pairs[0].resolved
    assert separated == 40
    # at 95% a pair from one distribution resolves ~5% of the time (the percentile bootstrap of a
    # median at n = 20 runs a little liberal): never more than a few of 40
    assert same <= 4


def test_too_few_iterations_resolve_nothing() -> None:
    few = {"a": [0.10, 0.11, 0.10, 0.11], "b": [0.50, 0.51, 0.50, 0.51]}  # far apart, 4 iterations each
    assert MIN_ITERATIONS > 4 and not rank_pairs(few, {"a": 1.0, "b": 2.0}).pairs[0].resolved
    enough = {k: v + v[:1] for k, v in few.items()}
    assert rank_pairs(enough, {"a": 1.0, "b": 2.0}).pairs[0].resolved


def test_a_resolved_pair_is_ordered_by_the_measurement_and_its_interval_excludes_zero() -> None:
    rng = np.random.default_rng(1)
    ranking = rank_pairs({"slow": rng.normal(0.2, 0.01, 20), "fast": rng.normal(0.1, 0.01, 20)},
                         {"slow": 1.0, "fast": 2.0})
    (pair,) = ranking.pairs
    assert (pair.faster, pair.slower) == ("fast", "slow")
    assert 0 < pair.low_s < pair.difference_s < pair.high_s
    low, high = ranking.intervals["fast"]
    assert low < 0.1 < high and ranking.level == LEVEL


def test_concordance_counts_only_resolved_pairs_and_lists_the_discordant() -> None:
    rng = np.random.default_rng(2)
    times = {name: rng.normal(mean, 0.002, 20) for name, mean in
             (("a", 0.10), ("b", 0.20), ("c", 0.30), ("d", 0.3001))}  # c, d: one distribution, in effect
    # predicted: a < b right, c < b wrong, d < a wrong, d < c (unresolved: must not count)
    ranking = rank_pairs(times, {"a": 2.0, "b": 3.0, "c": 2.5, "d": 1.0})
    resolved = {(p.faster, p.slower) for p in ranking.resolved}
    assert resolved == {("a", "b"), ("a", "c"), ("a", "d"), ("b", "c"), ("b", "d")}
    assert {(p.faster, p.slower) for p in ranking.discordant} == {("a", "d"), ("b", "c"), ("b", "d")}
    assert len(ranking.concordant) == 2
    summary_ = ranking.to_dict()
    assert (summary_["pairs"], summary_["resolved"], summary_["concordant"]) == (6, 5, 2)
    assert "a < d" in summary_["discordant"] and "discordant: " in ranking.sentence()
    # a predicted tie does not order the pair: discordant
    tie = rank_pairs({"a": times["a"], "b": times["b"]}, {"a": 1.0, "b": 1.0})
    assert len(tie.resolved) == 1 and len(tie.discordant) == 1


def test_a_plan_interval_is_fixed_by_the_seed_and_its_times_not_by_other_plans_or_its_name() -> None:
    rng = np.random.default_rng(3)
    times = {"x": rng.normal(0.1, 0.01, 20), "y": rng.normal(0.2, 0.01, 20)}
    # few draws, so that the interval moves with the draws (at 10,000 it sits on the same order statistics)
    alone = rank_pairs(times, {"x": 1.0, "y": 2.0}, draws=50).intervals["x"]
    more = rank_pairs({"z": rng.normal(0.3, 0.01, 20), **times}, {"x": 1.0, "y": 2.0, "z": 3.0},
                      draws=50).intervals["x"]
    assert alone == more
    renamed = rank_pairs({"x2": times["x"], "y": times["y"]}, {"x2": 1.0, "y": 2.0}, draws=50).intervals["x2"]
    assert renamed == alone
    others = {rank_pairs(times, {"x": 1.0, "y": 2.0}, draws=50, seed=seed).intervals["x"] for seed in range(5)}
    assert len(others) > 1  # the seed is what fixes them


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ConfigError, match="times of a"):
        rank_pairs({"a": [], "b": [0.1]}, {"a": 1.0, "b": 2.0})
    with pytest.raises(ConfigError, match="no prediction for b"):
        rank_pairs({"a": [0.1], "b": [0.1]}, {"a": 1.0})


def test_a_stored_suite_summarised_again_reads_the_kept_attempts(tmp_path: Path) -> None:
    table = resummarise(DATA / "suite-embedding-6", tmp_path)
    ranking = json.loads((tmp_path / "suite.json").read_text())["summary"]["ranking"]
    # the kept attempts' times: dense's is the retry (its first attempt had another median)
    kept = json.loads((DATA / "suite-embedding-6/plans/emb-dense-dp2-retry1/report.json").read_text())
    first = json.loads((DATA / "suite-embedding-6/plans/emb-dense-dp2/report.json").read_text())
    assert kept["iteration"]["measured"]["median_s"] != first["iteration"]["measured"]["median_s"]
    low, high = ranking["median_intervals_s"]["emb-dense-dp2"]
    assert low <= kept["iteration"]["measured"]["median_s"] <= high
    # the figures of the lead's run (docs/embrace.md): dense resolved from the three others, the
    # three within each other's noise; the prediction orders only dense < ps as measured
    assert (ranking["pairs"], ranking["resolved"], ranking["concordant"]) == (6, 3, 1)
    assert sorted(ranking["discordant"]) == ["emb-dense-dp2 < emb-embrace-2d-dp2",
                                             "emb-dense-dp2 < emb-embrace-seq-dp2"]
    text = (tmp_path / "suite.md").read_text()
    assert "Spearman rank correlation 0.400" in text and "Ranking: 3 of 6 pairs resolved" in text
    assert "median 95% interval (ms)" in text and len(table) == 4
    # what the stored summary held and the ranking does not recompute stays (wall time, calibration)
    assert json.loads((tmp_path / "suite.json").read_text())["summary"]["section"] == "embedding"


def test_a_stored_netns_run_ranked_per_rate(tmp_path: Path) -> None:
    table = summary(DATA / "netns-embedding-6", tmp_path)
    rankings = table.attrs["rankings"]
    assert {rate: (r["resolved"], r["concordant"]) for rate, r in rankings.items()} == \
        {"100mbit": (3, 3), "1gbit": (3, 3), "10gbit": (2, 1)}
    assert rankings["10gbit"]["discordant"] == ["ps < embrace-2d"]
    text = (tmp_path / "summary.md").read_text()
    assert "| 10gbit | embrace-2d < ps < embrace-seq < dense | ps < embrace-seq < embrace-2d < dense | 0.40 | " \
           "2 of 6 | 1 | ps < embrace-2d |" in text
    assert not (DATA / "netns-embedding-6" / "summary.md").exists()  # the stored run is only read


def test_a_folder_without_runs_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="suite.csv"):
        resummarise(tmp_path, tmp_path / "out")
    with pytest.raises(ConfigError, match="report.json"):
        summary(tmp_path)
