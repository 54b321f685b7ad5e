"""Drop a library's C++ log lines from the process's standard error, keep everything else.

torch's profiler (kineto, torch 2.13) writes two lines to file descriptor 2 each time a profile starts and
stops ("USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start"), about seventy per
`paratwin profile` and more per validation, with no setting that silences them (KINETO_LOG_LEVEL and
TORCH_CPP_LOG_LEVEL were tried). They are written below Python, so ``sys.stderr`` cannot filter them: the
descriptor itself is pointed at a temporary file for the duration and the lines that are not dropped are
written back, in order, when it ends.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def is_kineto_usdt_line(line: str) -> bool:
    return line.startswith("USDT:") and "ActivityProfilerHandler" in line


@contextmanager
def filtered_stderr(drop: Callable[[str], bool] = is_kineto_usdt_line) -> Iterator[None]:
    """Inside the block, standard error (descriptor 2, C++ and Python alike) is held back; on leaving it,
    every line for which ``drop`` is false is written to it."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                    if not drop(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
