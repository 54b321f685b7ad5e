"""Costs measured by the profiler on the hardware being simulated (a trace bundle).

The bundle was taken at one micro-batch size; times and activation bytes scale linearly with the
micro-batch (exact for activations; for time, an approximation that improves with size and that
validation measures). Under TP degree t, a transformer block's compute divides by t, its parameters
as ``sim.workloads.tp_rank_params`` says (LayerNorms and row-parallel biases whole on every rank), and
each pass all-reduces its output twice (attention and MLP, as ``exec`` shards them); embedding and
head layers are replicated on TP ranks (``exec`` does not shard them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pandas as pd

from sim.costs import LayerCosts
from sim.meeting import sd_from_spread
from sim.workloads import ADDED_CONFIG_FIELDS, UNPROFILED_OPTIONS, USER, LayerSpec, tp_rank_params, workload_family
from traces.bundle import ProfileBundle, profile_command, read_bundle
from traces.errors import ConfigError

# Share of a block's saved activations that TP shards, from sim.workloads.transformer_layers
# (block_sharded / block_saved, about 0.75 at f = 4h and s << h); a bundle does not record it.
_BLOCK_SHARDED_FRACTION = 0.75
# The phases a profile times, each with a spread (IQR / median): their standard deviations (sim.meeting).
_TIMED_PHASES = ("fwd", "bwd", "bwd_input", "bwd_weight", "recompute")


class BundleCostModel:
    def __init__(self, bundle: ProfileBundle, source: str = "bundle",
                 grad_accumulate: Callable[[int], float] | None = None,
                 specs: Sequence[LayerSpec] | None = None) -> None:
        """``grad_accumulate``: seconds of the plan's weight-gradient accumulation pass over a layer's
        gradient bytes (``sim.analytic.grad_accumulation_s``; None: no pass, ``fused``). Priced on top of
        the measured backward, which never includes it: the profiler times a backward with
        ``torch.autograd.grad``, which returns fresh gradients and never adds into ``.grad``
        (exec/profiler.py, ``_LayerProbe.backward``). ``specs``: the workload's layers
        (``sim.workloads.transformer_layers``), which say what of a block's measured parameters TP
        splits; a bundle does not record it, and costs under TP need it."""
        self.bundle, self.source = bundle, source
        self.grad_accumulate = grad_accumulate
        self.specs = specs
        self.layers: pd.DataFrame = bundle.layers.sort_values("layer").reset_index(drop=True)
        self.num_layers = len(self.layers)
        settings = bundle.meta.get("settings", {})
        if "micro_batch" not in settings:
            raise ConfigError(f"{source}: settings.micro_batch", "the bundle does not record its micro-batch",
                              "re-profile with paratwin profile")
        micro_batch = settings["micro_batch"]
        if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
            raise ConfigError(f"{source}: settings.micro_batch", f"{micro_batch!r} is not a positive integer",
                              "re-profile with paratwin profile")
        self.profiled_micro_batch = micro_batch
        self.optimizer_s_per_byte = float(settings.get("optimizer_s_per_param_byte", 0.0))
        # The host work of one synchronous ids request (exec.embedding.request_host_work), where the
        # profile measured it; 0 for a bundle that did not (older, or a plan without sharded tables):
        # then nothing is charged for it, as before (docs/traces.md).
        self.ids_request_host_s = float(settings.get("ids_request_host_s", 0.0))
        self._rows = self.layers.to_dict("records")
        # Per layer and timed phase, each co-located profiling process's median minus the merged
        # median (bundle.process_layers; sim.meeting): empty without the table.
        self._offsets: dict[int, dict[str, tuple[float, ...]]] = {}
        if bundle.process_layers is not None and len(bundle.process_layers):
            by_layer = bundle.process_layers.sort_values(["layer", "process"]).groupby("layer")
            merged = self.layers.set_index("layer")
            self._offsets = {int(layer): {phase: tuple(float(v) - float(merged.loc[layer, f"{phase}_s"])
                                                       for v in rows[f"{phase}_s"])
                                          for phase in _TIMED_PHASES}
                             for layer, rows in by_layer if layer in merged.index}

    @classmethod
    def load(cls, directory: str | Path, grad_accumulate: Callable[[int], float] | None = None,
             specs: Sequence[LayerSpec] | None = None) -> BundleCostModel:
        return cls(read_bundle(Path(directory)), source=str(directory), grad_accumulate=grad_accumulate, specs=specs)

    def check_describes(self, workload: str, options: Mapping[str, object], config: Mapping[str, object] | None,
                        num_layers: int | None, dtype: str, device_kind: str) -> None:
        """Refuse a bundle that was measured for another workload, configuration, layer count, dtype
        or device kind than the plan's: its times would silently predict a different job.
        ``config`` is the plan's resolved workload configuration (None when the simulator cannot
        resolve it; then the options the plan sets are compared one by one)."""
        described = self.bundle.meta.get("workload", {})
        settings = self.bundle.meta.get("settings", {})
        command = plan_profile_command(workload, options, self.profiled_micro_batch, dtype, device_kind)
        redo = f"profile {workload} as the plan sets it ({command}) and point profile: at that bundle"
        if described.get("name") != workload:
            raise ConfigError("profile", f"{self.source} profiles workload {described.get('name')!r}, the plan's "
                              f"workload is {workload!r}", redo)
        recorded = described.get("config")
        if not isinstance(recorded, dict):
            raise ConfigError("profile", f"{self.source} does not record its workload configuration", redo)
        expected = {k: v for k, v in (config or options).items() if k != "source" and k not in UNPROFILED_OPTIONS}
        if workload_family(workload) == USER:
            # Its options are its whole configuration (no preset fills in the rest): one the bundle was
            # built with and the plan does not set describes another model too.
            expected.update({k: _UNSET for k in recorded if k not in expected})
        for key, value in expected.items():
            profiled = recorded.get(key, ADDED_CONFIG_FIELDS.get(key, _UNSET))
            if _plain(profiled) != _plain(value):
                had = f"without {key}" if profiled is _UNSET else f"with {key}={profiled!r}"
                has = "does not set it" if value is _UNSET else f"has {value!r}"
                raise ConfigError(f"profile: workload.config.{key}", f"{self.source} was profiled {had}, the plan "
                                  f"{has}", redo)
        span = settings.get("layers")
        if num_layers is None:
            num_layers = described.get("num_layers")
        if self.num_layers != num_layers or span != [0, num_layers]:
            raise ConfigError("profile: layers", f"{self.source} holds {self.num_layers} layer rows (profiled "
                              f"span {span}), the plan's workload has {num_layers}", redo + " (all layers)")
        profiled_dtype = _DTYPES.get(str(settings.get("dtype")), settings.get("dtype"))
        if profiled_dtype != dtype:
            raise ConfigError("profile: dtype", f"{self.source} was profiled in {settings.get('dtype')}, the plan "
                              f"trains in {dtype}", f"re-profile with {command}, or set dtype: {profiled_dtype}")
        profiled_kind = "gpu" if str(settings.get("device", "")).startswith("cuda") else "cpu"
        if profiled_kind != device_kind:
            raise ConfigError("profile: device", f"{self.source} was measured on {settings.get('device')!r}, the "
                              f"plan's cluster has {device_kind} devices",
                              f"profile on the cluster's kind of device: {command}")

    def layer_costs(self, layer: int, micro_batch: int, tp: int) -> LayerCosts:
        row = self._rows[layer]
        scale = micro_batch / self.profiled_micro_batch
        sharded = row["kind"] == "block" and tp > 1
        compute_share = 1.0 / tp if sharded else 1.0
        saved_share = (1.0 - _BLOCK_SHARDED_FRACTION + _BLOCK_SHARDED_FRACTION / tp) if sharded else 1.0
        param_share = self._param_share(layer, tp) if sharded else 1.0
        grad_bytes = round(row["grad_bytes"] * param_share)
        return LayerCosts(
            fwd_s=row["fwd_s"] * scale * compute_share,
            bwd_input_s=row["bwd_input_s"] * scale * compute_share,
            bwd_weight_s=row["bwd_weight_s"] * scale * compute_share,
            recompute_s=row["recompute_s"] * scale * compute_share,
            param_bytes=round(row["param_bytes"] * param_share),
            grad_bytes=grad_bytes,
            grad_accumulate_s=self.grad_accumulate(grad_bytes) if self.grad_accumulate is not None else 0.0,
            optimizer_bytes=round(row["optimizer_bytes"] * param_share),
            saved_bytes=int(row["saved_bytes"] * scale * saved_share),
            output_bytes=int(row["output_bytes"] * scale),
            tp_allreduces=2 if sharded else 0,
            tp_comm_bytes=int(row["output_bytes"] * scale) if sharded else 0,
            flops_fwd=float(row["flops_fwd"]) * scale * compute_share,
            selective_saved_bytes=int(row["selective_saved_bytes"] * scale * saved_share)
            if row["selective_saved_bytes"] >= 0 else -1,
            selective_recompute_s=row["selective_recompute_s"] * scale * compute_share
            if row["selective_recompute_s"] >= 0 else -1.0,
            shared_input_bytes=int(self._shared_input(layer) * scale * saved_share),
            unsaved_input_bytes=int(self._unsaved_input(layer) * scale),
            saved_output_bytes=int(self._rows[layer]["saved_output_bytes"] * scale)
            if "saved_output_bytes" in self._rows[layer] else -1,
            **{f"{phase}_sd_s": sd_from_spread(row[f"{phase}_s"] * scale * compute_share,
                                               row.get(f"{phase}_spread", 0.0))
               for phase in _TIMED_PHASES},
            **{f"{phase}_offsets_s": tuple(v * scale * compute_share for v in offsets)
               for phase, offsets in self._offsets.get(int(row["layer"]), {}).items()},
        )

    def _param_share(self, layer: int, tp: int) -> float:
        """The share of a sharded layer's measured parameter bytes (and so of its gradient and optimizer
        bytes) one TP rank holds: ``tp_rank_params`` over the whole layer's parameters."""
        if self.specs is None:
            raise ValueError(f"{self.source}: costs under tensor parallelism need the workload's layer specs "
                             "(BundleCostModel(specs=...)): a bundle does not record which parameters TP splits")
        spec = self.specs[layer]
        return tp_rank_params(spec, tp) / spec.params

    def _shared_input(self, layer: int) -> int:
        """The layer's saved input that the previous layer saves as its output (the profiler's
        extra columns saved_input_bytes / saved_output_bytes; 0 in bundles without them)."""
        if layer == 0 or "saved_input_bytes" not in self._rows[layer]:
            return 0
        return int(min(self._rows[layer]["saved_input_bytes"], self._rows[layer - 1]["saved_output_bytes"]))

    def _unsaved_input(self, layer: int) -> int:
        """The layer's input when it saves none of it (a pooling that keeps only shapes, a head whose
        linear saves the pooled tensor): the previous layer's output, which a checkpointed re-run of
        this layer holds beside its saved tensors (sim.costs.LayerCosts.unsaved_input_bytes, as
        exec.structure measures it). 0 for the first layer and in bundles without saved_input_bytes."""
        if layer == 0 or "saved_input_bytes" not in self._rows[layer] or self._rows[layer]["saved_input_bytes"] > 0:
            return 0
        return int(self._rows[layer - 1]["output_bytes"])

    def optimizer_step_s(self, param_bytes: int) -> float:
        return self.optimizer_s_per_byte * param_bytes

    def layer_weights(self, by: str) -> list[float]:
        if by == "parameters":
            return [float(v) for v in self.layers["param_bytes"]]
        return [float(f + b) for f, b in zip(self.layers["fwd_s"], self.layers["bwd_s"], strict=True)]


_UNSET = object()  # a configuration field the plan leaves out
_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}  # profiler name -> plan name
_TORCH_DTYPES = {plan: torch for torch, plan in _DTYPES.items()}


def plan_profile_command(workload: str, options: Mapping[str, object], micro_batch: int, dtype: str,
                         device_kind: str) -> str:
    """The ``paratwin profile`` command that writes the bundle a plan of ``workload`` with ``options``,
    training in ``dtype`` (the plan's name) on ``device_kind`` devices, can use: what every refusal of a
    missing or mismatching profile prints, so that the command copied from it works."""
    profiled = {k: v for k, v in options.items() if k not in UNPROFILED_OPTIONS}  # no profile depends on them
    return profile_command(workload, micro_batch, profiled, _TORCH_DTYPES.get(dtype, dtype),
                           "cuda" if device_kind == "gpu" else "cpu")


def _plain(value: object) -> object:
    """Compare configuration values as JSON holds them (tuples come back from a bundle as lists)."""
    return list(value) if isinstance(value, tuple) else value

