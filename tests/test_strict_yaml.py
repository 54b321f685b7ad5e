"""A key given twice in a user's plan, cluster or sweep file is refused in one line naming the key and
where, instead of the last one silently winning (found by an outside-in review: `name: a` then
`name: b` ran as b)."""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis.sweep import SweepSpec
from sim.cluster import load_cluster
from sim.plan import Plan
from traces.errors import ConfigError
from traces.strict_yaml import load_yaml

PLAN = "name: a\nworkload: gpt-tiny\ncluster: {preset: local-cpu-2}\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, key, lines", [
    (PLAN + "name: b\n", "name", "lines 1 and 4"),
    (PLAN + "parallelism: {dp: 2}\nparallelism: {pp: 2}\n", "parallelism", "lines 4 and 5"),
    (PLAN + "parallelism:\n  dp: 2\n  dp: 1\n", "dp", "lines 5 and 6"),
])
def test_a_plan_with_a_repeated_key_is_refused(tmp_path: Path, text: str, key: str, lines: str) -> None:
    with pytest.raises(ConfigError, match=rf"not valid YAML: key '{key}' appears twice in one mapping \({lines}\)"):
        Plan.load(write(tmp_path, "plan.yaml", text))


def test_a_json_plan_with_a_repeated_key_is_refused(tmp_path: Path) -> None:
    text = '{"name": "a", "workload": "gpt-tiny", "name": "b"}'
    with pytest.raises(ConfigError, match=r"not valid JSON: key 'name' appears twice in one object.*char 38"):
        Plan.load(write(tmp_path, "plan.json", text))


def test_cluster_and_sweep_files_are_refused_too(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="key 'nodes' appears twice"):
        load_cluster(str(write(tmp_path, "c.yaml", "nodes: 1\ndevices_per_node: 2\ndevice: local-cpu\nnodes: 2\n")))
    with pytest.raises(ConfigError, match="key 'grid' appears twice"):
        SweepSpec.load(write(tmp_path, "s.yaml", "name: s\nbase: {}\ngrid: {a: [1]}\ngrid: {b: [2]}\n"))


def test_plans_without_repeats_load_as_before_merge_keys_included(tmp_path: Path) -> None:
    assert Plan.load(write(tmp_path, "ok.yaml", PLAN + "parallelism: {dp: 2}\n")).name == "a"
    # a merge key followed by an override is not a repeat: the override is the point of it
    assert load_yaml("base: &b {dp: 2, tp: 1}\nplan:\n  <<: *b\n  dp: 4\n")["plan"] == {"dp": 4, "tp": 1}
