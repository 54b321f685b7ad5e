"""The workload zoo. ``get_workload("gpt-tiny")`` builds a workload by preset name.

Presets are looked up lazily so that importing this package does not import every model family
(torchvision and torch_geometric are optional extras).
"""

from __future__ import annotations

import importlib

from traces.errors import ConfigError

from .base import Batch, Workload, run_layers

# preset name -> "module:factory"; the factory takes the preset name and keyword overrides.
_PRESETS: dict[str, str] = {
    **{name: "exec.workloads.gpt:from_preset" for name in (
        "gpt-tiny", "gpt2-small", "gpt2-medium", "gpt-1.5b", "gpt-2.5b", "gpt-8.3b", "gpt-20b", "gpt-175b")},
    **{name: "exec.workloads.bert:from_preset" for name in ("bert-tiny", "bert-base", "bert-large")},
    **{name: "exec.workloads.lstm:from_preset" for name in ("lstm-tiny", "lstm-lm")},
    **{name: "exec.workloads.resnet:from_preset" for name in ("resnet-tiny", "resnet50", "resnet101")},
    **{name: "exec.workloads.hap:from_preset" for name in ("hap-tiny", "hap-mutag")},
    **{name: "exec.workloads.rnn:from_preset" for name in ("rnn-tiny", "rnn-digits")},
}


def workload_names() -> list[str]:
    return sorted(_PRESETS)


def get_workload(name: str, **overrides: object) -> Workload:
    if name not in _PRESETS:
        raise ConfigError("workload", f"unknown workload {name!r}", f"choose one of {', '.join(workload_names())}")
    module_name, factory = _PRESETS[name].split(":")
    return getattr(importlib.import_module(module_name), factory)(name, **overrides)


__all__ = ["Batch", "Workload", "get_workload", "run_layers", "workload_names"]
