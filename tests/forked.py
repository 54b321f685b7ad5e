"""Start a test's own processes from the launcher's forkserver instead of fresh interpreters."""

from __future__ import annotations

from collections.abc import Callable

from traces.forkserver import forkserver_context


def start_ranks(fn: Callable, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.start_processes(fn, args, nprocs)`` (joined; a failed rank raises), forked
    from the process's forkserver (``traces.forkserver``): it has imported torch once, where each spawned
    interpreter imports it again (3-10 s a process on a loaded 2-core machine)."""
    import torch.multiprocessing as mp

    forkserver_context()  # start_processes takes a method's name: this sets the preload it starts with
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
