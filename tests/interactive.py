"""Start a command-line process as a terminal would, for tests that send it Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
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
