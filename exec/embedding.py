"""The runtime's side of each embedding method (``sim.embedding`` registers the simulator's side).

``embrace``: every embedding table of this rank's stages is replaced by its shard
(``ShardedTable``: rows v with v mod dp == r, or the r-th column slice, cut from the full seeded
weights, so the model starts exactly where the dense one does), and the Program's ``ALLTOALL``
instructions move, per micro-batch, the unique ids a batch touches to their owners (``emb:ids``,
synchronous: counts, then ids), the owners' rows back (``emb:rows``, asynchronous), and after the
backward the gradients of those rows to their owners (``emb:grads``, asynchronous), which add them,
divided by dp, into their shard's gradient: the dense mean gradient of every row they own.

A forward reads the rows its micro-batch's lookup brought (``ExchangeState.gathered``, a leaf
whose gradient the backward fills); the tag of an exchange says which micro-batch and which
iteration (offset 1: the next one, prefetched by the 2D schedule). The tables take their own Adam
step (``step``), at the ``OPTIMIZER_STEP`` the lowering gave the method's name, or with the dense
step when the Program has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from exec.contract import batch_seed, make_optimizer
from exec.parallel.dp import Works
from exec.parallel.tp import gather_columns_from_tp
from sim.embedding import Table, embedding_tables
from sim.embedding_embrace import table_shard
from sim.program import Instruction, Kind

if TYPE_CHECKING:
    from exec.interpreter import RankRuntime
    from sim.plan import Plan


class ShardedTable(nn.Module):
    """This rank's shard of one embedding table; its forward returns the rows the micro-batch's
    lookup brought, arranged like the ids.

    Under tensor parallelism each TP rank first takes its column slice of the table (dim / tp:
    sim.embedding_embrace.tp_width) and shards that over dp; the exchanges run in its own dp group
    (the replicas of its TP rank), and the forward all-gathers the slices' columns over the TP group
    (the gradient of the gathered rows is the same on every TP rank, so each keeps its columns)."""

    def __init__(self, full: torch.Tensor, shard: str, dp: int, rank: int, exchange: EmbraceExchange,
                 tp: tuple[int, int, object] = (0, 1, None)) -> None:
        super().__init__()
        self.tp_rank, self.tp, self.tp_group = tp
        width = full.shape[1] // self.tp
        full = full[:, self.tp_rank * width:(self.tp_rank + 1) * width]
        self.shard, self.dp, self.rank, self.rows, self.dim = shard, dp, rank, full.shape[0], full.shape[1]
        part = full[rank::dp] if shard == "rows" else full[:, rank * (self.dim // dp):(rank + 1) * (self.dim // dp)]
        self.weight = nn.Parameter(part.detach().clone())
        self.weight.sharded = True  # type: ignore[attr-defined]  # kept out of the gradient-sync buckets
        self.exchange = [exchange]  # a list: not a submodule

    def local_index(self, ids: torch.Tensor) -> torch.Tensor:
        """Row of this shard that holds each (owned) id."""
        return ids // self.dp if self.shard == "rows" else ids

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return gather_columns_from_tp(self.exchange[0].rows_for(self, ids), self.tp_rank, self.tp, self.tp_group)


def is_sharded(p: nn.Parameter) -> bool:
    return bool(getattr(p, "sharded", False))


def assemble(shards: list[torch.Tensor], shard: str) -> torch.Tensor:
    """The full table from every rank's shard (rank order), as ``ShardedTable`` cut it."""
    if shard == "columns":
        return torch.cat(shards, dim=1)
    rows = sum(s.shape[0] for s in shards)
    full = torch.empty(rows, shards[0].shape[1], dtype=shards[0].dtype)
    for rank, part in enumerate(shards):
        full[rank::len(shards)] = part
    return full


@dataclass
class ExchangeState:
    """One table's lookup of one micro-batch: what this rank asked for and what it was asked."""

    ids: torch.Tensor  # the micro-batch's ids, as the forward will pass them
    uniq: torch.Tensor  # sorted unique ids
    inverse: torch.Tensor  # ids -> position in uniq
    order: torch.Tensor  # positions of uniq in send order (grouped by owner)
    send_counts: list[int]  # ids sent to each owner
    recv_counts: list[int] = field(default_factory=list)  # ids each requester sent here
    requested: torch.Tensor | None = None  # those ids, requester by requester
    gathered: torch.Tensor | None = None  # [unique, dim] rows, a leaf: the backward fills its grad


class EmbraceExchange:
    def __init__(self, runtime: RankRuntime) -> None:
        self.rt = runtime
        plan = runtime.plan
        self.dp, self.rank, self.group = plan.dp, runtime.coords.dp, runtime.dp_group
        all_tables = embedding_tables(plan.workload, plan.workload_options)
        self.tables: dict[int, ShardedTable] = {}  # layer -> shard (one table per layer in every workload)
        for index, table in enumerate(all_tables):
            if table.layer in runtime.layer_modules:
                self.tables[table.layer] = self._replace(table, table_shard(plan, all_tables, index))
        self.states: dict[tuple[int, int, int], ExchangeState] = {}  # (layer, iteration, mb)
        self.current: tuple[int, int] = (-1, -1)
        self.optimizer = make_optimizer([t.weight for t in self.tables.values()]) if self.tables else None
        steps = [i for i in runtime.program.instructions if i.kind is Kind.OPTIMIZER_STEP]
        self.own_step = any(i.method for i in steps)
        self.prefetches = any(i.kind is Kind.ALLTOALL and exchange_tag(i)[2] == 1
                              for i in runtime.program.instructions)

    def _replace(self, table: Table, shard: str) -> ShardedTable:
        layer = self.rt.layer_modules[table.layer]
        module = layer.get_submodule(table.module) if table.module else layer
        sharded = ShardedTable(module.weight, shard, self.dp, self.rank, self,
                               (self.rt.coords.tp, self.rt.plan.tp, self.rt.tp_group))
        if table.module:
            parent, _, name = table.module.rpartition(".")
            setattr(layer.get_submodule(parent) if parent else layer, name, sharded)
        else:
            for stage, modules in self.rt.stages.items():
                layers = self.rt.stage_layers[stage]
                if table.layer in layers:
                    modules[layers.index(table.layer)] = sharded
            self.rt.layer_modules[table.layer] = sharded
        return sharded

    # -- the interpreter's calls -------------------------------------------------------------------
    def start_iteration(self, iteration: int) -> None:
        """Drop what earlier iterations left; the 2D schedule's first iteration fetches its rows
        here, before timing starts (later ones were prefetched by the iteration before)."""
        for t in self.tables.values():
            t.weight.grad = None
        self.states = {k: v for k, v in self.states.items() if k[1] >= iteration}
        if self.prefetches:
            for layer in self.tables:
                for mb in range(self.rt.plan.microbatches):
                    if (layer, iteration, mb) not in self.states:
                        self._ids(layer, iteration, mb)
                        self._rows(layer, iteration, mb).wait()

    def enter(self, iteration: int, mb: int) -> None:
        self.current = (iteration, mb)

    def step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()

    def execute(self, ins: Instruction) -> tuple[Any, int, Any]:
        """Run one ALLTOALL: (work in flight or None, bytes sent, what to do on completion)."""
        phase, mb, offset = exchange_tag(ins)
        iteration = self.rt.iteration + offset
        works, nbytes, thens = [], 0, []
        for layer in ins.layers:
            if phase == "ids":
                nbytes += self._ids(layer, iteration, mb)
            elif phase == "rows":
                pending = self._rows(layer, iteration, mb)
                works.append(pending.work)
                nbytes += pending.nbytes
                thens.append(pending.wait)
            else:
                pending = self._grads(layer, iteration, mb)
                works.append(pending.work)
                nbytes += pending.nbytes
                thens.append(pending.wait)
        work = Works(works) if works else None  # one per table of the layer
        return work, nbytes, (lambda: [t() for t in thens])

    # -- the three phases --------------------------------------------------------------------------
    def _ids(self, layer: int, iteration: int, mb: int) -> int:
        """Send this micro-batch's unique ids to their owners (by rows: id mod dp; by columns: all)."""
        state, nbytes = self._request(self.tables[layer], self.batch_ids(iteration, mb))
        self.states[(layer, iteration, mb)] = state
        return nbytes

    @staticmethod
    def batch_microbatches(plan: Plan, mb: int) -> list[int]:
        """The micro-batches whose ids one request of micro-batch ``mb`` sends (EmbRace: its own)."""
        return [mb]

    def batch_ids(self, iteration: int, mb: int) -> torch.Tensor:
        """The ids micro-batch ``mb`` of ``iteration`` looks up on this rank (the runtime's own batch)."""
        seed = batch_seed(iteration, self.rank, mb, self.dp, self.rt.plan.microbatches)
        return self.rt.workload.make_batch(self.rt.plan.micro_batch, seed=seed, device=self.rt.device).inputs

    def _request(self, table: ShardedTable, ids: torch.Tensor) -> tuple[ExchangeState, int]:
        """Send the unique ``ids`` to their owners (synchronous: counts, then ids); (state, bytes sent)."""
        uniq, inverse, order, send, send_counts = request_order(ids, table.shard, self.dp)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        requested = torch.empty(int(recv_counts.sum()), dtype=torch.int64, device=uniq.device)
        dist.all_to_all_single(requested, send, recv_counts.tolist(), send_counts.tolist(), group=self.group)
        state = ExchangeState(ids=ids, uniq=uniq, inverse=inverse, order=order, send_counts=send_counts.tolist(),
                              recv_counts=recv_counts.tolist(), requested=requested)
        return state, (send.numel() + send_counts.numel()) * 8

    def _width(self, table: ShardedTable) -> int:
        return table.weight.shape[1]

    def _rows(self, layer: int, iteration: int, mb: int) -> InFlight:
        return self._reply(self.tables[layer], self.states[(layer, iteration, mb)])

    def _reply(self, table: ShardedTable, state: ExchangeState) -> InFlight:
        """Owners send the requested rows (of their shard) back; on arrival they become ``gathered``."""
        width = self._width(table)
        with torch.no_grad():
            reply = table.weight[table.local_index(state.requested)].contiguous()
        unique = state.uniq.numel()
        if table.shard == "rows":
            received = torch.empty(unique, width, dtype=reply.dtype, device=reply.device)
            out_splits = [c * width for c in state.send_counts]
        else:
            received = torch.empty(self.dp, unique, width, dtype=reply.dtype, device=reply.device)
            out_splits = [unique * width] * self.dp
        work = dist.all_to_all_single(received.view(-1), reply.view(-1), out_splits,
                                      [c * width for c in state.recv_counts], group=self.group, async_op=True)

        def arrived() -> None:
            if table.shard == "rows":
                rows = torch.empty_like(received)
                rows[state.order] = received
            else:  # owner j's columns come j-th
                rows = received.permute(1, 0, 2).reshape(unique, self.dp * width)
            state.gathered = rows.requires_grad_(True)

        return InFlight(work, reply.numel() * reply.element_size(), arrived)

    def _grads(self, layer: int, iteration: int, mb: int) -> InFlight:
        """The gradients of the gathered rows to their owners, who add them / dp into their shard."""
        table, state = self.tables[layer], self.states.pop((layer, iteration, mb))
        width = self._width(table)
        assert state.gathered is not None and state.requested is not None
        grad = state.gathered.grad if state.gathered.grad is not None else torch.zeros_like(state.gathered)
        unique = state.uniq.numel()
        if table.shard == "rows":
            send = grad[state.order].contiguous()
            in_splits = [c * width for c in state.send_counts]
        else:
            send = grad.view(unique, self.dp, width).permute(1, 0, 2).contiguous()
            in_splits = [unique * width] * self.dp
        received = torch.empty(state.requested.numel(), width, dtype=grad.dtype, device=grad.device)
        work = dist.all_to_all_single(received.view(-1), send.view(-1), [c * width for c in state.recv_counts],
                                      in_splits, group=self.group, async_op=True)

        def arrived() -> None:
            if table.weight.grad is None:
                table.weight.grad = torch.zeros_like(table.weight)
            # Every requester's share of the sum, divided by dp: the mean gradient, as dense data
            # parallelism's all-reduce-then-divide gives it.
            table.weight.grad.index_add_(0, table.local_index(state.requested), received.div_(self.dp))

        return InFlight(work, send.numel() * send.element_size(), arrived)

    def rows_for(self, table: ShardedTable, ids: torch.Tensor) -> torch.Tensor:
        layer = next(layer for layer, t in self.tables.items() if t is table)
        iteration, mb = self.current
        state = self.states.get((layer, iteration, mb))
        if state is None or state.gathered is None:
            raise RuntimeError(f"embedding layer {layer}: forward of iteration {iteration} micro-batch {mb} "
                               "before its rows arrived (the Program lacks an emb:rows dependency)")
        if not torch.equal(ids, state.ids):
            raise RuntimeError(f"embedding layer {layer}: the forward's ids differ from the ids looked up")
        return state.gathered[state.inverse]


@dataclass
class InFlight:
    work: Any
    nbytes: int
    then: Any

    def wait(self) -> None:
        self.work.wait()
        self.then()


def request_order(ids: torch.Tensor, shard: str, dp: int) -> tuple[torch.Tensor, ...]:
    """The host work of an ids request before its counts move: the unique ids, each id's index in
    them, their order by owner (by rows: id mod dp; by columns: every rank), the send buffer and
    the counts per owner."""
    uniq, inverse = torch.unique(ids, return_inverse=True)
    if shard == "rows":
        owner = uniq % dp
        order = torch.argsort(owner, stable=True)
        return uniq, inverse, order, uniq[order], torch.bincount(owner, minlength=dp)
    order = torch.arange(uniq.numel(), device=uniq.device)
    return (uniq, inverse, order, uniq.repeat(dp),
            torch.full((dp,), uniq.numel(), dtype=torch.int64, device=uniq.device))


def request_host_work(plan: Plan, workload: Any, replica: int, iteration: int, microbatch: int) -> None:
    """One synchronous ids exchange's host work on a rank, as the runtime does it before the counts
    move (the profile times it: ``ids_request_host_s``): per sharded table, the ids of the
    micro-batches the request covers (``EmbraceExchange.batch_microbatches``: this one, or the
    iteration's for the parameter server), made as the runtime makes its batch, then
    ``request_order``. Needs no process group."""
    tables = embedding_tables(plan.workload, plan.workload_options)
    runtime = EMBEDDING_RUNTIMES[plan.embedding.method]
    mbs = runtime.batch_microbatches(plan, microbatch)
    for index in range(len(tables)):
        batches = [workload.make_batch(plan.micro_batch, seed=batch_seed(iteration, replica, mb, plan.dp,
                                                                         plan.microbatches)).inputs for mb in mbs]
        ids = batches[0] if len(batches) == 1 else torch.cat([b.reshape(-1) for b in batches])
        request_order(ids, table_shard(plan, tables, index), plan.dp)


def exchange_tag(ins: Instruction) -> tuple[str, int, int]:
    """(phase, micro-batch, iteration offset) of an ``emb:<phase>:<mb>:<offset>:<pp>:<tp>`` tag."""
    _, phase, mb, offset, *_ = ins.tag.split(":")
    return phase, int(mb), int(offset)


# The runtime of each embedding method with sharded tables; ``dense`` needs none. Other methods'
# modules add themselves on import (below).
EMBEDDING_RUNTIMES: dict[str, type[EmbraceExchange]] = {"embrace": EmbraceExchange}

from exec import embedding_ps  # noqa: E402, F401
