"""Choosing ADMMiRNN's and the baselines' settings on validation, and widening every method's grid
until its choice is interior.

The suite's grids are on a 1-3-10 ladder: ADMM's rho_o x theta_w, SGD's and Adam's learning rate.
A choice on a grid's edge says the best setting may lie outside it (on digits the suite's first
ADMM grid chose its smallest corner, and the widened grid was one point better; the baselines'
first choices all sat on an edge). ``widen`` adds one ladder step past every edge the choice sits
on, chooses again on validation, and repeats until the choice is interior, at most
``MAX_WIDENINGS`` steps per axis; the same function for every method, so every method gets the
same rule. Runs are deterministic for a seed, so points already run are reused. Every choice is
made on the validation split only.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from dataclasses import asdict, replace

import pandas as pd

from exec.admm.rnn_admm import ADMMConfig

MAX_WIDENINGS = 4  # at most this many steps past the starting grid along each axis


def describe(setting: ADMMConfig | float) -> str:
    """The setting as the JSON string stored in the tuning tables' ``setting`` column."""
    if isinstance(setting, ADMMConfig):
        return json.dumps({k: v for k, v in asdict(setting).items()
                           if k in ("rho_a", "rho_s", "rho_o", "theta_w", "reanchor", "sweep")})
    return json.dumps({"lr": setting})


def ranked(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` best first: higher final validation accuracy, ties to the lower validation loss;
    NaN ranks last (a diverged run)."""
    return rows.fillna({"val_acc": -1.0, "val_loss": float("inf")}).sort_values(
        ["val_acc", "val_loss"], ascending=[False, True], kind="stable")


def parse(setting: str) -> ADMMConfig | float:
    """The setting of a tuning table's ``setting`` column (the inverse of ``describe``)."""
    values = json.loads(setting)
    return float(values["lr"]) if "lr" in values else ADMMConfig(**values)


def choose(tuning: pd.DataFrame) -> dict[str, ADMMConfig | float]:
    """Best final validation accuracy per method (ties: lower validation loss); NaN loses."""
    return {str(method): parse(ranked(part).iloc[0].setting) for method, part in tuning.groupby("method")}


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


Setting = ADMMConfig | float


def at_iterations(rows: pd.DataFrame, iterations: int) -> pd.DataFrame:
    """The rows run at ``iterations`` iterations: the only ones a run of that length may reuse.

    A setting's result depends on how long it ran, so a row is reusable only for a run of the same
    length (a ``--quick`` run must not pick up a folder's full-length rows). A table without an
    ``iterations`` column is of unknown length and none of its rows is reused."""
    if "iterations" not in rows:
        return rows.iloc[0:0]
    return rows[rows["iterations"] == iterations]


def axes(setting: Setting) -> dict[str, float]:
    """The tuned axes of a setting: ADMM's rho_o and theta_w, a baseline's learning rate."""
    if isinstance(setting, ADMMConfig):
        return {"rho_o": setting.rho_o, "theta_w": setting.theta_w}
    return {"lr": float(setting)}


def with_axes(base: Setting, values: dict[str, float]) -> Setting:
    """``base`` with its tuned axes set to ``values`` (ADMM's other settings kept)."""
    return replace(base, **values) if isinstance(base, ADMMConfig) else float(values["lr"])


def grid(values: dict[str, set[float]], base: Setting) -> tuple[Setting, ...]:
    """Every combination of the axes' ``values`` (sorted), on ``base``'s other settings."""
    names = list(values)
    return tuple(with_axes(base, dict(zip(names, combo, strict=True)))
                 for combo in itertools.product(*(sorted(values[n]) for n in names)))


def widen(method: str, start: tuple[Setting, ...], known: pd.DataFrame,
          run_point: Callable[[Setting], dict]) -> tuple[pd.DataFrame, Setting]:
    """Widen ``method``'s starting grid ``start`` until its validation choice is interior.

    The same rule for every method: one ladder step past every edge of every axis the choice sits
    on, choose again, until interior (at most ``MAX_WIDENINGS`` steps). ``known``: tuning rows
    already run (matched on ``method`` and the ``setting`` string, reused and marked
    ``reused=True``); ``run_point(setting)``: runs one setting and returns its tuning row. Returns
    every row of the final grid and the choice on it."""
    mine = known[known["method"] == method] if "method" in known else known.iloc[0:0]
    reusable = {s: row for s, row in zip(mine.get("setting", []), mine.to_dict("records"), strict=True)}
    rows: dict[str, dict] = {}
    values = {name: {axes(s)[name] for s in start} for name in axes(start[0])}
    for _ in range(MAX_WIDENINGS + 1):
        for setting in grid(values, start[0]):
            key = describe(setting)
            if key not in rows:
                rows[key] = (reusable[key] | {"reused": True} if key in reusable
                             else run_point(setting) | {"reused": False})
        chosen = choose(pd.DataFrame(rows.values()))[method]
        grown = {name: widened(vals, axes(chosen)[name]) for name, vals in values.items()}
        if grown == values:
            break
        values = grown
    return pd.DataFrame(rows.values()), chosen
