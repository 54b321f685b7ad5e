"""Bounds on what paratwin reads and echoes: a plan document's size, and reprs in error messages.

A YAML alias bomb ("billion laughs") is a few hundred bytes that expand to billions of nodes; an
error message that echoes such an input, or a launcher that serialises it, runs out of memory.
``check_document`` counts the expanded nodes of a loaded document and stops at a limit;
``short_repr`` bounds what a message quotes.
"""

from __future__ import annotations

from pathlib import Path

from traces.errors import ConfigError

MAX_DOCUMENT_BYTES = 1 << 20  # a plan file; the largest example is a few hundred bytes
MAX_DOCUMENT_NODES = 100_000  # values after alias expansion (a 1,000-stage partition is ~3,000)
REPR_CHARS = 200


def short_repr(value: object, limit: int = REPR_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters, without building the whole repr of a huge value."""
    if _too_big(value, MAX_DOCUMENT_NODES):
        return f"<a {type(value).__name__} of more than {MAX_DOCUMENT_NODES:,} values>"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit:,} more characters)"


def check_file_size(path: Path, field: str, limit: int = MAX_DOCUMENT_BYTES) -> None:
    size = Path(path).stat().st_size
    if size > limit:
        raise ConfigError(field, f"{size:,} bytes is too large for a plan (limit {limit:,})",
                          "a plan is a short YAML or JSON document; see examples/plans/")


def check_document(data: object, field: str, limit: int = MAX_DOCUMENT_NODES) -> None:
    """Refuse a document with more than ``limit`` values once YAML aliases are expanded."""
    if _too_big(data, limit):
        raise ConfigError(field, f"more than {limit:,} values once YAML aliases (&/*) are expanded",
                          "write the plan out plainly; a plan has a few dozen values")


def _too_big(data: object, limit: int) -> bool:
    count, stack = 0, [data]
    while stack:
        value = stack.pop()
        count += 1
        if count > limit:
            return True
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list | tuple | set):
            stack.extend(value)
        elif isinstance(value, str | bytes) and len(value) > limit:
            return True
    return False


__all__ = ["MAX_DOCUMENT_BYTES", "MAX_DOCUMENT_NODES", "check_document", "check_file_size", "short_repr"]
