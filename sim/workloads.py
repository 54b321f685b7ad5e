"""Torch-free workload descriptions: preset configurations and closed-form layer costs.

``exec.workloads`` builds real modules from these configurations, and the simulator costs the
same layers analytically without importing torch, so a 175B model on 1,024 GPUs costs nothing
to describe. Layer lists here match ``exec.workloads`` one to one (same names, same order).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TypeVar

from sim.implementations import expand_implementation
from traces.errors import ConfigError
from traces.limits import short_repr

T = TypeVar("T")


@dataclass(frozen=True)
class TransformerConfig:
    """A GPT (causal decoder) or BERT (bidirectional encoder) stack.

    Layers: ``embed`` (token + position embedding), ``num_layers`` x ``block`` (attention + MLP,
    pre-LayerNorm), ``head`` (final LayerNorm + vocabulary projection + loss).
    """

    family: str  # "gpt" or "bert"
    vocab: int
    hidden: int
    heads: int
    num_layers: int
    seq: int
    ffn_mult: int = 4
    source: str = ""
    # How attention runs (ATTENTION_IMPLEMENTATIONS): "flash", one fused kernel with no seq x seq
    # tensor in memory (torch SDPA, FlashAttention-style); "unfused", scores, softmax and the weighted
    # sum as separate kernels with the probabilities saved, as Megatron-LM ran it in 2021-2023
    # (sim.analytic prices both; exec.workloads.gpt runs both).
    attention: str = "flash"
    # How weight gradients accumulate over micro-batches (GRAD_ACCUMULATIONS): "fused", no pass of their
    # own; "autograd", an in-place ``.grad +=`` pass after every backward but the first, as Megatron-LM
    # v2.5 ran it (sim.analytic prices it; docs/accuracy.md section 17). Simulated only.
    grad_accumulation: str = "fused"
    # Dropout probability p of Megatron-LM's GPT, one p for its three places (megatron/model at v2.5:
    # transformer.py line 178/308, attention dropout on the softmax probabilities; lines 357-380 and
    # 476-502, the bias-dropout-add after the attention projection and after fc2, --hidden-dropout;
    # language_model.py line 299, the embedding dropout, also --hidden-dropout). Megatron's default
    # is 0.1 for both flags (megatron/arguments.py lines 341-344 at v2.5, 440-443 at 739cb43, 631-634
    # at 23.04): sim.implementations.MEGATRON_DROPOUT, which implementation: megatron-lm sets. 0 (no dropout
    # anywhere, as before the option existed) for every preset: runs agree bit for bit with one process.
    dropout: float = 0.0
    # Megatron-LM's sequence parallelism (Korthikanti et al. 2022, section 4.2.2; --sequence-parallel
    # from Megatron-LM 739cb43, 2022): under tensor parallelism t the layernorm / dropout / residual
    # region of every block runs on 1/t of the sequence, and each TP all-reduce becomes a reduce-scatter
    # and an all-gather. Simulated only (sim.analytic); the runtime refuses it (exec.workloads.gpt).
    # Needs tp > 1 and a sequence divisible by tp (sim.compile.check_tp).
    sequence_parallel: bool = False
    # Whether the word embedding and the LM head share one matrix, as Megatron-LM's GPT does by default
    # (sim.tied_embedding: the lowering then all-reduces its gradient between the first and the last
    # stage). False for every preset: the runnable GPT's head is a separate weight.
    tied_embedding: bool = False

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class LSTMConfig:
    """An LSTM language model: ``embed``, ``num_layers`` x ``lstm``, ``head``."""

    vocab: int
    embed: int
    hidden: int
    num_layers: int
    seq: int
    source: str = ""


@dataclass(frozen=True)
class ResNetConfig:
    depth: int  # 50 or 101 (bottleneck), or 0 for the tiny test network
    image: int = 224
    classes: int = 1000
    source: str = ""


@dataclass(frozen=True)
class LayerSpec:
    """Hardware-independent facts of one layer for one sample (micro-batch size 1).

    FLOPs count a multiply-add as two. ``*_elems`` are element counts (multiply by the dtype size);
    the ``tp_*`` fields say how the layer behaves under tensor parallelism of degree t: its
    matmul FLOPs, sharded parameters (``tp_rank_params``) and sharded activations divide by t, and
    each forward (and each backward) all-reduces ``tp_allreduces`` tensors of the output's size
    across the t ranks.
    """

    name: str
    kind: str
    params: int
    flops_fwd: int
    output_elems: int
    saved_elems: int
    saved_elems_sharded: int = 0  # part of saved_elems that divides by the TP degree
    params_replicated: int = 0  # part of params that every TP rank holds whole (tp_rank_params)
    tp_allreduces: int = 0
    # Whether each backward all-reduces as many (False: the forward only, as Megatron's
    # vocabulary-parallel embedding, whose reduction is the identity backward).
    tp_in_backward: bool = True
    # What the layer keeps under torch's selective checkpointing (exec.selective: matmul, attention
    # and convolution outputs plus the layer input); -1: not modelled for this layer.
    selective_elems: int = -1
    selective_elems_sharded: int = 0
    # Of saved_elems, the layer's input that the previous layer also saves as its output (counted
    # once by a forward keeping both: sim.costs.LayerCosts.shared_input_bytes).
    shared_input_elems: int = 0
    unsaved_input_elems: int = 0  # its input, when it does not save it (sim.costs.LayerCosts.unsaved_input_bytes)
    saved_output_elems: int = -1  # of its output, what it saves itself (sim.costs.LayerCosts.saved_output_bytes)
    # Of the replicated part of saved_elems, what a layer at the edge of the sequence-parallel region
    # keeps on the rank's 1/t of the sequence under sequence parallelism (the LM head's final
    # LayerNorm: its input and statistics). A block keeps all of saved_elems split (sim.analytic).
    sequence_split_elems: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def flops_bwd(self) -> int:
        # Backward of a matmul costs two matmuls of the forward's size: input and weight grads.
        return 2 * self.flops_fwd


def tp_rank_params(spec: LayerSpec, tp: int) -> int:
    """Parameters one of ``tp`` tensor-parallel ranks holds of the layer: its replicated ones whole, the
    rest split. The one rule behind every per-rank parameter, gradient, optimizer-state and gradient
    all-reduce size of a TP plan (sim.analytic and sim.bundle_costs both apply it)."""
    return spec.params_replicated + math.ceil((spec.params - spec.params_replicated) / tp)


def block_replicated_params(hidden: int) -> int:
    """Parameters of a transformer block that tensor parallelism does not split: the two LayerNorms'
    weights and biases (4h) and the biases of the row-parallel proj and fc2 (2h), which are added once,
    after the all-reduce, so every rank holds them whole. So Megatron-LM holds them (megatron/mpu/
    layers.py at v2.5, RowParallelLinear: ``self.bias = Parameter(torch.empty(self.output_size))``, the
    whole output; LayerNorm outside the parallel layers) and so does this runtime (exec.parallel.tp)."""
    return 6 * hidden


# Sources: gpt2-* : Radford et al. 2019 (GPT-2), vocabulary 50,257, context 1,024.
# gpt-1.5b: GPT-2 XL (48 layers, hidden 1,600, 25 heads), Radford et al. 2019.
# gpt-2.5b and gpt-8.3b: Shoeybi et al. 2019 (Megatron-LM), Table 2: 54 x 1,920 x 20 heads and
#   72 x 3,072 x 24 heads, sequence 1,024, vocabulary padded to 51,200.
# gpt-20b: GPT-NeoX-20B, Black et al. 2022: 44 layers, hidden 6,144, 64 heads, sequence 2,048.
# gpt-175b: GPT-3, Brown et al. 2020 (and Narayanan et al. 2021, Table 1): 96 x 12,288 x 96 heads,
#   sequence 2,048.
# bert-base / bert-large: Devlin et al. 2019 (vocabulary 30,522, sequence 512).
TRANSFORMER_PRESETS: dict[str, TransformerConfig] = {
    "gpt-tiny": TransformerConfig("gpt", vocab=512, hidden=64, heads=4, num_layers=4, seq=32, source="test model"),
    "gpt2-small": TransformerConfig("gpt", 50257, 768, 12, 12, 1024, source="GPT-2, Radford et al. 2019"),
    "gpt2-medium": TransformerConfig("gpt", 50257, 1024, 16, 24, 1024, source="GPT-2, Radford et al. 2019"),
    "gpt-1.5b": TransformerConfig("gpt", 50257, 1600, 25, 48, 1024, source="GPT-2 XL, Radford et al. 2019"),
    "gpt-2.5b": TransformerConfig("gpt", 51200, 1920, 20, 54, 1024, source="Megatron-LM, Shoeybi et al. 2019, Table 2"),
    "gpt-8.3b": TransformerConfig("gpt", 51200, 3072, 24, 72, 1024, source="Megatron-LM, Shoeybi et al. 2019, Table 2"),
    "gpt-20b": TransformerConfig("gpt", 50432, 6144, 64, 44, 2048, source="GPT-NeoX-20B, Black et al. 2022"),
    "gpt-175b": TransformerConfig("gpt", 51200, 12288, 96, 96, 2048, source="GPT-3, Brown et al. 2020"),
    # A word-level Transformer LM on WikiText-2's vocabulary (33,278 words with <eos>, as S2 Reducer's
    # and EmbRace's LSTM baselines use): small blocks, so the token table (8.5M of 18.6M parameters)
    # and the untied head dominate. Vocabulary and width are workload_options (vocab, hidden).
    "gpt-wordlm": TransformerConfig("gpt", vocab=33278, hidden=256, heads=4, num_layers=2, seq=64,
                                    source="paratwin: WikiText-2 word vocabulary, embedding-dominated"),
    "bert-tiny": TransformerConfig("bert", vocab=1024, hidden=64, heads=4, num_layers=2, seq=32, source="test model"),
    "bert-base": TransformerConfig("bert", 30522, 768, 12, 12, 512, source="BERT, Devlin et al. 2019"),
    "bert-large": TransformerConfig("bert", 30522, 1024, 16, 24, 512, source="BERT, Devlin et al. 2019"),
}

# lstm-lm: the 2-layer LSTM LM on a large vocabulary of the kind S2 Reducer and EmbRace evaluate
# (their LSTM baselines use ~33k-800k vocabularies; 33,278 is WikiText-2's word vocabulary).
LSTM_PRESETS: dict[str, LSTMConfig] = {
    "lstm-tiny": LSTMConfig(vocab=1000, embed=32, hidden=32, num_layers=2, seq=16, source="test model"),
    "lstm-lm": LSTMConfig(vocab=33278, embed=650, hidden=650, num_layers=2, seq=35,
                          source="Zaremba et al. 2014 medium LSTM on WikiText-2's vocabulary"),
}

RESNET_PRESETS: dict[str, ResNetConfig] = {
    "resnet-tiny": ResNetConfig(depth=0, image=32, classes=10, source="test model"),
    "resnet50": ResNetConfig(depth=50, source="He et al. 2016"),
    "resnet101": ResNetConfig(depth=101, source="He et al. 2016"),
}


# Every workload preset and its model family (exec.workloads builds each family's modules). The
# simulator costs transformers in closed form; the other families need a profile bundle.
WORKLOAD_FAMILIES: dict[str, str] = {
    **{name: cfg.family for name, cfg in TRANSFORMER_PRESETS.items()},
    **{name: "lstm" for name in LSTM_PRESETS},
    **{name: "resnet" for name in RESNET_PRESETS},
    "hap-tiny": "hap", "hap-mutag": "hap",
    "rnn-tiny": "rnn", "rnn-digits": "rnn",
}


def workload_names() -> list[str]:
    return sorted(WORKLOAD_FAMILIES)


# A workload named by import path, ``package.module:Attribute`` (a Workload subclass, or a factory taking
# the plan's workload_options and returning one; docs/profiler.md, "Your own model"). exec.workloads
# imports it; the simulator, which imports no torch, never does: it prices such a workload from its
# profile bundle alone, as the families whose presets live only in exec (HAP, RNN).
USER = "user"  # the family of a workload named by import path
_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def workload_family(name: object) -> str | None:
    """The model family of workload ``name``: a preset's, ``USER`` for an import path, None for
    anything else. Every lookup of a workload name goes through here (``known_family`` refuses None)."""
    if not isinstance(name, str):
        return None
    if name in WORKLOAD_FAMILIES:
        return WORKLOAD_FAMILIES[name]
    return USER if _IMPORT_PATH.fullmatch(name) else None


def known_family(name: object) -> str:
    """``workload_family(name)``, refusing a name that is neither a preset nor an import path."""
    family = workload_family(name)
    if family is None:
        raise ConfigError("workload", f"unknown workload {short_repr(name, 80)}",
                          f"choose one of {', '.join(workload_names())}, or name your own Workload by import "
                          "path, module:Class (docs/profiler.md, \"Your own model\")")
    return family


def preset_with_overrides(kind: str, presets: Mapping[str, T], name: str, overrides: Mapping[str, object],
                          allowed: Iterable[str] | None = None, extra: Iterable[str] = ()) -> T:
    """The preset ``name`` of a dataclass config with ``overrides`` applied; ``allowed`` limits which
    fields may change (default: all), ``extra`` names options the caller consumed itself (for the
    message)."""
    if name not in presets:
        raise ConfigError("workload", f"unknown {kind} preset {name!r}", f"choose one of {', '.join(sorted(presets))}")
    base = presets[name]
    allowed = set(asdict(base) if allowed is None else allowed)  # type: ignore[call-overload]
    unknown = set(overrides) - allowed
    if unknown:
        raise ConfigError("workload_options", f"unknown option(s) {sorted(unknown)} for {name}",
                          f"use {sorted([*allowed, *extra])}")
    for key, value in overrides.items():
        _check_option(name, key, value, getattr(base, key))
    return replace(base, **overrides)  # type: ignore[type-var]


# Integer workload options (sizes, counts, lengths) must lie in [1, MAX_OPTION_INT]: zero or negative
# sizes give negative or zero costs, and larger ones overflow the int32 shapes of torch kernels.
MAX_OPTION_INT = 2**31 - 1


def _check_option(name: str, key: str, value: object, preset: object) -> None:
    """An override must have its preset value's type, and integers a sensible range."""
    field = f"workload_options.{key}"
    shown = short_repr(value, 60)
    if isinstance(preset, bool):
        if not isinstance(value, bool):
            raise ConfigError(field, f"must be true or false, got {shown}", f"see {name}'s preset: {preset}")
    elif isinstance(preset, int):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_OPTION_INT:
            raise ConfigError(field, f"must be an integer in [1, {MAX_OPTION_INT}], got {shown}",
                              f"{name}'s preset has {preset}")
    elif isinstance(preset, float):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ConfigError(field, f"must be a finite number, got {shown}", f"{name}'s preset has {preset}")
    elif isinstance(preset, str):
        if not isinstance(value, str):
            raise ConfigError(field, f"must be a string, got {shown}", f"{name}'s preset has {preset!r}")
    elif isinstance(preset, tuple) and not _positive_ints(value):
        raise ConfigError(field, f"must be a non-empty list of positive integers, got {shown}",
                          f"{name}'s preset has {list(preset)}")


def _positive_ints(value: object) -> bool:
    return isinstance(value, list | tuple) and bool(value) and all(
        not isinstance(v, bool) and isinstance(v, int) and 1 <= v <= MAX_OPTION_INT for v in value)


ATTENTION_IMPLEMENTATIONS = ("flash", "unfused")
# How a backward's weight gradients join those of the iteration's earlier micro-batches
# (docs/accuracy.md, section 17). "fused": inside the weight-gradient GEMM (beta = 1; Megatron-LM's
# --gradient-accumulation-fusion, on by default from 2022, 739cb43 megatron/mpu/layers.py), no pass of
# its own. "autograd": PyTorch's AccumulateGrad adds each into ``.grad`` in place, one memory-bound pass
# reading both and writing the sum (3 x the gradient bytes) for every backward but the first after
# ``zero_grad(set_to_none=True)``: Megatron-LM v2.5's local DDP without contiguous buffers
# (megatron/model/distributed.py), torch DDP, and DeepSpeed's engine without ZeRO.
GRAD_ACCUMULATIONS = ("fused", "autograd")

# Configuration fields that change no time a profile measures, so a bundle describes a plan whatever their
# value (sim.bundle_costs.check_describes does not compare them): how the training loop adds a backward's
# weight gradients into the earlier micro-batches' is priced on top of the profile (sim.analytic.
# grad_accumulation_s), whose backward never accumulates (exec/profiler.py times torch.autograd.grad).
UNPROFILED_OPTIONS = ("grad_accumulation",)

# Configuration fields added after bundles were first written, with the value every bundle written
# before them ran: a bundle that does not record such a field describes a plan that has that value.
ADDED_CONFIG_FIELDS: dict[str, object] = {"attention": "flash",  # torch SDPA, before the option existed
                                          "dropout": 0.0,  # no dropout, before the option existed
                                          "sequence_parallel": False,  # before the option existed
                                          "tied_embedding": False,  # an untied head, before the option existed
                                          "grad_accumulation": "fused"}  # no pass priced, before the option existed


def transformer_config(name: str, **overrides: object) -> TransformerConfig:
    sizes = [f for f in asdict(TRANSFORMER_PRESETS["gpt-tiny"]) if f != "family"]  # the family is the preset's
    cfg = preset_with_overrides("transformer", TRANSFORMER_PRESETS, name, overrides, allowed=sizes)
    if cfg.attention not in ATTENTION_IMPLEMENTATIONS:
        raise ConfigError("workload_options.attention", f"unknown attention implementation {cfg.attention!r}",
                          f"use one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
    if cfg.grad_accumulation not in GRAD_ACCUMULATIONS:
        raise ConfigError("workload_options.grad_accumulation",
                          f"unknown gradient accumulation {cfg.grad_accumulation!r}",
                          f"use one of {', '.join(GRAD_ACCUMULATIONS)}")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError("workload_options.dropout", f"a dropout probability must lie in [0, 1), got {cfg.dropout}",
                          "use 0 (no dropout) or Megatron-LM's 0.1")
    if cfg.hidden % cfg.heads:
        raise ConfigError("workload_options.heads", f"{cfg.heads} heads do not divide hidden size {cfg.hidden}",
                          "choose heads that divide hidden")
    return cfg


# Options that exec.workloads consumes itself (data source, kernel choices): they change no cost
# the simulator models, so the simulator sets them aside before resolving the configuration.
EXEC_ONLY_OPTIONS: dict[str, tuple[str, ...]] = {
    "gpt": ("data", "sparse"), "bert": ("data",), "lstm": ("sparse", "data"), "resnet": ("definition", "data"),
}


def workload_config(name: str, options: Mapping[str, object]) -> dict[str, object] | None:
    """The resolved configuration of a workload preset with ``options`` applied, as the profiler
    records it in a bundle (``meta.workload.config``), checking every option; None for families whose
    presets live only in ``exec`` (HAP, RNN: exec checks their options when it builds them) and for a
    workload named by import path (its own constructor checks them)."""
    family = known_family(name)
    options = expand_implementation(options, family)  # a plan's are expanded already; a search space's not
    kept = {k: v for k, v in options.items() if k not in EXEC_ONLY_OPTIONS.get(family, ())}
    if family in ("gpt", "bert"):
        return asdict(transformer_config(name, **kept))
    if family == "lstm":
        return asdict(preset_with_overrides("LSTM", LSTM_PRESETS, name, kept, extra=EXEC_ONLY_OPTIONS["lstm"]))
    if family == "resnet":
        return asdict(preset_with_overrides("ResNet", RESNET_PRESETS, name, kept, allowed=("image", "classes"),
                                            extra=EXEC_ONLY_OPTIONS["resnet"]))
    return None


def transformer_of(workload: str, options: Mapping[str, object]) -> TransformerConfig | None:
    """The transformer a plan's workload builds (its options applied), or None for other families."""
    if workload not in TRANSFORMER_PRESETS:
        return None
    family = known_family(workload)
    return transformer_config(workload, **{k: v for k, v in options.items() if k not in EXEC_ONLY_OPTIONS[family]})


def transformer_layers(cfg: TransformerConfig) -> list[LayerSpec]:
    """Closed-form per-sample costs of the transformer stack as ``exec.workloads.gpt`` builds it.

    Block (pre-LN, fused QKV, SDPA flash/efficient attention, GELU MLP), per sample, s = seq,
    h = hidden, a = heads, f = ffn_mult * h:
      FLOPs fwd = 2*s*h*3h (QKV) + 2*2*s*s*h (scores and weighted sum; causal kernels still
      count the full square) + 2*s*h*h (proj) + 2*2*s*h*f (MLP) = 8sh^2 + 4sh*f + 4s^2h.
      Saved for backward: LN1 input, i.e. the block's input (sh), and its mean/rstd (2s), QKV
      input (sh), QKV output shared by q, k, v (3sh), attention output (sh) and log-sum-exp
      (a*s), LN2 input (sh) and stats (2s), fc1 input (sh), GELU input (sf), fc2 input (sf)
      = 8sh + 2sf + a*s + 4s. The proj input is not a separate tensor: the flash/efficient
      kernels return the attention output in [s, heads, head_dim] memory order, so merging the
      heads is a view of the attention output (measured with saved_tensors_hooks on torch 2.13
      CPU: exact). SDPA's math fallback would instead copy (sh) and keep the a*s*s attention
      probabilities. The log-sum-exp is fp32 whatever the model dtype.
    Head (final LN, vocabulary projection, cross-entropy as the last pipeline stage runs it):
      saved = LN input (sh) and stats (2s), projection input (sh), log-softmax output (sv; the
      logits themselves are not kept), targets (s; int64, counted as s elements as the
      embedding's ids are) = 2sh + 3s + sv; the output is the scalar loss. Under sequence
      parallelism the final LN runs on the rank's 1/t of the sequence (exec.parallel.sequence: its
      input arrives split, the gather follows it), so its input and stats (sh + 2s) are 1/t; the
      projection's input is the all-gathered sequence, kept whole by this runtime's replicated head.
    Under torch's selective checkpointing (``memory: {policy: selective}``, exec.selective: keep
    the outputs of matmul and attention operators and the layer input, recompute the rest) a
    block keeps its input (sh), the QKV output (3sh), the attention output and log-sum-exp
    (sh + a*s), the proj, fc1 and fc2 outputs (sh + sf + sh) = 7sh + sf + a*s; the head its
    input (sh), the logits (sv: the policy keeps a matmul output even where the backward would
    not need it) and what the loss, outside the checkpointed layer, saves (sv + s) = sh + 2sv + s;
    the embedding its ids (s). Measured with torch 2.13 on CPU (tests/test_memory_selective.py).
    """
    s, h, a, v = cfg.seq, cfg.hidden, cfg.heads, cfg.vocab
    f = cfg.ffn_mult * h
    # The shape, for sim.analytic's kernel-by-kernel costs (GEMM shapes after the TP split, the
    # memory-bound kernels, the vocabulary padded as Megatron pads it). A causal GPT masks attention.
    shape = {"seq": float(s), "hidden": float(h), "heads": float(a), "ffn": float(f), "vocab": float(v),
             "causal": 1.0 if cfg.family == "gpt" else 0.0, "dropout": float(cfg.dropout),
             "sequence_parallel": 1.0 if cfg.sequence_parallel else 0.0}
    # Megatron's vocabulary-parallel table (megatron/core/tensor_parallel/layers.py,
    # VocabParallelEmbedding.forward): each rank looks up its vocabulary slice and the partial
    # outputs are summed by reduce_from_tensor_model_parallel_region, the identity backward
    # (mappings.py, _ReduceFromModelParallelRegion): one all-reduce forward, none backward. This
    # runtime keeps a dense table replicated instead (exec.parallel.tp) and its profiles and
    # structure charge nothing (sim.bundle_costs, exec.structure); docs/embrace.md.
    # Megatron splits only the word table by vocabulary; the position table (s h) is whole on every rank.
    embed = LayerSpec("embed", "embedding", params=v * h + s * h, params_replicated=s * h, flops_fwd=0,
                      output_elems=s * h, saved_elems=s, saved_elems_sharded=0, tp_allreduces=1,
                      tp_in_backward=False, selective_elems=s, extra=dict(shape))
    block_params = (3 * h * h + 3 * h) + (h * h + h) + (2 * h * f + f + h) + 4 * h
    block_flops = 8 * s * h * h + 4 * s * h * f + 4 * s * s * h
    block_saved = 8 * s * h + 2 * s * f + a * s + 4 * s
    # Under TP the QKV output, attention output (= proj input) and lse, fc1 output/GELU are
    # sharded by t.
    block_sharded = 3 * s * h + s * h + a * s + 2 * s * f
    block_selective = 7 * s * h + s * f + a * s
    block_selective_sharded = 3 * s * h + s * h + a * s + s * f
    blocks = [
        LayerSpec(f"block{i}", "block", params=block_params, params_replicated=block_replicated_params(h),
                  flops_fwd=block_flops, output_elems=s * h,
                  saved_elems=block_saved, saved_elems_sharded=block_sharded, tp_allreduces=2,
                  selective_elems=block_selective, selective_elems_sharded=block_selective_sharded, extra=dict(shape))
        for i in range(cfg.num_layers)
    ]
    # Head: final LN, projection to the vocabulary, cross-entropy (its log-softmax output is saved). Under
    # Megatron's TP the projection is split by vocabulary, the final LN (2 h) held whole.
    head = LayerSpec("head", "head", params=2 * h + h * v, params_replicated=2 * h, flops_fwd=2 * s * h * v,
                     output_elems=1, saved_elems=2 * s * h + 3 * s + s * v, saved_elems_sharded=s * v, tp_allreduces=1,
                     sequence_split_elems=s * h + 2 * s,
                     selective_elems=s * h + 2 * s * v + s, selective_elems_sharded=2 * s * v, extra=dict(shape))
    return [embed, *blocks, head]
