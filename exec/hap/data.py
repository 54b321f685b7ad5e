"""TU graph-classification datasets (MUTAG, PROTEINS, PTC_MR, NCI1, ENZYMES), built in a scratch copy.

MUTAG and PTC_MR ship in the package (``exec/data/TU/``, see ``exec/data/SOURCES.md``). The larger
ones are read from ``$PARATWIN_DATA/TU/<NAME>/raw/`` where a copy exists, or downloaded on first use
from the TU collection's site (the URL torch_geometric's ``TUDataset`` downloads from) into the cache
``~/.cache/paratwin/TU/`` (``traces.paths``), under the lock ``~/.cache/paratwin/TU/.<NAME>.lock`` (two
first loads download once). Offline, one line names the variable and the URL.

torch_geometric's ``TUDataset`` writes ``processed/`` next to ``raw/``, and the data folders are
read-only (the package's, a user's copy), so the raw text files are first copied into a scratch cache
directory and the dataset is built there: under a lock (``<cache>/.<NAME>.lock``, so concurrent first
loads build it once), finished by a ``<cache>/<NAME>/.built`` marker. A built cache is only read (it
may be read-only). Node features are the node attributes (where the dataset
has them) followed by the one-hot node labels (``use_node_attr=True``). Continuous node attributes
are z-scored per column over all nodes of the dataset (label-free statistics): PROTEINS' attribute
spans -538..798 and would otherwise swamp the one-hot labels.
"""

from __future__ import annotations

import fcntl
import io
import shutil
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

from traces.errors import ConfigError
from traces.paths import DATA_ENV, DOWNLOAD_TIMEOUT_S, cache_root, data_roots, offline_error

BUILT_MARKER = ".built"  # in <cache>/<NAME>/ once raw/ is copied and processed/ built
TU_NAMES = ("MUTAG", "PROTEINS", "PTC_MR", "NCI1", "ENZYMES")
# torch_geometric.datasets.TUDataset.url (PyG 2.8.1): <url>/<NAME>.zip holds <NAME>/<NAME>_*.txt.
TU_URL = "https://www.chrsmrrs.com/graphkerneldatasets"


def _has_raw(root: Path, name: str) -> bool:
    raw = root / name / "raw"
    return (raw / f"{name}_A.txt").is_file() and (raw / f"{name}_graph_indicator.txt").is_file()


def find_tu_root(name: str) -> Path | None:
    """The first ``<data root>/TU`` (``$PARATWIN_DATA``, the package, the download cache) holding ``name``."""
    return next((root / "TU" for root in data_roots() if _has_raw(root / "TU", name)), None)


def download_tu(name: str) -> Path:
    """Download ``<TU_URL>/<name>.zip`` into ``cache_root()/TU/<name>/raw/``; return ``cache_root()/TU``.

    One process at a time (``_exclusive``): two first loads on one machine would otherwise both
    download and replace each other's ``raw/`` while the other reads it; the later one waits and then
    finds the files there.
    """
    root = cache_root() / "TU"
    with _exclusive(root, name, "XDG_CACHE_HOME", "set XDG_CACHE_HOME to a writable folder, or put a copy "
                    f"under ${DATA_ENV}/TU/{name}/raw/"):
        if _has_raw(root, name):  # another process downloaded it while this one waited
            return root
        url = f"{TU_URL}/{name}.zip"
        try:
            with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
                archive = zipfile.ZipFile(io.BytesIO(response.read()))
        except (urllib.error.URLError, OSError, zipfile.BadZipFile) as exc:
            raise offline_error(f"TU dataset {name}", url, exc, place=f"TU/{name}/raw/ ({name}_A.txt and the "
                                "other .txt files of its zip)") from None
        staging = Path(tempfile.mkdtemp(dir=root))  # moved into place only when complete
        for member in archive.namelist():
            file_name = Path(member).name
            if file_name.startswith(f"{name}_") and file_name.endswith(".txt"):
                (staging / file_name).write_bytes(archive.read(member))
        if not (staging / f"{name}_A.txt").is_file():
            shutil.rmtree(staging, ignore_errors=True)
            raise ConfigError("data", f"{url} holds no {name}_A.txt", f"put a copy under ${DATA_ENV}/TU/{name}/raw/")
        target = root / name / "raw"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return root


@contextmanager
def _exclusive(folder: Path, name: str, field: str, fix: str) -> Iterator[None]:
    """Hold ``<folder>/.<name>.lock`` (created with ``folder``) exclusively: one writer of ``name`` there.

    Blocking; the lock goes with the file's descriptor, so a killed holder releases it. ``field`` and
    ``fix`` name the setting to change when the folder cannot be written.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = (folder / f".{name}.lock").open("a")
    except OSError as exc:
        raise ConfigError(field, f"cannot write TU dataset {name} in {folder} ({exc.strerror})", fix) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # dropped when the file is closed
        yield


def default_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / "paratwin-tu-cache"


def load_tu(
    name: str, data_root: Path | None = None, cache_dir: Path | None = None, standardize: bool = True
):
    """Load TU dataset ``name`` as a ``torch_geometric.datasets.TUDataset`` built in a scratch copy.

    ``data_root`` holds ``<name>/raw/<name>_A.txt`` etc. (never written to); without it the data
    roots of ``traces.paths`` are searched and, for a known TU name found in none, the dataset is
    downloaded into the cache. ``cache_dir`` is where the copy and ``processed/`` go (default: the
    system temp dir).
    """
    from torch_geometric.datasets import TUDataset

    if data_root is not None:
        source = Path(data_root)
        if not _has_raw(source, name):
            found = source.iterdir() if source.is_dir() else []
            available = sorted(p.name for p in found if (p / "raw").is_dir())
            raise ConfigError(
                "dataset",
                f"no TU dataset {name!r} under {source} (expected {source / name / 'raw'}/{name}_A.txt)",
                f"choose one of {', '.join(available) or 'none found'} or pass another data_root",
            )
    elif name not in TU_NAMES:
        raise ConfigError("dataset", f"unknown TU dataset {name!r}",
                          f"choose one of {', '.join(TU_NAMES)} or pass data_root")
    else:
        source = find_tu_root(name) or download_tu(name)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if not _built(source / name / "raw", cache / name):
        _build(source / name / "raw", cache, name)
    dataset = TUDataset(str(cache), name, use_node_attr=True)  # built: only reads
    attributes = dataset.num_node_attributes  # they come first in x, before the one-hot labels
    if standardize and attributes:
        x = dataset._data.x
        values = x[:, :attributes]
        scaled = (values - values.mean(0)) / values.std(0).clamp(min=1e-6)
        dataset._data.x = torch.cat([scaled, x[:, attributes:]], dim=1)
    return dataset


def _built(raw: Path, copy: Path) -> bool:
    """Whether ``copy`` (``<cache>/<NAME>``) holds a finished build of the raw files ``raw``."""
    return (copy / BUILT_MARKER).is_file() and _same_files(raw, copy / "raw")


def _build(raw: Path, cache: Path, name: str) -> None:
    """Copy ``raw`` into ``<cache>/<name>/raw`` and build ``processed/`` there, one process at a time.

    Two processes loading a data set for the first time (two commands, or the workers of a pool on
    one machine) would otherwise delete and rewrite each other's files: the later one waits on
    ``<cache>/.<name>.lock`` and then finds the build done. The marker is written last, so a build
    cut short (a kill) is redone, never read half-written.
    """
    from torch_geometric.datasets import TUDataset

    with _exclusive(cache, name, "cache_dir", "pass a writable cache_dir, or build it there once with write access"):
        copy = cache / name
        if _built(raw, copy):  # another process built it while this one waited
            return
        shutil.rmtree(copy, ignore_errors=True)  # stale or unfinished: rebuild processed/ too
        (copy / "raw").mkdir(parents=True)
        for path in raw.iterdir():
            if path.is_file():
                shutil.copyfile(path, copy / "raw" / path.name)
        TUDataset(str(cache), name, use_node_attr=True)  # writes processed/
        (copy / BUILT_MARKER).write_text("raw/ copied and processed/ built by exec.hap.data.load_tu\n")


def _same_files(source: Path, target: Path) -> bool:
    if not target.is_dir():
        return False
    for path in source.iterdir():
        copy = target / path.name
        if path.is_file() and (not copy.is_file() or copy.stat().st_size != path.stat().st_size):
            return False
    return True


def graph_labels(dataset) -> Tensor:
    """The class label of every graph, as a 1-D long tensor."""
    return dataset._data.y.view(-1).long() if hasattr(dataset, "_data") else dataset.data.y.view(-1).long()


def dense_batch(batch) -> tuple[Tensor, Tensor, Tensor]:
    """A torch_geometric mini-batch as dense tensors: X [B, N, F], A [B, N, N], mask [B, N]."""
    from torch_geometric.utils import to_dense_adj, to_dense_batch

    x, mask = to_dense_batch(batch.x, batch.batch)
    adj = to_dense_adj(batch.edge_index, batch.batch, max_num_nodes=x.shape[1])
    return x, adj, mask


def majority_accuracy(labels: Tensor) -> float:
    """Accuracy of always predicting the most frequent class of ``labels``."""
    return torch.bincount(labels).max().item() / labels.numel()
