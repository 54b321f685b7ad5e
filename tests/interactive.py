"""Start a command-line process as a terminal would, for tests that send it Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any


def default_interrupt() -> None:
    # A shell runs background jobs with SIGINT ignored, and Python keeps an ignored SIGINT ignored (it
    # installs its KeyboardInterrupt handler only over the default action): a test suite started with
    # `&` or nohup would otherwise send Ctrl-C to a process that cannot hear it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_as_from_terminal(argv: list[str], **popen: Any) -> subprocess.Popen:
    """``subprocess.Popen(argv)`` in a session of its own (so a test can signal its whole process group)
    with SIGINT at its default action whatever the test runner inherited."""
    return subprocess.Popen(argv, start_new_session=True, preexec_fn=default_interrupt, **popen)


def live_processes_in_group(pgid: int) -> list[int]:
    """The running processes of process group ``pgid`` (a test's ``start_as_from_terminal`` command and its
    workers), zombies aside: a reparented child's zombie waits for an init that may never reap it."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]  # after "pid (comm)"
        except (OSError, ValueError):
            continue  # it ended while being read
        if int(group) == pgid and state != "Z":
            found.append(int(stat.parent.name))
    return found
