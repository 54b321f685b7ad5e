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

DEVICE, AWAY, DROPPED = "device", "away", "dropped"


@dataclass
class SlotState:
    layers: tuple[int, ...]
    where: dict[int, str]
    last_use: dict[int, float]
    returned: bool = False  # back for its backward (every layer's tensors on the device)
    arriving: Any = None  # the engine's event for its swap-in in flight

    def layers_in(self, where: str) -> tuple[int, ...]:
        return tuple(layer for layer in self.layers if self.where[layer] == where)


@dataclass
class RankDelta:
    """One rank's saved tensors under run-time DELTA, as the ledger counts them."""

    cost: Callable[[int], LayerCosts]
    slots: dict[tuple[int, int], SlotState] = field(default_factory=dict)

    def forward(self, stage: int, microbatch: int, layers: tuple[int, ...], last_use: dict[int, float]) -> None:
        self.slots[(stage, microbatch)] = SlotState(layers, dict.fromkeys(layers, DEVICE), last_use)

    def backward_done(self, stage: int, microbatch: int) -> None:
        self.slots.pop((stage, microbatch), None)

    def slot_bytes(self, key: tuple[int, int], state: SlotState | None = None,
                   where: dict[int, str] | None = None) -> int:
        st = state or self.slots[key]
        w = where or st.where
        dropped = [layer for layer in st.layers if w[layer] == DROPPED]
        if st.returned:
            return held_bytes(st.layers, dropped, self.cost)
        return resident_bytes(st.layers, [layer for layer in st.layers if w[layer] == AWAY], dropped, self.cost)

    def resident(self) -> int:
        return sum(self.slot_bytes(key) for key in self.slots)

    def records(self, now: float) -> list[Held]:
        """One record per layer on the device of every micro-batch not yet back for its backward."""
        out = []
        for key, st in sorted(self.slots.items()):
            if st.returned:
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
        return self.slot_bytes(key) - before

    def bring_back(self, key: tuple[int, int]) -> int:
        """Every swapped layer of ``key`` back on the device; returns the bytes that come back."""
        st = self.slots.get(key)
        if st is None or not st.layers_in(AWAY):
            return 0
        before = self.slot_bytes(key)
        for layer in st.layers_in(AWAY):
            st.where[layer] = DEVICE
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
