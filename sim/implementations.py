"""What a training code base runs, as workload options: the one home of "a Megatron-LM run".

The presets describe the project's runnable GPT (FlashAttention-style attention, no dropout, an untied LM
head). A plan that describes a run of another code base asks for it in one line,
``workload_options: {implementation: megatron-lm}``, and ``expand_implementation`` replaces that key by the
options the code base ran (``IMPLEMENTATIONS``). Options the plan also sets explicitly win: a Megatron-LM
run can turn its dropout off (``--attention-dropout 0 --hidden-dropout 0``, as GPT-NeoX-20B did), use
FlashAttention (``--use-flash-attn``, 2023) or untie the head (``--untie-embeddings-and-output-weights``,
23.04), and a plan says so by setting that option next to ``implementation``.

The expansion happens when a plan is read (``sim.plan.Plan``) and when a workload's options are resolved
without a plan (``sim.workloads.workload_config``), so every consumer (the simulator's analytic model, the
lowering's tied-embedding all-reduce, the runtime) sees the expanded options and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from traces.errors import ConfigError
from traces.limits import short_repr

# Megatron-LM as the vTrain data and Narayanan et al. (SC'21) ran it: unfused attention with the fused
# scale-mask-softmax kernel (megatron/model/transformer.py CoreAttention, 2021-2023; FlashAttention
# came to Megatron-LM as --use-flash-attn in 2023). See sim.analytic.ATTENTION_IMPLEMENTATIONS.
MEGATRON_ATTENTION = "unfused"
# Megatron-LM's dropout, --attention-dropout and --hidden-dropout, both 0.1 by default (megatron/arguments.py
# lines 341-344 at v2.5, 440-443 at 739cb43, 631-634 at 23.04; the GPT example scripts at v2.5 do not
# change them). Neither the vTrain data nor SC'21 or Korthikanti 2022 state another value, so their runs
# are taken to have the default (sim.workloads.TransformerConfig.dropout).
MEGATRON_DROPOUT = 0.1
# Megatron-LM's GPT ties the word embedding to the LM head (sim.tied_embedding: v2.5 megatron/model/
# module.py l.41; 23.04 --untie-embeddings-and-output-weights store_true, arguments.py l.558). The plans
# of Megatron runs (SC'21, Korthikanti 2022, vTrain) set it: their lowering all-reduces the tied gradient.
MEGATRON_TIED_EMBEDDING = True

MEGATRON_LM = "megatron-lm"
# Each implementation: the workload families it describes and the options it stands for. Megatron-LM
# 2021-2023 (v2.5 to 23.04, the versions the project's Megatron data ran). How weight gradients accumulate
# is not here: it changed inside that range (v2.5's autograd pass, fused into the GEMM from 2022;
# sim.workloads.GRAD_ACCUMULATIONS), so a plan states it where it matters.
IMPLEMENTATIONS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    MEGATRON_LM: (("gpt",), {"attention": MEGATRON_ATTENTION, "dropout": MEGATRON_DROPOUT,
                             "tied_embedding": MEGATRON_TIED_EMBEDDING}),
}
FIELD = "workload_options.implementation"


def implementation_options(name: object, family: str | None) -> dict[str, Any]:
    """The workload options implementation ``name`` stands for, for a workload of ``family``."""
    if not isinstance(name, str) or name not in IMPLEMENTATIONS:
        raise ConfigError(FIELD, f"unknown implementation {short_repr(name, 60)}",
                          f"use one of {', '.join(IMPLEMENTATIONS)}, or set the workload options one by one")
    families, options = IMPLEMENTATIONS[name]
    if family not in families:
        raise ConfigError(FIELD, f"{name} describes {' or '.join(families)} workloads, not a {family} one",
                          f"remove workload_options.implementation, or use a {families[0]} workload")
    return dict(options)


def expand_implementation(options: Mapping[str, Any], family: str | None) -> dict[str, Any]:
    """``options`` with an ``implementation`` key replaced by the options it stands for; options also set
    explicitly win. Without the key, or for an unknown workload (``family`` None: the workload check names
    it): ``options`` unchanged (a copy)."""
    if "implementation" not in options or family is None:
        return dict(options)
    rest = {k: v for k, v in options.items() if k != "implementation"}
    return {**implementation_options(options["implementation"], family), **rest}
