"""The workload zoo. ``get_workload("gpt-tiny")`` builds a workload by preset name, and
``get_workload("mymodels.mlp:MyMLP")`` a user's own by import path (``exec.workloads.imported``).

Presets are looked up lazily so that importing this package does not import every model family
(torchvision and torch_geometric are optional extras).
"""

from __future__ import annotations

import importlib

from sim.implementations import expand_implementation
from sim.workloads import USER, known_family, workload_names

from .base import Batch, Workload, run_layers

# model family -> "module:factory"; the factory takes the workload's name and keyword overrides.
_FACTORIES: dict[str, str] = {
    "gpt": "exec.workloads.gpt:from_preset",
    "bert": "exec.workloads.bert:from_preset",
    "lstm": "exec.workloads.lstm:from_preset",
    "resnet": "exec.workloads.resnet:from_preset",
    "hap": "exec.workloads.hap:from_preset",
    "rnn": "exec.workloads.rnn:from_preset",
    USER: "exec.workloads.imported:from_import_path",
}


def get_workload(name: str, **overrides: object) -> Workload:
    family = known_family(name)
    module_name, factory = _FACTORIES[family].split(":")
    options = expand_implementation(overrides, family)  # implementation: megatron-lm
    workload = getattr(importlib.import_module(module_name), factory)(name, **options)
    workload.options = dict(overrides)  # as given: a bundle records them (Workload.options)
    return workload


__all__ = ["Batch", "Workload", "get_workload", "run_layers", "workload_names"]
