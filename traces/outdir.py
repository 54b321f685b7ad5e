"""Output folders: safe names, one writer at a time, and never deleting what paratwin did not write.

* ``safe_name`` turns a plan name into one path component (no separators, no ``..``).
* ``OutputLock`` holds an exclusive ``flock`` on ``<folder>/.paratwin.lock`` while a command
  writes there; a second writer gets a one-line ``OutputError`` naming the holder's pid and command
  line. Reentrant within a process. The kernel drops the lock when the holder exits, however it
  exits, so a lock is never stale.
* ``prepare_out_folder`` / ``prepare_out_file`` check a command's ``--out`` before any work: a user's
  file of an output name (a folder's) or any existing file (a single file's, unless ``force``) is refused.
* ``claim_run_folder`` prepares a folder for ``paratwin run``: it refuses a folder that already
  holds run outputs (unless ``force`` and a marker shows that an earlier run wrote them, in which
  case exactly the files that run writes are removed) and records in ``.paratwin-run.json`` what
  this run creates.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

from traces.atomic import atomic_write_text
from traces.errors import ConfigError, ParatwinError

LOCK_NAME = ".paratwin.lock"
MARKER_NAME = ".paratwin-run.json"
RENDEZVOUS_NAME = ".paratwin-rendezvous"
NAME_LIMIT = 100
COMMAND_CHARS = 300  # of the holder's command line kept in the lock file
HOLDER_BYTES = 4096  # read back from it: the pid, the command line and slack

# What a run writes, folder by folder: file name patterns (glob) inside each.
RUN_OUTPUTS: dict[str, tuple[str, ...]] = {
    "ranks": ("rank*.jsonl",),
    "heartbeat": ("rank*.json", "rank*.json.tmp*"),
    "errors": ("rank*.json", "rank*.json.tmp*"),
    "params": ("rank*.pt",),
    "record": ("manifest.json", "*.parquet", "*.csv", "*.schema.json", "trace.json", ".*.tmp", ".*.tmp*"),
}
RUN_FILES = ("trace.json",)


class OutputError(ParatwinError):
    """An output folder that cannot be written as asked (in use, or holding other outputs)."""


def prepare_out_folder(path: Path, writes: tuple[str, ...], option: str = "--out") -> None:
    """Make ``path`` ready for a command's outputs, before any work, or refuse in one line: an existing
    file (it was a FileExistsError after a whole search or simulation, which lost their results); a folder
    that cannot be created (a traceback after the work); a folder paratwin never wrote in (no lock file)
    that already holds one of the names in ``writes`` (the user's file would be overwritten). A folder
    that paratwin wrote before is reused: a rerun replaces its own outputs. Nothing is created."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(option, f"{path} is a file, not a folder",
                          "name a folder for the outputs (a new one is created)")
    if path.is_dir() and not (path / LOCK_NAME).exists():
        taken = [name for name in writes if (path / name).exists() or (path / name).is_symlink()]
        if taken:
            raise ConfigError(option, f"{path} already holds {', '.join(taken)}, not written by paratwin",
                              "choose an empty or new folder (nothing was overwritten)")
    _check_writable(path, option)


def prepare_out_file(path: Path, force: bool, option: str = "--out") -> None:
    """Refuse, in one line, an output file that is a folder or that already exists (unless ``force``):
    a single file carries no lock file that says paratwin wrote it, so an existing one may be the user's
    (``migrate-plan --out`` replaced it silently). Whether it can be written is found when writing it."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(option, f"{path} is a folder", "name the file to write to")
    if (path.exists() or path.is_symlink()) and not force:
        raise ConfigError(option, f"{path} already exists",
                          "name a new file, or pass --force to replace it (nothing was overwritten)")


def _check_writable(path: Path, option: str) -> None:
    """A folder that exists and can be written, or that can be created: tried by making (and removing) a
    uniquely named folder in it or in its nearest existing parent, never by creating ``path`` itself. A
    command that then refuses its input leaves nothing behind, and two commands that start on one new
    folder at once meet at its lock: when each created ``path`` to try it, the second's mkdir failed
    ("cannot write in ... (File exists)") or its rmdir removed the folder the first had just locked."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".paratwin-probe-", dir=probe))
    except OSError as exc:
        raise ConfigError(option, f"cannot write in {path} ({exc.strerror})",
                          "choose a folder in a place you can write") from None


def safe_name(name: str) -> str:
    """One path component made of ``[A-Za-z0-9._-]``: separators and other characters become ``_``;
    leading dots are dropped (no ``..``, no hidden folder); at most ``NAME_LIMIT`` characters."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", str(name)).lstrip(".")[:NAME_LIMIT]
    return cleaned or "plan"


# The folders this process holds (resolved): the descriptor holding the flock and how many holders
# share it. A second flock on a new descriptor would be refused even within this process.
_HELD: dict[Path, list[int]] = {}
_HELD_GUARD = threading.Lock()
# A forked child does not hold its parent's locks (it would otherwise skip the flock and write).
os.register_at_fork(after_in_child=_HELD.clear)


class OutputLock:
    """An exclusive, non-blocking lock on a folder (``with OutputLock(folder):``).

    Reentrant within one process: a function holding a folder's lock may call another that takes it
    again (``hap_experiment``'s ``run`` holds it, then its report takes it too); the ``flock`` is
    dropped when the outermost holder releases it. Another process is refused in one line that names
    the holder's pid and command line (both written into the lock file).
    """

    def __init__(self, folder: Path, option: str = "--out") -> None:
        self.folder = Path(folder)
        self.option = option
        self._key: Path | None = None

    def acquire(self) -> OutputLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        key = self.folder.resolve()
        with _HELD_GUARD:
            if key in _HELD:
                _HELD[key][1] += 1
            else:
                _HELD[key] = [self._lock(), 1]
        self._key = key
        return self

    def _lock(self) -> int:
        fd = os.open(self.folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, HOLDER_BYTES, 0).decode(errors="replace")
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            if holder.partition("\n")[0].strip() == str(os.getppid()) and _is_multiprocessing_child():
                # The holder started this process as a multiprocessing worker (a profile, a sweep point),
                # which re-ran the top level of the holder's script, which then called paratwin again.
                raise OutputError(f"{self.option} {self.folder}: in use by this process's parent "
                                  f"{_describe_holder(holder)}, whose script is being re-imported by a worker "
                                  "process it started; put the script's calls under "
                                  "`if __name__ == \"__main__\":`") from None
            raise OutputError(f"{self.option} {self.folder}: in use by another paratwin process "
                              f"{_describe_holder(holder)}; wait for it to finish or choose another "
                              f"{self.option}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n{_command_line()}\n".encode(), 0)
        return fd

    def release(self) -> None:
        if self._key is None:
            return
        with _HELD_GUARD:
            entry = _HELD[self._key]
            entry[1] -= 1
            if entry[1] == 0:
                del _HELD[self._key]
                os.close(entry[0])  # closing the descriptor drops the flock
        self._key = None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _command_line() -> str:
    """This process's command line on one line, the interpreter's directory dropped (``python -m ...``)."""
    argv = list(sys.orig_argv)  # as started: `python -m module ...`, not the module's path
    if argv:
        argv[0] = Path(argv[0]).name
    return " ".join(shlex.join(argv).split())[:COMMAND_CHARS]


def _is_multiprocessing_child() -> bool:
    """A multiprocessing worker, or a process still importing its parent's main module: spawn's workers
    and the forkserver do that before they know their parent, with the current process marked
    ``_inheriting`` (CPython's multiprocessing.spawn and .forkserver; no public flag says so)."""
    import multiprocessing

    return (multiprocessing.parent_process() is not None
            or bool(getattr(multiprocessing.current_process(), "_inheriting", False)))


def _describe_holder(text: str) -> str:
    """``(pid 1234) running "python -m ..."`` from a lock file's text (pid only if an older writer's)."""
    pid, _, command = text.strip().partition("\n")
    described = f"(pid {pid.strip() or '?'})"
    command = " ".join(command.split())
    return f'{described} running "{command}"' if command else described


def _present(folder: Path) -> list[str]:
    names = [*RUN_OUTPUTS, *RUN_FILES]
    return [name for name in names if (folder / name).exists() or (folder / name).is_symlink()]


def read_marker(folder: Path) -> dict | None:
    try:
        marker = json.loads((Path(folder) / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def claim_run_folder(folder: Path, force: bool = False) -> None:
    """Make ``folder`` ready for a run (the caller holds its ``OutputLock``) or refuse in one line."""
    folder = Path(folder)
    present = _present(folder)
    if present:
        marker = read_marker(folder)
        created = set(marker.get("created", [])) if marker else set()
        foreign = [name for name in present if name not in created]
        if foreign:
            raise OutputError(f"--out {folder}: already holds {', '.join(foreign)} that no paratwin run wrote; "
                              "choose an empty or new --out (nothing was deleted)")
        if not force:
            raise OutputError(f"--out {folder}: holds the outputs of an earlier run "
                              f"(status {marker.get('status', '?')}); choose another --out, or pass --force "
                              "to replace that run's files")
        _remove_run_outputs(folder, present)
        left = _present(folder)
        if left:
            raise OutputError(f"--out {folder}: {', '.join(left)} still hold files that no run wrote; "
                              "move them away or choose another --out")
    write_marker(folder, {"created": [*RUN_OUTPUTS, *RUN_FILES], "status": "running", "pid": os.getpid(),
                          "started": time.time()})


def write_marker(folder: Path, marker: dict) -> None:
    atomic_write_text(Path(folder) / MARKER_NAME, json.dumps(marker, indent=1) + "\n")


def finish_marker(folder: Path, status: str) -> None:
    marker = read_marker(folder) or {"created": [*RUN_OUTPUTS, *RUN_FILES]}
    write_marker(folder, {**marker, "status": status, "finished": time.time()})


def _remove_run_outputs(folder: Path, names: list[str]) -> None:
    """Remove the files a run writes (by name pattern) from ``names``; a folder left empty goes too."""
    for name in names:
        path = folder / name
        if name in RUN_FILES:
            if path.is_file() and not path.is_symlink():
                path.unlink()
            continue
        if path.is_symlink() or not path.is_dir():
            continue
        for pattern in RUN_OUTPUTS[name]:
            for child in path.glob(pattern):
                if child.is_file() and not child.is_symlink():
                    child.unlink()
        if not any(path.iterdir()):
            path.rmdir()


def fresh_run_folder(base: Path) -> Path:
    """``base`` if it holds no run outputs, else the first of ``base-2``, ``base-3``, ... that holds none."""
    base = Path(base)
    candidate, number = base, 1
    while _present(candidate):
        number += 1
        candidate = base.with_name(f"{base.name}-{number}")
    return candidate


__all__ = ["LOCK_NAME", "MARKER_NAME", "RENDEZVOUS_NAME", "OutputError", "OutputLock", "claim_run_folder",
           "finish_marker", "fresh_run_folder", "prepare_out_file", "prepare_out_folder", "read_marker", "safe_name"]
