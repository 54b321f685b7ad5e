"""The demo's verdict compares the measured order of its two validated plans with the predicted one, and
says a tie when no order was predicted (the search may pick the baseline itself)."""

from __future__ import annotations

from types import SimpleNamespace

from analysis.demo import Validated, _verdict, baseline_plan


def validated(role: str, predicted_s: float, measured_s: float, spread: float = 0.01, plan=None) -> Validated:
    report = SimpleNamespace(predicted_s=predicted_s, measured_s=measured_s, measured={"spread": spread})
    return Validated(role, plan or baseline_plan(), report)


def test_the_measured_order_matches_the_predicted_one() -> None:
    verdict = _verdict([validated("searched best", 1.0, 1.1), validated("naive baseline", 2.0, 2.2)])
    assert verdict.startswith("the measured order matches")


def test_an_order_against_the_prediction_is_a_contradiction_outside_the_spread_and_a_tie_inside() -> None:
    plans = [validated("searched best", 1.0, 2.2), validated("naive baseline", 2.0, 1.1)]
    assert "contradicts" in _verdict(plans)
    close = [validated("searched best", 1.0, 1.105, spread=0.05), validated("naive baseline", 2.0, 1.1)]
    assert "a tie on this machine" in _verdict(close)


def test_plans_predicted_equal_are_neither_matched_nor_contradicted() -> None:
    # The search's best is the baseline itself: one prediction for both, two measurements of one plan.
    same = [validated("searched best", 1.9896, 2.1), validated("naive baseline", 1.9896, 2.0)]
    verdict = _verdict(same)
    assert "contradicts" not in verdict and "matches" not in verdict
    assert "the same plan, predicted equal (1989.6 ms)" in verdict and "5.0% apart" in verdict
    assert "outside the measured spread (1.0%)" in verdict
    other = baseline_plan().replace(name="other", parallelism=baseline_plan().parallelism.model_copy(
        update={"dp": 1, "pp": 2}))
    different = [validated("searched best", 1.9896, 2.1, spread=0.1, plan=other),
                 validated("naive baseline", 1.9896, 2.0, spread=0.1)]
    assert "are predicted equal" in _verdict(different) and "inside the measured spread" in _verdict(different)
