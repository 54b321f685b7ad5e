"""Small data files the project ships as CSV with ``#`` comment lines on top (where the numbers came
from): ``sim/data/codec_rates.csv``, ``sim/data/row_sparsity.csv``. One reader and one writer."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path


def read_rows(path: Path) -> list[dict[str, str]]:
    """The data rows of ``path`` as dicts, comment lines skipped; none if the file is missing."""
    if not path.is_file():
        return []
    with path.open(encoding="utf-8") as handle:
        return list(csv.DictReader(line for line in handle if not line.startswith("#")))


def write_rows(path: Path, comment: Sequence[str], header: Sequence[str],
               rows: Iterable[Mapping[str, object]]) -> None:
    """``rows`` under ``header``, after ``comment`` (one ``# `` line each)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="") as handle:
        handle.writelines(f"# {line}\n" for line in comment)
        writer = csv.DictWriter(handle, fieldnames=list(header))
        writer.writeheader()
        writer.writerows(rows)
