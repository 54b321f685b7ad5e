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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from sim.comm import concurrent_groups
from sim.embedding import EmbeddingConfig, Table, embedding_tables, register_embedding_method
from sim.hardware import ELEMENT_BYTES
from sim.program import Kind
from traces.errors import ConfigError

if TYPE_CHECKING:
    from sim.plan import Plan

ID_BYTES = 8  # ids travel as int64, torch's index dtype
Shard = Literal["auto", "rows", "columns"]


class Embrace(EmbeddingConfig):
    """EmbRace: tables sharded over the data-parallel ranks; lookups and gradients exchanged by
    all-to-all, only the rows a batch touches."""

    method: Literal["embrace"] = "embrace"
    shard: Shard | list[Shard] = Field("auto", description="rows | columns | auto (columns when the width "
                                       "divides by dp), for every table or one per table")
    schedule: Literal["2d", "sequential"] = Field("2d", description="2d: per-micro-batch exchanges, the "
                                                  "next iteration's lookups prefetched; sequential: none")
    row_stats: str | None = Field(None, description="JSON of unique rows per micro-batch measured on real "
                                  "batches (python -m exec.embedding_rows); without it, uniform ids")


def shard_of(config: Embrace, tables: list[Table], index: int, dp: int) -> str:
    """How table ``index`` is sharded: as configured, or (auto) by columns when its width divides by
    dp (every owner then serves every row, so no skew of the ids can unbalance the owners)."""
    chosen = config.shard[index] if isinstance(config.shard, list) else config.shard
    if chosen == "auto":
        return "columns" if tables[index].dim % dp == 0 else "rows"
    return chosen


def shard_rows(table: Table, shard: str, dp: int, rank: int) -> tuple[int, int]:
    """(rows, width) of ``rank``'s shard: rows v with v mod dp == rank, or the rank's column slice."""
    if shard == "rows":
        return len(range(rank, table.rows, dp)), table.dim
    return table.rows, table.dim // dp


def _check(plan: Plan) -> None:
    config = plan.embedding
    assert isinstance(config, Embrace)
    tables = embedding_tables(plan.workload, plan.workload_options)
    if not tables:
        raise ConfigError("embedding.method", f"workload {plan.workload} has no embedding table to shard",
                          "use method: dense")
    if plan.dp < 2:
        raise ConfigError("embedding.method", "embrace shards tables over the data-parallel ranks; this plan "
                          "has dp 1", "use dp >= 2, or method: dense")
    if plan.tp > 1:
        # Tensor parallelism already splits a transformer's token table over the TP ranks; sharding
        # that split again over dp is neither priced (the table's bytes are counted whole) nor run.
        raise ConfigError("embedding.method", f"embrace with tensor parallelism (tp {plan.tp}) is not supported",
                          "use tp 1, or method: dense")
    if isinstance(config.shard, list) and len(config.shard) != len(tables):
        raise ConfigError("embedding.shard", f"has {len(config.shard)} entries for {len(tables)} table(s) of "
                          f"{plan.workload}", f"give one of rows | columns | auto per table ({len(tables)})")
    for index, table in enumerate(tables):
        if shard_of(config, tables, index, plan.dp) == "columns" and table.dim % plan.dp:
            raise ConfigError("embedding.shard", f"columns: width {table.dim} of table {index} does not divide "
                              f"by dp {plan.dp}", "shard it by rows")
    unique_rows(plan, tables[0])  # refuses real text without measured statistics
    alltoall_imbalance(plan)  # and row sharding without the owners' shares at this dp


def unique_rows(plan: Plan, table: Table) -> float:
    """Mean unique ids in one micro-batch of one rank: measured, or closed form for uniform ids."""
    config = plan.embedding
    assert isinstance(config, Embrace)
    seq = _seq(plan)
    tokens = plan.micro_batch * seq
    if config.row_stats is not None:
        return _measured(config.row_stats, plan, table, tokens)
    if plan.workload_options.get("data", "synthetic") != "synthetic":
        raise ConfigError("embedding.row_stats", f"the rows a batch of {plan.workload_options['data']} touches "
                          "are not uniform", f"measure them: python -m exec.embedding_rows --workload "
                          f"{plan.workload} --micro-batch {plan.micro_batch} --out rows.json, then set "
                          "embedding.row_stats: rows.json (workload_options too)")
    # n uniform draws from V ids: each id is missed by all with probability (1 - 1/V)^n.
    return table.rows * (1.0 - (1.0 - 1.0 / table.rows) ** tokens)


def alltoall_imbalance(plan: Plan) -> float:
    """Largest destination's share of an exchange over the even 1/dp: by rows, the measured largest
    share of a micro-batch's unique ids owned by one rank (id mod dp), times dp; by columns every owner
    serves every id (1). Uniform synthetic ids without statistics: 1 (their skew is not modelled)."""
    config = plan.embedding
    assert isinstance(config, Embrace)
    tables = embedding_tables(plan.workload, plan.workload_options)
    rows = [t for i, t in enumerate(tables) if shard_of(config, tables, i, plan.dp) == "rows"]
    if not rows or config.row_stats is None:
        return 1.0
    entry = _entry(config.row_stats, plan, rows[0], plan.micro_batch * _seq(plan))
    share = entry.get("owner_share_max_mean", {}).get(str(plan.dp))
    if share is None:
        raise ConfigError("embedding.row_stats", f"{config.row_stats} has no owner shares for dp {plan.dp}",
                          f"measure them: python -m exec.embedding_rows --workload {plan.workload} --micro-batch "
                          f"{plan.micro_batch} --dp {plan.dp} --out {config.row_stats}")
    return max(1.0, float(share) * plan.dp)


def _seq(plan: Plan) -> int:
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
                      f"--micro-batch {plan.micro_batch} --out {path}")


def exchange_bytes(plan: Plan, tables: list[Table]) -> dict[str, int]:
    """Bytes of one rank's send buffer per phase of one micro-batch's exchange, over ``tables``."""
    b = ELEMENT_BYTES[plan.dtype]
    config = plan.embedding
    assert isinstance(config, Embrace)
    all_tables = embedding_tables(plan.workload, plan.workload_options)
    ids = rows = 0
    for table in tables:
        unique = unique_rows(plan, table)
        columns = shard_of(config, all_tables, all_tables.index(table), plan.dp) == "columns"
        # By rows each id goes to its one owner; by columns every owner needs every id.
        ids += round(unique * ID_BYTES * (plan.dp if columns else 1))
        rows += round(unique * table.dim * b)
    return {"ids": ids, "rows": rows, "grads": rows}


@dataclass(frozen=True)
class EmbeddingTerms:
    """What ``sim.estimate`` needs of a sharded embedding: where the tables are (pipeline rank and
    the index of their stage among that rank's stages), the gradient bytes they take out of the
    buckets, and the seconds of their exchanges on the collective stream."""

    rank: int
    index: int
    removed_by_layer: tuple[tuple[int, int], ...]  # (layer, gradient bytes) the tables take out of the buckets
    lookups_s: float  # ids + rows of every micro-batch
    last_grads_s: float  # the last micro-batch's gradient exchange (the earlier ones overlap the backward)
    prefetch: bool  # 2D: lookups after the buckets, beside the dense optimizer step
    static_bytes_saved: int  # parameters, gradients and optimizer state of the other ranks' shards


def estimate_terms(plan: Plan, stage_layers: list[tuple[int, ...]], comm: Any, costs: Any, rank_of_stage: list[int],
                   stages_of_rank: list[tuple[int, ...]]) -> EmbeddingTerms | None:
    """The estimate's terms for ``plan`` (None unless its tables are sharded)."""
    if not isinstance(plan.embedding, Embrace):
        return None
    tables = embedding_tables(plan.workload, plan.workload_options)
    stage = next(s for s, layers in enumerate(stage_layers) if tables[0].layer in layers)
    rank = rank_of_stage[stage]
    group = tuple(d * plan.tp for d in range(plan.dp))  # pipeline rank 0's replicas (sim.program.rank_of)
    sizes = exchange_bytes(plan, tables)

    imbalance = alltoall_imbalance(plan)
    sharing = concurrent_groups(comm.cluster, plan.dp * plan.tp, group)  # one exchange per TP rank at once

    def a2a(phase: str) -> float:
        return comm.collective_s("all_to_all", round(sizes[phase] * imbalance), group, sharing)

    removed = excluded_bytes(tables, plan.dtype)
    full = sum(removed.values())
    shard = sum(_shard_bytes(plan, t, 0) for t in tables)
    layer = costs.layer_costs(tables[0].layer, plan.micro_batch, plan.tp)
    static = layer.param_bytes + layer.grad_bytes + layer.optimizer_bytes
    return EmbeddingTerms(rank=rank, index=stages_of_rank[rank].index(stage),
                          removed_by_layer=tuple(sorted(removed.items())),
                          lookups_s=plan.microbatches * (a2a("ids") + a2a("rows")), last_grads_s=a2a("grads"),
                          prefetch=plan.embedding.schedule == "2d",
                          static_bytes_saved=round((full - shard) / layer.param_bytes * static))


def excluded_bytes(tables: Sequence[Table], dtype: str) -> dict[int, int]:
    """Layer -> gradient bytes of the sharded tables it holds, which leave the data-parallel buckets."""
    out: dict[int, int] = {}
    for table in tables:
        out[table.layer] = out.get(table.layer, 0) + table.rows * table.dim * ELEMENT_BYTES[dtype]
    return out


def _shard_bytes(plan: Plan, table: Table, rank: int) -> int:
    """Bytes of ``rank``'s shard of ``table``."""
    assert isinstance(plan.embedding, Embrace)
    tables = embedding_tables(plan.workload, plan.workload_options)
    rows, width = shard_rows(table, shard_of(plan.embedding, tables, tables.index(table), plan.dp), plan.dp, rank)
    return rows * width * ELEMENT_BYTES[plan.dtype]


# ---------------------------------------------------------------------------------------------
# Lowering (sim.lower calls these on each rank's draft; see its _Draft and Node).


def _local_tables(draft: Any, stages: tuple[int, ...]) -> tuple[int, list[Table]]:
    layers = {layer: s for s in stages for layer in draft.program.stage_layers[s]}
    tables = [t for t in embedding_tables(draft.plan.workload, draft.plan.workload_options) if t.layer in layers]
    return (layers[tables[0].layer] if tables else -1), tables


def _group(draft: Any) -> tuple[int, ...]:
    c = draft.coords
    return tuple(draft.program.rank_of(d, c.pp, c.tp) for d in range(draft.plan.dp))


def _exchange(draft: Any, phase: str, mb: int, offset: int, tables: list[Table], stage: int, deps: list) -> Any:
    from sim.lower import Node

    c = draft.coords
    return Node(Kind.ALLTOALL, stage, mb, deps=deps, group=_group(draft),
                tag=f"emb:{phase}:{mb}:{offset}:{c.pp}:{c.tp}",
                bytes=exchange_bytes(draft.plan, tables)[phase], layers=tuple(sorted({t.layer for t in tables})),
                method="embrace")


def _lower(draft: Any, stages: tuple[int, ...]) -> None:
    """The tables leave gradient sync; each micro-batch's gradient rows go to their owners right
    after its backward; under ``sequential`` each lookup sits right before its forward."""
    stage, tables = _local_tables(draft, stages)
    if not tables:
        return
    draft.program.alltoall_imbalance = alltoall_imbalance(draft.plan)
    for layer, nbytes in excluded_bytes(tables, draft.plan.dtype).items():
        draft.excluded_grad_bytes[layer] = draft.excluded_grad_bytes.get(layer, 0) + nbytes
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

    stage, tables = _local_tables(draft, stages)
    if not tables:
        return
    plan, b = draft.plan, ELEMENT_BYTES[draft.plan.dtype]
    config = plan.embedding
    shard_bytes = sum(_shard_bytes(plan, table, draft.coords.dp) for table in tables)
    full_bytes = sum(t.rows * t.dim * b for t in tables)
    dense_bytes = sum(draft.cost(layer).param_bytes for s in stages for layer in draft.program.stage_layers[s]) \
        - full_bytes
    for table in tables:
        draft.program.unheld_param_bytes[table.layer] = full_bytes - shard_bytes
    step = next(n for n in draft.nodes if n.kind is Kind.OPTIMIZER_STEP)
    grads = [n for n in draft.nodes if n.kind is Kind.ALLTOALL and n.tag.startswith("emb:grads:")]
    if config.schedule == "sequential":
        step.deps.extend(grads)
        step.bytes = dense_bytes + shard_bytes
        return
    step.bytes = dense_bytes
    own = draft.insert_before(step, Node(Kind.OPTIMIZER_STEP, deps=list(grads), bytes=shard_bytes,
                                         layers=tuple(sorted({t.layer for t in tables})), method="embrace"))
    microbatches = [n.microbatch for n in draft.nodes if n.kind is Kind.FWD and n.stage == stage]
    for mb in microbatches:
        ids = draft.insert_before(step, _exchange(draft, "ids", mb, 1, tables, stage, [own]))
        draft.insert_before(step, _exchange(draft, "rows", mb, 1, tables, stage, [ids]))


register_embedding_method("embrace", Embrace, sharded=True, check=_check, lower=_lower, finish=_finish)
