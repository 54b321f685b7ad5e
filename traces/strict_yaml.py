"""YAML and JSON parsing that refuses a key given twice in one mapping.

PyYAML and the json module keep the last of two equal keys without a word, so a plan with ``name: a``
and later ``name: b``, or two ``parallelism:`` sections, ran with whichever came last. Both are syntax
errors here: ``yaml.YAMLError`` / ``json.JSONDecodeError``. ``read_document`` is how every user's file
(plan, sweep spec, cluster file, device file) is read: a missing file, a folder, text that is not UTF-8
or does not parse is a one-line refusal naming the file (and where in it the parser stopped).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from traces.errors import ConfigError
from traces.limits import check_file_size


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


def read_document(path: str | Path, what: str, fix: str, max_bytes: int | None = None) -> Any:
    """The YAML (JSON for a ``.json`` file) of the ``what`` file at ``path`` (a plan file, a sweep spec,
    ...), or a one-line ``ConfigError`` naming the path: missing, a folder (it said "not found"), larger
    than ``max_bytes``, not UTF-8, or not valid syntax, with the line and column where the parser stopped.
    ``fix`` says what to pass instead of a missing file or a folder."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(str(path), f"a folder, not a {what}", fix)
    if not path.is_file():
        raise ConfigError(str(path), f"{what} not found", fix)
    if max_bytes is not None:
        check_file_size(path, str(path), max_bytes)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), f"not UTF-8 text (byte {exc.start} is 0x{exc.object[exc.start]:02x})",
                          "save it as UTF-8 YAML or JSON") from None
    json_file = path.suffix == ".json"
    try:
        return load_json(text) if json_file else load_yaml(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(str(path), f"not valid {'JSON' if json_file else 'YAML'}: {syntax_problem(exc)}",
                          "fix the syntax") from None


def syntax_problem(exc: yaml.YAMLError | json.JSONDecodeError) -> str:
    """What the parser found and where: PyYAML's message opens with its context ("while scanning for the
    next token"), which says nothing of where; its ``problem`` and ``problem_mark`` (0-based) do. JSON's
    message already ends with the line and column."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or problem is None:
        return str(exc).splitlines()[0]
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"


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
