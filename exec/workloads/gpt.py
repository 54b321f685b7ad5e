"""GPT (causal decoder) and BERT (bidirectional encoder) as cuttable layers: embed, N x block, head.

The layers are exactly those of ``sim.workloads.transformer_layers`` (same names, same order,
same parameter counts), so the simulator's closed forms and the profiler's measurements describe
the same modules. Dropout (``TransformerConfig.dropout``, p) where Megatron-LM's GPT has it: after the
embedding, on the attention probabilities, and after the attention projection and fc2 before each
residual add; with p 0 (every preset's default) no dropout runs at all, so two runs with the same
seed agree bit for bit.

Tensor parallelism is applied later from outside (torchtitan style); the modules only keep the
four matmuls as plainly named ``nn.Linear`` attributes (``attn.qkv``, ``attn.proj``,
``mlp.fc1``, ``mlp.fc2``) and read their head count from ``attn.heads``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from exec.parallel.sequence import SequenceParallelRng, forked
from sim.workloads import TransformerConfig, transformer_config, transformer_layers
from traces.errors import ConfigError

from .base import Batch, Workload
from .data import check_data_source, token_windows

# Token id that replaces masked positions in BERT inputs (the last id of the vocabulary).
MASK_FRACTION = 0.15


class Embedding(nn.Module):
    """Token plus learned position embedding: ids [b, s] int64 -> [b, s, h]."""

    def __init__(self, vocab: int, hidden: int, seq: int, sparse: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout
        # sparse: the token table's gradient is its touched rows (row-sparse gradient sync, issue 11)
        self.tok = nn.Embedding(vocab, hidden, sparse=sparse)
        self.pos = nn.Embedding(seq, hidden)
        # Where the output enters the sequence-parallel region (exec.parallel.tp, sequence_parallel):
        # Megatron-LM scatters the embedding's output along the sequence.
        self.sequence_scatter: nn.Module = nn.Identity()
        # This TP rank's generator for the region's dropout (exec.parallel.sequence.SequenceParallelRng).
        self.sequence_rng: SequenceParallelRng | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        # Megatron-LM scatters first and drops out the shard under the model-parallel RNG
        # (language_model.py, Embedding.forward); without sequence parallelism the scatter is the identity.
        x = self.sequence_scatter(self.tok(ids) + self.pos(positions))
        with forked(self.sequence_rng):
            return _dropout(x, self.dropout, self.training)


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout where the workload has it; with p 0 nothing runs (no kernel, no RNG draw)."""
    return F.dropout(x, p, training) if p else x


class Attention(nn.Module):
    """Multi-head self-attention with one fused QKV projection and torch SDPA.

    The QKV output is laid out head-major ([head][q, k, v][head_dim]), so a contiguous slice of
    rows of ``qkv.weight`` holds whole heads: tensor parallelism of degree t keeps rows
    ``[r * 3h/t, (r+1) * 3h/t)`` on rank r, the matching columns of ``proj.weight``, and sets
    ``heads`` to heads / t. ``forward`` reads every size from the modules, not from a config.
    """

    def __init__(self, hidden: int, heads: int, causal: bool, implementation: str = "flash",
                 dropout: float = 0.0) -> None:
        super().__init__()
        if hidden % heads:
            raise ConfigError("heads", f"hidden size {hidden} is not divisible by {heads} heads",
                              "choose heads that divide hidden")
        self.heads = heads
        self.head_dim = hidden // heads
        self.causal = causal
        self.implementation = implementation  # sim.workloads.ATTENTION_IMPLEMENTATIONS
        self.dropout = dropout  # on the probabilities (Megatron-LM's attention dropout)
        # Korthikanti et al.'s selective recomputation (memory: {policy: selective-attention}, set by
        # exec.selective.checkpoint_attention_cores): the unfused core keeps nothing, its backward re-runs it.
        self.checkpoint_core = False
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # under sequence parallelism x is a sequence shard and qkv the whole sequence
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, self.heads, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))  # each [b, heads, s, head_dim]
        if self.implementation == "unfused":
            out = self._unfused(q, k, v)
        else:
            p = self.dropout if self.training else 0.0  # the fused kernel draws its mask itself, keeps none
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=p)
        return self.proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


    def _unfused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Scores, masked softmax and weighted sum as separate kernels: the [b, heads, s, s] scores and
        probabilities go through memory and autograd saves the probabilities (Megatron-LM's
        CoreAttention), and with dropout its mask and output."""
        if self.checkpoint_core and torch.is_grad_enabled():  # torch's checkpoint replays the dropout's RNG
            return checkpoint(self._core, q, k, v, use_reentrant=False)
        return self._core(q, k, v)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        if self.causal:
            s = scores.shape[-1]
            mask = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        return torch.matmul(_dropout(torch.softmax(scores, dim=-1), self.dropout, self.training), v)


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, gelu_approximate: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.act = nn.GELU(approximate=gelu_approximate)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then + mlp(ln2(.))."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        causal = cfg.family == "gpt"
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg.hidden, cfg.heads, causal=causal, implementation=cfg.attention, dropout=cfg.dropout)
        self.dropout = cfg.dropout  # Megatron-LM's bias-dropout-add: dropout(linear + bias) + residual
        self.ln2 = nn.LayerNorm(cfg.hidden)
        # GPT-2 uses the tanh approximation of GELU, BERT the exact one.
        self.mlp = MLP(cfg.hidden, cfg.ffn_mult * cfg.hidden, "tanh" if causal else "none")
        self.sequence_rng: SequenceParallelRng | None = None  # as Embedding.sequence_rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under sequence parallelism the whole block draws from this TP rank's generator, as Megatron-LM
        # runs its transformer layers inside get_cuda_rng_tracker().fork() (transformer.py, ParallelTransformer).
        with forked(self.sequence_rng):
            x = x + _dropout(self.attn(self.ln1(x)), self.dropout, self.training)
            return x + _dropout(self.mlp(self.ln2(x)), self.dropout, self.training)


class Head(nn.Module):
    """Final LayerNorm and the vocabulary projection (no bias): [b, s, h] -> logits [b, s, vocab]."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        # Where the sequence-parallel region ends (exec.parallel.tp, sequence_parallel): the final
        # LayerNorm runs on the sequence shard, the replicated projection on the gathered sequence.
        self.sequence_gather: nn.Module = nn.Identity()
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.sequence_gather(self.ln(x)))


class TransformerWorkload(Workload):
    """GPT or BERT from a ``TransformerConfig``.

    Data: GPT predicts the next token (inputs are tokens 0..s-1 of a window of s+1, targets
    tokens 1..s). BERT uses a simplified masked-LM target: 15% of the input positions (seeded)
    are replaced by the mask id ``vocab - 1`` and the loss asks for the original token at *every*
    position, masked or not (no 80/10/10 rule, no next-sentence task).
    """

    def __init__(self, name: str, cfg: TransformerConfig, data: str = "synthetic", sparse: bool = False) -> None:
        if cfg.family not in ("gpt", "bert"):
            raise ConfigError("family", f"unknown transformer family {cfg.family!r}", "use 'gpt' or 'bert'")
        if sparse and cfg.tied_embedding:  # the tied all-reduce sums dense gradients
            raise ConfigError("workload_options.tied_embedding", "a tied word embedding needs a dense token table",
                              "leave sparse or tied_embedding out")
        if sparse and cfg.family != "gpt":  # the simulator's row counts assume GPT's unmasked inputs
            raise ConfigError("workload_options.sparse", f"a sparse token table is for gpt workloads, not {name}",
                              "leave sparse out")
        self.name = name
        self.cfg = cfg
        self.stochastic = cfg.dropout > 0
        self.sequence_parallel = cfg.sequence_parallel
        self.data = check_data_source(data)
        self.sparse = bool(sparse)
        self.seq = cfg.seq

    def layer_names(self) -> list[str]:
        return ["embed", *(f"block{i}" for i in range(self.cfg.num_layers)), "head"]

    def layer_kind(self, index: int) -> str:
        return "embedding" if index == 0 else "head" if index == self.num_layers - 1 else "block"

    def build_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        if index == 0:
            return Embedding(cfg.vocab, cfg.hidden, cfg.seq, sparse=self.sparse, dropout=cfg.dropout)
        if index == self.num_layers - 1:
            return Head(cfg.hidden, cfg.vocab)
        return Block(cfg)

    def build_layers(self, start: int = 0, end: int | None = None, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.ModuleList:
        """The seeded layers; with ``tied_embedding`` the head's projection starts as the token table
        (sim.tied_embedding: Megatron-LM's first and last stage each hold a copy, equal at the start and
        kept equal by the all-reduce of their gradients; the runtime ties across stages only)."""
        layers = super().build_layers(start, end, device, dtype, seed)
        last = self.num_layers - 1
        if self.cfg.tied_embedding and (last if end is None else end - 1) == last:
            table = super().build_layers(0, 1, device, dtype, seed)[0].tok.weight
            with torch.no_grad():
                layers[-1].out.weight.copy_(table)
        return layers

    @staticmethod
    def tied_weight(module: nn.Module) -> nn.Parameter:
        """The tied matrix's copy a layer holds: the token table, or the head's projection."""
        return module.tok.weight if isinstance(module, Embedding) else module.out.weight

    def make_batch(self, micro_batch: int, seed: int = 0, device: str | torch.device = "cpu") -> Batch:
        cfg = self.cfg
        if cfg.family == "gpt":
            window = token_windows(self.data, micro_batch, cfg.seq + 1, cfg.vocab, seed)
            return Batch(window[:, :-1].contiguous().to(device), window[:, 1:].contiguous().to(device))
        tokens = token_windows(self.data, micro_batch, cfg.seq, cfg.vocab, seed)
        masked = torch.rand(tokens.shape, generator=torch.Generator().manual_seed(seed + 1)) < MASK_FRACTION
        inputs = tokens.masked_fill(masked, cfg.vocab - 1)
        return Batch(inputs.to(device), tokens.to(device))

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.view(-1, output.shape[-1]), targets.view(-1))

    def closed_form_params(self) -> int:
        return sum(spec.params for spec in transformer_layers(self.cfg))

    def describe(self) -> dict[str, object]:
        return {
            **super().describe(),
            "family": self.cfg.family,
            "config": self.cfg.to_dict(),
            "params": self.closed_form_params(),
            "data": self.data,
            "target": "next token" if self.cfg.family == "gpt" else
                      f"masked-LM style: {MASK_FRACTION:.0%} of inputs masked, loss on all positions",
            "definition": "paratwin exec.workloads.gpt (pre-LN, fused QKV, torch SDPA, "
                          + (f"dropout {self.cfg.dropout})" if self.cfg.dropout else "no dropout)"),
            **({"sparse_embedding": True} if self.sparse else {}),  # absent: dense, as every older bundle
            **({"tied_embedding": True} if self.cfg.tied_embedding else {}),  # absent: untied
        }


def from_preset(name: str, **overrides: object) -> TransformerWorkload:
    """``gpt-tiny`` ... ``gpt-175b`` and ``bert-*``; overrides are TransformerConfig fields, ``data``
    and (gpt) ``sparse``."""
    data = str(overrides.pop("data", "synthetic"))
    sparse = bool(overrides.pop("sparse", False))
    return TransformerWorkload(name, transformer_config(name, **overrides), data=data, sparse=sparse)
