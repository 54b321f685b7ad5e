"""The optimal per-layer memory policy: keep, recompute or swap every layer of every stage.

Merak's stage-aware rule fixes recompute ratios by a formula; this policy instead solves a small
mixed-integer linear program (``scipy.optimize.milp``, HiGHS) over the same quantities the fast
estimate (``sim.estimate``) and the engine's memory ledger use:

- **Time.** Per pipeline rank k and micro-batch, ``t_k >= base_k + sum(recompute of its recomputed
  layers) + sum(exposed swap-in of its stages)`` (compute stream) and ``t_k >= sum(2 x saved / host
  bandwidth of its swapped layers)`` (the copy stream moves every swapped byte out and back once per
  micro-batch). The lowering starts a swap-in with the compute step before the backward that needs
  it (``sim.lower.swap_pass``): in a 1F1B-like steady state a forward, whose own swap-out queues
  behind it, so ``exposed_s = max(0, swapped_s / bandwidth - forward_s)``; but when the stage
  recomputes anything that step is its RECOMPUTE, which starts right after a forward, so the
  forward's swap-out runs first: ``exposed_s = max(0, 2 x swapped_s / bandwidth - recompute_s)``.
  What the copies take beyond their window, the backward waits. The iteration is priced as the
  estimate prices a pipeline: ``m x max_k t_k`` (the bottleneck's steady state) ``+ beta x
  sum_k t_k`` (the schedule's bubble, ``beta`` read from the schedule's own unit-cost run), so an
  idle rank's choices still count, a little.
- **Memory.** For every rank and every state of the schedule that can be its peak (``n`` forwards
  held and ``x`` recomputed sets held per local stage, from ``sim.estimate.unit_pipeline``): the
  static bytes plus, per stage, ``n x kept + x x recomputed-back + min(n, 2) x swapped`` must fit.
  ``kept`` counts a kept layer's saved bytes and a recomputed layer's input (the ledger's
  ``checkpoint_bytes``), a storage the previous layer, kept, saves too counted once (the ledger's rule:
  ``sim.memory.input_saved_by_previous``); ``recomputed-back`` adds a re-run layer's saved bytes and the input
  it does not save, less its checkpoint (``held_bytes - forward_bytes``); a swapped micro-batch is on the
  device while its swap-out runs and again from its prefetch one compute step before the backward, hence
  ``min(n, 2)`` of them. That holds while a swap-out ends within the next forward, so a stage swaps no more
  than its forward time can move (in the warm-up forwards run back to back, and a slower copy would pile them
  up).
- **The optimizer step.** It holds no activations but the model state with the optimizer's own
  copies of the gradients (``sim.model_state.step_peak_bytes``: Megatron's fp16 optimizer copies
  them to fp32), which may exceed the pipeline's peak. No choice changes it, so a rank whose step
  does not fit is refused (``step_problem``) rather than planned for.

The model is in plain numbers (``LayerChoiceModel``) with ``time`` and ``fits`` for any choice, so
tests brute-force small cases against ``solve``. What the model leaves out (the order of the copy
stream's queue, contention of the copy stream with TP/DP traffic, the gradient-sync tail) the engine simulates; the
benchmark ``benchmarks/memory_optimal.py`` checks the chosen plans there. Imports neither torch
nor simpy.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from sim.costs import CostModel
from sim.memory import (
    MemoryConfig,
    MemoryPolicy,
    checkpoint_bytes,
    input_saved_by_previous,
    received_gradient_bytes,
    register_memory_policy,
    unsaved_checkpoint_bytes,
)
from sim.schedules import SCHEDULES, merak_recompute

if TYPE_CHECKING:
    from sim.plan import Plan

KEEP, RECOMPUTE, SWAP = 0, 1, 2
Choice = tuple[int, ...]  # per entry of ``LayerChoiceModel.layers``: KEEP, RECOMPUTE or SWAP


class OptimalMemory(MemoryConfig):
    """Per layer of every stage, keep, recompute or swap to host, chosen by a MILP (HiGHS) that
    minimises the predicted iteration time with the schedule's in-flight micro-batches within the
    memory budget; ``swap`` (optional) caps the fraction of each stage's saved bytes it may swap."""

    policy: Literal["optimal"] = "optimal"
    budget_gb: float | None = Field(None, gt=0, description="memory per device to plan for, GiB "
                                    "(default: the device's capacity)")
    allow_swap: bool = Field(True, description="may swap layers to host memory")
    allow_recompute: bool = Field(True, description="may recompute layers")


@dataclass(frozen=True)
class LayerChoiceModel:
    """The optimisation problem in numbers. Layers are listed stage by stage; ``stage_of[i]`` is
    the virtual stage of ``layers[i]``; ranks are pipeline ranks."""

    layers: tuple[int, ...]
    stage_of: tuple[int, ...]
    rank_of_stage: tuple[int, ...]
    microbatches: int
    bubble_weight: float  # beta: seconds of bubble per second of (sum over ranks of t_k)
    base_s: tuple[float, ...]  # per rank: forward + backward per micro-batch, every layer kept
    forward_s: tuple[float, ...]  # per stage: its forward (the prefetch window when it recomputes nothing)
    recompute_s: tuple[float, ...]  # per layer
    copy_s: tuple[float, ...]  # per layer: out and back through the host link
    saved: tuple[int, ...]  # per layer: bytes its forward saves
    checkpoint: tuple[int, ...]  # per layer: bytes kept when it is recomputed (its input)
    static: tuple[int, ...]  # per rank: parameters, gradients, optimizer state, buffers
    states: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]  # per rank, per state, per local stage (n, x)
    local_stages: tuple[tuple[int, ...], ...]  # per rank: its virtual stages, in the states' order
    capacity: int
    swap_cap: tuple[float, ...]  # per stage: largest fraction of its saved bytes that may be swapped
    allow_swap: bool = True
    allow_recompute: bool = True
    # per layer: bytes of its saved input that the previous layer of its stage saves too (a ResNet
    # ReLU output is the next convolution's input): counted once while both keep it, as
    # sim.memory.kept_saved_bytes
    shared: tuple[int, ...] = ()
    # per layer: bytes of its checkpoint (when recomputed) that the previous layer of its stage, kept,
    # saves (sim.memory.input_saved_by_previous: ``shared`` and, for a layer that does not save its
    # input, the previous layer's saved output): counted once, as sim.memory.forward_bytes; empty: 0
    checkpoint_shared: tuple[int, ...] = ()
    # per layer: the input a recomputed layer holds beside its re-run's saved tensors, as it does not
    # save it (sim.memory.unsaved_checkpoint_bytes, as sim.memory.held_bytes counts it); empty: 0
    unsaved: tuple[int, ...] = ()
    # per rank: bytes held during the optimizer step (sim.model_state.step_peak_bytes), which no choice
    # changes; a rank's peak is the larger of its pipeline's and this
    step: tuple[int, ...] = ()

    # -- the objective and the constraints, for any choice ---------------------------------------
    def rank_times(self, choice: Choice) -> list[float]:
        pp, stages_n = len(self.base_s), len(self.forward_s)
        compute, copy = list(self.base_s), [0.0] * pp
        recomputing, swapping = [0.0] * stages_n, [0.0] * stages_n
        for i, c in enumerate(choice):
            s = self.stage_of[i]
            if c == RECOMPUTE:
                recomputing[s] += self.recompute_s[i]
            elif c == SWAP:
                swapping[s] += self.copy_s[i] / 2
        for s in range(stages_n):
            k = self.rank_of_stage[s]
            if any(choice[i] == RECOMPUTE for i in self._members(s)):
                exposed = max(0.0, 2 * swapping[s] - recomputing[s])
            else:
                exposed = max(0.0, swapping[s] - self.forward_s[s])
            compute[k] += recomputing[s] + exposed
            copy[k] += 2 * swapping[s]
        return [max(a, b) for a, b in zip(compute, copy, strict=True)]

    def _members(self, stage: int) -> list[int]:
        return [i for i, s in enumerate(self.stage_of) if s == stage]

    def time(self, choice: Choice) -> float:
        t = self.rank_times(choice)
        return self.microbatches * max(t) + self.bubble_weight * sum(t)

    def counted_once(self, i: int, choice: Choice) -> int:
        """Bytes layer ``i`` shares with the previous layer of its stage that count once under
        ``choice``: the previous one kept, this one kept (``shared``) or recomputed (its checkpoint,
        ``checkpoint_shared``)."""
        if i == 0 or self.stage_of[i - 1] != self.stage_of[i] or choice[i - 1] != KEEP:
            return 0
        if choice[i] == KEEP:
            return self.shared[i] if self.shared else 0
        return self.checkpoint_shared[i] if choice[i] == RECOMPUTE and self.checkpoint_shared else 0

    def back_bytes(self, i: int) -> int:
        """What layer ``i``, recomputed, adds once its re-run is back (before its backward) to what its
        checkpointed forward keeps: its saved bytes and the input it holds beside them, less that
        checkpoint (sim.memory.held_bytes - sim.memory.forward_bytes, whatever its neighbours do)."""
        return self.saved[i] + (self.unsaved[i] if self.unsaved else 0) - self.checkpoint[i]

    def kept_bytes(self, choice: Choice) -> dict[int, int]:
        """Per stage: what one forward leaves on the device (swapped layers aside), each storage once."""
        kept: dict[int, int] = {}
        for i, c in enumerate(choice):
            s = self.stage_of[i]
            kept[s] = kept.get(s, 0) + (self.saved[i] if c == KEEP else self.checkpoint[i] if c == RECOMPUTE else 0) \
                - self.counted_once(i, choice)
        return kept

    def peaks(self, choice: Choice) -> list[int]:
        kept = self.kept_bytes(choice)
        back: dict[int, int] = {}
        swapped: dict[int, int] = {}
        for i, c in enumerate(choice):
            s = self.stage_of[i]
            back[s] = back.get(s, 0) + (self.back_bytes(i) if c == RECOMPUTE else 0)
            swapped[s] = swapped.get(s, 0) + (self.saved[i] if c == SWAP else 0)
        return [max(self.static[k] + max((sum(n * kept.get(s, 0) + x * back.get(s, 0) + min(n, 2) * swapped.get(s, 0)
                                              for s, (n, x) in zip(self.local_stages[k], state, strict=True))
                                          for state in self.states[k]), default=0),
                    self.step[k] if self.step else 0)
                for k in range(len(self.base_s))]

    def allowed(self, choice: Choice) -> bool:
        if (not self.allow_swap and SWAP in choice) or (not self.allow_recompute and RECOMPUTE in choice):
            return False
        for s, cap in enumerate(self.swap_cap):
            members = self._members(s)
            swapped = [i for i in members if choice[i] == SWAP]
            if sum(self.saved[i] for i in swapped) > cap * sum(self.saved[i] for i in members):
                return False
            if sum(self.copy_s[i] / 2 for i in swapped) > self.forward_s[s] * (1 + 1e-9):
                return False
        return True

    def fits(self, choice: Choice) -> bool:
        return self.allowed(choice) and max(self.peaks(choice)) <= self.capacity

    def brute_force(self) -> tuple[Choice, float] | None:
        """Every choice (3 ^ layers): the reference for tests on small cases."""
        best: tuple[Choice, float] | None = None
        for choice in itertools.product((KEEP, RECOMPUTE, SWAP), repeat=len(self.layers)):
            if self.fits(choice):
                t = self.time(choice)
                if best is None or t < best[1]:
                    best = (choice, t)
        return best

    # -- the MILP --------------------------------------------------------------------------------
    def solve(self) -> Choice | None:
        """The choice of least ``time`` that fits, or None when none does. Among equally fast
        choices the one moving and recomputing least (a tie-break a millionth of the objective)."""
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp

        if any(b > self.capacity for b in self.step):  # the optimizer step does not fit, whatever the choice
            return None
        n, pp, stages_n = len(self.layers), len(self.base_s), len(self.forward_s)
        # Variables: r_i (recompute layer i), w_i (swap it), z_s (stage s recomputes anything),
        # e_s (exposed swap-in of stage s), t_k (rank k per micro-batch), T (the slowest rank).
        # u_i, v_i (continuous, <= 1): layer i, kept (u) or recomputed (v), shares its input with the
        # previous layer, kept (``counted_once``)
        size = 2 * n + 2 * stages_n + pp + 1 + 2 * n
        r, w, z, e = 0, n, 2 * n, 2 * n + stages_n
        t = 2 * n + 2 * stages_n
        big_t = t + pp
        u = big_t + 1
        v = u + n
        scale = max([*self.base_s, *self.recompute_s, *self.copy_s, 1e-30])  # times to order 1
        cost = np.zeros(size)
        cost[big_t] = self.microbatches
        cost[t:t + pp] = self.bubble_weight
        tie = 1e-6 / max(n, 1)
        cost[r:r + n] = tie * np.array(self.recompute_s) / scale
        cost[w:w + n] = tie * np.array(self.copy_s) / scale
        rows, lower, upper = [], [], []

        def row(coefficients: dict[int, float], lo: float, hi: float) -> None:
            vector = np.zeros(size)
            for index, value in coefficients.items():
                vector[index] += value
            rows.append(vector)
            lower.append(lo)
            upper.append(hi)

        # per layer, what counts once after a kept previous layer: this one kept, this one recomputed
        kept_share = [self.counted_once(i, (KEEP,) * n) for i in range(n)]
        recomputed_share = [self.counted_once(i, (KEEP,) * i + (RECOMPUTE,) * (n - i)) for i in range(n)]
        for i in range(n):
            row({r + i: 1.0, w + i: 1.0}, -np.inf, 1.0)
            row({r + i: 1.0, z + self.stage_of[i]: -1.0}, -np.inf, 0.0)
            if kept_share[i]:  # u_i <= [previous kept] = 1 - r - w, u_i <= [this one kept] = 1 - r - w
                row({u + i: 1.0, r + i - 1: 1.0, w + i - 1: 1.0}, -np.inf, 1.0)
                row({u + i: 1.0, r + i: 1.0, w + i: 1.0}, -np.inf, 1.0)
            if recomputed_share[i]:  # v_i <= [previous kept], v_i <= [this one recomputed] = r
                row({v + i: 1.0, r + i - 1: 1.0, w + i - 1: 1.0}, -np.inf, 1.0)
                row({v + i: 1.0, r + i: -1.0}, -np.inf, 0.0)
        for s in range(stages_n):
            # e_s >= 2 x swapped - recompute when z_s, e_s >= swapped - forward otherwise (times / scale);
            # ``big`` switches a row off: no right side exceeds it.
            members = self._members(s)
            big = (sum(self.copy_s[i] for i in members) + self.forward_s[s]) / scale
            row({**{w + i: self.copy_s[i] / scale for i in members},
                 **{r + i: -self.recompute_s[i] / scale for i in members},
                 z + s: big, e + s: -1.0}, -np.inf, big)
            row({**{w + i: self.copy_s[i] / 2 / scale for i in members},
                 z + s: -big, e + s: -1.0}, -np.inf, self.forward_s[s] / scale)
            # a swap-out ends within the next forward (see the module's docstring)
            row({w + i: self.copy_s[i] / 2 / scale for i in members}, -np.inf, self.forward_s[s] / scale)
        for k in range(pp):
            on_k = [i for i in range(n) if self.rank_of_stage[self.stage_of[i]] == k]
            exposed = {e + s: 1.0 for s in range(stages_n) if self.rank_of_stage[s] == k}
            # base + sum rec r + sum e - t <= 0 and sum copy w - t <= 0, in units of ``scale``
            row({**{r + i: self.recompute_s[i] / scale for i in on_k}, **exposed, t + k: -1.0},
                -np.inf, -self.base_s[k] / scale)
            row({**{w + i: self.copy_s[i] / scale for i in on_k}, t + k: -1.0}, -np.inf, 0.0)
            row({t + k: 1.0, big_t: -1.0}, -np.inf, 0.0)
            room = self.capacity - self.static[k]
            for state in self.states[k]:
                n_of = dict(zip(self.local_stages[k], state, strict=True))
                coefficients: dict[int, float] = {}
                constant = 0.0
                for i in on_k:
                    held, back = n_of[self.stage_of[i]]
                    saved, ckpt = self.saved[i], self.checkpoint[i]
                    constant += held * saved
                    coefficients[r + i] = (held * (ckpt - saved) + back * self.back_bytes(i)) / self.capacity
                    coefficients[w + i] = (min(held, 2) - held) * saved / self.capacity
                    coefficients[u + i] = -held * kept_share[i] / self.capacity
                    coefficients[v + i] = -held * recomputed_share[i] / self.capacity
                row(coefficients, -np.inf, (room - constant) / self.capacity)
        for s, cap in enumerate(self.swap_cap):
            members = [i for i in range(n) if self.stage_of[i] == s]
            total = sum(self.saved[i] for i in members)
            if cap < 1.0 and total > 0:
                row({w + i: self.saved[i] / total for i in members}, -np.inf, cap)
        integrality = np.zeros(size)
        integrality[: 2 * n + stages_n] = 1
        high = np.full(size, np.inf)
        high[z:z + stages_n] = 1.0
        high[r:r + n] = 1.0 if self.allow_recompute else 0.0
        high[w:w + n] = 1.0 if self.allow_swap else 0.0
        high[u:u + n] = [1.0 if b else 0.0 for b in kept_share]
        high[v:v + n] = [1.0 if b else 0.0 for b in recomputed_share]
        result = milp(cost, constraints=LinearConstraint(np.array(rows), lower, upper), integrality=integrality,
                      bounds=Bounds(np.zeros(size), high), options={"mip_rel_gap": 1e-9})
        if result.x is None:
            return None
        x = np.round(result.x[: 2 * n]).astype(int)
        choice = tuple(RECOMPUTE if x[r + i] else SWAP if x[w + i] else KEEP for i in range(n))
        # The rows are scaled; the unscaled check guards against a rounding at the boundary.
        return choice if self.fits(choice) else None


# ---------------------------------------------------------------------------------------------
# From a plan to the model, and from a choice to a MemoryPolicy.


def layer_choice_model(plan: Plan, stage_layers: Sequence[Sequence[int]], costs: CostModel,
                       capacity_bytes: int) -> LayerChoiceModel:
    from sim.cluster import load_cluster
    from sim.comm import ClusterComm
    from sim.estimate import Estimator, _layout, unit_pipeline
    from sim.gradient_sync import bucket_buffer_bytes
    from sim.model_state import held_gradient_bytes, held_optimizer_bytes, step_peak_bytes

    config = plan.memory
    assert isinstance(config, OptimalMemory)
    comm = ClusterComm(load_cluster(plan.cluster), None)
    estimator = Estimator(costs, comm, plan.dtype)
    info = SCHEDULES[plan.schedule.name]
    pp, stages_n, mb, tp = plan.pp, plan.num_stages, plan.micro_batch, plan.tp
    level = plan.parallelism.tp_overlap
    rank_of, stages_of = _layout(pp, plan.chunks, info.placement)
    unit = unit_pipeline(plan.schedule.name, pp, plan.microbatches, plan.chunks, (False,) * stages_n, 0.0)
    m = plan.microbatches
    bubble_weight = max(0.0, unit.makespan - max(unit.busy)) / max(sum(b / m for b in unit.busy), 1e-30)
    latency, bandwidth = comm.host_copy()

    def cost(layer: int):  # noqa: ANN202 - LayerCosts
        return costs.layer_costs(layer, mb, tp)

    layers, stage_of, recompute_s, copy_s, saved, ckpt, shared, ckpt_shared, unsaved = ([] for _ in range(9))
    base = [0.0] * pp
    static = [0] * pp
    # what the optimizer step holds (sim.model_state.step_peak_bytes), and the optimizer state counted whole
    model_state, grads, state = [0] * pp, [0] * pp, [0] * pp
    forward = []
    for s in range(stages_n):
        whole = estimator.stage(tuple(stage_layers[s]), (), mb, tp, level, 0.0)
        base[rank_of[s]] += whole.fwd_s + whole.bwd_s
        forward.append(whole.fwd_s)
        # the gradients as held (sim.model_state): the stage counted them in the parameters' dtype
        static[rank_of[s]] += whole.static_bytes - whole.grad_bytes + held_gradient_bytes(
            whole.grad_bytes, plan.gradient_sync, plan.dtype)
        model_state[rank_of[s]] += whole.static_bytes
        grads[rank_of[s]] += whole.grad_bytes
        state[rank_of[s]] += whole.static_bytes - whole.param_bytes - whole.grad_bytes
        for layer in stage_layers[s]:
            layers.append(layer)
            stage_of.append(s)
            recompute_s.append(estimator.stage((layer,), (layer,), mb, tp, level, 0.0).recompute_s)
            saved.append(cost(layer).saved_bytes)
            ckpt.append(checkpoint_bytes(layer, cost))
            first = layer == stage_layers[s][0]
            shared.append(0 if first else cost(layer).shared_input_bytes)
            ckpt_shared.append(0 if first else input_saved_by_previous(layer, cost))
            unsaved.append(unsaved_checkpoint_bytes(layer, cost))
            copy_s.append(2 * (latency + saved[-1] / bandwidth))
    for k in range(pp):  # the received gradient a rank holds at once, as the engine and the runtime do
        static[k] += received_gradient_bytes(stages_of[k], rank_of, stage_layers, cost)
        # the optimizer state as held: 1/dp of it under the distributed optimizer (sim.model_state)
        static[k] -= state[k] - held_optimizer_bytes(state[k], plan.gradient_sync, plan.dp)
    # one flattened gradient bucket in flight, clipped to the rank's gradients, as the estimate counts it
    static = [b + bucket_buffer_bytes(plan.gradient_sync, plan.gradient_sync.bucket_mb, g, plan.dp, plan.dtype)
              for b, g in zip(static, grads, strict=True)]
    capacity = capacity_bytes if config.budget_gb is None else min(capacity_bytes, int(config.budget_gb * 2**30))
    swap_cap = tuple(config.swap) if config.swap is not None else (1.0,) * stages_n
    return LayerChoiceModel(
        layers=tuple(layers), stage_of=tuple(stage_of), rank_of_stage=rank_of, microbatches=m,
        bubble_weight=bubble_weight, base_s=tuple(base), forward_s=tuple(forward), recompute_s=tuple(recompute_s),
        copy_s=tuple(copy_s),
        saved=tuple(saved), checkpoint=tuple(ckpt), static=tuple(static), states=unit.states,
        local_stages=stages_of, capacity=capacity, swap_cap=swap_cap,
        allow_swap=config.allow_swap, allow_recompute=config.allow_recompute, shared=tuple(shared),
        checkpoint_shared=tuple(ckpt_shared), unsaved=tuple(unsaved),
        step=tuple(step_peak_bytes(costs, b, g, plan.gradient_sync, plan.dtype, o, plan.dp)
                   for b, g, o in zip(model_state, grads, state, strict=True)))


def policy_of(model: LayerChoiceModel, choice: Choice, num_stages: int) -> MemoryPolicy:
    recompute: list[list[int]] = [[] for _ in range(num_stages)]
    swap: list[list[int]] = [[] for _ in range(num_stages)]
    for layer, s, c in zip(model.layers, model.stage_of, choice, strict=True):
        if c == RECOMPUTE:
            recompute[s].append(layer)
        elif c == SWAP:
            swap[s].append(layer)
    return MemoryPolicy(tuple(map(tuple, recompute)), (0.0,) * num_stages, tuple(map(tuple, swap)))


def build_optimal(plan: Plan, stage_layers: Sequence[Sequence[int]], costs: CostModel,
                  capacity_bytes: int) -> MemoryPolicy:
    stages_n = plan.num_stages
    if SCHEDULES[plan.schedule.name].recompute_is_schedule:
        flags = merak_recompute(plan.schedule.name, plan.pp)
        return MemoryPolicy(tuple(tuple(layers) if f else () for f, layers in zip(flags, stage_layers, strict=True)),
                            (0.0,) * stages_n,
                            problem=f"schedule {plan.schedule.name} fixes its own recomputation; the optimal "
                            "memory policy needs an ordinary schedule (1f1b, gpipe, interleaved-1f1b, zb-*)")
    from sim.model_state import step_problem

    model = layer_choice_model(plan, stage_layers, costs, capacity_bytes)
    choice = model.solve()
    if choice is not None:
        return policy_of(model, choice, stages_n)
    problem = step_problem(model.step, model.capacity)
    if problem:  # the pipeline may fit; the step, which no choice changes, does not
        return replace(policy_of(model, (KEEP,) * len(model.layers), stages_n), problem=problem)
    # Nothing fits: recompute everything (or swap everything, if recompute is off), with the reason.
    frugal = tuple(RECOMPUTE if model.allow_recompute else SWAP if model.allow_swap else KEEP for _ in model.layers)
    peaks = model.peaks(frugal)
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    what = "recomputing" if model.allow_recompute else "swapping" if model.allow_swap else "keeping"
    return replace(policy_of(model, frugal, stages_n),
                   problem=f"no per-layer choice fits {model.capacity / 2**30:.3g} GiB per device: even {what} "
                   f"every layer, pipeline rank {worst} needs {peaks[worst] / 2**30:.3g} GiB (static "
                   f"{model.static[worst] / 2**30:.3g} GiB) with {plan.microbatches} micro-batches of "
                   f"{plan.micro_batch}")


register_memory_policy("optimal", OptimalMemory, build_optimal, per_plan=True)
