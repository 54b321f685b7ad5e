"""Atomic writes: a reader sees the old file (or directory) or the complete new one, never half.

Files are written to a temporary name in the same directory and renamed over the target
(``os.replace`` is atomic on POSIX within one file system). A directory is built under a hidden
temporary name beside the target; only once every file in it is complete does it take the
target's name. If anything raises before that, the temporary is removed and the target is untouched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on a clean exit it is renamed to ``path``. On any failure the
    temporary is removed, and an ``OSError`` (a full disk) names ``path``, not the temporary's name."""
    path = Path(path)
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        tmp.chmod(0o644)  # mkstemp makes files private (0600); a trace file is meant to be shared
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        _name_target(exc, tmp, path)
        raise
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_directory(directory: Path, keep: tuple[str, ...] = ()) -> Iterator[Path]:
    """Yield an empty temporary directory; on a clean exit it replaces ``directory``.

    An existing ``directory`` is first moved aside, then the new one is renamed into place and
    the old one deleted. The only window without ``directory`` is between those two renames (two
    system calls); the old copy then still exists under ``.<name>.old-*`` beside it. The entries
    named in ``keep`` (the folder's lock file) are hard-linked from the old directory into the new
    one first: the same file, so a ``flock`` held on it still holds the new folder. What else the old
    directory held is deleted: the caller checks that it is its own (``traces.bundle.check_replaceable``).
    An ``OSError`` (a full disk) names the file at its final path, not the temporary's.
    """
    directory = Path(directory)
    tmp: Path | None = None
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=directory.parent))
        tmp.chmod(0o755)  # mkdtemp makes directories private (0700)
        yield tmp
        for name in keep:
            if (directory / name).is_file():
                _link_or_copy(directory / name, tmp / name)
        _fsync_tree(tmp)
        _swap_into_place(tmp, directory)
    except OSError as exc:
        _name_target(exc, tmp, directory)
        raise
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # a file system without hard links: the file survives, a lock on it covers the old folder only
        shutil.copyfile(source, target)


def _name_target(exc: OSError, tmp: Path | None, target: Path) -> None:
    """Make ``exc`` name the file being written at its final place: a write's ENOSPC names no file (or
    pyarrow's, the temporary), and the user knows only the target."""
    name = None if exc.filename is None else Path(exc.filename)
    if tmp is not None and name is not None and (name == tmp or tmp in name.parents):
        exc.filename = str(target / name.relative_to(tmp)) if name != tmp else str(target)
    elif name is None:
        exc.filename = str(target)


def _swap_into_place(new: Path, target: Path) -> None:
    if not target.exists() and not target.is_symlink():
        os.rename(new, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    old.rmdir()  # only the unique name is wanted; rename needs it absent
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)  # put the previous bundle back before reporting the failure
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)


def _fsync_file(path: Path) -> None:
    # Without fsync a crash soon after the rename can leave a renamed but empty file.
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_tree(directory: Path) -> None:
    for child in directory.rglob("*"):
        if child.is_file():
            _fsync_file(child)
