"""One profile from several profiles of one workload taken at different moments (issue 12): the
suite's common profile (``paratwin validate-suite --common-profile``: one profile per round,
pooled) and the what-if of ``scripts/suite_common_profile.py``.

Per layer, every time column (``*_s``) and every spread (``*_spread``) is the median over the
profiles, and so is each co-located process's own median (``process_layers``, when every profile
has the same processes and layers). The settings are the first profile's, with the per-byte
optimizer time and the ids request's host work the medians over the profiles, and ``pooled_from``
naming the profiles. A median, not a mean: the rounds sample the host's drift, and one slow
profile should move the pooled one no more than one slow round moves the measured median of the
round medians (analysis.rounds)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis.validation.profiling import reduce_process_layers
from traces.bundle import ProfileBundle, read_bundle, write_bundle
from traces.errors import ConfigError
from traces.schema import LAYER_TABLE
from traces.tables import conform

SAME = ("layer", "name", "kind", "param_bytes")  # what makes two profiles' rows the same layer


def median_layers(tables: list[pd.DataFrame], sources: list[object]) -> pd.DataFrame:
    """The first table with every time and spread column replaced by its per-layer median over
    ``tables``; they must hold the same layers (names, kinds, parameter bytes)."""
    ordered = [t.sort_values("layer").reset_index(drop=True) for t in tables]
    first = ordered[0]
    for source, table in zip(sources, ordered, strict=True):
        if not table[list(SAME)].equals(first[list(SAME)]):
            raise ConfigError("profile", f"{source} profiles other layers than {sources[0]}",
                              "pool only profiles of one workload at one micro-batch")
    pooled = first.copy()
    for column in LAYER_TABLE.columns:
        if column.endswith(("_s", "_spread")) and column in first:
            pooled[column] = np.median(np.stack([t[column].to_numpy(dtype=float) for t in ordered]), axis=0)
    return pooled


def _median_process_layers(bundles: list[ProfileBundle]) -> pd.DataFrame | None:
    tables = [b.process_layers for b in bundles]
    if any(t is None or not len(t) for t in tables):
        return None
    return reduce_process_layers(tables, np.median, "pooled per-process profile")  # type: ignore[arg-type]


def pool_profiles(profiles: list[Path], out: Path) -> Path:
    """Write the pooled bundle of ``profiles`` (at least one) to ``out``; its communication samples
    and fits are the first profile's (none, for a suite's round profiles: the suite copies the
    group's benchmark in). Returns ``out``."""
    if not profiles:
        raise ConfigError("profiles", "nothing to pool", "give at least one profile bundle")
    bundles = [read_bundle(p) for p in profiles]
    layers = conform(median_layers([b.layers for b in bundles], list(profiles)), LAYER_TABLE, "pooled profile")
    settings = dict(bundles[0].meta.get("settings", {}))
    for key in ("optimizer_s_per_param_byte", "ids_request_host_s"):
        values = [b.meta.get("settings", {}).get(key) for b in bundles]
        if all(v is not None for v in values):
            settings[key] = float(np.median([float(v) for v in values]))
        else:  # a profile lacks it: none of them speaks for the pool (docs/traces.md: absent charges 0)
            settings.pop(key, None)
    settings["pooled_from"] = [str(Path(p).resolve()) for p in profiles]
    settings["pooled_statistic"] = "per layer, the median over the pooled profiles of every time and spread"
    first = bundles[0]
    pooled = ProfileBundle({**first.meta, "settings": settings}, layers, first.ops, first.comm_samples,
                           first.comm_fits, _median_process_layers(bundles))
    write_bundle(pooled, out)
    return Path(out)
