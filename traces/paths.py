"""Where paratwin's data files live: inside the package, in a user's copy, or fetched into a cache.

Nothing outside the installed package is read unless the user points at it. A data file is named by
its path relative to a data root (``TU/MUTAG/raw/MUTAG_A.txt``, ``wikitext-2/valid.txt``) and looked up
in this order:

1. ``$PARATWIN_DATA``, a folder laid out like the package's data (``TU/<NAME>/raw/``,
   ``wikitext-2/``, ``tinyshakespeare/``), for a local copy of the larger data sets;
2. the small data sets that ship inside the package (``exec/data/``, see ``exec/data/SOURCES.md``);
3. the download cache ``$XDG_CACHE_HOME/paratwin`` (default ``~/.cache/paratwin``), where the larger
   data sets are fetched on first use.

``download`` fetches one file into the cache and, offline, raises one line that names both
``$PARATWIN_DATA`` and the URL.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from traces.errors import ConfigError

DATA_ENV = "PARATWIN_DATA"
# The small data sets shipped as package data of ``exec`` (pyproject.toml's package-data).
PACKAGE_DATA = Path(__file__).resolve().parents[1] / "exec" / "data"
DOWNLOAD_TIMEOUT_S = 60.0


def user_data_root() -> Path | None:
    """``$PARATWIN_DATA`` if set (not checked: a missing file there falls through to the next root)."""
    env = os.environ.get(DATA_ENV)
    return Path(env).expanduser() if env else None


def cache_root() -> Path:
    """The download cache: ``$XDG_CACHE_HOME/paratwin``, else ``~/.cache/paratwin``."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "paratwin"


def data_roots() -> list[Path]:
    """Every root a data file is looked for in, first match wins."""
    user = user_data_root()
    return ([user] if user is not None else []) + [PACKAGE_DATA, cache_root()]


def find_data(relative: str | Path) -> Path | None:
    """The first existing ``root / relative`` over ``data_roots()``, or None."""
    for root in data_roots():
        candidate = root / relative
        if candidate.exists():
            return candidate
    return None


def offline_error(what: str, url: str, reason: object, place: str = "") -> ConfigError:
    """``place``: where under the data root the files go (``TU/NAME/raw/``), where it is not the name."""
    return ConfigError("data", f"{what} is not in the package and could not be downloaded from {url} ({reason})",
                       f"put a copy under ${DATA_ENV}{'/' + place if place else ''} (see docs/data.md) or go "
                       "online once")


def git_blob_sha1(data: bytes) -> str:
    """``git hash-object`` of ``data``: the blob id SOURCES.md lists for every file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def download(url: str, relative: str | Path, git_blob: str | None = None) -> Path:
    """Fetch ``url`` into ``cache_root() / relative`` (atomically) and return its path.

    ``git_blob``, when given, must equal the file's ``git hash-object``; a mismatch is refused and
    nothing is kept. Offline (or any HTTP failure) raises ``offline_error``.
    """
    target = cache_root() / relative
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            data = response.read()
    except (urllib.error.URLError, OSError) as exc:
        raise offline_error(str(relative), url, exc) from None
    if git_blob is not None and git_blob_sha1(data) != git_blob:
        raise ConfigError("data", f"{url} has git blob {git_blob_sha1(data)}, expected {git_blob}",
                          f"put a verified copy under ${DATA_ENV}/{relative}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
        tmp.write(data)
    shutil.move(tmp.name, target)
    return target
