"""A user's own workload, named by import path: ``workload: mymodels.mlp:MyMLP`` (docs/profiler.md,
"Your own model").

The attribute is a ``Workload`` subclass or a factory; either is called with the plan's
``workload_options`` as keyword arguments and must return a ``Workload``. The module is looked for on
``sys.path`` and then in the current directory (as ``python -m`` would find it, also when ``paratwin`` runs
as an installed script, whose ``sys.path`` does not hold the current directory). Rank processes and the
profiler's workers import it again: multiprocessing (forkserver and spawn alike) starts each with the
launching process's ``sys.path`` and current directory as they are at launch (``multiprocessing.spawn.
prepare``), so they find it where this process found it (tests/test_own_workload.py runs that). A rank on
another machine (torchrun, SLURM) needs the module there, on its PYTHONPATH or in its current directory.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

from sim.workloads import USER
from traces.errors import ConfigError

from .base import Workload


def from_import_path(name: str, **options: object) -> Workload:
    """The workload ``name`` (``module:attribute``) builds with ``options``, recorded under ``name``."""
    module_name, attribute = name.split(":")
    module = _import(module_name, name)
    target = getattr(module, attribute, None)
    if target is None:
        found = sorted(k for k, v in vars(module).items()
                       if isinstance(v, type) and issubclass(v, Workload) and v is not Workload)
        raise ConfigError("workload", f"module {module_name} ({module.__file__}) has no attribute {attribute!r}",
                          f"name a Workload subclass or factory it defines (Workload subclasses there: "
                          f"{', '.join(found) or 'none'})")
    if (isinstance(target, type) and not issubclass(target, Workload)) or not callable(target):
        raise ConfigError("workload", f"{name} is {_what(target)}, not a Workload subclass or a factory",
                          "name a subclass of exec.workloads.Workload, or a function returning an instance of one")
    try:
        workload = target(**options)
    except TypeError as exc:  # options it does not take: the plan's workload_options are its keyword arguments
        raise ConfigError("workload_options", f"{name}({_call(options)}) failed: {_line(exc)}",
                          "set workload_options to keyword arguments it takes") from None
    if not isinstance(workload, Workload):
        raise ConfigError("workload", f"{name}({_call(options)}) returned {_what(workload)}, not a Workload",
                          "return an instance of a subclass of exec.workloads.Workload")
    # What a plan names it by and the options it was built with, whatever the class says: a profile of it
    # records these (meta.workload), and sim.bundle_costs.check_describes compares them with the plan's,
    # so a bundle of another model, or of this one with other options, is refused.
    own = workload.describe
    workload.name = name
    workload.describe = lambda: {**own(), "name": name, "family": USER,  # type: ignore[method-assign]
                                 "config": dict(options)}
    return workload


def _import(module_name: str, name: str) -> ModuleType:
    """``module_name`` imported from sys.path, then the current directory; each failure one line."""
    cwd = os.getcwd()
    if cwd not in (os.path.abspath(entry) for entry in sys.path):
        sys.path.append(cwd)  # after everything installed, so an installed package is never shadowed
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigError("workload", f"importing {module_name} failed: {_line(exc)}",
                              f"install what it imports; python -c 'import {module_name}' shows where") from None
        if "." in exc.name:  # its package was found, without this module
            parent, _, missing = exc.name.rpartition(".")
            where = list(getattr(sys.modules.get(parent), "__path__", []))
            raise ConfigError("workload", f"package {parent} ({', '.join(where)}) has no module {missing!r}",
                              f"check the module's name in {name}") from None
        python_path = os.environ.get("PYTHONPATH") or "unset"
        top = module_name.split(".")[0]
        raise ConfigError("workload", f"no module {exc.name!r} for workload {name} on this process's path (the "
                          f"current directory {cwd}, PYTHONPATH {python_path}, and {len(sys.path)} entries of "
                          "sys.path in all)",
                          f"run from the folder that holds {top}/ or {top}.py, or add that folder to PYTHONPATH "
                          "(every rank process imports it too)") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed at import: one line, where to look
        raise ConfigError("workload", f"importing {module_name} failed: {type(exc).__name__}: {_line(exc)}",
                          f"fix the module; python -c 'import {module_name}' shows the traceback") from None


def _what(value: object) -> str:
    return f"a class ({value.__name__})" if isinstance(value, type) else f"a {type(value).__name__}"


def _line(exc: BaseException) -> str:
    """The first line of ``exc``'s message: an error here is one line (a SyntaxError's is several)."""
    return (str(exc).splitlines() or [""])[0]


def _call(options: dict[str, object]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in options.items())
