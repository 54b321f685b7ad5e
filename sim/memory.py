"""Memory policies: which layers of each virtual stage recompute, and what share of what a forward
keeps is swapped to host until its backward.

A plan's ``memory:`` section names a registered policy (``policy: stage-aware``) and its settings.
Each registered policy is one record here: its settings (a pydantic model), one line of docs, and
``build(plan, stage_layers, costs, capacity_bytes) -> MemoryPolicy``, which sees the partition, the
per-layer costs and the device capacity, so a policy may decide from them (DELTA does). Lowering
and both engines only read the resulting ``MemoryPolicy``. Imports neither torch nor simpy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sim.costs import CostModel, LayerCosts
from sim.delta import DeltaSettings
from sim.schedules import SCHEDULES, merak_recompute
from sim.workloads import transformer_layers, transformer_of
from traces.errors import ConfigError

if TYPE_CHECKING:
    from sim.plan import Plan


@dataclass(frozen=True)
class MemoryPolicy:
    """Per virtual stage: which layers recompute (any subset of the stage's layers), and what is
    swapped to host between a forward and its backward: a fraction of the saved bytes or, when
    ``swap_layers`` is set, exactly the saved tensors of those layers (a per-layer plan).

    ``problem`` is set by a policy that found no choice fitting the device: ``build_memory_policy``
    (compiling a plan) refuses it with that message, while the plan search, which builds policies
    directly, gets the most frugal choice and lets its estimate prune it."""

    recompute_layers: tuple[tuple[int, ...], ...]
    swap_fraction: tuple[float, ...]
    swap_layers: tuple[tuple[int, ...], ...] | None = None
    problem: str = ""
    delta: DeltaSettings | None = None  # DELTA decides per micro-batch at lowering (sim.delta_lowering)
    # Recompute inside the backward, one checkpointed layer at a time (FullRecompute.in_backward):
    # the backward holds one layer's activations at once, not the stage's; its RECOMPUTE is a marker.
    recompute_in_backward: bool = False
    # How every layer runs, a key of LAYER_VIEWS ("": as costed): under torch's selective
    # checkpointing ("selective", sim.memory_selective) or Korthikanti's selective recomputation of
    # the attention core ("selective-attention", sim.memory_attention), a layer keeps fewer bytes and
    # its backward recomputes the rest; ``layer_view`` says so to whoever prices a layer.
    view: str = ""

    @property
    def selective(self) -> bool:
        """Whether layers run under torch's selective checkpointing (what the runtime can run)."""
        return self.view == "selective"

    def layer_view(self, c: LayerCosts) -> LayerCosts:
        """A layer's costs as this policy runs it (LAYER_VIEWS[view]): its saved bytes are what it keeps
        and its input-gradient step also recomputes what it dropped."""
        return LAYER_VIEWS[self.view](c) if self.view else c

    def recomputes(self, stage: int) -> bool:
        return bool(self.recompute_layers[stage])

    def swaps(self, stage: int) -> bool:
        if self.swap_layers is not None:
            return bool(self.swap_layers[stage])
        return self.swap_fraction[stage] > 0

    def swap_bytes(self, stage: int, layers: Sequence[int], save: bool,
                   cost: Callable[[int], LayerCosts]) -> int:
        """Bytes a forward of ``layers`` of ``stage`` moves to host (and its backward brings back):
        a fraction of what it keeps beyond its kept inputs, or the swapped layers' saved bytes."""
        if self.swap_layers is None:
            recomputed = set() if save else set(self.recompute_layers[stage])
            kept = [layer for layer in layers if layer not in recomputed]
            return int(movable_bytes(layers, kept, cost) * self.swap_fraction[stage])
        return movable_bytes(layers, self.swap_layers[stage], cost)

    def forward_kept_bytes(self, stage: int, layers: Sequence[int], save: bool,
                           cost: Callable[[int], LayerCosts], recomputed_layers: Sequence[int] | None = None) -> int:
        """Bytes a forward of ``layers`` of ``stage`` leaves on the device: everything it saves or,
        when checkpointed, only the input of each recomputed layer plus the other layers' saves.
        ``recomputed_layers``: what this micro-batch's RECOMPUTE re-runs, when the program says."""
        if recomputed_layers is None:
            recomputed_layers = self.recompute_layers[stage]
        return forward_bytes(layers, () if save else recomputed_layers, cost)


def selective_view(c: LayerCosts) -> LayerCosts:
    """A layer's costs under torch's selective checkpointing (unchanged where the model does not know)."""
    if not c.knows_selective:
        return c
    # A layer under SAC keeps its output only when its last operator is a kept one; the layers here
    # end in an add or a ReLU, so no storage is shared across a boundary (tests/test_memory_selective.py).
    return replace(c, saved_bytes=c.selective_saved_bytes, bwd_input_s=c.bwd_input_s + c.selective_recompute_s,
                   shared_input_bytes=0, saved_output_bytes=0)


def attention_core_view(c: LayerCosts) -> LayerCosts:
    """A layer's costs under Korthikanti et al.'s selective recomputation (unchanged where the model
    does not know): the attention core's tensors are not kept, the backward re-runs the core first."""
    if not c.knows_attention_core:
        return c
    return replace(c, saved_bytes=c.saved_bytes - c.attention_core_bytes,
                   bwd_input_s=c.bwd_input_s + c.attention_core_recompute_s)


# Per-layer views of the policies that change how every layer runs (MemoryPolicy.view): one function
# each, which the lowering, the engine and the fast estimate apply alike.
LAYER_VIEWS: dict[str, Callable[[LayerCosts], LayerCosts]] = {
    "selective": selective_view,
    "selective-attention": attention_core_view,
}


def kept_saved_bytes(layers: Sequence[int], kept: Collection[int], cost: Callable[[int], LayerCosts]) -> int:
    """Saved bytes of the ``kept`` layers of one forward of ``layers`` (consecutive, in order), each
    storage once: a layer's input that the previous layer, kept too, saves as its output counts once
    (``LayerCosts.shared_input_bytes``; per-layer measurements count it on both sides)."""
    chosen = set(kept)
    total = 0
    for position, layer in enumerate(layers):
        if layer in chosen:
            c = cost(layer)
            total += c.saved_bytes
            if position > 0 and layers[position - 1] in chosen:
                total -= c.shared_input_bytes
    return total


def forward_bytes(layers: Sequence[int], recomputed: Collection[int], cost: Callable[[int], LayerCosts]) -> int:
    """What a forward of ``layers`` (a stage, in order) leaves on the device when ``recomputed`` run
    checkpointed: the other layers' saved bytes (sim.memory.kept_saved_bytes) and each checkpointed
    layer's input, unless the previous layer, kept, saves that storage already."""
    return resident_bytes(layers, (), recomputed, cost)


def resident_bytes(layers: Sequence[int], away: Collection[int], dropped: Collection[int],
                   cost: Callable[[int], LayerCosts]) -> int:
    """What one (stage, micro-batch) holds on the device while the ``away`` layers' saved tensors are
    on the host and the ``dropped`` layers' are freed (each keeping its input), the others kept.
    A storage counts once while some layer on the device saves it (kept_saved_bytes); the stage
    input and a dropped layer's input never leave (the runtime holds them for the backward:
    ``exec.activations.Slot.kept_inputs``). One function for DELTA's decisions in both engines."""
    gone, rec = set(away), set(dropped)
    on = [layer for layer in layers if layer not in gone and layer not in rec]
    total = kept_saved_bytes(layers, on, cost)
    for position, layer in enumerate(layers):
        if layer in rec:
            shared = input_saved_by_previous(layer, cost) if position > 0 and layers[position - 1] in on else 0
            total += checkpoint_bytes(layer, cost) - shared
    if layers and layers[0] in gone:  # the stage input stays (movable_bytes leaves it out too)
        total += min(checkpoint_bytes(layers[0], cost), cost(layers[0]).saved_bytes)
    return total


def in_backward_extra_bytes(layers: Sequence[int], recomputed: Collection[int],
                            cost: Callable[[int], LayerCosts]) -> int:
    """What a backward that re-runs ``recomputed`` one layer at a time (Megatron-style, MemoryPolicy.
    recompute_in_backward) holds at its most beyond what the forward left (``forward_bytes``). It walks
    the stage backwards, as ``exec.interpreter`` runs it: a re-run layer's activations live until its own
    backward is done, and every layer's saved tensors are freed after its backward, while the checkpointed
    layers' inputs stay to the end. With every layer re-run that is the largest layer's re-run; a kept LM
    head is freed before the blocks below it are re-run, so its bytes and a block's re-run never add up."""
    rec = set(recomputed)
    kept = forward_bytes(layers, rec, cost)
    most = kept  # the first step, the last layer's backward, starts from what the forward left
    for position in range(len(layers) - 1, -1, -1):
        layer = layers[position]
        done = [other for other in layers[position + 1:] if other not in rec]
        held = resident_bytes(layers, done, rec, cost)
        if layer in rec:
            held += cost(layer).saved_bytes - checkpoint_bytes(layer, cost)
        most = max(most, held)
    return most - kept


def held_bytes(layers: Sequence[int], recomputed: Collection[int], cost: Callable[[int], LayerCosts]) -> int:
    """What one (stage, micro-batch) holds once every layer's saved tensors are back (after its
    RECOMPUTE, before its backward). A storage two layers save counts once unless the earlier layer
    was recomputed: its recomputed output is a new storage, while the later layer still holds the
    one it kept from the forward (as torch's checkpointing does)."""
    fresh = set(recomputed)
    total = 0
    for position, layer in enumerate(layers):
        c = cost(layer)
        total += c.saved_bytes
        if layer in fresh:  # its checkpoint: the input it does not save, held beside its re-run
            total += unsaved_checkpoint_bytes(layer, cost)
        if position > 0 and layers[position - 1] not in fresh:
            total -= input_saved_by_previous(layer, cost) if layer in fresh else c.shared_input_bytes
    return total


def unsaved_checkpoint_bytes(layer: int, cost: Callable[[int], LayerCosts]) -> int:
    """The part of a recomputed layer's checkpointed input that its own saved bytes do not count
    (``LayerCosts.unsaved_input_bytes``): the whole input of a layer that does not save it."""
    return min(cost(layer).unsaved_input_bytes, checkpoint_bytes(layer, cost))


def input_saved_by_previous(layer: int, cost: Callable[[int], LayerCosts]) -> int:
    """Bytes of a recomputed layer's checkpointed input that the previous layer, kept, saves as its
    output, so one storage: the part both save (``shared_input_bytes``) and, of the input this layer
    does not save (``unsaved_checkpoint_bytes``), what the previous layer saves of its output
    (``LayerCosts.saved_output_bytes``). resnet-tiny's pool + head follows a block ending in a ReLU,
    which saves its output: one storage; lstm-tiny's first LSTM follows an embedding, which saves
    none of it: two (docs/memory.md). One rule for the forward (``resident_bytes``), the re-run
    (``held_bytes``) and the MILP (``sim.memory_optimal``). Raises ConfigError where the layer does not
    save its input and the costs do not say what the previous layer saves of its output."""
    shared = cost(layer).shared_input_bytes
    unsaved = unsaved_checkpoint_bytes(layer, cost)
    if unsaved == 0:
        return shared
    previous = cost(layer - 1).saved_output_bytes
    if previous < 0:
        # A user's error, not a bug: a profile bundle written before session 16 has no saved_output_bytes.
        raise ConfigError(f"costs: layer {layer - 1}'s LayerCosts.saved_output_bytes",
                          f"layer {layer} does not save its input ({unsaved} B) and the costs do not say whether "
                          f"layer {layer - 1} saves that tensor as its output",
                          "re-profile the workload with this version (its layers table then records "
                          "saved_output_bytes), or give the cost model the field (0 if the layer saves none of it)")
    return shared + min(unsaved, previous)


def movable_bytes(layers: Sequence[int], chosen: Collection[int], cost: Callable[[int], LayerCosts]) -> int:
    """Bytes a swap of the ``chosen`` layers of one forward of ``layers`` (a stage, in order) moves:
    their saved bytes, less the stage's input when the first layer saves it (a layer's saved bytes
    count its input): the runtime keeps the stage input on the device, the backward reads its
    gradient (exec.interpreter ``_to_swap``). Recomputed layers' inputs are kept the same way and
    are never chosen."""
    total = kept_saved_bytes(layers, chosen, cost)
    if layers and layers[0] in chosen:
        total -= min(checkpoint_bytes(layers[0], cost), cost(layers[0]).saved_bytes)
    return total


def received_gradient_bytes(stages: Collection[int], rank_of: Sequence[int], layers_of: Sequence[Sequence[int]],
                            cost: Callable[[int], LayerCosts]) -> int:
    """Bytes of received gradients one pipeline rank holds at once: the largest output of its
    ``stages`` whose next stage sits on another rank (``rank_of[s]``: each stage's pipeline rank).
    One at a time: the runtime allocates a gradient's buffer at its receive's place in program order,
    right before the backward (or recompute) that needs it, after the previous compute step
    (exec.interpreter ``_recv``), and the backward frees it; the engine holds it the same way
    (sim.engine ``_post_receives``). The models that plan memory (DELTA's replay, the MILP, the fast
    estimate) all count it with this function."""
    return max((cost(layers_of[s][-1]).output_bytes for s in stages
                if s + 1 < len(rank_of) and rank_of[s + 1] != rank_of[s]), default=0)


def checkpoint_bytes(layer: int, cost: Callable[[int], LayerCosts]) -> int:
    """A checkpointed layer keeps only its input: the previous layer's output."""
    return cost(layer - 1).output_bytes if layer > 0 else 0


# ---------------------------------------------------------------------------------------------
# Settings of the built-in policies. Every policy may also swap: ``swap`` gives, per virtual stage,
# the fraction of what a forward keeps that goes to host memory until the backward needs it.


class MemoryConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str
    swap: list[float] | None = Field(None, description="per virtual stage: fraction of kept bytes swapped to host")


class NoRecompute(MemoryConfig):
    """Keep every activation the backward needs."""

    policy: Literal["none"] = "none"


class FullRecompute(MemoryConfig):
    """Checkpoint every layer of every stage: keep only layer inputs, recompute in the backward."""

    policy: Literal["full"] = "full"
    # Megatron-LM checkpoints each transformer layer (--checkpoint-num-layers 1, the default at tag
    # v2.5: megatron/arguments.py; megatron/model/transformer.py, _checkpointed_forward, one
    # mpu.checkpoint per chunk of layers), so autograd re-runs one layer's forward right before that
    # layer's backward: a backward holds the kept layer inputs plus ONE layer's activations.
    in_backward: bool = Field(False, description="recompute each transformer layer inside the backward, one at "
                              "a time (Megatron-LM): the peak holds one layer's activations, not the stage's; "
                              "the embedding and the LM head are not re-run")

    @model_validator(mode="after")
    def _no_swap_in_backward(self) -> FullRecompute:
        if self.in_backward and self.swap is not None:
            raise ValueError("in_backward recomputes inside the backward and keeps only layer inputs: "
                             "drop swap (nothing is left to swap)")
        return self


class StageAwareRecompute(MemoryConfig):
    """Merak's stage-aware recomputation: the first stage recomputes ``ratio`` of its layers, later
    stages less, the last none, so that every stage keeps about the same activation bytes."""

    policy: Literal["stage-aware"] = "stage-aware"
    ratio: float = Field(1.0, ge=0.0, le=1.0, description="recomputed fraction r0 of the first stage")


class PerStageRecompute(MemoryConfig):
    """An explicit recomputed fraction for every virtual stage (its first layers recompute)."""

    policy: Literal["per-stage"] = "per-stage"
    recompute: list[float] = Field(description="per virtual stage: fraction of its layers recomputed")


Build = Callable[["Plan", Sequence[Sequence[int]], CostModel, int], MemoryPolicy]


@dataclass(frozen=True)
class MemoryPolicyKind:
    name: str
    config: type[MemoryConfig]
    build: Build  # (plan, stage_layers, costs, capacity_bytes) -> MemoryPolicy
    doc: str
    # A policy whose choice depends on the whole plan (micro-batch, degrees, costs) and is costly to
    # make or to estimate (optimal's MILP, DELTA's replay of each rank's order): the plan search builds
    # and estimates it per plan, for its best plan shapes only (sim.search).
    per_plan: bool = False
    # Whether the torch runtime runs the policy (exec.contract refuses a plan whose policy it cannot run).
    runtime: bool = True


MEMORY_POLICIES: dict[str, MemoryPolicyKind] = {}


def register_memory_policy(name: str, config: type[MemoryConfig], build: Build,
                           per_plan: bool = False, runtime: bool = True) -> MemoryPolicyKind:
    if name in MEMORY_POLICIES:
        raise ValueError(f"memory policy {name!r} is registered twice")
    doc = " ".join((config.__doc__ or "").split("\n\n")[0].split())
    MEMORY_POLICIES[name] = kind = MemoryPolicyKind(name, config, build, doc, per_plan, runtime)
    return kind


def build_memory_policy(plan: Plan, stage_layers: Sequence[Sequence[int]], costs: CostModel,
                        capacity_bytes: int) -> MemoryPolicy:
    policy = MEMORY_POLICIES[plan.memory.policy].build(plan, stage_layers, costs, capacity_bytes)
    if policy.problem:
        raise ConfigError("memory", policy.problem,
                          "raise the memory budget, use more pipeline stages or smaller micro-batches")
    return policy


# ---------------------------------------------------------------------------------------------
# The built-in policies: a recomputed fraction per stage, its first layers recomputing.


def _from_fractions(fraction: Callable[[Plan], list[float]]) -> Build:
    def build(plan: Plan, stage_layers: Sequence[Sequence[int]], costs: CostModel,
              capacity_bytes: int) -> MemoryPolicy:
        if SCHEDULES[plan.schedule.name].recompute_is_schedule:
            # Merak's schedules decide which stages checkpoint (all but the last, in most variants).
            fractions = [1.0 if flag else 0.0 for flag in merak_recompute(plan.schedule.name, plan.pp)]
        else:
            fractions = fraction(plan)
        recompute_layers = tuple(tuple(layers[: math.ceil(round(f * len(layers), 9))])
                                 for f, layers in zip(fractions, stage_layers, strict=True))
        swap = plan.memory.swap
        in_backward = bool(getattr(plan.memory, "in_backward", False))
        if in_backward:
            recompute_layers = megatron_checkpointed(plan, recompute_layers)
        info = SCHEDULES[plan.schedule.name]
        problem = ""
        if in_backward and (info.split_backward or info.recompute_is_schedule):
            problem = (f"memory.in_backward recomputes inside a whole backward; schedule {plan.schedule.name} "
                       f"{'splits its backward' if info.split_backward else 'places its own recomputes'}: "
                       "use a schedule without split backward (1f1b, interleaved-1f1b, gpipe) or drop in_backward")
        return MemoryPolicy(recompute_layers, tuple(swap) if swap is not None else (0.0,) * plan.num_stages,
                            problem=problem, recompute_in_backward=in_backward)

    return build


def megatron_checkpointed(plan: Plan, recompute_layers: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """Of ``recompute_layers``, what Megatron-style per-layer checkpointing re-runs: the transformer blocks
    only. Megatron-LM checkpoints inside ``ParallelTransformer`` (v2.5 ``_checkpointed_forward`` over its
    layers; the embedding, the logits and the cross-entropy run outside it), and DeepSpeed's
    ``PipelineModule`` checkpoints a run of layers only when every one is a transformer layer
    (``_is_checkpointable`` for ``GPTModelPipe``): neither re-runs the embedding or the LM head. Workloads
    that are not transformers keep every layer."""
    transformer = transformer_of(plan.workload, plan.workload_options)
    if transformer is None:
        return recompute_layers
    blocks = {i for i, spec in enumerate(transformer_layers(transformer)) if spec.kind == "block"}
    return tuple(tuple(layer for layer in layers if layer in blocks) for layers in recompute_layers)


def stage_aware_fractions(plan: Plan) -> list[float]:
    """Merak: r_i = 1 - (1 - r0)(P - 1)/(P - 1 - i) on pipeline rank i < P - 1, none on the last,
    so (kept fraction) x (1F1B in-flight micro-batches P - i) is the same on every stage."""
    assert isinstance(plan.memory, StageAwareRecompute)
    pp, ratio = plan.pp, plan.memory.ratio
    fractions = []
    for stage in range(plan.num_stages):
        i = stage % pp
        if pp == 1 or i == pp - 1:
            fractions.append(0.0 if pp > 1 else ratio)
            continue
        fractions.append(max(0.0, 1.0 - (1.0 - ratio) * (pp - 1) / (pp - 1 - i)))
    return fractions


register_memory_policy("none", NoRecompute, _from_fractions(lambda plan: [0.0] * plan.num_stages))
register_memory_policy("full", FullRecompute, _from_fractions(lambda plan: [1.0] * plan.num_stages))
register_memory_policy("stage-aware", StageAwareRecompute, _from_fractions(stage_aware_fractions))
register_memory_policy("per-stage", PerStageRecompute,
                       _from_fractions(lambda plan: [float(f) for f in plan.memory.recompute]))

# Policies in their own modules register themselves on import (after the registry exists).
from sim import delta_lowering, memory_attention, memory_optimal, memory_selective  # noqa: E402, F401
