"""DELTA deciding at run time, the simulator's side: what one rank holds, per (stage, micro-batch)
and layer, in the bytes of the memory ledger (``sim.memory.resident_bytes``), so that the engine's
DECIDE instructions can call the very policy the runtime calls (``sim.delta.choose``).

``exec.delta_runtime`` is the runtime's side: it measures the same quantities on its saved-tensor
store. The engine (``sim.engine.Engine._decide``) moves the simulated clock and the copy engine;
this module only keeps the state and the byte arithmetic. Imports neither torch nor simpy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sim.costs import LayerCosts
from sim.delta import Held
from sim.memory import held_bytes, resident_bytes

# device: a candidate; away: on the host; dropped: freed, its input kept; needed: back for its
# backward (prefetched or returned), no longer a candidate (as the replay's "needed")
DEVICE, AWAY, DROPPED, NEEDED = "device", "away", "dropped", "needed"


@dataclass
class SlotState:
    layers: tuple[int, ...]
    where: dict[int, str]
    last_use: dict[int, float] = field(default_factory=dict)
    done: int = 0  # layers forwarded so far (decisions run after each)
    claimed: bool = False  # its backward is next: no longer a candidate
    returned: bool = False  # back for its backward (every layer's tensors on the device)
    dropped_bytes: int = 0  # what its drops freed: what re-running them brings back
    arriving: Any = None  # the engine's event for its swap-in in flight

    @property
    def forwarded(self) -> tuple[int, ...]:
        return self.layers[: self.done]

    def layers_in(self, where: str) -> tuple[int, ...]:
        return tuple(layer for layer in self.forwarded if self.where[layer] == where)


@dataclass
class RankDelta:
    """One rank's saved tensors under run-time DELTA, as the ledger counts them."""

    cost: Callable[[int], LayerCosts]
    slots: dict[tuple[int, int], SlotState] = field(default_factory=dict)

    def layer_start(self, key: tuple[int, int], layers: tuple[int, ...]) -> int:
        """The next layer of ``key``'s forward starts; returns the bytes it adds (what it saves)."""
        if key not in self.slots:
            self.slots[key] = SlotState(layers, dict.fromkeys(layers, DEVICE))
        before = self.slot_bytes(key)
        self.slots[key].done += 1
        return self.slot_bytes(key) - before

    def layer_used(self, key: tuple[int, int], layer: int, now: float) -> None:
        self.slots[key].last_use[layer] = now

    def backward_done(self, key: tuple[int, int]) -> None:
        self.slots.pop(key, None)

    def slot_bytes(self, key: tuple[int, int], where: dict[int, str] | None = None) -> int:
        st = self.slots[key]
        w = where or st.where
        layers = st.forwarded
        dropped = [layer for layer in layers if w[layer] == DROPPED]
        if st.returned:
            return held_bytes(layers, dropped, self.cost)
        return resident_bytes(layers, [layer for layer in layers if w[layer] == AWAY], dropped, self.cost)

    def resident(self) -> int:
        return sum(self.slot_bytes(key) for key in self.slots)

    def records(self, now: float) -> list[Held]:
        """One record per layer on the device, not yet needed back, of every (stage, micro-batch)."""
        out = []
        for key, st in sorted(self.slots.items()):
            if st.claimed:
                continue
            here = self.slot_bytes(key)
            for layer in st.layers_in(DEVICE):
                swap = here - self.slot_bytes(key, where={**st.where, layer: AWAY})
                drop = here - self.slot_bytes(key, where={**st.where, layer: DROPPED})
                out.append(Held((*key, layer), swap, swap - drop, st.last_use[layer],
                                self.cost(layer).recompute_s))
        return out

    def apply(self, victim: tuple[int, int, int], action: str) -> int:
        """Release a layer (``swap`` or ``drop``); returns the change of the held bytes (negative)."""
        key, layer = victim[:2], victim[2]
        before = self.slot_bytes(key)
        self.slots[key].where[layer] = AWAY if action == "swap" else DROPPED
        change = self.slot_bytes(key) - before
        if action == "drop":
            self.slots[key].dropped_bytes -= change
        return change

    def claim(self, key: tuple[int, int]) -> int:
        """``key``'s backward is next: none of its tensors may go; returns the bytes its re-runs
        will bring back (what its drops freed), for which the rank makes room first."""
        st = self.slots[key]
        st.claimed = True
        return st.dropped_bytes

    def away_bytes(self, key: tuple[int, int]) -> int:
        """What bringing ``key``'s swapped layers back would add."""
        st = self.slots[key]
        return self.slot_bytes(key, where={**st.where, **dict.fromkeys(st.layers_in(AWAY), NEEDED)}) - \
            self.slot_bytes(key)

    def bring_back(self, key: tuple[int, int]) -> int:
        """Every swapped layer of ``key`` back on the device, needed; returns the bytes that come back."""
        st = self.slots.get(key)
        if st is None or not st.layers_in(AWAY):
            return 0
        before = self.slot_bytes(key)
        for layer in st.layers_in(AWAY):
            st.where[layer] = NEEDED
        return self.slot_bytes(key) - before

    def recompute(self, key: tuple[int, int]) -> tuple[tuple[int, ...], int]:
        """Re-materialise the dropped layers of ``key`` for its backward: the layers, and the bytes
        they bring back (the recomputed outputs are new storages: ``sim.memory.held_bytes``)."""
        st = self.slots[key]
        before = self.slot_bytes(key)
        st.returned = True
        return st.layers_in(DROPPED), self.slot_bytes(key) - before


def decision_name(kind: str, stage: int, microbatch: int, layer: int) -> str:
    """The ``name`` of a decision's row, the same in both engines."""
    return f"{kind} s{stage} mb{microbatch}" + (f" layer {layer}" if layer >= 0 else "")
