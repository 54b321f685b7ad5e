"""DELTA deciding at run time (``memory: {policy: delta, decide: runtime}``): the runtime's side of
the Program's DECIDE instructions (``sim.delta_lowering.decision_points``).

At each decision point the rank measures what it holds (each saved-tensor storage once, as it
reports ``activation_peak``) and the wall clock of each layer's last use, and calls the policy the
simulator calls, ``sim.delta.choose``. It then swaps a layer's saved storages to a host buffer, or
drops them (the layer's segment of the stage's autograd graph goes; its input stays as the
checkpoint that ``RankRuntime._rerun`` re-runs it from, the per-layer mechanism the static policies
use). Swapped tensors come back one compute step ahead of their backward (``prefetch``); a
backward's ``return`` waits for them and re-runs its dropped layers. Every action is a child row of
its DECIDE (``parent`` = the DECIDE's index, ``layer`` = the victim's), the same columns as the
simulator's (``sim.delta_runtime``), so the two can be compared decision by decision.

What "a layer holds" is counted as ``sim.memory.resident_bytes`` counts it: a swap moves the
storages no other layer still on the device saves (never a kept input: the stage input, a dropped
layer's input); a drop frees the storages only that layer saves, less its input.

On CUDA the copies run on a side stream into pinned host buffers, ordered by events: a swap-out's
device storage is held until its copy's event has passed; a prefetched swap-in is waited for by the
compute stream before the backward. On a CPU the same code copies synchronously.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from exec.activations import Run, Slot, storage_key
from sim.delta import Held, choose
from sim.delta_runtime import AWAY, DEVICE, DROPPED, NEEDED, decision_name
from sim.program import Instruction, Kind

if TYPE_CHECKING:
    from exec.interpreter import RankRuntime

@dataclass
class _SlotState:
    layers: tuple[int, ...]
    where: dict[int, str]
    last_use: dict[int, float] = field(default_factory=dict)  # perf_counter seconds
    done: int = 0  # layers forwarded so far
    claimed: bool = False  # its backward is next: no longer a candidate
    dropped_bytes: int = 0  # what its drops freed, measured: what re-running them brings back
    arriving: Any = None  # CUDA: the event of its prefetch


class RuntimeDelta:
    def __init__(self, rt: RankRuntime) -> None:
        self.rt = rt
        self.settings = rt.policy.delta
        assert self.settings is not None
        self.cuda = rt.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(rt.device) if self.cuda else None
        self.slots: dict[tuple[int, int], _SlotState] = {}
        self.in_flight: list[tuple[Any, list[torch.UntypedStorage]]] = []  # CUDA swap-outs still copying
        # the rank's activation budget, which the lowering wrote on every DECIDE
        self.budget = next(i.bytes for i in rt.program.instructions if i.kind is Kind.DECIDE)

    def start_iteration(self) -> None:
        self.slots.clear()
        self.in_flight.clear()

    # -- what the forward and backward tell it ---------------------------------------------------
    def forward_layer(self, ins: Instruction, layer: int, release: bool = True) -> None:
        """A layer of ``ins`` (a FWD) just ran: its saved tensors' last use is now; then release
        while over budget (``release=False``: the caller releases once it has finished the layer,
        e.g. attached the loss to the last one)."""
        key = (ins.stage, ins.microbatch)
        if key not in self.slots:
            layers = tuple(self.rt.stage_layers[ins.stage])
            self.slots[key] = _SlotState(layers, dict.fromkeys(layers, DEVICE))
        state = self.slots[key]
        state.done += 1
        state.last_use[layer] = time.perf_counter()
        self.rt._track(self.rt.slots[key])
        if release:
            self.release(ins)

    def backward_done(self, stage: int, microbatch: int) -> None:
        self.slots.pop((stage, microbatch), None)

    # -- the DECIDE instruction ------------------------------------------------------------------
    def decide(self, ins: Instruction) -> int:
        """Run one decision point: make room for what comes back (release others while what the
        rank holds plus what arrives is over budget), then ``prefetch`` starts bringing a backward's
        swapped tensors back, or ``return`` waits for them and re-runs its dropped layers. Returns
        the activation bytes held after it."""
        self._retire_copies()
        key = (ins.stage, ins.microbatch)
        state = self.slots.get(key)
        slot = self.rt.slots.get(key)
        if state is not None and slot is not None:
            rerun = 0
            if ins.tag == "return":
                state.claimed = True
                rerun = state.dropped_bytes
            self.release(ins, incoming=_host_bytes(slot) + rerun)
            self._bring_back(ins, key, wait=ins.tag == "return")
            if ins.tag == "return":
                self._rerun_dropped(ins, key)
        return self.rt.activation_bytes

    def release(self, ins: Instruction, incoming: int = 0) -> None:
        """Ask ``sim.delta.choose`` what to release so that what the rank holds, and ``incoming`` bytes
        about to arrive, fit; do it; each action a child row of ``ins``."""
        budget = replace(self.settings, budget_bytes=self.budget)
        now = time.perf_counter()
        for victim, action in choose(self._records(now), self.rt.activation_bytes + incoming, now, budget):
            start = self.rt.clock.mark()
            moved = self._swap_out(victim) if action == "swap" else self._drop(victim)
            self._child(ins, "SWAP_OUT" if action == "swap" else "DROP", victim, start, moved,
                        "copy" if action == "swap" else "compute")

    # -- measuring ---------------------------------------------------------------------------------
    def _records(self, now: float) -> list[Held]:
        """One record per layer on the device of every micro-batch not yet claimed by its backward:
        the bytes a swap moves (``_leaving``) and what a drop keeps of them (its input, and storages
        another layer saves too)."""
        held: list[Held] = []
        for (s, mb), state in sorted(self.slots.items()):
            slot = self.rt.slots.get((s, mb))
            if state.claimed or slot is None:
                continue
            refs, size = _references(slot)
            for position, layer in enumerate(state.layers[: state.done]):
                if state.where[layer] != DEVICE:
                    continue
                segment = slot.segments[position]
                assert segment is not None
                moving = self._leaving(slot, state, layer, refs)
                dropping = [k for k in moving if refs[k] == {layer} and k != storage_key(segment.inp)]
                swap_bytes = sum(size[k] for k in moving)
                held.append(Held((s, mb, layer), swap_bytes, swap_bytes - sum(size[k] for k in dropping),
                                 state.last_use.get(layer, now), _recompute_s(self.rt, layer)))
        return held

    @staticmethod
    def _leaving(slot: Slot, state: _SlotState, layer: int, refs: dict[int, set[int]]) -> list[int]:
        """The storages a swap of ``layer`` moves: those it saves that no layer still on the device
        saves too (others may be away already) and that are not kept inputs (``resident_bytes``)."""
        keep = {storage_key(t) for t in slot.kept_inputs()}
        return [k for k, users in refs.items() if layer in users and k not in keep
                and all(state.where[u] == AWAY for u in users - {layer})]

    # -- actions -----------------------------------------------------------------------------------
    def _swap_out(self, victim: tuple[int, int, int]) -> int:
        """Move what leaves with the layer now (after this round's earlier actions, as the engine's
        ``RankDelta.apply`` counts it)."""
        s, mb, layer = victim
        slot = self.rt.slots[(s, mb)]
        store = slot.store
        chosen = set(self._leaving(slot, self.slots[(s, mb)], layer, _references(slot)[0]))
        groups: dict[int, list[int]] = {}
        for p, t in enumerate(store.tensors):
            if t is not None and p not in store.host and storage_key(t) in chosen:
                groups.setdefault(storage_key(t), []).append(p)
        moved, sources = self.rt.move_out(store, list(groups.values()), self.copy_stream)
        if self.cuda:  # the device storages live until the copy has read them
            event = torch.cuda.Event()
            event.record(self.copy_stream)
            self.in_flight.append((event, sources))
        self.slots[(s, mb)].where[layer] = AWAY
        self.rt._track(slot)
        return moved

    def _drop(self, victim: tuple[int, int, int]) -> int:
        s, mb, layer = victim
        slot = self.rt.slots[(s, mb)]
        state = self.slots[(s, mb)]
        position = state.layers.index(layer)
        segment = slot.segments[position]
        assert segment is not None
        before = slot.resident
        for p, owner in enumerate(slot.store.layers):
            if owner == layer:
                slot.store.tensors[p] = None  # the segment's graph goes with the segment below
        last = s == self.rt.num_stages - 1 and position == len(state.layers) - 1
        slot.checkpointed.append(Run(position, position + 1, segment.inp, position, loss=last, rng=segment.rng))
        slot.segments[position] = None
        state.where[layer] = DROPPED
        self.rt._track(slot)
        state.dropped_bytes += before - slot.resident
        return before - slot.resident

    def _bring_back(self, ins: Instruction, key: tuple[int, int], wait: bool) -> None:
        state = self.slots.get(key)
        slot = self.rt.slots.get(key)
        if state is None or slot is None:
            return
        if slot.store.host:
            start = self.rt.clock.mark()
            moved = self.rt.move_in(slot.store, self.copy_stream)
            if self.cuda:
                state.arriving = torch.cuda.Event()
                state.arriving.record(self.copy_stream)
            for layer, where in state.where.items():
                if where == AWAY:
                    state.where[layer] = NEEDED  # back for its backward: no longer a candidate
            self.rt._track(slot)
            self._child(ins, "SWAP_IN", (*key, -1), start, moved, "copy")
        if wait and state.arriving is not None:
            torch.cuda.current_stream(self.rt.device).wait_event(state.arriving)
            state.arriving = None

    def _rerun_dropped(self, ins: Instruction, key: tuple[int, int]) -> None:
        slot = self.rt.slots[key]
        for run in sorted(slot.checkpointed, key=lambda r: r.start):
            if slot.segments[run.segment] is not None:
                continue
            start = self.rt.clock.mark()
            before = slot.resident
            self.rt._rerun(slot, key[0], run, key[1])
            self.rt._track(slot)
            self._child(ins, "RECOMPUTE", (*key, self.slots[key].layers[run.start]), start,
                        slot.resident - before, "compute")

    def _retire_copies(self) -> None:
        self.in_flight = [(event, sources) for event, sources in self.in_flight if not event.query()]

    def _child(self, ins: Instruction, kind: str, victim: tuple[int, int, int], start: Any, nbytes: int,
               stream: str) -> None:
        rt = self.rt
        s, mb, layer = victim
        rt.rows.append({
            "rank": rt.rank, "index": ins.index, "kind": kind, "stage": s, "microbatch": mb, "stream": stream,
            "start_s": start, "end_s": rt.clock.mark(), "bytes": nbytes, "mem_after": rt._memory(),
            "parent": ins.index, "layer": layer, "name": decision_name(kind, s, mb, layer),
            "iteration": rt.iteration,
        })


def _references(slot: Slot) -> tuple[dict[int, set[int]], dict[int, int]]:
    """Per storage on the device that the slot's saved tensors use: the layers saving it, its bytes."""
    refs: dict[int, set[int]] = {}
    size: dict[int, int] = {}
    store = slot.store
    for p, t in enumerate(store.tensors):
        if t is None or p in store.host:
            continue
        k = storage_key(t)
        refs.setdefault(k, set()).add(store.layers[p])
        size[k] = t.untyped_storage().nbytes()
    return refs, size


def _host_bytes(slot: Slot) -> int:
    """Bytes of the slot's saved tensors on the host (each host storage once)."""
    return sum({storage_key(t): t.untyped_storage().nbytes() for t in slot.store.host.values()}.values())


def _recompute_s(rt: RankRuntime, layer: int) -> float:
    """The director's price of recomputing a layer: the cost model's, as the simulator's (the
    runtime measures bytes and staleness; one layer's recompute it would only know after doing it)."""
    return rt.layer_recompute_s(layer)
