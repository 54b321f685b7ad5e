"""``workload_options: {implementation: megatron-lm}`` (sim.implementations): one line of a plan that stands
for what Megatron-LM ran (unfused attention, dropout 0.1, a tied head), options set next to it winning, and
the simulator pricing what it expands to."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from analysis.calibrate import CurveCalibration, SimulatorPredictor, load_rows, row_to_plan
from sim.analytic import default_for
from sim.calibration import MEGATRON_DEVICE, MEGATRON_DTYPE
from sim.compile import resolve_plan
from sim.hardware import get_device
from sim.implementations import IMPLEMENTATIONS, MEGATRON_LM
from sim.plan import Plan
from sim.search import SearchSpace
from sim.simulate import simulate
from sim.workloads import workload_config
from traces.errors import ConfigError

MEGATRON = {"attention": "unfused", "dropout": 0.1, "tied_embedding": True}


def plan_yaml(tmp_path: Path, options: str, micro_batch: int = 4) -> Plan:
    """A plan read from YAML text as a user writes it: gpt2-medium on a DGX A100, tp 2, pp 2."""
    path = tmp_path / "plan.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: megatron-gpt2-medium
        workload: gpt2-medium
        workload_options: {options}
        cluster: {{preset: dgx-a100-8}}
        dtype: fp16
        parallelism: {{dp: 2, tp: 2, pp: 2}}
        schedule: {{name: 1f1b, micro_batch: {micro_batch}, microbatches: 4}}
        memory: {{policy: full}}
        """))
    return Plan.load(path)


def test_the_one_line_expands_to_megatron_lms_options(tmp_path: Path) -> None:
    assert IMPLEMENTATIONS[MEGATRON_LM][1] == MEGATRON
    plan = plan_yaml(tmp_path, "{implementation: megatron-lm}")
    assert plan.workload_options == MEGATRON  # the key itself is gone: every reader sees plain options
    assert workload_config(plan.workload, plan.workload_options)["attention"] == "unfused"
    # Dumped and read back, the plan is the same plan.
    assert Plan.load(plan.dump(tmp_path / "again.yaml")) == plan
    # The presets are unchanged: without the line, the project's runnable GPT.
    config = workload_config("gpt2-medium", plan_yaml(tmp_path, "{}").workload_options)
    assert (config["attention"], config["dropout"], config["tied_embedding"]) == ("flash", 0.0, False)


def test_options_set_next_to_it_win(tmp_path: Path) -> None:
    plan = plan_yaml(tmp_path, "{implementation: megatron-lm, dropout: 0.0, attention: flash, hidden: 768}")
    assert plan.workload_options == {"attention": "flash", "dropout": 0.0, "tied_embedding": True, "hidden": 768}


def test_workload_options_outside_a_plan_expand_too() -> None:
    assert workload_config("gpt2-small", {"implementation": MEGATRON_LM})["tied_embedding"] is True
    space = SearchSpace("gpt2-small", "dgx-a100-8", workload_options={"implementation": MEGATRON_LM, "dropout": 0.2})
    assert space.workload_options == {**MEGATRON, "dropout": 0.2}


@pytest.mark.parametrize(("workload", "options", "problem", "fix"), [
    ("gpt2-medium", "{implementation: megatron}", "unknown implementation", "use one of megatron-lm"),
    ("gpt2-medium", "{implementation: [megatron-lm]}", "unknown implementation", "use one of megatron-lm"),
    ("bert-base", "{implementation: megatron-lm}", "describes gpt workloads, not a bert one", "use a gpt workload"),
])
def test_a_bad_implementation_is_refused_naming_the_field(tmp_path: Path, workload: str, options: str,
                                                          problem: str, fix: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(f"workload: {workload}\nworkload_options: {options}\n")
    with pytest.raises(ConfigError, match=problem) as raised:
        Plan.load(path)
    assert raised.value.field == "workload_options.implementation"
    assert fix in raised.value.fix


def test_the_simulator_prices_unfused_attention_for_such_a_plan(tmp_path: Path) -> None:
    # Sequence 2,048 and micro-batch 8: GPU-bound (at 1,024 and 4 this plan is host-launch bound, so the
    # attention kernels' time hides under the launches either way).
    megatron = plan_yaml(tmp_path, "{implementation: megatron-lm, seq: 2048}", micro_batch=8)
    assert resolve_plan(megatron).costs.model.attention == "unfused"
    # The same plan but FlashAttention (Megatron-LM's --use-flash-attn): everything else equal. Unfused
    # attention writes and reads the b (a/t) s^2 scores and probabilities through memory: slower.
    flash = plan_yaml(tmp_path, "{implementation: megatron-lm, seq: 2048, attention: flash}", micro_batch=8)
    assert resolve_plan(flash).costs.model.attention == "flash"
    t_unfused, t_flash = simulate(megatron).iteration_s, simulate(flash).iteration_s
    assert t_unfused > 1.5 * t_flash
    # And the line prices exactly what the options written out by hand do.
    by_hand = plan_yaml(tmp_path, "{attention: unfused, dropout: 0.1, tied_embedding: true, seq: 2048}", micro_batch=8)
    assert simulate(by_hand).iteration_s == t_unfused


def test_a_vtrain_rows_plan_alone_carries_megatron_lm() -> None:
    """``paratwin simulate`` of a calibration row's plan predicts what the calibration's predictor does."""
    rows = load_rows()
    # Hidden 2,048, micro-batch 8, tp 2, pp 2: GPU-bound, so flash attention would predict 16% less.
    row = rows[rows["row_id"] == 34].iloc[0].to_dict()
    assert (row["hidden"], row["micro_batch"], row["tp"], row["pp"]) == (2048, 8, 2, 2)
    plan = row_to_plan(row)
    assert plan.workload_options["attention"] == "unfused"
    curve = default_for(get_device(MEGATRON_DEVICE), MEGATRON_DTYPE)
    predicted = SimulatorPredictor(engine_only=False)(row, CurveCalibration(curve))
    assert simulate(plan).iteration_s == pytest.approx(predicted, rel=1e-12)
