"""DELTA in a Program: the ``delta`` memory policy and its lowering pass.

``delta_pass`` runs on one rank's draft after the compute pass: it replays the rank's compute order
through ``sim.delta.decide`` and writes the decisions down, per (stage, micro-batch):

- dropped layers: the forward becomes checkpointed (``save=False``) and a RECOMPUTE of exactly
  those layers is inserted before the micro-batch's first backward action (ordinary, not eager:
  it waits for the output gradient like the backward);
- swapped layers: a SWAP_OUT of those layers right after the forward; the swap pass that follows
  prefetches it (SWAP_IN one compute step before the backward) as for every swap.

Both engines read a checkpointed forward's layers from its RECOMPUTE, and a swap's from its
SWAP_OUT, so no per-micro-batch table lives anywhere else. A rank whose optimizer step (no
activations, the optimizer's gradient copies: ``sim.model_state.step_peak_bytes``) exceeds the
budget is refused: no release makes it fit. Imports neither torch nor simpy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from sim.costs import CostModel, LayerCosts
from sim.delta import Decisions, DeltaSettings, LayerFacts, Step, decide
from sim.gradient_sync import bucket_buffer_bytes
from sim.memory import (
    MemoryConfig,
    MemoryPolicy,
    checkpoint_bytes,
    movable_bytes,
    received_gradient_bytes,
    register_memory_policy,
    resident_bytes,
)
from sim.model_state import held_gradient_bytes, held_optimizer_bytes, step_peak_bytes, step_problem
from sim.program import Kind
from sim.schedules import SCHEDULES, Op, generate_schedule, stage_to_rank

if TYPE_CHECKING:
    from sim.lower import _Draft
    from sim.plan import Plan

_STEP_OF = {Kind.FWD: "F", Kind.BWD: "B", Kind.BWD_I: "B", Kind.BWD_W: "W"}
_STEP_OF_OP = {Op.FORWARD: "F", Op.BACKWARD: "B", Op.BACKWARD_INPUT: "B", Op.BACKWARD_WEIGHT: "W"}


class DeltaMemory(MemoryConfig):
    """DELTA: under a memory budget per rank, after each forward release the saved tensor with the
    largest size x staleness, swapping it to host when that is cheaper than recomputing it, else
    dropping and recomputing it; swapped tensors are prefetched before their backward."""

    policy: Literal["delta"] = "delta"
    budget_gb: float | None = Field(None, gt=0, description="memory per rank, GiB (default: the device's capacity)")
    tiny_mb: float = Field(1.0, ge=0, description="saved tensors (one layer's, one micro-batch) below this many "
                           "MiB are never released (a choice of ours, not the paper's number)")
    director: Literal["cost", "swap", "recompute"] = Field(
        "cost", description="cost: DELTA's rule (swap when cheaper than recomputing); swap / recompute: always "
        "that, with DELTA's filter (baselines)")
    decide: Literal["lowering", "runtime"] = Field(
        "lowering", description="lowering: decide once from predicted times and write the decisions into the "
        "Program; runtime: each engine decides at DECIDE instructions from the bytes it holds and its own clock")


def build_delta(plan: Plan, stage_layers: Sequence[Sequence[int]], costs: CostModel,
                capacity_bytes: int) -> MemoryPolicy:
    from sim.cluster import load_cluster
    from sim.comm import ClusterComm

    config = plan.memory
    assert isinstance(config, DeltaMemory)
    stages_n = plan.num_stages
    none = ((),) * stages_n
    if SCHEDULES[plan.schedule.name].recompute_is_schedule:
        return MemoryPolicy(none, (0.0,) * stages_n, problem=f"schedule {plan.schedule.name} fixes its own "
                            "recomputation; DELTA needs an ordinary schedule (1f1b, gpipe, interleaved-1f1b, zb-*)")
    if config.swap is not None:
        return MemoryPolicy(none, (0.0,) * stages_n, problem="DELTA decides its swaps itself: drop memory.swap")
    if config.decide == "runtime" and SCHEDULES[plan.schedule.name].split_backward:
        return MemoryPolicy(none, (0.0,) * stages_n, problem=f"DELTA at run time re-materialises a micro-batch "
                            f"before one whole backward; schedule {plan.schedule.name} splits its backward: use "
                            "1f1b, gpipe or interleaved-1f1b, or memory.decide: lowering")
    latency, bandwidth = ClusterComm(load_cluster(plan.cluster), None).host_copy()
    budget = capacity_bytes if config.budget_gb is None else min(capacity_bytes, int(config.budget_gb * 2**30))
    model_state, grads, state = _rank_model_state(plan, stage_layers, costs)
    problem = step_problem([step_peak_bytes(costs, b, g, plan.gradient_sync, plan.dtype, o, plan.dp)
                            for b, g, o in zip(model_state, grads, state, strict=True)], budget)
    if problem:  # DELTA releases activations; the optimizer step holds none
        return MemoryPolicy(none, (0.0,) * stages_n, problem=problem)
    settings = DeltaSettings(budget_bytes=budget, tiny_bytes=int(config.tiny_mb * 2**20), host_latency_s=latency,
                             host_bandwidth_Bps=bandwidth, director=config.director, decide=config.decide,
                             gradient_extra_bytes=tuple(gradient_extra_bytes(plan, g, o)
                                                        for g, o in zip(grads, state, strict=True)))
    return MemoryPolicy(none, (0.0,) * stages_n, delta=settings)


def _rank_model_state(plan: Plan, stage_layers: Sequence[Sequence[int]],
                      costs: CostModel) -> tuple[list[int], list[int], list[int]]:
    """Per pipeline rank, its parameters, gradients and optimizer state (the gradients in the parameters'
    dtype), those gradients' bytes and that optimizer state's: what ``sim.model_state.step_peak_bytes``
    starts from."""
    placement = SCHEDULES[plan.schedule.name].placement
    model_state, grads, state = [0] * plan.pp, [0] * plan.pp, [0] * plan.pp
    for s, layers in enumerate(stage_layers):
        k = stage_to_rank(s, plan.pp, plan.chunks, placement)
        for layer in layers:
            c = costs.layer_costs(layer, plan.micro_batch, plan.tp)
            model_state[k] += c.param_bytes + c.grad_bytes + c.optimizer_bytes
            grads[k] += c.grad_bytes
            state[k] += c.optimizer_bytes
    return model_state, grads, state


def gradient_extra_bytes(plan: Plan, grad_bytes: int, optimizer_bytes: int = 0) -> int:
    """What a pipeline rank with gradients of ``grad_bytes`` (the parameters' dtype) and optimizer state of
    ``optimizer_bytes`` (counted whole) holds beyond them all iteration, by the plan's gradient sync: one
    flattened gradient bucket in flight (clipped to the rank's gradients: ``sim.gradient_sync.
    bucket_buffer_bytes``) and the held gradients' bytes over ``grad_bytes`` (an fp32 main-grad buffer
    where they reduce in fp32: ``sim.model_state``), less the optimizer state it does not hold (the
    distributed optimizer's other shards: ``sim.model_state.held_optimizer_bytes``), as the engine's
    ledger holds them. The lowering and the estimate's replay decide with it."""
    sync = plan.gradient_sync
    bucket = bucket_buffer_bytes(sync, sync.bucket_mb, grad_bytes, plan.dp, plan.dtype)
    unheld = optimizer_bytes - held_optimizer_bytes(optimizer_bytes, sync, plan.dp)
    return bucket + held_gradient_bytes(grad_bytes, sync, plan.dtype) - grad_bytes - unheld


def _extra(settings: DeltaSettings, rank: int) -> int:
    """``settings.gradient_extra_bytes`` of pipeline rank ``rank`` (none in hand-made settings)."""
    return settings.gradient_extra_bytes[rank] if settings.gradient_extra_bytes else 0


def _replay(steps: list[Step], stage_layers: Sequence[Sequence[int]], cost: Callable[[int], LayerCosts],
            settings: DeltaSettings, rank_of: Sequence[int],
            extra_static: int) -> tuple[Decisions, dict[int, LayerFacts], int]:
    """``decide`` for one rank: its layers' facts and its static bytes (``_static``)."""
    stages = sorted({step.stage for step in steps})
    facts = {}
    shared = {}
    for s in stages:
        layers = stage_layers[s]
        whole = resident_bytes(layers, (), (), cost)
        for position, layer in enumerate(layers):
            c = cost(layer)
            shared_out = cost(layers[position + 1]).shared_input_bytes if position + 1 < len(layers) else 0
            # Each storage once, as the ledger counts (sim.memory.resident_bytes): a swap frees what
            # no other layer of the forward saves too (nor the stage input), a drop that less its input.
            alone = whole - resident_bytes(layers, (layer,), (), cost)
            dropped = whole - resident_bytes(layers, (), (layer,), cost)
            facts[layer] = LayerFacts(saved=alone, checkpoint=alone - dropped, forward_s=c.fwd_s,
                                      backward_s=c.bwd_s, recompute_s=c.recompute_s, shared_out=shared_out,
                                      unsaved_in=min(c.unsaved_input_bytes, checkpoint_bytes(layer, cost)))
        shared[s] = whole - sum(facts[layer].saved for layer in layers)
    static = _static(stages, stage_layers, cost, rank_of) + extra_static
    return decide(steps, stage_layers, facts, static, settings, shared), facts, static


def _static(stages: Sequence[int], stage_layers: Sequence[Sequence[int]], cost: Callable[[int], LayerCosts],
            rank_of: Sequence[int]) -> int:
    """Parameters, gradients, optimizer state, and the received gradient the rank holds at once
    (``sim.memory.received_gradient_bytes``, as the engine and the runtime hold it)."""
    static = sum(cost(layer).param_bytes + cost(layer).grad_bytes + cost(layer).optimizer_bytes
                 for s in stages for layer in stage_layers[s])
    return static + received_gradient_bytes(stages, rank_of, stage_layers, cost)


def delta_estimate(schedule: str, pp: int, microbatches: int, chunks: int, stage_layers: Sequence[Sequence[int]],
                   cost: Callable[[int], LayerCosts], settings: DeltaSettings) -> list[tuple[float, int]]:
    """For the fast estimate (``sim.estimate``), per pipeline rank: the recompute seconds per
    micro-batch DELTA's decisions add, and the activation bytes it holds at its settled peak. The
    same replay as ``delta_pass`` on the schedule's own order, with the same gradient bytes beyond the
    static ones (``gradient_extra_bytes``: the estimate adds them to the peak itself); swaps are
    priced as hidden behind compute. Deciding at run time, the
    engines release after each layer of a forward, so a rank that releases holds up to one layer
    more: added."""
    out = []
    placement = SCHEDULES[schedule].placement
    rank_of = [stage_to_rank(s, pp, chunks, placement) for s in range(len(stage_layers))]
    for k, actions in enumerate(generate_schedule(schedule, pp, microbatches, chunks, None)):
        steps = [Step(_STEP_OF_OP[a.op], a.stage, a.microbatch) for a in actions if a.op in _STEP_OF_OP]
        decisions, facts, static = _replay(steps, stage_layers, cost, settings, rank_of, _extra(settings, k))
        recompute = sum(facts[layer].recompute_s for layers in decisions.dropped.values() for layer in layers)
        held = max(0, decisions.settled_peak_bytes - static)
        if settings.decide == "runtime" and (decisions.dropped or decisions.swapped):
            # a layer's tensors arrive before the release after it
            held += max(cost(layer).saved_bytes for layer in facts)
        out.append((recompute / microbatches, held))
    return out


def delta_pass(draft: _Draft) -> None:
    from sim.lower import Node

    settings = draft.policy.delta
    assert settings is not None
    stage_layers = draft.program.stage_layers
    computes = [n for n in draft.nodes if n.kind in _STEP_OF]
    # one flattened gradient bucket in flight and the gradients as held, beyond their bytes in the
    # parameters' dtype that _static counts: what build_delta set for this pipeline rank
    bucket = _extra(settings, draft.coords.pp)
    if settings.decide == "runtime":
        stages = sorted({n.stage for n in computes})
        static = _static(stages, stage_layers, draft.cost, draft.stage_rank) + bucket
        decision_points(draft, computes, max(0, settings.budget_bytes - static))
        return
    decisions, facts, _ = _replay([Step(_STEP_OF[n.kind], n.stage, n.microbatch) for n in computes], stage_layers,
                                  draft.cost, settings, draft.stage_rank, bucket)
    last_stage = draft.plan.num_stages - 1
    for (s, mb), layers in sorted(decisions.dropped.items()):
        forward = draft.find(Kind.FWD, s, mb)
        backward = draft.find(Kind.BWD, s, mb) or draft.find(Kind.BWD_I, s, mb)
        assert forward is not None and backward is not None
        forward.save = False
        recompute = Node(Kind.RECOMPUTE, s, mb, deps=[forward], layers=layers)
        if s < last_stage and not draft.is_remote(s + 1):
            later = draft.find(Kind.BWD, s + 1, mb) or draft.find(Kind.BWD_I, s + 1, mb)
            recompute.deps.append(later)
        draft.insert_before(backward, recompute)
        backward.deps.append(recompute)
    for (s, mb), layers in sorted(decisions.swapped.items()):
        forward = draft.find(Kind.FWD, s, mb)
        draft.insert_after(forward, Node(Kind.SWAP_OUT, s, mb, deps=[forward], layers=layers,
                                         bytes=movable_bytes(draft.program.stage_layers[s], layers, draft.cost)))


def decision_points(draft: _Draft, computes: list, activation_budget: int) -> None:
    """DELTA at run time: DECIDE instructions where the replay (``sim.delta.decide``) brings tensors
    back, so an engine calling ``sim.delta.choose`` there decides from its own bytes and clock:
    before each compute step whose successor is a backward, ``prefetch`` that backward's swapped
    tensors (one compute step ahead); before each backward, ``return`` its tensors (waiting for the
    prefetch, recomputing what was dropped), then release others while over budget. Releases also
    happen inside every forward, after each layer (both engines do it there: the policy says
    ``decide: runtime``), finer than the replay's once per forward. ``bytes``: the activation budget,
    the rank's budget less the static bytes the replay counts (parameters, gradients, optimizer
    state, received gradients, one gradient bucket), so both engines compare what they hold with
    the same number."""
    from sim.lower import Node

    forward_at: dict[tuple[int, int], int] = {}
    for index, node in enumerate(computes):
        key = (node.stage, node.microbatch)
        nxt = computes[index + 1] if index + 1 < len(computes) else None
        if nxt is not None and nxt.kind is Kind.BWD and forward_at.get((nxt.stage, nxt.microbatch), index) < index:
            draft.insert_before(node, Node(Kind.DECIDE, nxt.stage, nxt.microbatch, tag="prefetch",
                                           bytes=activation_budget))
        if node.kind is Kind.FWD:
            forward_at[key] = index
        else:
            back = draft.insert_before(node, Node(Kind.DECIDE, *key, deps=[draft.find(Kind.FWD, *key)], tag="return",
                                                  bytes=activation_budget))
            node.deps.append(back)


register_memory_policy("delta", DeltaMemory, build_delta, per_plan=True)
