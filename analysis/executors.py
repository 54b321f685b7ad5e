"""Where independent tasks run: one interface over this process, a local process pool, or Dask.

Shared by the sweep (``analysis.sweep``, a task is a simulated point) and the HAP protocol runner
(``analysis.hap_protocol``, a task is one fit). A backend has ``submit(fn, task, task_id)``, which
returns a future, ``as_completed(futures)`` and ``close()``. Results travel back to the process
that submitted them, which writes them, so workers need no shared file system.

- ``workers=1`` and no scheduler: ``Serial``, in this process;
- otherwise, no scheduler: a ``concurrent.futures.ProcessPoolExecutor`` of ``workers`` processes;
- ``scheduler="local-dask"``: an embedded Dask ``LocalCluster`` of ``workers`` workers;
- ``scheduler="tcp://host:8786"``: an existing Dask cluster (each worker needs paratwin installed).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from traces.errors import ConfigError
from traces.worker_pool import WorkerPool

try:
    from concurrent.futures.process import BrokenProcessPool
except ImportError:  # pragma: no cover
    BrokenProcessPool = RuntimeError  # type: ignore[misc,assignment]

LOCAL_DASK = "local-dask"


def one_line(message: object) -> str:
    return " ".join(str(message).split())[:2000]


class Serial:
    """``workers=1``, and a debugger's friend: each task runs in this process when ``as_completed``
    reaches it, so the caller records one result before the next task starts (a killed run loses
    only the task in flight, as with the other backends)."""

    name = "this process"

    def submit(self, fn: Callable, task: Any, task_id: str) -> Any:  # noqa: ARG002 - the interface's
        return (fn, task)

    def as_completed(self, futures: list[Any]) -> Iterator[Any]:
        from concurrent.futures import Future

        for fn, task in futures:
            future: Future = Future()
            try:
                future.set_result(fn(task))
            except Exception as exc:  # raised by future.result(), as a worker's exception would be
                future.set_exception(exc)
            yield future

    def close(self, abort: bool = False) -> None:  # noqa: ARG002 - nothing runs beside the caller
        pass


class Pool:
    def __init__(self, workers: int) -> None:
        # Not fork (traces.forkserver.pool_context): a worker must not inherit the output folder's lock
        # (an orphan of a killed run would hold it), nor this process's threads. Its workers ignore Ctrl-C:
        # this process handles it (traces.worker_pool).
        self.executor = WorkerPool(workers)
        self.name = f"{workers} local processes"

    def submit(self, fn: Callable, task: Any, task_id: str) -> Any:  # noqa: ARG002 - the interface's
        return self.executor.submit(fn, task)

    def as_completed(self, futures: list[Any]) -> Iterator[Any]:
        from concurrent.futures import as_completed

        yield from as_completed(futures)

    def close(self, abort: bool = False) -> None:
        """Wait for the workers; with ``abort`` (Ctrl-C) end the tasks they are running instead. A SIGINT
        sent to this process alone (``kill -INT``, ``timeout``, a batch system) reaches no worker, and
        waiting left the command silent until every task in flight had finished: seconds to minutes."""
        if abort:
            self.executor.stop()
        else:
            self.executor.shutdown(wait=True, cancel_futures=True)


class Dask:
    def __init__(self, scheduler: str, workers: int, processes: bool = True) -> None:
        try:
            from distributed import Client, LocalCluster
        except ImportError:
            raise ConfigError("--scheduler", "Dask distributed is not installed",
                              'pip install "dask[distributed]" (or leave --scheduler out: local processes)') from None
        self.cluster = None
        if scheduler == LOCAL_DASK:
            self.cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=processes,
                                        dashboard_address=None)
            self.client = Client(self.cluster)
            self.name = f"Dask LocalCluster of {workers} workers"
        else:
            try:
                self.client = Client(scheduler)  # waits distributed.comm.timeouts.connect (Dask config)
            except (OSError, ValueError) as exc:  # ValueError: not an address at all
                raise ConfigError("--scheduler", f"cannot reach the Dask scheduler at {scheduler}: "
                                  f"{one_line(exc)}", "start `dask scheduler` there, or use local-dask") from None
            self.name = f"Dask scheduler {scheduler}"

    def submit(self, fn: Callable, task: Any, task_id: str) -> Any:
        # pure=False: a task resubmitted after a resume is computed, not looked up in a stale cache.
        return self.client.submit(fn, task, key=f"paratwin-{task_id}-{uuid.uuid4().hex[:8]}", pure=False)

    def as_completed(self, futures: list[Any]) -> Iterator[Any]:
        from distributed import as_completed

        yield from as_completed(futures)

    def close(self, abort: bool = False) -> None:  # noqa: ARG002 - closing the client cancels its tasks
        self.client.close()
        if self.cluster is not None:
            self.cluster.close()


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_workers(workers: int) -> None:
    if workers < 1:
        raise ConfigError("--workers", f"{workers} workers", "use at least 1")


def backend(workers: int, scheduler: str | None, dask_processes: bool = True) -> Serial | Pool | Dask:
    """The backend for ``workers`` and ``scheduler`` (None: this process if 1 worker, else a pool)."""
    check_workers(workers)
    if scheduler:
        return Dask(scheduler, workers, processes=dask_processes)
    return Serial() if workers == 1 else Pool(workers)


__all__ = ["LOCAL_DASK", "BrokenProcessPool", "Dask", "Pool", "Serial", "backend", "check_workers", "one_line",
           "usable_cores"]
