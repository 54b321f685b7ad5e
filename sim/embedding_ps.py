"""A Parallax-like parameter server for the embedding tables: the baseline EmbRace is compared with.

Parallax (Kim et al., "Parallax: Sparsity-aware Data Parallel Training of Deep Neural Networks",
EuroSys 2019, arXiv:1808.02621) keeps dense variables data parallel with all-reduce and puts sparse
ones (embedding tables) on parameter servers, partitioned by rows, one server process colocated with
each worker. paratwin models exactly that:

- every table is sharded by rows over the data-parallel ranks (row v on server v mod dp, the
  round-robin partitioning that keeps a frequency-ranked vocabulary balanced, as for EmbRace);
- **pull**, once per iteration and strictly before its first forward: the worker sends the unique
  ids of its whole iteration (every micro-batch) to their servers and waits for the rows;
- **push**, once per iteration after its last backward: the worker sends (indices, values), two
  all-to-alls launched together (``sim.embedding.exchange_phases``: priced one after the other), the
  summed gradients of the rows it pulled, to their servers; a server adds every worker's push,
  divides by dp and applies the optimizer to its shard (the dense Adam over the whole shard, so the
  run stays exactly dense data parallelism's; untouched rows get a zero gradient there too);
- no overlap beyond what the stream order gives: no prefetch, no per-micro-batch exchange.

On the wire every worker talks to every server: with servers colocated on all dp ranks that traffic
is an all-to-all, and the Program says so (``ALLTOALL`` instructions, priced by
``sim.collectives``' all-to-all of one rank's send buffer). Unlike EmbRace's gradient exchange,
a push carries its indices (a server keeps no state between a worker's pull and its push), and the
messages cover the union of the iteration's rows once instead of each micro-batch's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from sim.embedding import EmbeddingTerms, Table, embedding_tables, register_embedding_method, synchronous_exchange_pass
from sim.embedding_embrace import (
    ID_BYTES,
    ShardedEmbedding,
    alltoall_imbalance,
    alltoall_s,
    check_sharded,
    exchange,
    exclude_tables,
    local_tables,
    seq_len,
    sharded_terms,
    step_bytes,
    tp_width,
    unique_rows,
)
from sim.hardware import ELEMENT_BYTES
from sim.program import Kind

if TYPE_CHECKING:
    from sim.plan import Plan


class ParameterServer(ShardedEmbedding):
    """Parallax-like parameter server colocated with the workers: tables sharded by rows; each
    iteration pulls the rows it touches before its forwards and pushes their gradients after its
    backwards."""

    method: Literal["ps"] = "ps"


def iteration_tokens(plan: Plan) -> int:
    """Ids one worker looks up in an iteration: every micro-batch's."""
    return plan.microbatches * plan.micro_batch * seq_len(plan)


def exchange_bytes(plan: Plan, tables: list[Table]) -> dict[str, int]:
    """One rank's send buffer per phase of an iteration: pull request (ids), pull reply (rows),
    push (ids and row gradients)."""
    b = ELEMENT_BYTES[plan.dtype]
    ids = rows = 0
    for table in tables:
        unique = unique_rows(plan, table, iteration_tokens(plan))
        ids += round(unique * ID_BYTES)
        rows += round(unique * tp_width(plan, table) * b)
    return {"ids": ids, "rows": rows, "push": ids + rows}


def _check(plan: Plan) -> None:
    check_sharded(plan)
    tables = embedding_tables(plan.workload, plan.workload_options)
    unique_rows(plan, tables[0], iteration_tokens(plan))  # refuses real text without measured statistics
    alltoall_imbalance(plan, iteration_tokens(plan))


def _lower(draft: Any, stages: tuple[int, ...]) -> None:
    """The pull gates every forward of the tables' stage; the push follows its last backward."""
    stage, tables = local_tables(draft, stages)
    if not tables:
        return
    plan = draft.plan
    exclude_tables(draft, tables, alltoall_imbalance(plan, iteration_tokens(plan)))
    sizes = exchange_bytes(plan, tables)
    forwards = [n for n in draft.nodes if n.stage == stage and n.kind is Kind.FWD]
    backwards = [n for n in draft.nodes if n.stage == stage and n.kind in (Kind.BWD, Kind.BWD_W)]
    first = forwards[0]
    ids = draft.insert_before(first, exchange(draft, "ids", first.microbatch, 0, tables, stage, [], sizes["ids"]))
    rows = draft.insert_before(first, exchange(draft, "rows", first.microbatch, 0, tables, stage, [ids],
                                               sizes["rows"]))
    for forward in forwards:
        forward.deps.append(rows)
    draft.insert_after(backwards[-1], exchange(draft, "push", backwards[-1].microbatch, 0, tables, stage,
                                               list(backwards), sizes["push"], index_bytes=sizes["ids"]))


def _finish(draft: Any, stages: tuple[int, ...]) -> None:
    """One optimizer step, the servers' shards with the dense layers, once the pushes have arrived."""
    stage, tables = local_tables(draft, stages)
    if not tables:
        return
    dense_bytes, shard_bytes = step_bytes(draft, stages, tables)
    step = next(n for n in draft.nodes if n.kind is Kind.OPTIMIZER_STEP)
    step.deps.extend(n for n in draft.nodes if n.kind is Kind.ALLTOALL and n.tag.startswith("emb:push:"))
    step.bytes = dense_bytes + shard_bytes
    synchronous_exchange_pass(draft.nodes)


def estimate_terms(plan: Plan, stage_layers: list[tuple[int, ...]], comm: Any, costs: Any, rank_of_stage: list[int],
                   stages_of_rank: list[tuple[int, ...]]) -> EmbeddingTerms:
    """The pull before the forwards, the push after the last backward."""
    sizes = exchange_bytes(plan, embedding_tables(plan.workload, plan.workload_options))
    imbalance = alltoall_imbalance(plan, iteration_tokens(plan))
    return sharded_terms(plan, stage_layers, costs, rank_of_stage, stages_of_rank,
                         lookups_s=sum(alltoall_s(plan, comm, p, sizes[p], imbalance, costs=costs)
                                       for p in ("ids", "rows")),
                         last_grads_s=alltoall_s(plan, comm, "push", sizes["push"], imbalance, sizes["ids"]),
                         prefetch=False)


register_embedding_method("ps", ParameterServer, sharded=True, check=_check, lower=_lower, finish=_finish,
                          terms=estimate_terms)
