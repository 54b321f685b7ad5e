"""The runtime of ``embedding: {method: ps}`` (``sim.embedding_ps``): a Parallax-like parameter server
colocated with the workers.

Each rank is a worker and the server of its row shard (row v on rank v mod dp). Per iteration:

- ``emb:ids`` (pull request, synchronous): the unique ids of every micro-batch of the iteration to
  their servers;
- ``emb:rows`` (pull reply): the servers' rows back; every forward of the iteration reads them
  (``gathered``, one leaf for the whole iteration: each micro-batch's backward adds into its grad);
- ``emb:push`` (after the last backward): (indices, values) to the servers, who add every worker's
  values, divided by dp, into their shard's gradient at the pushed indices; the shard then takes
  the optimizer step with the dense layers.

All three are all-to-alls over the data-parallel group: with a server on every rank each worker
sends to every server, and one ``all_to_all_single`` is that exchange in one call (gloo and NCCL
run it as pairwise sends and receives). The push carries its indices: the server uses the pushed
indices, not what the pull asked, as a parameter server keeps no per-worker state between the two.
The message lengths (the split sizes) are the pull's: the same rows go back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from exec.embedding import EMBEDDING_RUNTIMES, EmbraceExchange, ExchangeState, InFlight, ShardedTable, exchange_tag
from exec.parallel.dp import Works
from sim.program import Instruction

ITERATION = -1  # the micro-batch key of a whole iteration's pull


class ParameterServerExchange(EmbraceExchange):
    def __init__(self, runtime: Any) -> None:
        super().__init__(runtime)
        # (layer, iteration) -> each micro-batch's (start in the pulled ids, shape of its ids)
        self.parts: dict[tuple[int, int], list[tuple[int, torch.Size]]] = {}

    def execute(self, ins: Instruction) -> tuple[Any, int, Any]:
        phase, _, _ = exchange_tag(ins)
        iteration = self.rt.iteration
        works, nbytes, thens = [], 0, []
        for layer in ins.layers:
            if phase == "ids":
                nbytes += self._pull_request(layer, iteration)
                continue
            if phase == "rows":
                pending = self._reply(self.tables[layer], self.states[(layer, iteration, ITERATION)])
            else:
                pending = self._push(layer, iteration)
            works.append(pending.work)
            nbytes += pending.nbytes
            thens.append(pending.then)
        return (Works(works) if works else None), nbytes, (lambda: [t() for t in thens])

    @staticmethod
    def batch_microbatches(plan: Any, mb: int) -> list[int]:
        """The pull asks once per iteration for all its micro-batches' ids."""
        return list(range(plan.microbatches))

    def _pull_request(self, layer: int, iteration: int) -> int:
        """The unique ids of the iteration's micro-batches to their servers."""
        batches = [self.batch_ids(iteration, mb) for mb in self.batch_microbatches(self.rt.plan, 0)]
        starts = [0]
        for ids in batches:
            starts.append(starts[-1] + ids.numel())
        self.parts[(layer, iteration)] = [(start, ids.shape) for start, ids in zip(starts, batches, strict=False)]
        state, nbytes = self._request(self.tables[layer], torch.cat([ids.reshape(-1) for ids in batches]))
        self.states[(layer, iteration, ITERATION)] = state
        return nbytes

    def _push(self, layer: int, iteration: int) -> InFlight:
        """(indices, values) of the pulled rows' summed gradients to their servers."""
        table, state = self.tables[layer], self.states.pop((layer, iteration, ITERATION))
        del self.parts[(layer, iteration)]
        assert state.gathered is not None
        grad = state.gathered.grad if state.gathered.grad is not None else torch.zeros_like(state.gathered)
        width = table.weight.shape[1]
        indices = state.uniq[state.order].contiguous()
        values = grad[state.order].contiguous()
        received = torch.empty(sum(state.recv_counts), dtype=indices.dtype, device=indices.device)
        received_values = torch.empty(sum(state.recv_counts), width, dtype=values.dtype, device=values.device)
        index_work = dist.all_to_all_single(received, indices, state.recv_counts, state.send_counts,
                                            group=self.group, async_op=True)
        value_work = dist.all_to_all_single(received_values.view(-1), values.view(-1),
                                            [c * width for c in state.recv_counts],
                                            [c * width for c in state.send_counts], group=self.group, async_op=True)

        def arrived() -> None:
            if table.weight.grad is None:
                table.weight.grad = torch.zeros_like(table.weight)
            # The server's sum of every worker's push, divided by dp: dense data parallelism's mean.
            table.weight.grad.index_add_(0, table.local_index(received), received_values.div_(self.dp))

        nbytes = indices.numel() * indices.element_size() + values.numel() * values.element_size()
        return InFlight(Works([index_work, value_work]), nbytes, arrived)

    def rows_for(self, table: ShardedTable, ids: torch.Tensor) -> torch.Tensor:
        layer = next(layer for layer, t in self.tables.items() if t is table)
        iteration, mb = self.current
        state: ExchangeState | None = self.states.get((layer, iteration, ITERATION))
        if state is None or state.gathered is None:
            raise RuntimeError(f"embedding layer {layer}: forward of iteration {iteration} before its pull "
                               "arrived (the Program lacks an emb:rows dependency)")
        start, shape = self.parts[(layer, iteration)][mb]
        if ids.shape != shape or not torch.equal(ids.reshape(-1), state.ids[start:start + ids.numel()]):
            raise RuntimeError(f"embedding layer {layer}: the forward's ids differ from the ids pulled")
        return state.gathered[state.inverse[start:start + ids.numel()].view(shape)]


EMBEDDING_RUNTIMES["ps"] = ParameterServerExchange
