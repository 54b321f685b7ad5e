"""YAML and JSON parsing that refuses a key given twice in one mapping.

PyYAML and the json module keep the last of two equal keys without a word, so a plan with ``name: a``
and later ``name: b``, or two ``parallelism:`` sections, ran with whichever came last. Both are syntax
errors here: ``yaml.YAMLError`` / ``json.JSONDecodeError``, which every reader of a user's file already
turns into a one-line refusal.
"""

from __future__ import annotations

import json
from typing import Any

import yaml


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader whose mappings refuse a repeated key, naming both lines."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: what follows it may override
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping (lines {seen[key]} and {line}); "
                    "YAML would keep only the last", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that raises ``yaml.YAMLError`` for a key repeated in a mapping."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(f"key {repeated[0]!r} appears twice in one object; JSON readers would keep only the last")
    return dict(pairs)


def load_json(text: str) -> Any:
    """``json.loads`` that raises ``json.JSONDecodeError`` for a key repeated in an object."""
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except ValueError as exc:
        if isinstance(exc, json.JSONDecodeError):
            raise
        key = str(exc).split("'")[1]  # point at the second occurrence of the key, as a parser would
        first = text.find(f'"{key}"')
        raise json.JSONDecodeError(str(exc), text, max(text.find(f'"{key}"', first + 1), 0)) from None
