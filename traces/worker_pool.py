"""The process pool of the search's and the sweep's workers, which Ctrl-C stops whole.

A terminal's Ctrl-C sends SIGINT to every process of the command's group: a worker starting up (importing
the simulator) or waiting for a task printed a KeyboardInterrupt traceback of its own, and one running a
task sent the interrupt back as that task's result. A SIGINT sent to the command alone (``kill -INT``,
``timeout -s INT``, a batch system) reaches no worker, and leaving a ``ProcessPoolExecutor`` block waits
for every queued task: the command stayed silent for as long as they took. So here the workers never see
SIGINT (the command that submitted their tasks handles it), and leaving the pool's block on an exception
ends the tasks running and drops the queued ones.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from traces.forkserver import pool_context


class WorkerPool(ProcessPoolExecutor):
    """A ``ProcessPoolExecutor`` on ``pool_context()`` whose workers ignore SIGINT and whose ``with`` block,
    left by an exception (Ctrl-C above all), stops them at once (``stop``)."""

    def __init__(self, workers: int, initializer: Callable[..., None] | None = None,
                 initargs: tuple[Any, ...] = ()) -> None:
        super().__init__(workers, mp_context=pool_context(), initializer=_ignore_sigint,
                         initargs=(initializer, initargs))

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:
        # submit() starts the workers (spawn and forkserver start them on demand). SIGINT blocked meanwhile
        # is blocked in a spawned worker for its whole life (the signal mask survives fork and exec); here
        # the signal only waits for the unblock, so a Ctrl-C in between still stops this process.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return super().submit(fn, *args, **kwargs)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    def stop(self) -> None:
        """Drop the queued tasks and end the running ones (the executor has no public way to end a
        running task), then wait for the workers to go."""
        processes = list((getattr(self, "_processes", None) or {}).values())
        self.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        for process in processes:
            process.join(timeout=10)

    def __exit__(self, exc_type: type[BaseException] | None, *rest: Any) -> bool:
        if exc_type is not None:  # Ctrl-C, an error, a generator closed early: nobody waits for the rest
            self.stop()
            return False
        return super().__exit__(exc_type, *rest)


def _ignore_sigint(initializer: Callable[..., None] | None, initargs: tuple[Any, ...]) -> None:
    """A worker's start: SIGINT ignored (a worker forked from the forkserver does not inherit this
    process's blocked SIGINT), then the pool's own initializer."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if initializer is not None:
        initializer(*initargs)
