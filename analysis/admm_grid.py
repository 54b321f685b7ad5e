"""Choosing ADMMiRNN's (and the baselines') settings on validation, and widening ADMM's grid
until the choice is interior.

The suite's ADMM grid is rho_o x theta_w on a 1-3-10 ladder. A choice on the grid's edge says the
best setting may lie outside it (on digits the suite's first grid chose its smallest corner, and
the widened grid was one point better). ``widen`` adds one ladder step past every edge the choice
sits on, chooses again on validation, and repeats until the choice is interior, at most
``MAX_WIDENINGS`` steps per axis. Runs are deterministic for a seed, so points already run are
reused. Every choice is made on the validation split only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict

import pandas as pd

from exec.admm.rnn_admm import ADMMConfig

MAX_WIDENINGS = 4  # at most this many steps past the starting grid along each axis


def describe(setting: ADMMConfig | float) -> str:
    """The setting as the JSON string stored in the tuning tables' ``setting`` column."""
    if isinstance(setting, ADMMConfig):
        return json.dumps({k: v for k, v in asdict(setting).items()
                           if k in ("rho_a", "rho_s", "rho_o", "theta_w", "reanchor", "sweep")})
    return json.dumps({"lr": setting})


def choose(tuning: pd.DataFrame) -> dict[str, ADMMConfig | float]:
    """Best final validation accuracy per method (ties: lower validation loss); NaN loses."""
    chosen: dict[str, ADMMConfig | float] = {}
    for method, part in tuning.groupby("method"):
        best = part.fillna({"val_acc": -1.0, "val_loss": float("inf")}).sort_values(
            ["val_acc", "val_loss"], ascending=[False, True]).iloc[0]
        values = json.loads(best.setting)
        chosen[str(method)] = float(values["lr"]) if "lr" in values else ADMMConfig(**values)
    return chosen


def ladder_step(value: float, down: bool) -> float:
    """The next value on the 1-3-10 ladder of the suite's grids (..., 0.01, 0.03, 0.1, 0.3, ...)."""
    mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
    factor = (0.3 if mantissa < 2 else 1 / 3) if down else (3.0 if mantissa < 2 else 10 / 3)
    return float(f"{value * factor:.6g}")


def widened(values: set[float], chosen: float) -> set[float]:
    """``values`` plus one ladder step past the edge ``chosen`` sits on (none when it is interior)."""
    if chosen == min(values):
        return values | {ladder_step(chosen, down=True)}
    if chosen == max(values):
        return values | {ladder_step(chosen, down=False)}
    return values


def grid_of(rhos: set[float], thetas: set[float], base: ADMMConfig) -> tuple[ADMMConfig, ...]:
    """rho_o x theta_w on ``base``'s other settings (rho_a, rho_s, block order)."""
    return tuple(ADMMConfig(rho_a=base.rho_a, rho_s=base.rho_s, rho_o=r, theta_w=t, sweep=base.sweep)
                 for r in sorted(rhos) for t in sorted(thetas))


def widen(start: tuple[ADMMConfig, ...], known: pd.DataFrame,
          run_point: Callable[[ADMMConfig], dict]) -> tuple[pd.DataFrame, ADMMConfig]:
    """Widen ``start`` (a rho_o x theta_w grid) until the validation choice is interior.

    ``known``: tuning rows already run (their ``setting`` strings are reused, marked
    ``reused=True``); ``run_point(cfg)``: runs one setting and returns its tuning row. Returns every
    ADMM row of the final grid and the choice on it."""
    reusable = {s: row for s, row in zip(known.get("setting", []), known.to_dict("records"), strict=True)}
    rows: dict[str, dict] = {}
    rhos, thetas = {c.rho_o for c in start}, {c.theta_w for c in start}
    for _ in range(MAX_WIDENINGS + 1):
        for cfg in grid_of(rhos, thetas, start[0]):
            setting = describe(cfg)
            if setting not in rows:
                rows[setting] = (reusable[setting] | {"reused": True} if setting in reusable
                                 else run_point(cfg) | {"reused": False})
        chosen = choose(pd.DataFrame(rows.values()))["admm"]
        assert isinstance(chosen, ADMMConfig)
        grown = widened(rhos, chosen.rho_o), widened(thetas, chosen.theta_w)
        if grown == (rhos, thetas):
            break
        rhos, thetas = grown
    return pd.DataFrame(rows.values()), chosen
