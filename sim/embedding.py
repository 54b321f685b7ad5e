"""Embedding communication: how the gradient of an embedding table (and its lookups) travels.

A plan's ``embedding:`` section names a registered method (``method: dense``) and its settings,
following the pattern of ``sim.gradient_sync``: each method is one record here (the simulator's
side): its settings, one line of docs, a plan check and two lowering hooks. The runtime's side is
registered under the same name in ``exec.embedding``.

- ``dense`` (the default): tables are ordinary data-parallel parameters; their whole gradient goes
  through the plan's gradient-sync method, whichever is registered (``allreduce``, ``fp16``, and
  any added later), so every gradient-sync method is a baseline for the sharded methods.
- ``embrace`` (``sim.embedding_embrace``): EmbRace's hybrid communication.
- ``ps`` (``sim.embedding_ps``): a Parallax-like parameter server colocated with the workers, the
  baseline EmbRace compares itself with.

The tables of a workload (which module of which layer, rows x width) come from its configuration
(``embedding_tables``), so the simulator and the runtime shard the same tensors. Imports neither
torch nor simpy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from sim.costs import LayerCosts
from sim.program import Kind
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


@dataclass(frozen=True)
class EmbeddingTerms:
    """What ``sim.estimate`` needs of a sharded embedding: where the tables are (pipeline rank and
    the index of their stage among that rank's stages), the gradient bytes they take out of the
    buckets, and the seconds of their exchanges on the collective stream."""

    rank: int
    index: int
    removed_by_layer: tuple[tuple[int, int], ...]  # (layer, gradient bytes) the tables take out of the buckets
    lookups_s: float  # every lookup of the iteration (ids + rows)
    last_grads_s: float  # the gradient exchange after the last backward (earlier ones overlap the backward)
    prefetch: bool  # lookups after the buckets, beside the dense optimizer step (else before the forwards)
    static_bytes_saved: int  # parameters, gradients and optimizer state of the other ranks' shards
    tp_table_layers: tuple[int, ...] = ()  # layers whose TP communication is the tables' all-gather (tp > 1)
    # Times per iteration the rank's compute waits on its replicas (sim.meeting): sequential EmbRace's
    # lookups gate every forward (once per micro-batch); otherwise once, at the gradient sync.
    meetings: int = 1
    # Of the prefetched lookups, the seconds before the dense step can start: the thread that runs
    # the step waits for each synchronous ids exchange (``synchronous_exchange_pass``), so for
    # every ids exchange but the last, the rows queued before it too.
    blocking_s: float = 0.0
    # Parameter bytes of the other ranks' shards: the rank's optimizer steps leave them out.
    step_bytes_saved: int = 0
    # Parameter bytes of the rank's own shard: stepped whole, as no replica holds it (the distributed
    # optimizer's 1/dp share is of the dense parameters only: sim.embedding_embrace.step_bytes).
    shard_bytes: int = 0
    # 2D: the tables take their own step over the rank's shard (these bytes) once their gradients
    # have arrived, beside the buckets; the lookups wait for it (0: the shard steps in the rank's one step).
    table_step_bytes: int = 0
    # Cores one gradient exchange and one rows exchange keep busy while they move data
    # (sim.host_cpu; 0 where the benchmark did not measure the CPU): under 2D the next micro-batch's
    # compute runs beside a gradient exchange, the dense step beside the last rows exchange.
    grads_cores: float = 0.0
    rows_cores: float = 0.0


# terms(plan, stage_layers, comm, costs, rank_of_stage, stages_of_rank): the estimate's terms.
TermsHook = Callable[[Any, list[tuple[int, ...]], Any, Any, list[int], list[tuple[int, ...]]], EmbeddingTerms | None]

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
    terms: TermsHook | None = None  # how sim.estimate prices it (None: nothing beyond dense)


EMBEDDING_METHODS: dict[str, EmbeddingMethod] = {}


def register_embedding_method(name: str, config: type[EmbeddingConfig], *, sharded: bool,
                              check: Callable[[Plan], None] | None = None, lower: LowerHook | None = None,
                              finish: LowerHook | None = None, terms: TermsHook | None = None) -> EmbeddingMethod:
    if name in EMBEDDING_METHODS:
        raise ValueError(f"embedding method {name!r} is registered twice")
    doc = " ".join((config.__doc__ or "").split("\n\n")[0].split())
    EMBEDDING_METHODS[name] = method = EmbeddingMethod(name, config, doc, sharded, check, lower, finish,
                                                             terms)
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


def table_tp_costs(c: LayerCosts) -> LayerCosts:
    """A sharded table's layer under TP as the runtime runs it (``exec.embedding``,
    ``exec.parallel.tp.gather_columns_from_tp``): each TP rank looks up its own columns of the rows,
    the forward all-gathers them into the layer's output (one all-gather of the output's bytes),
    and the backward keeps each rank's columns of the gradient: no TP communication. The analytic
    model's dense layer is Megatron's vocabulary-parallel table (one all-reduce of the output
    forward, none backward: ``sim.workloads``); a dense table the runtime runs is replicated and
    its profiled or structural costs communicate nothing (docs/embrace.md, "Dense tables under
    TP"). The engine, the lowering and the estimate all take this one view (``TableTPCosts``
    in ``sim.compile.resolve_plan``; ``EmbeddingTerms.tp_table_layers`` in the estimate)."""
    return replace(c, tp_allreduces=1, tp_comm_bytes=c.output_bytes, tp_collective="allgather", tp_in_backward=False)


class TableTPCosts:
    """``base`` with ``table_tp_costs`` applied to the ``layers`` of sharded tables when tp > 1."""

    def __init__(self, base: Any, layers: tuple[int, ...]) -> None:
        self.base, self.layers, self.num_layers = base, tuple(layers), base.num_layers

    def layer_costs(self, layer: int, micro_batch: int, tp: int) -> LayerCosts:
        c = self.base.layer_costs(layer, micro_batch, tp)
        return table_tp_costs(c) if tp > 1 and layer in self.layers else c

    def optimizer_step_s(self, param_bytes: int) -> float:
        return self.base.optimizer_step_s(param_bytes)

    def layer_weights(self, by: str) -> list[float]:
        return self.base.layer_weights(by)

    def __getattr__(self, name: str) -> Any:  # whatever else a cost model offers (a bundle, a describe)
        if name == "base" or name.startswith("__"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)


def sharded_table_layers(plan: Plan) -> tuple[int, ...]:
    """The layers of the tables ``plan``'s embedding method shards (none for dense)."""
    if not EMBEDDING_METHODS[plan.embedding.method].sharded:
        return ()
    return tuple(sorted({t.layer for t in embedding_tables(plan.workload, plan.workload_options)}))


def estimate_terms(plan: Plan, stage_layers: list[tuple[int, ...]], comm: Any, costs: Any, rank_of_stage: list[int],
                   stages_of_rank: list[tuple[int, ...]]) -> EmbeddingTerms | None:
    """The fast estimate's terms of ``plan``'s embedding method (None when its tables are dense)."""
    hook = EMBEDDING_METHODS[plan.embedding.method].terms
    return None if hook is None else hook(plan, stage_layers, comm, costs, rank_of_stage, stages_of_rank)


register_embedding_method("dense", DenseEmbedding, sharded=False)



# ---------------------------------------------------------------------------------------------
# The exchanges of the sharded methods (their ALLTOALL instructions, tagged
# ``emb:<phase>:<mb>:<offset>:<pp>:<tp>``), as the runtime runs them (exec.embedding).
EXCHANGE_TAG = "emb:"

# The ids go to their owners synchronously, on the runtime's one thread (exec.embedding.
# EmbraceExchange._request, which the parameter server reuses): an all-to-all of the per-peer
# counts (int64, torch.bincount), whose values size the receive buffer, then one of the ids. The
# rows and the gradients are asynchronous (async_op=True), one all-to-all each. The parameter
# server's push (exec.embedding_ps._push) is two asynchronous all-to-alls launched together, the
# indices (int64) and the values: on gloo each runs on a worker thread of the group and they share
# the link, so they end no earlier than one after the other would (scripts/probe_ids_exchange.py,
# docs/embrace.md; the rule of concurrent buckets, sim.comm): priced as the two, one after the other.
COUNTS_PHASE = "counts"
COUNT_BYTES = 8
SYNCHRONOUS_PHASES = frozenset({"ids"})
LOOKUP_PHASES = frozenset({"ids", "rows"})  # the lookups; "grads" and "push" carry gradients
INDEXED_PHASES = frozenset({"push"})  # (indices, values): two all-to-alls


def exchange_phase(tag: str) -> str:
    return tag.split(":")[1]


def exchange_phases(phase: str, nbytes: int, dp: int, index_bytes: int = 0) -> tuple[tuple[str, int], ...]:
    """The all-to-alls an exchange of ``phase`` runs, in order: (kind, bytes of one rank's send
    buffer). ``index_bytes``: of ``nbytes``, the indices an indexed exchange (the push) sends apart."""
    if phase in SYNCHRONOUS_PHASES:
        return ((COUNTS_PHASE, dp * COUNT_BYTES), ("all_to_all", nbytes))
    if phase in INDEXED_PHASES:
        if not 0 < index_bytes < nbytes:
            raise ValueError(f"a {phase} exchange of {nbytes} bytes needs its index bytes (got {index_bytes})")
        return (("all_to_all", index_bytes), ("all_to_all", nbytes - index_bytes))
    return (("all_to_all", nbytes),)


def ids_request_host_s(costs: Any) -> float:
    """Seconds of host work before one synchronous ids exchange (the batch, unique, owners, order,
    counts: ``exec.embedding.request_host_work``), as the profile measured it; 0 where it did not
    (an older bundle, a cost model without a profile): nothing charged."""
    return float(getattr(costs, "ids_request_host_s", 0.0))


def exchange_s(comm: Any, phases: tuple[tuple[str, int], ...], group: tuple[int, ...], imbalance: float,
               sharing: int = 1, host_s: float = 0.0) -> float:
    """Seconds of one exchange (the engine's ALLTOALL and the estimate's terms): its all-to-alls one
    after the other; the data waits for the most loaded owner (``imbalance``), the counts (the same
    few bytes to every peer) do not. A synchronous exchange (it has counts) is a meeting of the
    ranks' threads after unaligned work, and pays the run's measured overhead of a message once
    (``message_overhead_s``, docs/embrace.md "Why the ids request costs more"), and before its
    counts the runtime's thread does the request's host work (``host_s``: ``ids_request_host_s``)."""
    seconds = sum(comm.collective_s("all_to_all", nbytes if kind == COUNTS_PHASE else round(nbytes * imbalance),
                                    group, sharing) for kind, nbytes in phases)
    if any(kind == COUNTS_PHASE for kind, _ in phases):
        seconds += getattr(comm, "message_overhead_s", 0.0) + host_s  # 0 for a cluster without a calibration
    return seconds


def synchronous_exchange_pass(nodes: list[Any]) -> None:
    """A synchronous exchange holds the runtime's thread, which walks the Program in order
    (exec.interpreter): it starts once the compute before it has ended, and the compute after it
    starts once it has ended. On the collective stream it queues behind what was launched before."""
    before, waiting = None, []
    for node in nodes:
        if node.kind.is_compute:
            node.deps.extend(w for w in waiting if w not in node.deps)
            before, waiting = node, []
        elif node.kind is Kind.ALLTOALL and exchange_phase(node.tag) in SYNCHRONOUS_PHASES:
            if before is not None and before not in node.deps:
                node.deps.append(before)
            waiting.append(node)


# Every other method lives in a module of its own and registers itself on import.
from sim import embedding_embrace, embedding_ps  # noqa: E402, F401
