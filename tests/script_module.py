"""Import a script or benchmark of the repository (not a package) as a module, by its path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """The module of ROOT / relative (e.g. "benchmarks/megatron_at_scale.py"), executed once per call."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where a dataclass with string annotations looks its module up
    spec.loader.exec_module(module)
    return module
