"""The optimal per-layer memory policy (``sim.memory_optimal``).

- The MILP finds the least predicted time among the choices that fit: brute force over every
  keep/recompute/swap choice (3^layers) of small random and real cases gives the same objective.
- A plan that no choice fits is refused with a ConfigError naming ``memory``.
- The engine's memory ledger stays within the budget the policy planned for, at paper scale.
- A real 2-rank pp2 run under the policy trains exactly like one process (tests/test_runtime.py's
  check), with recomputed layers that are not a prefix and per-layer swaps.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sim.compile import resolve_plan
from sim.memory_optimal import KEEP, RECOMPUTE, SWAP, LayerChoiceModel, layer_choice_model, policy_of
from sim.plan import Plan
from sim.simulate import simulate
from traces.errors import ConfigError


def random_model(rng: random.Random, layers_per_stage: tuple[int, ...]) -> LayerChoiceModel:
    """Two pipeline ranks, 1F1B-like peak states, random costs; a capacity between the most frugal
    and the keep-everything peaks, so that the answer is neither trivial nor always infeasible."""
    stages = len(layers_per_stage)
    stage_of = tuple(s for s, n in enumerate(layers_per_stage) for _ in range(n))
    n = len(stage_of)
    saved = tuple(rng.randrange(100, 1000) for _ in range(n))
    model = LayerChoiceModel(
        layers=tuple(range(n)), stage_of=stage_of, rank_of_stage=tuple(range(stages)), microbatches=rng.choice([4, 8]),
        bubble_weight=rng.uniform(0.0, 1.5), base_s=tuple(rng.uniform(1.0, 3.0) for _ in range(stages)),
        forward_s=tuple(rng.uniform(0.3, 1.0) for _ in range(stages)),
        recompute_s=tuple(rng.uniform(0.05, 0.5) for _ in range(n)),
        copy_s=tuple(rng.uniform(0.05, 0.8) for _ in range(n)), saved=saved,
        checkpoint=tuple(rng.randrange(0, s // 2) for s in saved),
        static=tuple(rng.randrange(0, 500) for _ in range(stages)),
        # per rank, two candidate peak states of its one stage: (forwards held, recomputed sets held)
        states=tuple((((stages - k + 1, 1),), ((stages - k + 2, 0),)) for k in range(stages)),
        local_stages=tuple((s,) for s in range(stages)), capacity=0, swap_cap=(1.0,) * stages)
    keep, frugal = (KEEP,) * n, (RECOMPUTE,) * n
    low, high = max(model.peaks(frugal)), max(model.peaks(keep))
    return LayerChoiceModel(**{**model.__dict__, "capacity": rng.randrange(low - 50, high + 50)})


@pytest.mark.parametrize("seed", range(12))
def test_milp_matches_brute_force_with_shared_storages(seed: int) -> None:
    """Storages two neighbouring layers save (a ResNet ReLU output, the next convolution's input)
    count once in the MILP's memory rows as in ``peaks`` (the brute force's reference); so does a
    recomputed layer's checkpoint that the previous layer, kept, saves, and a layer that does not
    save its input holds it beside its re-run (``checkpoint_shared``, ``unsaved``: each layer at
    random saves its input, or does not and the previous layer saves it, or neither does)."""
    rng = random.Random(100 + seed)
    model = random_model(rng, rng.choice([(3, 3), (2, 4), (4, 2)]))
    shared, checkpoint_shared, unsaved = [], [], []
    for i in range(len(model.layers)):
        first = i == 0 or model.stage_of[i - 1] != model.stage_of[i]
        kind = rng.choice(["saves its input", "previous saves it", "neither"])
        both = 0 if first or kind != "saves its input" else min(model.checkpoint[i], model.saved[i - 1])
        shared.append(both)
        unsaved.append(0 if kind == "saves its input" else model.checkpoint[i])
        checkpoint_shared.append(both if kind != "previous saves it" or first else model.checkpoint[i])
    model = LayerChoiceModel(**{**model.__dict__, "shared": tuple(shared),
                                "checkpoint_shared": tuple(checkpoint_shared), "unsaved": tuple(unsaved)})
    keep, frugal = (KEEP,) * len(shared), (RECOMPUTE,) * len(shared)
    low, high = max(model.peaks(frugal)), max(model.peaks(keep))
    model = LayerChoiceModel(**{**model.__dict__, "capacity": rng.randrange(low - 50, high + 50)})
    best = model.brute_force()
    choice = model.solve()
    assert (best is None) == (choice is None)
    if best is not None:
        assert model.fits(choice) and model.time(choice) == pytest.approx(best[1], rel=1e-6)


def test_model_counts_storages_as_the_ledger() -> None:
    """resnet-tiny (structural costs, measured shared storages): for every keep / recompute choice
    of a stage, the model's kept bytes are the ledger's (``sim.memory.forward_bytes``)."""
    import itertools

    from exec.contract import compile_for_run
    from sim.memory import forward_bytes
    from tests.test_runtime import plan_of

    plan = plan_of(workload="resnet-tiny", pp=2, schedule="gpipe", microbatches=4, micro_batch=2)
    plan = plan.model_copy(update={"memory": Plan.from_dict({"workload": "resnet-tiny", "memory": {
        "policy": "optimal", "budget_gb": 1.0}}).memory})
    run = compile_for_run(plan)
    model = layer_choice_model(plan, run.program.stage_layers, run.resolved.costs, 2**30)
    assert any(model.shared)

    def cost(layer: int):  # noqa: ANN202
        return run.resolved.costs.layer_costs(layer, plan.micro_batch, plan.tp)

    stage = 0
    members = [i for i, s in enumerate(model.stage_of) if s == stage]
    others = tuple(KEEP for i in range(len(model.layers)) if model.stage_of[i] != stage)
    for picks in itertools.product((KEEP, RECOMPUTE), repeat=len(members)):
        choice = picks + others if members[0] == 0 else others + picks
        recomputed = [model.layers[i] for i, c in zip(members, picks, strict=True) if c == RECOMPUTE]
        assert model.kept_bytes(choice)[stage] == forward_bytes(run.program.stage_layers[stage], recomputed, cost)


@pytest.mark.parametrize("seed", range(12))
def test_milp_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    model = random_model(rng, rng.choice([(3, 3), (2, 4), (4, 2), (3, 2)]))
    best = model.brute_force()
    choice = model.solve()
    if best is None:
        assert choice is None
        return
    assert choice is not None and model.fits(choice)
    assert model.time(choice) == pytest.approx(best[1], rel=1e-6)


def test_milp_matches_brute_force_on_a_real_plan() -> None:
    """A 6-block GPT-8.3B on 24 A100s (tp 8, pp 3; 8 layers: 3^8 choices), at capacities from
    keeping everything to recomputing everything; the MILP's choice is a brute-force optimum each
    time, and the capacities exercise keep, recompute (not only a prefix) and swap."""
    plan = small_gpt(None)
    resolved = resolve_plan(plan)
    model = layer_choice_model(plan, resolved.stage_layers, resolved.costs, resolved.comm.capacity_bytes)
    n = len(model.layers)
    low, high = max(model.peaks((RECOMPUTE,) * n)), max(model.peaks((KEEP,) * n))
    found: set[int] = set()
    gaps = False
    for step in range(-1, 12):
        capacity = high - (high - low) * step // 10
        case = LayerChoiceModel(**{**model.__dict__, "capacity": capacity})
        best = case.brute_force()
        choice = case.solve()
        assert (best is None) == (choice is None), f"capacity {capacity}"
        if best is not None:
            assert case.time(choice) == pytest.approx(best[1], rel=1e-6), f"capacity {capacity}"
            found |= set(choice)
            stage0 = [c for c, s in zip(choice, model.stage_of, strict=True) if s == 0]
            gaps |= RECOMPUTE in stage0 and stage0[0] != RECOMPUTE
    assert {KEEP, RECOMPUTE, SWAP} <= found, "the capacities should exercise every kind of choice"
    assert gaps, "some optimum should recompute layers that are not a prefix"


def small_gpt(budget_gb: float | None) -> Plan:
    return Plan.from_dict({
        "name": "gpt-small-optimal", "workload": "gpt-8.3b", "workload_options": {"num_layers": 6},
        "cluster": {"preset": "a100-64", "nodes": 3}, "dtype": "fp16",
        "parallelism": {"dp": 1, "tp": 8, "pp": 3, "partition": [[0, 5], [5, 7], [7, 8]]},
        "schedule": {"name": "1f1b", "micro_batch": 4, "microbatches": 6},
        "memory": {"policy": "optimal", "budget_gb": budget_gb}})


def test_no_choice_fits_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as error:
        resolve_plan(small_gpt(0.5))
    assert error.value.field == "memory"
    assert "no per-layer choice fits" in str(error.value)


def test_schedule_that_fixes_recompute_is_refused() -> None:
    plan = Plan.from_dict({**small_gpt(None).model_dump(), "schedule": {"name": "merak-shifted", "micro_batch": 4,
                                                                        "microbatches": 6}})
    with pytest.raises(ConfigError, match="fixes its own recomputation"):
        resolve_plan(plan)


@pytest.mark.parametrize("budget_gb", [20.0, 30.0])
def test_engine_stays_within_the_budget_and_beats_stage_aware(budget_gb: float) -> None:
    """GPT-8.3B on 64 A100s (dp 2, tp 8, pp 4, 16 micro-batches of 16): the simulated peak of every
    rank is within the budget, and the iteration is no slower than Merak's rule at any ratio that
    fits the same budget."""
    base = {"name": "gpt-8.3b-opt", "workload": "gpt-8.3b", "cluster": "a100-64", "dtype": "fp16",
            "parallelism": {"dp": 2, "tp": 8, "pp": 4}, "schedule": {"name": "1f1b", "micro_batch": 16,
                                                                      "microbatches": 16}}
    optimal = simulate(Plan.from_dict({**base, "memory": {"policy": "optimal", "budget_gb": budget_gb}}))
    budget = budget_gb * 2**30
    assert max(m.peak_bytes for m in optimal.memory.values()) <= budget
    rule = [simulate(Plan.from_dict({**base, "memory": {"policy": "stage-aware", "ratio": r / 10}})) for r in range(11)]
    fitting = [r.iteration_s for r in rule if max(m.peak_bytes for m in r.memory.values()) <= budget]
    assert fitting, "Merak's rule should fit these budgets at some ratio"
    assert optimal.iteration_s <= min(fitting)


# ---------------------------------------------------------------------------------------------
# A real run: gloo ranks, the policy's Program, the same parameters as one process.


def mixing_budget(model: LayerChoiceModel, stage_layers: list[tuple[int, ...]]) -> int | None:
    """The loosest capacity (of 400 between the frugal and the keep-everything peaks) at which the
    policy recomputes layers that are not a prefix of their stage and swaps others."""
    low = max(model.peaks((RECOMPUTE,) * len(model.layers)))
    high = max(model.peaks((KEEP,) * len(model.layers)))
    for step in range(1, 400):
        capacity = high - (high - low) * step // 400
        choice = LayerChoiceModel(**{**model.__dict__, "capacity": capacity}).solve()
        if choice is None:
            return None
        policy = policy_of(model, choice, len(stage_layers))
        not_prefix = any(layers != stage_layers[s][: len(layers)]
                         for s, layers in enumerate(policy.recompute_layers) if layers)
        if not_prefix and any(policy.swap_layers):
            return capacity
    return None


@pytest.mark.slow
def test_pp2_run_under_the_optimal_policy_equals_one_process(gpt_tiny_profile: Path, tmp_path: Path) -> None:
    """GPipe, so that four micro-batches are in flight and a swap saves memory (with two, as 1F1B
    holds on pp 2, a swapped micro-batch is back before the next one leaves: nothing saved)."""
    from exec.contract import compile_for_run
    from tests.test_runtime import check_against_reference, plan_of
    from traces.runrecord import read_run_record

    def plan(budget_gb: float | None) -> Plan:
        memory = Plan.from_dict({"workload": "gpt-tiny", "memory": {"policy": "optimal", "budget_gb": budget_gb}})
        return plan_of(pp=2, schedule="gpipe", microbatches=4, micro_batch=1).model_copy(update={
            "name": "gpt-tiny-pp2-optimal", "profile": str(gpt_tiny_profile), "memory": memory.memory})

    loose = compile_for_run(plan(None)).resolved
    model = layer_choice_model(loose.plan, loose.stage_layers, loose.costs, loose.comm.capacity_bytes)
    capacity = mixing_budget(model, loose.stage_layers)
    assert capacity is not None, "no budget made the policy mix a non-prefix recompute with swap"
    chosen = plan(capacity / 2**30)
    policy = compile_for_run(chosen).resolved.policy
    assert any(policy.swap_layers) and any(policy.recompute_layers)
    check_against_reference(chosen, tmp_path)
    table = read_run_record(tmp_path / chosen.name / "record").instructions
    assert {"RECOMPUTE", "SWAP_OUT", "SWAP_IN"} <= set(table["kind"])
    assert (table.loc[table["kind"] == "SWAP_OUT", "bytes"] > 0).all()


@pytest.mark.slow
@pytest.mark.parametrize(("workload", "pp", "schedule"), [("resnet-tiny", 2, "gpipe"), ("gpt-tiny", 1, "gpipe")])
def test_optimal_without_profile_equals_one_process(workload: str, pp: int, schedule: str, tmp_path: Path) -> None:
    """A ResNet over two pipeline ranks and a GPT in one process, on the runtime's structural costs
    (zero times: the policy recomputes, never swaps), at a capacity halfway between recomputing
    everything and keeping everything. GPipe: with one micro-batch in flight (1F1B on one rank) a
    stage's recompute brings every layer back before the backward, and nothing is saved."""
    from exec.contract import compile_for_run
    from tests.test_runtime import check_against_reference, plan_of

    def plan(budget_gb: float | None) -> Plan:
        memory = Plan.from_dict({"workload": workload, "memory": {"policy": "optimal", "budget_gb": budget_gb}})
        return plan_of(workload=workload, pp=pp, schedule=schedule, microbatches=4, micro_batch=2).model_copy(
            update={"name": f"{workload}-pp{pp}-optimal", "memory": memory.memory})

    loose = compile_for_run(plan(None)).resolved
    model = layer_choice_model(loose.plan, loose.stage_layers, loose.costs, loose.comm.capacity_bytes)
    n = len(model.layers)
    capacity = (max(model.peaks((RECOMPUTE,) * n)) + max(model.peaks((KEEP,) * n))) // 2
    chosen = plan(capacity / 2**30)
    assert any(compile_for_run(chosen).resolved.policy.recompute_layers)
    check_against_reference(chosen, tmp_path)


def test_estimate_prices_any_recomputed_set_and_per_layer_swap() -> None:
    """The fast estimate (what the plan search ranks by) counts a non-prefix recomputed layer's
    input and a swapped layer's absence, layer by layer."""
    from sim.estimate import Estimator
    from sim.memory import checkpoint_bytes

    plan = small_gpt(None)
    resolved = resolve_plan(plan)
    layers = resolved.stage_layers[0]  # (0, 1, 2, 3, 4): embedding and four blocks
    estimator = Estimator(resolved.costs, resolved.comm, plan.dtype)

    def cost(layer: int):  # noqa: ANN202
        return resolved.costs.layer_costs(layer, plan.micro_batch, plan.tp)

    stage = estimator.stage(layers, (2,), plan.micro_batch, plan.tp, 0, (3,))
    saved = {layer: cost(layer).saved_bytes for layer in layers}
    assert stage.kept_bytes == sum(saved[x] for x in (0, 1, 4)) + checkpoint_bytes(2, cost)
    assert stage.recompute_extra_bytes == saved[2] - checkpoint_bytes(2, cost)
    assert stage.recompute_compute_s == pytest.approx(cost(2).recompute_s)


def test_swap_cap_limits_what_the_optimum_swaps() -> None:
    n_stages = 3
    free = resolve_plan(small_gpt(2.67)).policy
    capped = resolve_plan(small_gpt(2.67).model_copy(update={"memory": small_gpt(2.67).memory.model_copy(
        update={"swap": [0.0] * n_stages})})).policy
    assert any(free.swap_layers), "this budget should make the optimum swap"
    assert not any(capped.swap_layers)
