"""Sequence data sets for the ADMMiRNN experiments, as time-major tensors.

Two tasks, both small enough to train full-batch on a laptop core:

* ``digits``: scikit-learn's bundled 8x8 digits (1,797 images), each image read row by row as
  an 8-step sequence of 8 pixel intensities; one class label on the last step.
* ``shakespeare``: character-level next-character prediction on Tiny Shakespeare, one-hot
  inputs, a target on every step.

Every split is drawn from a fixed seed so that serial, synchronous and asynchronous runs (and the
gradient baselines) all see the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from traces.errors import BundleError, ConfigError
from traces.paths import find_data


@dataclass(frozen=True)
class SequenceData:
    """Inputs ``x`` of shape (T, N, D); integer targets ``y`` of shape (len(out_steps), N).

    ``out_steps`` lists the time steps that carry an output and a loss term (the last step only
    for classification, every step for language modelling).
    """

    x: torch.Tensor
    y: torch.Tensor
    out_steps: tuple[int, ...]
    num_classes: int

    @property
    def steps(self) -> int:
        return self.x.shape[0]

    @property
    def samples(self) -> int:
        return self.x.shape[1]

    @property
    def input_dim(self) -> int:
        return self.x.shape[2]

    def subset(self, index: torch.Tensor | np.ndarray | slice) -> SequenceData:
        """The same task restricted to samples ``index`` (a shard of the data)."""
        index = torch.as_tensor(index) if isinstance(index, np.ndarray) else index
        return SequenceData(self.x[:, index], self.y[:, index], self.out_steps, self.num_classes)

    def shards(self, count: int) -> list[SequenceData]:
        """``count`` contiguous, near-equal shards (the data split of the parallel variants)."""
        if not 1 <= count <= self.samples:
            raise ConfigError("workers", f"{count} shards of {self.samples} samples",
                              "use 1..samples workers")
        bounds = np.linspace(0, self.samples, count + 1).round().astype(int)
        return [self.subset(slice(int(lo), int(hi))) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


@dataclass(frozen=True)
class TaskData:
    train: SequenceData
    test: SequenceData
    description: str


def load_digits_task(seed: int = 0, test_fraction: float = 0.25,
                     dtype: torch.dtype = torch.float64) -> TaskData:
    from sklearn.datasets import load_digits  # optional extra "rnn"; imported only when used

    digits = load_digits()
    images = digits.images.astype(np.float64) / 16.0  # pixel intensities are 0..16
    order = np.random.default_rng(seed).permutation(len(images))
    n_test = int(round(test_fraction * len(images)))
    # (N, 8 rows, 8 columns) -> time-major (8 steps, N, 8 features)
    x = torch.tensor(images[order].transpose(1, 0, 2), dtype=dtype)
    y = torch.tensor(digits.target[order], dtype=torch.long).unsqueeze(0)
    full = SequenceData(x, y, (7,), 10)
    test, train = full.subset(slice(0, n_test)), full.subset(slice(n_test, None))
    return TaskData(train, test,
                    f"sklearn digits, 8 steps x 8 features, {train.samples} train / {test.samples} test")


def load_shakespeare_task(
    seed: int = 0,
    seq_len: int = 16,
    train_sequences: int = 512,
    test_sequences: int = 256,
    path: Path | str | None = None,
    dtype: torch.dtype = torch.float64,
) -> TaskData:
    """Random windows of ``seq_len + 1`` characters: the first 90% of the text feeds training
    windows, the last 10% test windows, so test text is never seen in training. ``path``
    defaults to the copy in the package (Karpathy's char-rnn input.txt, see exec/data/SOURCES.md),
    or ``$PARATWIN_DATA/tinyshakespeare/input.txt`` where that exists."""
    relative = Path("tinyshakespeare") / "input.txt"
    path = Path(path) if path is not None else find_data(relative) or relative
    if not path.is_file():
        raise BundleError(path, "Tiny Shakespeare text not found (pass path= to its input.txt)")
    text = path.read_text(encoding="utf-8")
    vocab = sorted(set(text))
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    lookup = {ord(ch): i for i, ch in enumerate(vocab)}
    ids = np.array([lookup[int(c)] for c in codes], dtype=np.int64)
    split = int(0.9 * len(ids))
    rng = np.random.default_rng(seed)

    def windows(lo: int, hi: int, count: int) -> SequenceData:
        starts = rng.integers(lo, hi - seq_len - 1, size=count)
        chunk = torch.tensor(np.stack([ids[s : s + seq_len + 1] for s in starts]))  # (N, T+1)
        x = torch.nn.functional.one_hot(chunk[:, :-1].T, len(vocab)).to(dtype)  # (T, N, V)
        return SequenceData(x, chunk[:, 1:].T.contiguous(), tuple(range(seq_len)), len(vocab))

    train, test = windows(0, split, train_sequences), windows(split, len(ids), test_sequences)
    return TaskData(train, test, f"tiny shakespeare chars, vocab {len(vocab)}, {seq_len} steps, "
                                 f"{train_sequences} train / {test_sequences} test windows")


def load_task(task: str, seed: int = 0, **options: object) -> TaskData:
    if task == "digits":
        return load_digits_task(seed, **options)  # type: ignore[arg-type]
    if task == "shakespeare":
        return load_shakespeare_task(seed, **options)  # type: ignore[arg-type]
    raise ConfigError("task", f"unknown ADMMiRNN task {task!r}", "use 'digits' or 'shakespeare'")
