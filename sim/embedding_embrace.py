"""EmbRace (Li et al., "EmbRace: Accelerating Sparse Communication for Distributed Training of NLP
Neural Networks", arXiv:2110.09132): sparsity-aware hybrid communication and 2D scheduling.

Hybrid communication: every embedding table is sharded over the data-parallel ranks (by rows:
row v lives on rank v mod dp, so frequent low ids spread evenly; or by columns: rank r holds the
r-th slice of every row), while the dense layers stay data parallel. A micro-batch's lookup is two
all-to-alls carrying only the rows it touches: its unique ids to their owners (``emb:ids``), the
owners' rows back (``emb:rows``); after the backward the gradients of those rows go back to their
owners (``emb:grads``), which sum them and divide by dp: exactly the dense mean gradient, for every
row (untouched rows get zero, as in dense data parallelism), so Adam moves every element as in dense
data-parallel training.

Scheduling, in the Program (both engines run it):

- ``sequential``: a micro-batch's lookup right before its forward; its gradient exchange right after
  its backward; one optimizer step after every exchange and bucket.
- ``2d``: the gradient exchange of each micro-batch right after its backward (it overlaps the
  backward of the later micro-batches); the tables take their own optimizer step as soon as their
  gradients have arrived, and the lookups of the *next* iteration's micro-batches follow it at once,
  in the order their forwards need them, while the dense optimizer step computes. The forwards of
  an iteration then find their rows already there: the Program is one period of the steady state,
  and the runtime fetches the first iteration's rows before it starts timing (docs/embrace.md says
  why this, and not a relaxed dependency, keeps the method exact with Adam).

The bytes of an exchange are its send buffer on one rank (the nccl-tests convention of
``sim.collectives``), from the unique rows a micro-batch touches: measured on real batches
(``row_stats``, written by ``python -m exec.embedding_rows``) or, for uniform synthetic ids, the
closed form V (1 - (1 - 1/V)^n) for n tokens. By rows, an exchange is as slow as its most
loaded destination: the measured largest owner share over the even 1/dp scales its transfer time
(``alltoall_imbalance``; by columns the owners are balanced by construction).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from sim.comm import concurrent_groups
from sim.embedding import (
    EXCHANGE_TAG,
    EmbeddingConfig,
    EmbeddingTerms,
    Table,
    embedding_tables,
    exchange_phases,
    exchange_s,
    ids_request_host_s,
    register_embedding_method,
    synchronous_exchange_pass,
)
from sim.hardware import ELEMENT_BYTES
from sim.host_cpu import cores_taken, phases_cpu_s
from sim.model_state import held_gradient_bytes
from sim.program import Kind
from traces.errors import ConfigError

if TYPE_CHECKING:
    from sim.plan import Plan

ID_BYTES = 8  # ids travel as int64, torch's index dtype
Shard = Literal["auto", "rows", "columns"]


class ShardedEmbedding(EmbeddingConfig):
    """Settings every method with sharded tables has (``embrace``, ``ps``)."""

    row_stats: str | None = Field(None, description="JSON of unique rows per micro-batch measured on real "
                                  "batches (python -m exec.embedding_rows); without it, uniform ids")


class Embrace(ShardedEmbedding):
    """EmbRace: tables sharded over the data-parallel ranks; lookups and gradients exchanged by
    all-to-all, only the rows a batch touches."""

    method: Literal["embrace"] = "embrace"
    shard: Shard | list[Shard] = Field("auto", description="rows | columns | auto (columns when the width "
                                       "divides by dp), for every table or one per table")
    schedule: Literal["2d", "sequential"] = Field("2d", description="2d: per-micro-batch exchanges, the "
                                                  "next iteration's lookups prefetched; sequential: none")


def tp_width(plan: Plan, table: Table) -> int:
    """Columns of ``table`` one tensor-parallel rank holds: under TP every TP rank of a replica takes
    its column slice of the table (dim / tp), which is then sharded over the dp ranks as without
    TP; a forward all-gathers the slices' rows over the TP group (exec.embedding.ShardedTable)."""
    return table.dim // plan.tp


def shard_of(config: Embrace, tables: list[Table], index: int, dp: int, tp: int = 1) -> str:
    """How table ``index`` is sharded: as configured, or (auto) by columns when its TP slice's width
    divides by dp (every owner then serves every row, so no skew of the ids can unbalance the owners)."""
    chosen = config.shard[index] if isinstance(config.shard, list) else config.shard
    if chosen == "auto":
        return "columns" if (tables[index].dim // tp) % dp == 0 else "rows"
    return chosen


def table_shard(plan: Plan, tables: list[Table], index: int) -> str:
    """How ``plan``'s method shards table ``index``: EmbRace as configured, a parameter server by rows."""
    config = plan.embedding
    return shard_of(config, tables, index, plan.dp, plan.tp) if isinstance(config, Embrace) else "rows"


def shard_rows(rows: int, width: int, shard: str, dp: int, rank: int) -> tuple[int, int]:
    """(rows, width) of ``rank``'s shard of a table (or TP slice) of ``rows`` x ``width``: rows v with
    v mod dp == rank, or the rank's column slice."""
    if shard == "rows":
        return len(range(rank, rows, dp)), width
    return rows, width // dp


def check_sharded(plan: Plan) -> list[Table]:
    """What every method with sharded tables refuses; returns the workload's tables."""
    name = plan.embedding.method
    tables = embedding_tables(plan.workload, plan.workload_options)
    if not tables:
        raise ConfigError("embedding.method", f"workload {plan.workload} has no embedding table to shard",
                          "use method: dense")
    if plan.dp < 2:
        raise ConfigError("embedding.method", f"{name} shards tables over the data-parallel ranks; this plan "
                          "has dp 1", "use dp >= 2, or method: dense")
    for index, table in enumerate(tables):
        if table.dim % plan.tp:  # each TP rank holds a column slice of the table (tp_width)
            raise ConfigError("parallelism.tp", f"{name}: width {table.dim} of table {index} does not divide by "
                              f"tp {plan.tp}", "use a tp that divides the embedding width, or method: dense")
    return tables


def _check(plan: Plan) -> None:
    config = plan.embedding
    assert isinstance(config, Embrace)
    tables = check_sharded(plan)
    if isinstance(config.shard, list) and len(config.shard) != len(tables):
        raise ConfigError("embedding.shard", f"has {len(config.shard)} entries for {len(tables)} table(s) of "
                          f"{plan.workload}", f"give one of rows | columns | auto per table ({len(tables)})")
    for index, table in enumerate(tables):
        width = tp_width(plan, table)
        if shard_of(config, tables, index, plan.dp, plan.tp) == "columns" and width % plan.dp:
            raise ConfigError("embedding.shard", f"columns: width {width} of table {index} (per TP rank) does not "
                              f"divide by dp {plan.dp}", "shard it by rows")
    unique_rows(plan, tables[0])  # refuses real text without measured statistics
    alltoall_imbalance(plan)  # and row sharding without the owners' shares at this dp


def unique_rows(plan: Plan, table: Table, tokens: int | None = None) -> float:
    """Mean unique ids among ``tokens`` ids of one rank (default: one micro-batch): measured, or
    closed form for uniform ids."""
    config = plan.embedding
    assert isinstance(config, ShardedEmbedding)
    seq = seq_len(plan)
    tokens = tokens or plan.micro_batch * seq
    if config.row_stats is not None:
        return _measured(config.row_stats, plan, table, tokens)
    if plan.workload_options.get("data", "synthetic") != "synthetic":
        raise ConfigError("embedding.row_stats", f"the rows a batch of {plan.workload_options['data']} touches "
                          "are not uniform", f"measure them: python -m exec.embedding_rows --workload "
                          f"{plan.workload} --micro-batch {tokens // seq} --out rows.json, then set "
                          "embedding.row_stats: rows.json (workload_options too)")
    # n uniform draws from V ids: each id is missed by all with probability (1 - 1/V)^n.
    return table.rows * (1.0 - (1.0 - 1.0 / table.rows) ** tokens)


def alltoall_imbalance(plan: Plan, tokens: int | None = None) -> float:
    """Largest destination's share of an exchange over the even 1/dp: by rows, the measured largest
    share of the unique ids among ``tokens`` ids (default: a micro-batch's) owned by one rank (id mod
    dp), times dp; by columns every owner serves every id (1). Uniform synthetic ids without
    statistics: 1 (their skew is not modelled)."""
    config = plan.embedding
    assert isinstance(config, ShardedEmbedding)
    tables = embedding_tables(plan.workload, plan.workload_options)
    rows = [t for i, t in enumerate(tables) if table_shard(plan, tables, i) == "rows"]
    if not rows or config.row_stats is None:
        return 1.0
    tokens = tokens or plan.micro_batch * seq_len(plan)
    entry = _entry(config.row_stats, plan, rows[0], tokens)
    share = entry.get("owner_share_max_mean", {}).get(str(plan.dp))
    if share is None:
        raise ConfigError("embedding.row_stats", f"{config.row_stats} has no owner shares for dp {plan.dp}",
                          f"measure them: python -m exec.embedding_rows --workload {plan.workload} --micro-batch "
                          f"{tokens // seq_len(plan)} --dp {plan.dp} --out {config.row_stats}")
    return max(1.0, float(share) * plan.dp)


def seq_len(plan: Plan) -> int:
    from sim.workloads import workload_config

    return int((workload_config(plan.workload, plan.workload_options) or {}).get("seq", 1))


def _measured(path: str, plan: Plan, table: Table, tokens: int) -> float:
    return float(_entry(path, plan, table, tokens)["unique_rows_mean"])


def _entry(path: str, plan: Plan, table: Table, tokens: int) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError("embedding.row_stats", f"{path} does not exist",
                          "write it with python -m exec.embedding_rows")
    try:
        stats: dict[str, Any] = json.loads(file.read_text())
        entries = stats["entries"]
    except (ValueError, KeyError, TypeError):
        raise ConfigError("embedding.row_stats", f"{path} is not a row-statistics file",
                          "write it with python -m exec.embedding_rows") from None
    for entry in entries:
        if entry.get("tokens") == tokens and entry.get("vocab") == table.rows \
                and entry.get("data") == plan.workload_options.get("data", "synthetic"):
            return entry
    have = sorted({(e.get("tokens"), e.get("vocab"), e.get("data")) for e in entries})
    raise ConfigError("embedding.row_stats", f"{path} has no entry for {tokens} tokens per micro-batch, vocabulary "
                      f"{table.rows}, data {plan.workload_options.get('data', 'synthetic')} (has {have[:4]})",
                      f"measure this micro-batch: python -m exec.embedding_rows --workload {plan.workload} "
                      f"--micro-batch {tokens // seq_len(plan)} --out {path}")


def exchange_bytes(plan: Plan, tables: list[Table]) -> dict[str, int]:
    """Bytes of one rank's send buffer per phase of one micro-batch's exchange, over ``tables``."""
    b = ELEMENT_BYTES[plan.dtype]
    config = plan.embedding
    assert isinstance(config, Embrace)
    all_tables = embedding_tables(plan.workload, plan.workload_options)
    ids = rows = 0
    for table in tables:
        unique = unique_rows(plan, table)
        columns = table_shard(plan, all_tables, all_tables.index(table)) == "columns"
        # By rows each id goes to its one owner; by columns every owner needs every id.
        ids += round(unique * ID_BYTES * (plan.dp if columns else 1))
        rows += round(unique * tp_width(plan, table) * b)
    return {"ids": ids, "rows": rows, "grads": rows}


def sharded_terms(plan: Plan, stage_layers: list[tuple[int, ...]], costs: Any, rank_of_stage: list[int],
                  stages_of_rank: list[tuple[int, ...]], lookups_s: float, last_grads_s: float,
                  prefetch: bool, meetings: int = 1, blocking_s: float = 0.0, table_step: bool = False,
                  grads_cores: float = 0.0, rows_cores: float = 0.0) -> EmbeddingTerms:
    """The estimate's terms of a method with sharded tables, given the seconds of its exchanges;
    ``table_step``: the tables step on their own (EmbRace 2D, ``_finish``)."""
    tables = embedding_tables(plan.workload, plan.workload_options)
    stage = next(s for s, layers in enumerate(stage_layers) if tables[0].layer in layers)
    rank = rank_of_stage[stage]
    removed = excluded_bytes(plan, tables, costs)
    full = sum(removed.values())
    shard = sum(_shard_bytes(plan, t, 0) for t in tables)
    layer = costs.layer_costs(tables[0].layer, plan.micro_batch, plan.tp)
    static = layer.param_bytes + held_gradient_bytes(layer.grad_bytes, plan.gradient_sync, plan.dtype) \
        + layer.optimizer_bytes
    return EmbeddingTerms(rank=rank, index=stages_of_rank[rank].index(stage),
                          removed_by_layer=tuple(sorted(removed.items())),
                          lookups_s=lookups_s, last_grads_s=last_grads_s, prefetch=prefetch,
                          static_bytes_saved=round((full - shard) / layer.param_bytes * static),
                          tp_table_layers=tuple(sorted({t.layer for t in tables})), meetings=meetings,
                          blocking_s=blocking_s, step_bytes_saved=full - shard, shard_bytes=shard,
                          table_step_bytes=shard if table_step else 0, grads_cores=grads_cores,
                          rows_cores=rows_cores)


def alltoall_s(plan: Plan, comm: Any, phase: str, nbytes: int, imbalance: float, index_bytes: int = 0,
               costs: Any = None) -> float:
    """Seconds of one exchange of ``phase`` of ``nbytes`` (one rank's send buffer) among pipeline rank
    0's replicas, every TP rank's group exchanging at once, as slow as its most loaded destination;
    a synchronous one with the host work ``costs`` measured before it (``ids_request_host_s``)."""
    group = tuple(d * plan.tp for d in range(plan.dp))  # pipeline rank 0's replicas (sim.program.rank_of)
    sharing = concurrent_groups(comm.cluster, plan.dp * plan.tp, group)
    return exchange_s(comm, exchange_phases(phase, nbytes, plan.dp, index_bytes), group, imbalance, sharing,
                      ids_request_host_s(costs))


def alltoall_cores(plan: Plan, comm: Any, phase: str, nbytes: int, seconds: float) -> float:
    """Cores one exchange of ``phase`` keeps busy while it moves data for ``seconds`` (as the engine
    counts them: the CPU fit at the send buffer's bytes, ``sim.host_cpu``)."""
    return cores_taken(phases_cpu_s(comm, exchange_phases(phase, nbytes, plan.dp), plan.dp), seconds)


def estimate_terms(plan: Plan, stage_layers: list[tuple[int, ...]], comm: Any, costs: Any, rank_of_stage: list[int],
                   stages_of_rank: list[tuple[int, ...]]) -> EmbeddingTerms:
    """EmbRace's estimate terms: every micro-batch's lookup, the last micro-batch's gradient exchange;
    under 2D the tables' own step and the cores the exchanges that overlap compute take."""
    assert isinstance(plan.embedding, Embrace)
    sizes, imbalance = exchange_bytes(plan, embedding_tables(plan.workload, plan.workload_options)), \
        alltoall_imbalance(plan)
    ids_s, rows_s, grads_s = (alltoall_s(plan, comm, p, sizes[p], imbalance, costs=costs)
                              for p in ("ids", "rows", "grads"))
    m = plan.microbatches
    two_d = plan.embedding.schedule == "2d"
    return sharded_terms(plan, stage_layers, costs, rank_of_stage, stages_of_rank,
                         lookups_s=m * (ids_s + rows_s), last_grads_s=grads_s, prefetch=two_d,
                         meetings=1 if two_d else m, blocking_s=m * ids_s + (m - 1) * rows_s, table_step=two_d,
                         grads_cores=alltoall_cores(plan, comm, "grads", sizes["grads"], grads_s) if two_d else 0.0,
                         rows_cores=alltoall_cores(plan, comm, "rows", sizes["rows"], rows_s) if two_d else 0.0)


def table_bytes(plan: Plan, table: Table, costs: Any) -> int:
    """Bytes of the table one rank of a dense run holds, as ``costs`` price that run's layer. Under TP
    the runtime's workloads replicate a dense table (docs/embrace.md, "Dense tables under TP"), so its
    rank holds all of it; the analytic model's dense table is Megatron's vocabulary-parallel one, a
    1 / tp share (its padding's remainder stays dense). Which one a cost model prices shows in the
    layer's parameters: at least the whole table, or less. Until session 20 this was the TP share for
    both, and a runtime plan's buckets kept (tp - 1) / tp of the table's gradient that the runtime does
    not all-reduce (tests/test_embrace.py compares the two instruction tables)."""
    whole = table.rows * table.dim * ELEMENT_BYTES[plan.dtype]
    if plan.tp == 1 or costs.layer_costs(table.layer, plan.micro_batch, plan.tp).param_bytes >= whole:
        return whole
    return table.rows * tp_width(plan, table) * ELEMENT_BYTES[plan.dtype]


def excluded_bytes(plan: Plan, tables: Sequence[Table], costs: Any) -> dict[int, int]:
    """Layer -> gradient bytes of the sharded tables it holds (what a dense rank holds of them:
    ``table_bytes``), which leave the data-parallel buckets."""
    out: dict[int, int] = {}
    for table in tables:
        out[table.layer] = out.get(table.layer, 0) + table_bytes(plan, table, costs)
    return out


def _shard_bytes(plan: Plan, table: Table, rank: int) -> int:
    """Bytes of ``rank``'s shard of ``table``."""
    tables = embedding_tables(plan.workload, plan.workload_options)
    rows, width = shard_rows(table.rows, tp_width(plan, table), table_shard(plan, tables, tables.index(table)),
                             plan.dp, rank)
    return rows * width * ELEMENT_BYTES[plan.dtype]


# ---------------------------------------------------------------------------------------------
# Lowering (sim.lower calls these on each rank's draft; see its _Draft and Node).


def local_tables(draft: Any, stages: tuple[int, ...]) -> tuple[int, list[Table]]:
    layers = {layer: s for s in stages for layer in draft.program.stage_layers[s]}
    tables = [t for t in embedding_tables(draft.plan.workload, draft.plan.workload_options) if t.layer in layers]
    return (layers[tables[0].layer] if tables else -1), tables


def _group(draft: Any) -> tuple[int, ...]:
    c = draft.coords
    return tuple(draft.program.rank_of(d, c.pp, c.tp) for d in range(draft.plan.dp))


def exchange(draft: Any, phase: str, mb: int, offset: int, tables: list[Table], stage: int, deps: list,
             nbytes: int, index_bytes: int = 0) -> Any:
    """One ``ALLTOALL`` of the plan's method among this rank's replicas."""
    from sim.lower import Node

    c = draft.coords
    return Node(Kind.ALLTOALL, stage, mb, deps=deps, group=_group(draft),
                tag=f"{EXCHANGE_TAG}{phase}:{mb}:{offset}:{c.pp}:{c.tp}", bytes=nbytes,
                layers=tuple(sorted({t.layer for t in tables})), method=draft.plan.embedding.method,
                phases=exchange_phases(phase, nbytes, draft.plan.dp, index_bytes))


def _exchange(draft: Any, phase: str, mb: int, offset: int, tables: list[Table], stage: int, deps: list) -> Any:
    return exchange(draft, phase, mb, offset, tables, stage, deps, exchange_bytes(draft.plan, tables)[phase])


def exclude_tables(draft: Any, tables: list[Table], imbalance: float) -> None:
    """The tables' gradients leave the data-parallel buckets; the exchanges wait for the most loaded owner."""
    draft.program.alltoall_imbalance = imbalance
    for layer, nbytes in excluded_bytes(draft.plan, tables, draft.costs).items():
        draft.excluded_grad_bytes[layer] = draft.excluded_grad_bytes.get(layer, 0) + nbytes


def step_bytes(draft: Any, stages: tuple[int, ...], tables: list[Table]) -> tuple[int, int]:
    """(dense parameter bytes, own shard bytes) an optimizer step of this rank updates; records the
    other ranks' shards as parameter bytes this rank does not hold. Under the distributed optimizer
    the rank steps its 1/dp share of the dense parameters (``Program.optimizer_share``; the runtime's
    ``exec.distributed_optimizer`` owns a chunk of each bucket) and its own shard whole (no replica
    holds it). Until session 16 (issue-9v) the dense bytes here were all of them, and the engine, which
    takes an instruction's bytes as given, stepped a sharded embedding's rank over dp x its share."""
    plan = draft.plan
    shard_bytes = sum(_shard_bytes(plan, table, draft.coords.dp) for table in tables)
    full_bytes = sum(table_bytes(plan, t, draft.costs) for t in tables)
    dense_bytes = sum(draft.cost(layer).param_bytes for s in stages for layer in draft.program.stage_layers[s]) \
        - full_bytes
    dense_bytes = round(dense_bytes * draft.program.optimizer_share)
    for table in tables:
        draft.program.unheld_param_bytes[table.layer] = full_bytes - shard_bytes
    return dense_bytes, shard_bytes


def _lower(draft: Any, stages: tuple[int, ...]) -> None:
    """The tables leave gradient sync; each micro-batch's gradient rows go to their owners right
    after its backward; under ``sequential`` each lookup sits right before its forward."""
    stage, tables = local_tables(draft, stages)
    if not tables:
        return
    exclude_tables(draft, tables, alltoall_imbalance(draft.plan))
    sequential = draft.plan.embedding.schedule == "sequential"
    for node in [n for n in draft.nodes if n.stage == stage and n.kind in (Kind.FWD, Kind.BWD, Kind.BWD_W)]:
        if node.kind is Kind.FWD and sequential:
            ids = draft.insert_before(node, _exchange(draft, "ids", node.microbatch, 0, tables, stage, []))
            rows = draft.insert_before(node, _exchange(draft, "rows", node.microbatch, 0, tables, stage, [ids]))
            node.deps.append(rows)
        elif node.kind is not Kind.FWD:
            draft.insert_after(node, _exchange(draft, "grads", node.microbatch, 0, tables, stage, [node]))


def _finish(draft: Any, stages: tuple[int, ...]) -> None:
    """The optimizer step waits for the gradient exchanges; under ``2d`` the tables step on their own
    and the next iteration's lookups follow, before the dense step."""
    from sim.lower import Node

    stage, tables = local_tables(draft, stages)
    if not tables:
        return
    config = draft.plan.embedding
    dense_bytes, shard_bytes = step_bytes(draft, stages, tables)
    step = next(n for n in draft.nodes if n.kind is Kind.OPTIMIZER_STEP)
    grads = [n for n in draft.nodes if n.kind is Kind.ALLTOALL and n.tag.startswith("emb:grads:")]
    if config.schedule == "sequential":
        step.deps.extend(grads)
        step.bytes = dense_bytes + shard_bytes
        synchronous_exchange_pass(draft.nodes)
        return
    step.bytes = dense_bytes
    own = draft.insert_before(step, Node(Kind.OPTIMIZER_STEP, deps=list(grads), bytes=shard_bytes,
                                         layers=tuple(sorted({t.layer for t in tables})), method="embrace"))
    microbatches = [n.microbatch for n in draft.nodes if n.kind is Kind.FWD and n.stage == stage]
    for mb in microbatches:
        ids = draft.insert_before(step, _exchange(draft, "ids", mb, 1, tables, stage, [own]))
        draft.insert_before(step, _exchange(draft, "rows", mb, 1, tables, stage, [ids]))
    synchronous_exchange_pass(draft.nodes)


register_embedding_method("embrace", Embrace, sharded=True, check=_check, lower=_lower, finish=_finish,
                          terms=estimate_terms)
