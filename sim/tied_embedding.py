"""Megatron-LM's tied word embedding: the one rule for its gradient all-reduce between the first and
the last pipeline stage, which the lowering (``sim.lower.tied_embedding_pass``), the fast estimate
(``sim.estimate``) and the closed form of the calibration (``sim.calibration.quick_predict``) apply.

Megatron-LM's GPT ties the word embedding to the LM head by default: at v2.5 (e269e20)
``MegatronModule(share_word_embeddings=True)`` (megatron/model/module.py l.41), never overridden by
``GPTModel``; at 23.04 (2360d73) ``--untie-embeddings-and-output-weights`` is store_true (megatron/
arguments.py l.558). With more than one pipeline stage the first and the last stage each hold the
matrix, and after the data-parallel gradient sync, before the step, Megatron all-reduces its gradient
(the main_grad, in place) over the two (megatron/training.py l.371-394 at v2.5; optimizer.py
``allreduce_word_embedding_grads`` l.202-228 at 23.04, from ``reduce_model_grads``). One such pair
per (data-parallel, tensor-parallel) coordinate.

A workload option (``workload_options: {tied_embedding: true}``), default false: the project's
runnable GPT has an untied head, and the runtime refuses the option with pp > 1
(``exec.contract.compile_for_run``). The plans that describe Megatron runs set it
(``sim.implementations.MEGATRON_TIED_EMBEDDING``). Bytes: the head layer's gradient, the vocabulary
matrix (its 1/tp slice: Megatron's table is vocabulary-parallel) plus the final layernorm's 2h
elements (2 / vocabulary of it, counted too), in the dtype the gradients are held in. Not modelled:
at pp 1 a tied model holds one vocabulary matrix, our GPT two. Imports neither torch nor simpy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sim.costs import LayerCosts

TIED_TAG = "tied"  # the tag prefix of the all-reduce (one per data-parallel and tensor-parallel coordinate)


def ties_embedding(workload_options: Mapping[str, Any], pp: int) -> bool:
    """Whether the plan runs the tied-embedding all-reduce: a tied GPT on more than one stage."""
    return pp > 1 and bool(workload_options.get("tied_embedding", False))


def tied_embedding_bytes(head: LayerCosts, buffer_scale: float = 1.0) -> int:
    """Bytes of the all-reduce: the head's gradient as held (``sim.model_state.gradient_buffer_scale``)."""
    return round(head.grad_bytes * buffer_scale)


def tied_ranks(tp: int, dp: int, last: int) -> tuple[int, int]:
    """The ranks of the first stage and of the last (on pipeline rank ``last``) at data-parallel and
    tensor-parallel coordinate 0, in Megatron-LM's rank order (tensor-parallel ranks innermost, then
    data-parallel, then pipeline; ``sim.program.Program.rank_of``)."""
    return 0, last * dp * tp
