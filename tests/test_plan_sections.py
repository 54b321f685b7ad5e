"""Plans in sections: every dimension has one home, a registry lists its choices, and a plan in the
old flat form is refused with its sectioned spelling."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sim.embedding import EMBEDDING_METHODS
from sim.gradient_sync import GRADIENT_SYNC
from sim.memory import MEMORY_POLICIES, StageAwareRecompute
from sim.plan import Plan, migrate_flat
from sim.schedules import SCHEDULES
from sim.simulate import simulate
from traces.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted([*ROOT.glob("examples/plans/*.yaml"), *ROOT.glob("examples/validation/**/*.yaml")])
# examples/plans/gpt-8.3b-a100-64-merak.yaml as it was written before plans had sections.
FLAT_8_3B = """name: gpt-8.3b-a100-64-merak
workload: gpt-8.3b
cluster: a100-64
dtype: fp16
dp: 2
tp: 8
pp: 4
micro_batch: 4
microbatches: 16
schedule: merak-shifted
tp_overlap: 3
"""


def paratwin(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "analysis.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_is_sectioned_and_round_trips(path: Path) -> None:
    plan = Plan.load(path)
    assert Plan.from_dict(plan.model_dump()) == plan


def test_flat_plan_is_refused_with_its_sectioned_spelling() -> None:
    flat = yaml.safe_load(FLAT_8_3B)
    with pytest.raises(ConfigError) as error:
        Plan.from_dict(flat)
    message = str(error.value)
    assert "\n" not in message and "sections" in message
    spelled = yaml.safe_load(message.split("(fix: write ", 1)[1].removesuffix(")"))
    rest = {k: v for k, v in flat.items() if k in ("name", "workload", "cluster", "dtype")}
    assert Plan.from_dict({**rest, **spelled}) == Plan.load(ROOT / "examples/plans/gpt-8.3b-a100-64-merak.yaml")


def test_migrate_plan_prints_a_plan_that_predicts_the_same(tmp_path: Path) -> None:
    (tmp_path / "old.yaml").write_text(FLAT_8_3B)
    done = paratwin("migrate-plan", str(tmp_path / "old.yaml"), "--out", str(tmp_path / "new.yaml"))
    assert done.returncode == 0, done.stdout + done.stderr
    migrated = Plan.load(tmp_path / "new.yaml")
    example = Plan.load(ROOT / "examples/plans/gpt-8.3b-a100-64-merak.yaml")
    assert migrated == example
    assert simulate(migrated).iteration_s == simulate(example).iteration_s


def test_migration_covers_every_flat_memory_spelling() -> None:
    base = {"workload": "gpt-tiny", "pp": 2}
    assert migrate_flat({**base, "recompute": "stage-aware", "recompute_ratio": 0.3})["memory"] == \
        {"policy": "stage-aware", "ratio": 0.3}
    assert migrate_flat({**base, "recompute": [0.5, 0.0], "swap": [0.5, 0.0]})["memory"] == \
        {"policy": "per-stage", "recompute": [0.5, 0.0], "swap": [0.5, 0.0]}
    assert migrate_flat({**base, "recompute": "full"})["memory"] == {"policy": "full"}
    assert "memory" not in migrate_flat(base)
    plan = Plan.from_dict(migrate_flat({**base, "recompute": "stage-aware", "recompute_ratio": 0.3}))
    assert isinstance(plan.memory, StageAwareRecompute) and plan.memory.ratio == 0.3


@pytest.mark.parametrize(("section", "bad", "fragment"), [
    ("memory", {"policy": "dtr"}, "registered: none, full"),
    ("memory", {"policy": "stage-aware", "ratoi": 0.5}, "memory.ratoi"),
    ("gradient_sync", {"method": "carrier-pigeon"}, "registered: allreduce"),
    ("schedule", {"name": "2f2b"}, "unknown schedule '2f2b'"),
    ("parallelism", {"dp": 0}, "parallelism.dp"),
])
def test_bad_sections_name_the_field(section: str, bad: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as error:
        Plan.from_dict({"workload": "gpt-tiny", section: bad})
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_replace_merges_a_section_and_switches_a_policy() -> None:
    plan = Plan.from_dict({"workload": "gpt-tiny", "schedule": {"name": "zb-h1", "microbatches": 4},
                           "memory": {"policy": "stage-aware", "ratio": 0.5}})
    assert plan.replace(schedule={"microbatches": 8}).schedule.name == "zb-h1"
    assert plan.replace(memory={"policy": "full"}).memory.model_dump() == {"policy": "full", "swap": None,
                                                                           "in_backward": False}


def test_options_lists_every_registered_choice() -> None:
    done = paratwin("options")
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")}
    assert listed == {*SCHEDULES, *MEMORY_POLICIES, *GRADIENT_SYNC, *EMBEDDING_METHODS}
