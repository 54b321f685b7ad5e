"""Named sections of the validation suite (analysis.validation_suite): subfolders of
examples/validation/ but calibration/ and netns/; the default suite stays the top-level plans."""

from __future__ import annotations

import pytest

from analysis.validation_suite import SUITE_DIR, default_plans, run_suite, sections
from sim.gradient_sync import GRADIENT_SYNC
from sim.plan import Plan
from traces.errors import ConfigError


def test_the_default_suite_is_the_top_level_plans_and_sections_leave_out_calibration_and_netns() -> None:
    assert default_plans() == sorted(SUITE_DIR.glob("*.yaml"))
    assert all(p.parent == SUITE_DIR for p in default_plans())
    names = sections()
    assert "compression" in names
    assert not {"calibration", "netns"} & set(names)
    for name in names:
        assert default_plans(name) and all(p.parent == SUITE_DIR / name for p in default_plans(name))


def test_the_compression_section_runs_every_method_on_one_plan() -> None:
    plans = [Plan.load(p) for p in default_plans("compression")]
    assert sorted(p.gradient_sync.method for p in plans) == sorted(GRADIENT_SYNC)

    def rest(p: Plan) -> dict:  # everything but the name and the method (with its settings)
        data = p.model_dump(mode="json")
        data.pop("name")
        data["gradient_sync"] = data["gradient_sync"]["bucket_mb"]
        return data

    assert all(rest(p) == rest(plans[0]) for p in plans)
    assert plans[0].dp == 2 and plans[0].workload_options["sparse"]


def test_an_unknown_section_or_a_section_with_plans_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError) as error:
        default_plans("no-such-section")
    assert error.value.field == "--section" and "compression" in str(error.value)
    with pytest.raises(ConfigError) as error:
        run_suite(tmp_path, plans=default_plans(), section="compression")
    assert error.value.field == "--section"
