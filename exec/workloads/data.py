"""Input data for the workload zoo: seeded synthetic tokens and images, and WikiText-2 as real text.

Synthetic data is the default everywhere: it is generated on the CPU from a seeded generator and
then moved, so the same seed gives the same batch on every device. Real text is the tokenized
WikiText-2 (PyTorch's word_language_model copy), cut into windows at seeded offsets. Its valid split
(1.1 MB) ships in ``exec/data/wikitext-2/`` and is the default; train (10.8 MB) and test are fetched
on first use into the cache, or read from ``$PARATWIN_DATA/wikitext-2/`` (``traces.paths``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from traces.errors import ConfigError
from traces.paths import DATA_ENV, download, find_data

UNK = "<unk>"
EOS = "<eos>"
DATA_SOURCES = ("synthetic", "wikitext-2")
WIKITEXT_SPLITS = ("train", "valid", "test")
# The split in the package (the only one the tests and the demo read); the others are downloaded.
WIKITEXT_DEFAULT_SPLIT = "valid"
# pytorch/examples at the commit exec/data/SOURCES.md names; git blob ids from the same table.
_WIKITEXT_URL = ("https://raw.githubusercontent.com/pytorch/examples/77f55b912142e11fcfdf5b530231fb9c52f181e8/"
                 "word_language_model/data/wikitext-2/{split}.txt")
_WIKITEXT_BLOBS = {"train": "2d84b35af79e411d73ea7cae83c73964c6ac83b4",
                   "valid": "eec944eb2d9e46061cd34a6913528797db6842fc",
                   "test": "6f3fc88e4cd88456ea892971f9f12243e8428624"}


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def synthetic_tokens(batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Uniform random token ids, shape [batch, length], int64."""
    return torch.randint(0, vocab, (batch, length), generator=_generator(seed), dtype=torch.int64)


def synthetic_images(
    batch: int, size: int, classes: int, seed: int = 0, channels: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard-normal images [batch, channels, size, size] and uniform class labels [batch]."""
    gen = _generator(seed)
    images = torch.randn(batch, channels, size, size, generator=gen)
    labels = torch.randint(0, classes, (batch,), generator=gen, dtype=torch.int64)
    return images, labels


def check_data_source(data: object) -> str:
    if data not in DATA_SOURCES:
        raise ConfigError("data", f"unknown data source {data!r}", f"use one of {', '.join(DATA_SOURCES)}")
    return str(data)


@dataclass(frozen=True)
class TokenStream:
    """A tokenized text as one long id sequence plus its vocabulary (id -> token)."""

    ids: torch.Tensor  # int64, 1-D
    vocab: tuple[str, ...]
    source: str

    def decode(self, ids: torch.Tensor | list[int]) -> list[str]:
        return [self.vocab[int(i)] for i in ids]


def _tokens(text: str, tokenizer: str) -> list[str]:
    if tokenizer == "word":
        # The file is already tokenized; every line ends with <eos>, as in PyTorch's
        # word_language_model example that this copy of WikiText-2 comes from.
        return [tok for line in text.splitlines() for tok in (*line.split(), EOS)]
    if tokenizer == "char":
        return list(text)
    raise ConfigError("tokenizer", f"unknown tokenizer {tokenizer!r}", "use 'word' or 'char'")


@lru_cache(maxsize=8)
def load_wikitext2(
    split: str = WIKITEXT_DEFAULT_SPLIT, vocab_size: int = 33_279, tokenizer: str = "word", root: str | None = None
) -> TokenStream:
    """WikiText-2 ``split`` as a token stream with at most ``vocab_size`` types.

    Id 0 is ``<unk>``; the other ids go to the most frequent tokens of this split in order of
    frequency (ties in order of first appearance), and every rarer token maps to ``<unk>``, so
    a workload with a smaller vocabulary still reads real text. The vocabulary is built from the
    split itself (simple, and enough for profiling and short training runs; not for comparing
    perplexities across splits).
    """
    if split not in WIKITEXT_SPLITS:
        raise ConfigError("split", f"unknown WikiText-2 split {split!r}",
                          f"use one of {', '.join(WIKITEXT_SPLITS)}")
    if vocab_size < 2:
        raise ConfigError("vocab", f"vocabulary of {vocab_size} is too small for real text", "use at least 2")
    path = wikitext2_path(split, root)
    tokens = _tokens(path.read_text(encoding="utf-8"), tokenizer)
    counts = Counter(tokens)
    counts.pop(UNK, None)
    vocab = (UNK, *(tok for tok, _ in counts.most_common(vocab_size - 1)))
    index = {tok: i for i, tok in enumerate(vocab)}
    ids = torch.tensor([index.get(tok, 0) for tok in tokens], dtype=torch.int64)
    return TokenStream(ids=ids, vocab=vocab, source=str(path))


def wikitext2_path(split: str, root: str | None = None) -> Path:
    """The split's file: under ``root`` if given, else the first data root holding it, else downloaded."""
    relative = Path("wikitext-2") / f"{split}.txt"
    if root:
        path = Path(root) / relative
        if not path.is_file():
            raise ConfigError("data", f"{path} does not exist",
                              f"pass the folder holding wikitext-2/, or unset it to use ${DATA_ENV} / the package")
        return path
    return find_data(relative) or download(_WIKITEXT_URL.format(split=split), relative, _WIKITEXT_BLOBS[split])


def text_windows(stream: TokenStream, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """``batch`` windows of ``length`` consecutive tokens at seeded offsets, shape [batch, length]."""
    if length > stream.ids.numel():
        raise ConfigError("seq", f"windows of {length} tokens do not fit in {stream.source}",
                          "use a shorter seq")
    starts = torch.randint(0, stream.ids.numel() - length + 1, (batch,), generator=_generator(seed))
    return torch.stack([stream.ids[int(s): int(s) + length] for s in starts])


def token_windows(
    data: str, batch: int, length: int, vocab: int, seed: int = 0, split: str = WIKITEXT_DEFAULT_SPLIT
) -> torch.Tensor:
    """[batch, length] token ids from ``data`` ("synthetic" or "wikitext-2"), all ids < ``vocab``."""
    if check_data_source(data) == "synthetic":
        return synthetic_tokens(batch, length, vocab, seed)
    return text_windows(load_wikitext2(split, vocab_size=vocab), batch, length, seed)
