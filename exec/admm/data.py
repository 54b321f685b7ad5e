"""Sequence data sets for the ADMMiRNN experiments, as time-major tensors.

Three tasks, all small enough to train full-batch on a laptop core:

* ``digits``: scikit-learn's bundled 8x8 digits (1,797 images), each image read row by row as
  an 8-step sequence of 8 pixel intensities; one class label on the last step.
* ``shakespeare``: character-level next-character prediction on Tiny Shakespeare, one-hot
  inputs, a target on every step.
* ``text-source``: text classification (the paper's IMDb task is a text classification; IMDb is
  80 MB and not shipped): is a 32-character window from Shakespeare or from Wikipedia? Built from
  the two texts the package already ships (Tiny Shakespeare and WikiText-2 valid), lower-cased to
  a 28-symbol alphabet so that capitals and markup do not give the answer away; one label on the
  last step.

Every task has three disjoint splits: ``train`` (fit), ``validation`` (carved from the training
data; hyper-parameters are chosen on it) and ``test`` (touched once, for the reported numbers).
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
    validation: SequenceData
    test: SequenceData
    description: str

    def split(self, name: str) -> SequenceData:
        if name not in ("validation", "test"):
            raise ConfigError("split", f"unknown evaluation split {name!r}", "use 'validation' or 'test'")
        return self.validation if name == "validation" else self.test


TASKS = ("digits", "shakespeare", "text-source")
VALIDATION_FRACTION = 0.2  # of the training data, for every task


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
    n_val = int(round(VALIDATION_FRACTION * (len(images) - n_test)))
    test = full.subset(slice(0, n_test))
    validation, train = full.subset(slice(n_test, n_test + n_val)), full.subset(slice(n_test + n_val, None))
    return TaskData(train, validation, test,
                    f"sklearn digits, 8 steps x 8 features, {train.samples} train / {validation.samples} "
                    f"validation / {test.samples} test")


def load_shakespeare_task(
    seed: int = 0,
    seq_len: int = 16,
    train_sequences: int = 512,
    test_sequences: int = 256,
    path: Path | str | None = None,
    dtype: torch.dtype = torch.float64,
    validation_sequences: int = 128,
) -> TaskData:
    """Random windows of ``seq_len + 1`` characters: the first 80% of the text feeds training
    windows, the next 10% validation windows, the last 10% test windows, so neither validation
    nor test text is seen in training. ``path`` defaults to the copy in the package (Karpathy's
    char-rnn input.txt, see exec/data/SOURCES.md), or ``$PARATWIN_DATA/tinyshakespeare/input.txt``
    where that exists."""
    text = _read_shipped(Path("tinyshakespeare") / "input.txt", path, "Tiny Shakespeare")
    vocab = sorted(set(text))
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    lookup = {ord(ch): i for i, ch in enumerate(vocab)}
    ids = np.array([lookup[int(c)] for c in codes], dtype=np.int64)
    rng = np.random.default_rng(seed)

    def windows(lo: int, hi: int, count: int) -> SequenceData:
        starts = rng.integers(lo, hi - seq_len - 1, size=count)
        chunk = torch.tensor(np.stack([ids[s : s + seq_len + 1] for s in starts]))  # (N, T+1)
        x = torch.nn.functional.one_hot(chunk[:, :-1].T, len(vocab)).to(dtype)  # (T, N, V)
        return SequenceData(x, chunk[:, 1:].T.contiguous(), tuple(range(seq_len)), len(vocab))

    fit_end, val_end = int(0.8 * len(ids)), int(0.9 * len(ids))
    train, validation = windows(0, fit_end, train_sequences), windows(fit_end, val_end, validation_sequences)
    test = windows(val_end, len(ids), test_sequences)
    return TaskData(train, validation, test,
                    f"tiny shakespeare chars, vocab {len(vocab)}, {seq_len} steps, {train_sequences} train / "
                    f"{validation_sequences} validation / {test_sequences} test windows")


def _read_shipped(relative: Path, path: Path | str | None, name: str) -> str:
    """A text shipped in exec/data (or under $PARATWIN_DATA), or ``path`` when given."""
    path = Path(path) if path is not None else find_data(relative) or relative
    if not path.is_file():
        raise BundleError(path, f"{name} text not found (pass the path to {relative.name})")
    return path.read_text(encoding="utf-8")


TEXT_ALPHABET = "abcdefghijklmnopqrstuvwxyz "  # plus one symbol for everything else


def _normalize(text: str) -> np.ndarray:
    """Lower-case, whitespace runs to one space, WikiText's tokenizer markup undone, then codes
    0..26 for the alphabet and 27 for any other character."""
    for token, plain in (("<unk>", " "), (" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), ("=", " ")):
        text = text.replace(token, plain)
    text = " ".join(text.lower().split())
    lookup = {ch: i for i, ch in enumerate(TEXT_ALPHABET)}
    return np.array([lookup.get(ch, len(TEXT_ALPHABET)) for ch in text], dtype=np.int64)


def load_text_source_task(
    seed: int = 0,
    seq_len: int = 32,
    train_sequences: int = 512,
    validation_sequences: int = 128,
    test_sequences: int = 256,
    dtype: torch.dtype = torch.float64,
) -> TaskData:
    """Binary text classification, Shakespeare (0) or Wikipedia (1), from ``seq_len``-character
    windows of the two shipped texts. Each text is split 80/10/10 (train/validation/test regions,
    windows never cross a region), classes are balanced in every split."""
    sources = [_normalize(_read_shipped(Path("tinyshakespeare") / "input.txt", None, "Tiny Shakespeare")),
               _normalize(_read_shipped(Path("wikitext-2") / "valid.txt", None, "WikiText-2 valid"))]
    rng = np.random.default_rng(seed)
    symbols = len(TEXT_ALPHABET) + 1

    def windows(lo: float, hi: float, count: int) -> SequenceData:
        chunks, labels = [], []
        for label, ids in enumerate(sources):
            start, stop = int(lo * len(ids)), int(hi * len(ids)) - seq_len
            starts = rng.integers(start, stop, size=count // 2 + (label < count % 2))
            chunks += [ids[s : s + seq_len] for s in starts]
            labels += [label] * len(starts)
        order = rng.permutation(len(labels))
        chunk = torch.tensor(np.stack(chunks)[order])  # (N, T)
        x = torch.nn.functional.one_hot(chunk.T, symbols).to(dtype)  # (T, N, symbols)
        y = torch.tensor(np.array(labels)[order]).unsqueeze(0)
        return SequenceData(x, y, (seq_len - 1,), 2)

    train, validation = windows(0.0, 0.8, train_sequences), windows(0.8, 0.9, validation_sequences)
    test = windows(0.9, 1.0, test_sequences)
    return TaskData(train, validation, test,
                    f"text source (Shakespeare vs Wikipedia), {seq_len} chars of {symbols} symbols, "
                    f"{train_sequences} train / {validation_sequences} validation / {test_sequences} test")


def load_task(task: str, seed: int = 0, **options: object) -> TaskData:
    loaders = {"digits": load_digits_task, "shakespeare": load_shakespeare_task,
               "text-source": load_text_source_task}
    if task not in loaders:
        raise ConfigError("task", f"unknown ADMMiRNN task {task!r}", f"use one of {', '.join(TASKS)}")
    return loaders[task](seed, **options)  # type: ignore[operator]
