"""The workload contract: a model as an ordered list of pipeline-cuttable layers.

Every layer maps one tensor to one tensor, so a pipeline stage is any contiguous range of layers
and the tensor between two layers is exactly what a stage sends to the next. A workload can build
any layer range on any device (``meta`` costs models far too large for this machine) and makes
its own seeded input batches and loss.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Batch:
    """One micro-batch: the first layer's input and the loss targets."""

    inputs: torch.Tensor
    targets: torch.Tensor


class Workload(ABC):
    """A model described as ``num_layers`` cuttable layers plus data and loss."""

    name: str
    # Whether a forward draws random numbers (dropout): a re-run forward (RECOMPUTE) must then draw
    # the same ones, so the interpreter keeps the RNG state of each checkpointed forward.
    stochastic: bool = False
    # Whether tensor parallelism also splits the layers' replicated region along the sequence
    # (exec.parallel.sequence; the transformers' workload_options.sequence_parallel).
    sequence_parallel: bool = False
    # The options it was built with (exec.workloads.get_workload; a plan's workload_options), recorded in
    # a bundle so that a refusal of the bundle prints the profile command that measures it again
    # (traces.bundle.remake_hint).
    options: dict[str, object] | None = None

    @abstractmethod
    def layer_names(self) -> list[str]:
        """One name per layer, in execution order."""

    @property
    def num_layers(self) -> int:
        return len(self.layer_names())

    @abstractmethod
    def build_layer(self, index: int) -> nn.Module:
        """Build layer ``index`` on the current default device and dtype."""

    def build_layers(
        self,
        start: int = 0,
        end: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> nn.ModuleList:
        """Build layers ``[start, end)`` only; weights are seeded per layer so that any
        partition of the model holds exactly the weights of the whole model."""
        end = self.num_layers if end is None else end
        if not 0 <= start < end <= self.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is outside 0..{self.num_layers}")
        layers = []
        for index in range(start, end):
            with torch.device(device):
                torch.manual_seed(seed * 100_003 + index)
                layer = self.build_layer(index)
            layers.append(layer.to(dtype=dtype) if dtype.is_floating_point else layer)
        return nn.ModuleList(layers)

    @abstractmethod
    def make_batch(self, micro_batch: int, seed: int = 0, device: str | torch.device = "cpu") -> Batch:
        """A deterministic synthetic (or loaded) micro-batch."""

    @abstractmethod
    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Scalar loss of the last layer's output (mean over the micro-batch)."""

    def describe(self) -> dict[str, object]:
        """Configuration facts recorded in trace bundles."""
        return {"name": self.name, "num_layers": self.num_layers, **({"options": dict(self.options)} if self.options
                                                                      else {})}


def run_layers(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x
