"""The ADMMiRNN vanilla RNN as cuttable layers: input projection, recurrence, output head.

Same network as ``exec.admm.rnn_admm`` (a_t = U x_t + W s_{t-1} + b, s_t = tanh(a_t),
o_t = V s_t + c), batch-first here like the other workloads:

* ``input_proj``  [N, T, D] -> [N, T, H]   x_t U^T + b
* ``recurrent``   [N, T, H] -> [N, T, H]   s_t = tanh(p_t + s_{t-1} W^T), s_0 = 0
* ``head``        [N, T, H] -> [N, K] (last step, classification) or [N, T, K] (every step)

Presets: ``rnn-digits`` reads scikit-learn's 8x8 digits row by row (8 steps x 8 features, label on
the last step); ``rnn-tiny`` is a synthetic one-hot next-token task for tests.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sim.workloads import preset_with_overrides
from traces.errors import ConfigError

from .base import Batch, Workload


@dataclass(frozen=True)
class RNNConfig:
    inputs: int
    hidden: int
    classes: int
    seq: int
    per_step: bool  # a target on every step (language model) or on the last step only
    data: str  # "digits" or "synthetic"
    source: str = ""


RNN_PRESETS: dict[str, RNNConfig] = {
    "rnn-tiny": RNNConfig(inputs=16, hidden=16, classes=16, seq=8, per_step=True, data="synthetic",
                          source="test model"),
    "rnn-digits": RNNConfig(inputs=8, hidden=32, classes=10, seq=8, per_step=False, data="digits",
                            source="ADMMiRNN digits experiment (analysis/admm_experiment.py)"),
}


class InputProjection(nn.Module):
    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(inputs, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Recurrence(nn.Module):
    """The tanh recurrence over the already projected inputs; W has no bias (b sits in the
    input projection), so the layer's parameters are exactly the RNN's W."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.W = nn.Linear(hidden, hidden, bias=False)

    def forward(self, projected: torch.Tensor) -> torch.Tensor:
        s = projected.new_zeros(projected.shape[0], projected.shape[2])
        states = []
        for t in range(projected.shape[1]):
            s = torch.tanh(projected[:, t] + self.W(s))
            states.append(s)
        return torch.stack(states, dim=1)


class OutputHead(nn.Module):
    def __init__(self, hidden: int, classes: int, per_step: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, classes)
        self.per_step = per_step

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.linear(states if self.per_step else states[:, -1])


class RNNWorkload(Workload):
    def __init__(self, name: str, cfg: RNNConfig) -> None:
        self.name = name
        self.cfg = cfg

    def layer_names(self) -> list[str]:
        return ["input_proj", "recurrent", "head"]

    def build_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        if index == 0:
            return InputProjection(cfg.inputs, cfg.hidden)
        if index == 1:
            return Recurrence(cfg.hidden)
        if index == 2:
            return OutputHead(cfg.hidden, cfg.classes, cfg.per_step)
        raise ValueError(f"layer {index} is outside 0..2")

    def make_batch(self, micro_batch: int, seed: int = 0, device: str | torch.device = "cpu") -> Batch:
        cfg = self.cfg
        gen = torch.Generator().manual_seed(seed)
        if cfg.data == "digits":
            from sklearn.datasets import load_digits  # optional extra "rnn"

            digits = load_digits()
            pick = torch.randint(0, len(digits.target), (micro_batch,), generator=gen)
            images = torch.tensor(digits.images, dtype=torch.float32)[pick] / 16.0  # [N, 8 rows, 8 cols]
            return Batch(images.to(device), torch.tensor(digits.target)[pick].to(device))
        tokens = torch.randint(0, cfg.classes, (micro_batch, cfg.seq + 1), generator=gen)
        inputs = F.one_hot(tokens[:, :-1], cfg.inputs).float()
        return Batch(inputs.to(device), tokens[:, 1:].contiguous().to(device))

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "family": "rnn", "config": asdict(self.cfg),
                "definition": "paratwin exec.workloads.rnn (vanilla tanh RNN of ADMMiRNN)"}


def from_preset(name: str, **overrides: object) -> RNNWorkload:
    """``rnn-tiny`` or ``rnn-digits``; overrides are RNNConfig fields."""
    cfg = preset_with_overrides("RNN", RNN_PRESETS, name, overrides)
    if cfg.data not in ("digits", "synthetic"):
        raise ConfigError("workload.data", f"unknown RNN data {cfg.data!r}", "use 'digits' or 'synthetic'")
    if cfg.data == "digits" and (cfg.inputs, cfg.seq, cfg.classes, cfg.per_step) != (8, 8, 10, False):
        raise ConfigError("workload", "digits are 8 steps x 8 features, 10 classes, label on the last step",
                          "change only 'hidden' for rnn-digits")
    if cfg.data == "synthetic" and cfg.inputs != cfg.classes:
        raise ConfigError("workload", "synthetic next-token data needs inputs == classes (one-hot)",
                          "set inputs and classes to the same vocabulary size")
    return RNNWorkload(name, cfg)
