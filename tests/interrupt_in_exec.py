"""Run as ``python -m tests.interrupt_in_exec``: a command whose Ctrl-C lands inside an ``exec`` of a string
(as it can in a lazy import, where a dataclass's methods are generated that way) and becomes paratwin's
one-line ``Interrupted`` (tests/test_validate_signals.py)."""

from __future__ import annotations

from analysis.report import run_cli
from traces.errors import Interrupted


def command() -> None:
    try:
        exec("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\nfor _ in range(10**8): pass")
    except KeyboardInterrupt:
        raise Interrupted("interrupted by SIGINT") from None


if __name__ == "__main__":
    run_cli(command)
