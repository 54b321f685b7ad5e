"""Costs measured by the profiler on the hardware being simulated (a trace bundle).

The bundle was taken at one micro-batch size; times and activation bytes scale linearly with the
micro-batch (exact for activations; for time, an approximation that improves with size and that
validation measures). Under TP degree t, a transformer block's compute and parameters divide by
t and each pass all-reduces its output twice (attention and MLP, as ``exec`` shards them);
embedding and head layers are replicated on TP ranks (``exec`` does not shard them).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from sim.costs import LayerCosts
from traces.bundle import ProfileBundle, read_bundle
from traces.errors import ConfigError

# Share of a block's saved activations that TP shards, from sim.workloads.transformer_layers
# (block_sharded / block_saved, about 0.75 at f = 4h and s << h); a bundle does not record it.
_BLOCK_SHARDED_FRACTION = 0.75


class BundleCostModel:
    def __init__(self, bundle: ProfileBundle, source: str = "bundle") -> None:
        self.bundle, self.source = bundle, source
        self.layers: pd.DataFrame = bundle.layers.sort_values("layer").reset_index(drop=True)
        self.num_layers = len(self.layers)
        settings = bundle.meta.get("settings", {})
        if "micro_batch" not in settings:
            raise ConfigError(f"{source}: settings.micro_batch", "the bundle does not record its micro-batch",
                              "re-profile with paratwin profile")
        self.profiled_micro_batch = int(settings["micro_batch"])
        self.optimizer_s_per_byte = float(settings.get("optimizer_s_per_param_byte", 0.0))
        self._rows = self.layers.to_dict("records")

    @classmethod
    def load(cls, directory: str | Path) -> BundleCostModel:
        return cls(read_bundle(Path(directory)), source=str(directory))

    def layer_costs(self, layer: int, micro_batch: int, tp: int) -> LayerCosts:
        row = self._rows[layer]
        scale = micro_batch / self.profiled_micro_batch
        sharded = row["kind"] == "block" and tp > 1
        compute_share = 1.0 / tp if sharded else 1.0
        saved_share = (1.0 - _BLOCK_SHARDED_FRACTION + _BLOCK_SHARDED_FRACTION / tp) if sharded else 1.0
        return LayerCosts(
            fwd_s=row["fwd_s"] * scale * compute_share,
            bwd_input_s=row["bwd_input_s"] * scale * compute_share,
            bwd_weight_s=row["bwd_weight_s"] * scale * compute_share,
            recompute_s=row["recompute_s"] * scale * compute_share,
            param_bytes=int(row["param_bytes"] * compute_share),
            grad_bytes=int(row["grad_bytes"] * compute_share),
            optimizer_bytes=int(row["optimizer_bytes"] * compute_share),
            saved_bytes=int(row["saved_bytes"] * scale * saved_share),
            output_bytes=int(row["output_bytes"] * scale),
            tp_allreduces=2 if sharded else 0,
            tp_comm_bytes=int(row["output_bytes"] * scale) if sharded else 0,
            flops_fwd=float(row["flops_fwd"]) * scale * compute_share,
        )

    def optimizer_step_s(self, param_bytes: int) -> float:
        return self.optimizer_s_per_byte * param_bytes

    def layer_weights(self, by: str) -> list[float]:
        if by == "parameters":
            return [float(v) for v in self.layers["param_bytes"]]
        return [float(f + b) for f, b in zip(self.layers["fwd_s"], self.layers["bwd_s"], strict=True)]
