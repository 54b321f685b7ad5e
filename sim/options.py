"""Every plan dimension with a registry, and its registered choices: what ``paratwin options``
prints and what a plan search enumerates."""

from __future__ import annotations

from sim.embedding import EMBEDDING_METHODS
from sim.gradient_sync import GRADIENT_SYNC
from sim.memory import MEMORY_POLICIES
from sim.schedules import SCHEDULES


def _first_sentence(text: str) -> str:
    return text.split(". ")[0].rstrip(".") + "."


def registered_options() -> dict[str, list[tuple[str, str]]]:
    """Plan field -> [(choice, one line of docs)], in registration order."""
    return {
        "schedule.name": [(name, _first_sentence(info.description)) for name, info in SCHEDULES.items()],
        "memory.policy": [(name, kind.doc) for name, kind in MEMORY_POLICIES.items()],
        "gradient_sync.method": [(name, method.doc) for name, method in GRADIENT_SYNC.items()],
        "embedding.method": [(name, method.doc) for name, method in EMBEDDING_METHODS.items()],
    }
