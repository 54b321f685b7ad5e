"""BERT presets (``bert-tiny``, ``bert-base``, ``bert-large``): the transformer stack of
``exec.workloads.gpt`` with bidirectional attention and a masked-LM style target."""

from __future__ import annotations

from .gpt import TransformerWorkload, from_preset

__all__ = ["TransformerWorkload", "from_preset"]
