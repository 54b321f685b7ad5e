"""The MILP (``sim.memory_optimal``) charges a recomputed layer's checkpoint as the engine's ledger does.

One rule, ``sim.memory.input_saved_by_previous``: a recomputed layer's checkpoint (its input) is the
storage the previous layer, kept, saves as its output when it saves it (resnet-tiny's pool + head
after a ReLU), and a storage of its own when it does not (lstm-tiny's and rnn-tiny's first recurrent
layer after the embedding, measured by torch: ``LayerCosts.saved_output_bytes``). Once re-run, a
layer that does not save its input holds it beside its saved tensors (``unsaved_checkpoint_bytes``).
The MILP counted the checkpoint twice after a kept layer and left out the input held beside the
re-run: on resnet-tiny (GPipe, 8 x 8, fp16) its peak was 917,504 B over to 131,072 B under the
ledger's. Here the model's peak equals the ledger's, per rank, for every keep / recompute choice
that recomputes a layer after a kept one, and for the MILP's own choices under budgets that make it
recompute. Swaps are left out: a swap's bytes leave the ledger when its copy ends, which the model
does not time (tests/test_received_gradients.py)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from functools import cache, partial

import pytest

from sim.compile import ResolvedPlan, compile_plan, resolve_plan
from sim.costs import CostModel
from sim.engine import Engine
from sim.memory import forward_bytes, held_bytes, input_saved_by_previous
from sim.memory_optimal import KEEP, RECOMPUTE, Choice, LayerChoiceModel, layer_choice_model, policy_of
from sim.plan import Plan
from sim.simulate import simulate
from tests.test_received_gradients import MICRO_BATCH, MICROBATCHES, cluster, resnet_costs
from traces.errors import ConfigError

# Workloads whose layers' bytes torch measures at this micro-batch (exec.structure: exact bytes,
# zero times), where a layer that does not save its input follows one that saves none of its output.
STRUCTURAL = ("lstm-tiny", "rnn-tiny")


@cache
def costs_of(workload: str) -> CostModel | None:
    if workload in STRUCTURAL:
        from exec.structure import StructuralCosts
        from exec.workloads import get_workload

        return StructuralCosts(get_workload(workload), MICRO_BATCH, "fp32")
    return resnet_costs() if workload == "resnet-tiny" else None


def plan_of(workload: str, pp: int, schedule: str, budget_gb: float) -> Plan:
    return Plan.from_dict({"name": f"{workload}-pp{pp}-{schedule}", "workload": workload, "cluster": cluster(pp),
                           "dtype": "fp32" if workload in STRUCTURAL else "fp16", "parallelism": {"pp": pp},
                           "schedule": {"name": schedule, "micro_batch": MICRO_BATCH, "microbatches": MICROBATCHES},
                           "memory": {"policy": "optimal", "budget_gb": budget_gb, "allow_swap": False}})


def model_of(plan: Plan, costs: CostModel | None) -> tuple[LayerChoiceModel, ResolvedPlan]:
    resolved = resolve_plan(plan, costs)
    budget = int(plan.memory.budget_gb * 2**30)
    return layer_choice_model(plan, resolved.stage_layers, resolved.costs, budget), resolved


def recomputes_after_kept(model: LayerChoiceModel, choice: Choice) -> bool:
    return any(choice[i] == RECOMPUTE and choice[i - 1] == KEEP and model.stage_of[i] == model.stage_of[i - 1]
               for i in range(1, len(choice)))


def ledger_peaks(plan: Plan, resolved: ResolvedPlan, model: LayerChoiceModel, choice: Choice) -> list[int]:
    policy = policy_of(model, choice, plan.num_stages)
    resolved = replace(resolved, policy=policy)
    engine = Engine(compile_plan(plan, resolved=resolved).program, resolved.costs, resolved.comm, policy, MICRO_BATCH)
    engine.run()
    return [engine.ledgers[k].peak for k in sorted(engine.ledgers)]


CASES = [*((w, pp, "gpipe") for w in ("resnet-tiny", "gpt-tiny") for pp in (1, 2, 3, 4)),
         ("resnet-tiny", 2, "1f1b"), ("gpt-tiny", 2, "1f1b"),
         *((w, pp, "gpipe") for w in STRUCTURAL for pp in (1, 2))]


@pytest.mark.parametrize(("workload", "pp", "schedule"), CASES)
def test_model_peak_is_the_ledger_peak_for_a_layer_recomputed_after_a_kept_one(workload: str, pp: int,
                                                                                 schedule: str) -> None:
    plan = plan_of(workload, pp, schedule, 1000.0)
    model, resolved = model_of(plan, costs_of(workload))
    choices = [c for c in itertools.product((KEEP, RECOMPUTE), repeat=len(model.layers))
               if recomputes_after_kept(model, c)]
    assert choices
    for choice in choices:
        assert model.peaks(choice) == ledger_peaks(plan, resolved, model, choice), f"choice {choice}"


@pytest.mark.parametrize(("workload", "pp"), [("resnet-tiny", 1), ("resnet-tiny", 3), ("gpt-tiny", 2)])
def test_the_milps_choice_peaks_where_it_predicts(workload: str, pp: int) -> None:
    """GPipe, budgets from keeping everything down to recomputing everything (20 steps): wherever the
    MILP recomputes a layer after a kept one, the engine's ledger peaks at the model's prediction for
    that choice, per rank, within the budget."""
    costs = costs_of(workload)
    plan = plan_of(workload, pp, "gpipe", 1000.0)
    model, _ = model_of(plan, costs)
    n = len(model.layers)
    low, high = max(model.peaks((RECOMPUTE,) * n)), max(model.peaks((KEEP,) * n))
    checked = set()
    for step in range(21):
        capacity = high - (high - low) * step // 20
        choice = LayerChoiceModel(**{**model.__dict__, "capacity": capacity}).solve()
        if choice is None or choice in checked or not recomputes_after_kept(model, choice):
            continue
        checked.add(choice)
        budgeted = plan.model_copy(update={"memory": plan.memory.model_copy(update={"budget_gb": capacity / 2**30})})
        ledger = [m.peak_bytes for _, m in sorted(simulate(budgeted, costs=costs).memory.items())]
        assert model.peaks(choice) == ledger, f"capacity {capacity}, choice {choice}"
        assert max(ledger) <= capacity
    assert checked, "some budget should make the MILP recompute a layer after a kept one"


@pytest.mark.parametrize("workload", STRUCTURAL)
def test_a_checkpoint_the_previous_layer_does_not_save_is_a_storage_of_its_own(workload: str) -> None:
    """The first recurrent layer saves a copy of its input (torch's batch-first LSTM / RNN), not the
    input, and the embedding before it saves none of its output: recomputed after the kept
    embedding, its checkpoint is held beside the embedding's saves (the rule assumed it was one of
    them), and once re-run beside its own saved tensors too."""
    resolved = resolve_plan(plan_of(workload, 1, "gpipe", 1000.0), costs_of(workload))
    cost = partial(resolved.costs.layer_costs, micro_batch=MICRO_BATCH, tp=1)
    checkpoint = cost(1).unsaved_input_bytes
    assert checkpoint == cost(0).output_bytes > 0 and cost(0).saved_output_bytes == 0
    assert input_saved_by_previous(1, cost) == 0
    assert forward_bytes((0, 1), (1,), cost) == cost(0).saved_bytes + checkpoint
    assert held_bytes((0, 1), (1,), cost) == cost(0).saved_bytes + cost(1).saved_bytes + checkpoint


def test_lstm_head_after_a_kept_lstm_shares_its_checkpoint() -> None:
    """lstm-tiny's head (a linear) does not save its input either, but the LSTM before it saves its
    output: one storage, as resnet-tiny's head after a ReLU."""
    resolved = resolve_plan(plan_of("lstm-tiny", 1, "gpipe", 1000.0), costs_of("lstm-tiny"))
    cost = partial(resolved.costs.layer_costs, micro_batch=MICRO_BATCH, tp=1)
    assert cost(3).unsaved_input_bytes == cost(2).saved_output_bytes == cost(2).output_bytes > 0
    assert input_saved_by_previous(3, cost) == cost(2).output_bytes
    assert forward_bytes((2, 3), (3,), cost) == cost(2).saved_bytes


def test_a_cost_model_that_does_not_say_what_the_previous_layer_saves_is_refused() -> None:
    resolved = resolve_plan(plan_of("rnn-tiny", 1, "gpipe", 1000.0), costs_of("rnn-tiny"))

    def cost(layer: int):  # noqa: ANN202 - LayerCosts
        c = resolved.costs.layer_costs(layer, MICRO_BATCH, 1)
        return replace(c, saved_output_bytes=-1)

    with pytest.raises(ConfigError, match="layer 0's LayerCosts.saved_output_bytes.*re-profile"):
        forward_bytes((0, 1), (1,), cost)
