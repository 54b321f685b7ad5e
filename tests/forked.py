"""Start a test's own processes from the launcher's forkserver instead of fresh interpreters."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from multiprocessing.context import ForkServerContext


def forkserver() -> ForkServerContext:
    """The forkserver context ``exec.launcher`` uses: it has imported torch once, where each spawned
    interpreter imports it again (3-10 s a process on a loaded 2-core machine). The forkserver is one
    per process and its preload is fixed by whoever starts it first, so this sets the launcher's."""
    from exec.launcher import FORKSERVER_PRELOAD

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return context


def start_ranks(fn: Callable, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.start_processes(fn, args, nprocs)`` (joined; a failed rank raises), forked
    from the launcher's forkserver (``forkserver()``)."""
    import torch.multiprocessing as mp

    forkserver()
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
