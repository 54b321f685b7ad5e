"""DELTA's decisions (dynamic tensor offload and recompute, arXiv 2203.15980), in plain Python.

Under a memory budget per rank, after each forward and after a backward's tensors come back
(prefetched or recomputed), while the rank holds more than the budget, release one saved tensor:

- **Filter**: among the saved tensors still on the device that are not tiny, the victim is the one
  with the largest ``bytes x staleness`` (seconds since its last use).
- **Director**: swap it to host when moving it out and back (``2 x (latency + bytes / host
  bandwidth)``) costs less than recomputing the op that produced it; otherwise drop it and
  recompute it before the backward that needs it (its input stays: ``checkpoint`` bytes).
- Swapped tensors are prefetched one compute step ahead of their backward, on the copy stream
  (the replay counts them back from that step on).

Granularity: a "tensor" is what one layer of one (stage, micro-batch) saves, the unit both engines
account (``sim.engine``'s ledger) and move (``exec.activations.SavedStore`` tags every saved tensor
with its layer). The decisions are made once per rank, by replaying the rank's compute order with
the cost model's durations (``decide``); lowering (``sim.delta_lowering``) writes them into the
Program as checkpointed forwards with per-micro-batch RECOMPUTE layers and SWAP_OUT / SWAP_IN
instructions with their layers, so the simulator and the runtime execute the very same decisions
and their instruction tables compare row for row. What this leaves out of the paper's DELTA: the
runtime does not re-decide from the memory it measures (the replay's predictions stand), and a
victim's swap-out is issued right after its own forward rather than at the moment it is chosen.
Imports neither torch nor simpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DeltaSettings:
    budget_bytes: int  # everything this rank holds: parameters, gradients, optimizer state, activations
    tiny_bytes: int  # saved tensors smaller than this are never released
    host_latency_s: float
    host_bandwidth_Bps: float
    director: str = "cost"  # cost (DELTA's rule) / swap / recompute (baselines: always one)
    # lowering: decided once, by ``decide``, and written into the Program; runtime: each engine
    # decides at the Program's DECIDE instructions from what it holds (sim.delta_runtime, exec.delta_runtime)
    decide: str = "lowering"
    # per pipeline rank, bytes it holds beyond what the replay's static counts (parameters, gradients in
    # the parameters' dtype, optimizer state, received gradient): the held gradients' extra over their
    # dtype and one gradient bucket (sim.delta_lowering.gradient_extra_bytes). Part of the settings, so a
    # policy built for one gradient sync is never taken for another's (the estimate caches by policy).
    # Empty: none (hand-made settings).
    gradient_extra_bytes: tuple[int, ...] = ()


@dataclass(frozen=True)
class LayerFacts:
    saved: int  # bytes its forward saves (one micro-batch)
    checkpoint: int  # bytes kept when it is dropped (its input)
    forward_s: float
    backward_s: float
    recompute_s: float
    # bytes of its output that the next layer of the stage saves too: re-run, it makes a new storage
    # while the next layer still holds the old one (sim.memory.held_bytes)
    shared_out: int = 0
    # bytes of its input it does not save: dropped, it keeps that input, held beside its re-run's
    # tensors once it is back (sim.memory.held_bytes)
    unsaved_in: int = 0


@dataclass(frozen=True)
class Step:
    """One compute step of the rank, in program order: F (forward), B (backward, or its input
    half I), W (the weight half of a split backward: the micro-batch's tensors die after it)."""

    op: str
    stage: int
    microbatch: int


@dataclass
class _Saved:
    stage: int
    microbatch: int
    layer: int
    facts: LayerFacts
    last_use: float
    where: str = "device"  # device / host / dropped / needed (back on the device for its backward)


@dataclass
class Decisions:
    """Per (stage, micro-batch): the layers dropped (recomputed) and the layers swapped."""

    dropped: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    swapped: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    peak_bytes: int = 0  # the replay's own peak, before each release
    settled_peak_bytes: int = 0  # the largest it holds once a step's releases are done (the ledger's view)
    short_bytes: int = 0  # how far above the budget the replay stayed when nothing was left to release


def decide(steps: Sequence[Step], stage_layers: Sequence[Sequence[int]], facts: dict[int, LayerFacts],
           static_bytes: int, settings: DeltaSettings, shared: dict[int, int] | None = None) -> Decisions:
    """Replay ``steps`` against a ledger of per-layer saved tensors and release victims after each
    forward and each backward's return while over budget. Deterministic: ties go to the earliest
    (stage, micro-batch, layer). ``shared[stage]``: what a forward holds beyond its layers' own
    ``saved`` (the stage input, storages two layers save), so the replay holds what the ledger does."""
    shared = shared or {}
    now = 0.0
    resident = static_bytes
    live: dict[tuple[int, int, int], _Saved] = {}
    out = Decisions(peak_bytes=static_bytes)
    twice: dict[tuple[int, int], int] = {}  # re-run outputs held beside the old storage (LayerFacts.shared_out)
    forward_at: dict[tuple[int, int], int] = {}
    for index, step in enumerate(steps):
        key = (step.stage, step.microbatch)
        layers = stage_layers[step.stage]
        resident = _prefetch(steps, index, forward_at, stage_layers, live, resident)
        if step.op == "F":
            forward_at[key] = index
            for layer in layers:
                live[(*key, layer)] = _Saved(step.stage, step.microbatch, layer, facts[layer], now)
                resident += facts[layer].saved
            resident += shared.get(step.stage, 0)
            now += sum(facts[layer].forward_s for layer in layers)
            out.peak_bytes = max(out.peak_bytes, resident)
            resident = _release(live, resident, now, settings, out)
            out.settled_peak_bytes = max(out.settled_peak_bytes, resident)
        elif step.op == "B":
            mine = [live[(*key, layer)] for layer in layers]
            back = sum(t.facts.saved if t.where == "host" else t.facts.saved - t.facts.checkpoint
                       for t in mine if t.where in ("host", "dropped"))
            twice[key] = sum(t.facts.shared_out for t in mine[:-1] if t.where == "dropped") \
                + sum(t.facts.unsaved_in for i, t in enumerate(mine)
                      if t.where == "dropped" and (i == 0 or mine[i - 1].where == "dropped"))
            resident += back + twice[key]
            out.peak_bytes = max(out.peak_bytes, resident)
            now += sum(t.facts.recompute_s for t in mine if t.where == "dropped")
            for t in mine:  # back for good: its backward has begun (a split one ends at W)
                t.where, t.last_use = "needed", now
            # what came back may push the rank over: release other micro-batches' tensors
            resident = _release(live, resident, now, settings, out)
            out.settled_peak_bytes = max(out.settled_peak_bytes, resident)
            now += sum(t.facts.backward_s for t in mine)
        if step.op == "W" or (step.op == "B" and not _split(steps, key)):
            resident -= sum(facts[layer].saved for layer in layers) + shared.get(step.stage, 0) + twice.pop(key, 0)
            for layer in layers:
                del live[(*key, layer)]
    return out


def _prefetch(steps: Sequence[Step], index: int, forward_at: dict[tuple[int, int], int],
              stage_layers: Sequence[Sequence[int]], live: dict[tuple[int, int, int], _Saved], resident: int) -> int:
    """As the lowering does (``sim.lower.swap_pass``): the swapped tensors of the backward that
    follows this step come back as this step starts (never before the step after their forward)."""
    if index + 1 >= len(steps) or steps[index + 1].op != "B":
        return resident
    nxt = steps[index + 1]
    key = (nxt.stage, nxt.microbatch)
    if forward_at.get(key, index) >= index:
        return resident
    for layer in stage_layers[nxt.stage]:
        t = live[(*key, layer)]
        if t.where == "host":
            t.where = "needed"
            resident += t.facts.saved
    return resident


def _split(steps: Sequence[Step], key: tuple[int, int]) -> bool:
    return any(s.op == "W" and (s.stage, s.microbatch) == key for s in steps)


def _release(live: dict[tuple[int, int, int], _Saved], resident: int, now: float, settings: DeltaSettings,
             out: Decisions) -> int:
    held = [Held((t.stage, t.microbatch, t.layer), t.facts.saved, t.facts.checkpoint, t.last_use, t.facts.recompute_s)
            for t in live.values() if t.where == "device"]
    actions = choose(held, resident, now, settings)
    by_key = {h.key: h for h in held}
    for key, action in actions:
        t, h = live[key], by_key[key]
        resident -= freed(h, action)
        t.where = "host" if action == "swap" else "dropped"
        table = out.swapped if action == "swap" else out.dropped
        table[key[:2]] = tuple(sorted((*table.get(key[:2], ()), key[2])))
    if resident > settings.budget_bytes:
        out.short_bytes = max(out.short_bytes, resident - settings.budget_bytes)
    return resident


# ---------------------------------------------------------------------------------------------
# The policy itself, over plain records: the lowering's replay above, the simulator's decision points
# (sim.delta_runtime) and the runtime's (exec.delta_runtime) all call ``choose``.


@dataclass(frozen=True)
class Held:
    """A saved tensor on the device that may be released: what one layer of one (stage, micro-batch)
    saves. ``bytes`` leave the device when it is swapped; a drop keeps ``kept`` of them (its input)."""

    key: tuple[int, int, int]  # (stage, micro-batch, layer)
    bytes: int
    kept: int
    last_use: float  # seconds, on the caller's clock
    recompute_s: float


def freed(h: Held, action: str) -> int:
    return h.bytes if action == "swap" else h.bytes - h.kept


def choose(held: Sequence[Held], resident: int, now: float,
           settings: DeltaSettings) -> list[tuple[tuple[int, int, int], str]]:
    """DELTA's filter and director while ``resident`` (bytes, compared with ``settings.budget_bytes``)
    is over the budget: the victim is the non-tiny record with the largest ``bytes x (now -
    last_use)`` (ties to the earliest key, so every caller agrees); it is swapped when moving it
    out and back costs less than recomputing it (or always / never, under the baseline directors),
    else dropped. Returns the actions in the order chosen; stops when under budget or out of
    candidates (the caller sees what is left over)."""
    candidates = [h for h in held if h.bytes >= settings.tiny_bytes and h.bytes > h.kept]
    actions: list[tuple[tuple[int, int, int], str]] = []
    while resident > settings.budget_bytes and candidates:
        victim = max(candidates, key=lambda h: (h.bytes * (now - h.last_use), tuple(-k for k in h.key)))
        candidates.remove(victim)
        swap_s = 2 * (settings.host_latency_s + victim.bytes / settings.host_bandwidth_Bps)
        swap = settings.director == "swap" or (settings.director == "cost" and swap_s < victim.recompute_s)
        action = "swap" if swap else "drop"
        actions.append((victim.key, action))
        resident -= freed(victim, action)
    return actions
