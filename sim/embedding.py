"""Embedding communication: how the gradient of an embedding table (and its lookups) travels.

A plan's ``embedding:`` section names a registered method (``method: dense``) and its settings,
following the pattern of ``sim.gradient_sync``: each method is one record here (the simulator's
side): its settings, one line of docs, a plan check and two lowering hooks. The runtime's side is
registered under the same name in ``exec.embedding``.

- ``dense`` (the default): tables are ordinary data-parallel parameters; their whole gradient goes
  through the plan's gradient-sync method, whichever is registered (``allreduce``, ``fp16``, and
  any added later), so every gradient-sync method is a baseline for the sharded methods.
- ``embrace`` (``sim.embedding_embrace``): EmbRace's hybrid communication.

The tables of a workload (which module of which layer, rows x width) come from its configuration
(``embedding_tables``), so the simulator and the runtime shard the same tensors. Imports neither
torch nor simpy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from sim.workloads import workload_config

if TYPE_CHECKING:
    from sim.plan import Plan


class EmbeddingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str


class DenseEmbedding(EmbeddingConfig):
    """Tables stay data parallel: their whole gradient goes through the plan's gradient-sync method."""

    method: Literal["dense"] = "dense"


@dataclass(frozen=True)
class Table:
    """One embedding table: ``module`` of model layer ``layer`` ("" is the layer itself)."""

    layer: int
    module: str
    rows: int
    dim: int


# lower(draft, stages) runs before the gradient-sync buckets are formed, finish(draft, stages) after
# the optimizer step is placed (sim.lower); both may be None.
LowerHook = Callable[[Any, tuple[int, ...]], None]


@dataclass(frozen=True)
class EmbeddingMethod:
    name: str
    config: type[EmbeddingConfig]
    doc: str
    sharded: bool  # tables are sharded over the data-parallel ranks (their gradient leaves gradient sync)
    check: Callable[[Plan], None] | None = None  # raise ConfigError when the plan cannot use it
    lower: LowerHook | None = None
    finish: LowerHook | None = None


EMBEDDING_METHODS: dict[str, EmbeddingMethod] = {}


def register_embedding_method(name: str, config: type[EmbeddingConfig], *, sharded: bool,
                              check: Callable[[Plan], None] | None = None, lower: LowerHook | None = None,
                              finish: LowerHook | None = None) -> EmbeddingMethod:
    if name in EMBEDDING_METHODS:
        raise ValueError(f"embedding method {name!r} is registered twice")
    doc = " ".join((config.__doc__ or "").split("\n\n")[0].split())
    EMBEDDING_METHODS[name] = method = EmbeddingMethod(name, config, doc, sharded, check, lower, finish)
    return method


def embedding_tables(workload: str, options: dict[str, Any]) -> list[Table]:
    """The embedding tables of a workload preset, from its resolved configuration: the token table
    of a transformer (``embed.tok``; the position table is small and stays dense) and the
    embedding layer of an LSTM language model. Other families have none."""
    config = workload_config(workload, options) or {}
    if "heads" in config:  # a transformer (sim.workloads.TransformerConfig)
        return [Table(0, "tok", int(config["vocab"]), int(config["hidden"]))]
    if "embed" in config and "vocab" in config:  # an LSTM language model (sim.workloads.LSTMConfig)
        return [Table(0, "", int(config["vocab"]), int(config["embed"]))]
    return []


register_embedding_method("dense", DenseEmbedding, sharded=False)

# Every other method lives in a module of its own and registers itself on import.
from sim import embedding_embrace  # noqa: E402, F401
