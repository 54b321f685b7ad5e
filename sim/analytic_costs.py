"""The analytic model (``sim.analytic``) behind the simulator's ``CostModel`` interface."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from sim.analytic import AnalyticCostModel, EfficiencyCurve
from sim.cluster import ClusterSpec
from sim.costs import LayerCosts
from sim.hardware import DeviceSpec
from sim.workloads import LayerSpec


class AnalyticCosts:
    def __init__(self, layers: Sequence[LayerSpec], device: DeviceSpec, dtype: str,
                 cluster: ClusterSpec | None = None, efficiency: EfficiencyCurve | None = None,
                 attention: str = "flash", kernels: bool = True, optimizer: str = "adam",
                 tp_backward_overlap: bool | float = False, grad_accumulation: str = "fused") -> None:
        self.specs = list(layers)
        self.num_layers = len(self.specs)
        self.model = AnalyticCostModel(device, dtype, efficiency, attention=attention, kernels=kernels,
                                       optimizer=optimizer, tp_backward_overlap=tp_backward_overlap,
                                       grad_accumulation=grad_accumulation)
        self.cluster = cluster
        self.layer_costs = lru_cache(maxsize=None)(self._layer_costs)  # type: ignore[method-assign]

    def _layer_costs(self, layer: int, micro_batch: int, tp: int) -> LayerCosts:
        c = self.model.layer_costs(self.specs[layer], micro_batch, tp)
        return LayerCosts(
            fwd_s=c.fwd_s, bwd_input_s=c.bwd_input_s, bwd_weight_s=c.bwd_weight_s, recompute_s=c.recompute_s,
            param_bytes=c.param_bytes, grad_bytes=c.grad_bytes, optimizer_bytes=c.optimizer_bytes,
            saved_bytes=c.saved_bytes, output_bytes=c.output_bytes, tp_allreduces=c.tp_allreduces_fwd,
            tp_comm_bytes=c.tp_message_bytes, tp_in_backward=c.tp_allreduces_bwd > 0 or not c.tp_allreduces_fwd,
            tp_bwd_allreduces=c.tp_allreduces_bwd, tp_bwd_comm_bytes=c.tp_bwd_message_bytes,
            flops_fwd=c.flops_fwd,
            selective_saved_bytes=c.selective_saved_bytes, selective_recompute_s=c.selective_recompute_s,
            shared_input_bytes=c.shared_input_bytes,
            unsaved_input_bytes=c.unsaved_input_bytes, saved_output_bytes=c.saved_output_bytes,
            tp_bwd_overlap_s=c.tp_bwd_overlap_s, tp_bwd_overlap_share=c.tp_bwd_overlap_share,
            tp_sequence_parallel=c.tp_sequence_parallel,
            tp_bwd_regathers=c.tp_bwd_regathers, tp_bwd_regather_overlap_s=c.tp_bwd_regather_overlap_s,
            attention_core_bytes=c.attention_core_bytes, attention_core_recompute_s=c.attention_core_recompute_s,
            sp_grad_bytes=c.sp_grad_bytes, grad_accumulate_s=c.grad_accumulate_s,
        )

    def optimizer_step_s(self, param_bytes: int) -> float:
        return self.model.optimizer_step_s(param_bytes)

    def step_copy_bytes(self, grad_bytes: int, buffer_scale: float) -> int:
        return self.model.step_copy_bytes(grad_bytes, buffer_scale)

    def layer_weights(self, by: str) -> list[float]:
        if by == "parameters":
            return [float(spec.params) for spec in self.specs]
        return [c.fwd_s + c.bwd_s for c in (self.layer_costs(i, 1, 1) for i in range(self.num_layers))]
