"""An LSTM language model as cuttable layers: embed, one layer per LSTM layer, head.

Its embedding table (vocabulary x embedding width) dominates the parameters while a batch
touches only a few rows, so its gradient is large and sparse: the workload S2 Reducer and
EmbRace target. ``sparse=True`` makes the embedding produce a sparse gradient (rows, values).
"""

from __future__ import annotations

from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch import nn

from sim.workloads import LSTM_PRESETS, LSTMConfig, preset_with_overrides

from .base import Batch, Workload
from .data import check_data_source, token_windows


class LSTMLayer(nn.Module):
    """One ``nn.LSTM`` layer that returns only its output sequence [b, s, hidden]."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(inputs, hidden, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


class LSTMWorkload(Workload):
    """Next-token prediction with an LSTM stack; no dropout, so runs are deterministic."""

    def __init__(self, name: str, cfg: LSTMConfig, sparse: bool = False, data: str = "synthetic") -> None:
        self.name = name
        self.cfg = cfg
        self.sparse = bool(sparse)
        self.data = check_data_source(data)
        self.seq = cfg.seq

    def layer_names(self) -> list[str]:
        return ["embed", *(f"lstm{i}" for i in range(self.cfg.num_layers)), "head"]

    def layer_kind(self, index: int) -> str:
        return "embedding" if index == 0 else "head" if index == self.num_layers - 1 else "lstm"

    def build_layer(self, index: int) -> nn.Module:
        cfg = self.cfg
        if index == 0:
            return nn.Embedding(cfg.vocab, cfg.embed, sparse=self.sparse)
        if index == self.num_layers - 1:
            return nn.Linear(cfg.hidden, cfg.vocab)
        return LSTMLayer(cfg.embed if index == 1 else cfg.hidden, cfg.hidden)

    def make_batch(self, micro_batch: int, seed: int = 0, device: str | torch.device = "cpu") -> Batch:
        window = token_windows(self.data, micro_batch, self.cfg.seq + 1, self.cfg.vocab, seed)
        return Batch(window[:, :-1].contiguous().to(device), window[:, 1:].contiguous().to(device))

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "family": "lstm", "config": asdict(self.cfg),
                "sparse_embedding": self.sparse, "data": self.data,
                "definition": "paratwin exec.workloads.lstm (torch nn.LSTM, no dropout)"}


def from_preset(name: str, **overrides: object) -> LSTMWorkload:
    """``lstm-tiny`` or ``lstm-lm``; overrides are LSTMConfig fields, ``sparse`` and ``data``."""
    sparse = bool(overrides.pop("sparse", False))
    data = str(overrides.pop("data", "synthetic"))
    cfg = preset_with_overrides("LSTM", LSTM_PRESETS, name, overrides, extra=("sparse", "data"))
    return LSTMWorkload(name, cfg, sparse=sparse, data=data)
