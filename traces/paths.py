"""Where the project's shared, read-only data lives (datasets and validation data).

``$PARATWIN_SHARED`` wins; otherwise ``shared/`` inside the repository or beside it (CI lays a copy
beside its clone). Nothing here checks that files exist: readers report a missing file themselves.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def shared_root() -> Path:
    env = os.environ.get("PARATWIN_SHARED")
    if env:
        return Path(env)
    for candidate in (REPO_ROOT / "shared", REPO_ROOT.parent / "shared"):
        if candidate.is_dir():
            return candidate
    return REPO_ROOT.parent / "shared"


def datasets_root() -> Path:
    env = os.environ.get("PARATWIN_DATASETS")
    return Path(env) if env else shared_root() / "datasets"


def validation_root() -> Path:
    return shared_root() / "validation"
