"""Spawn a probe's ranks with a file rendezvous and collect what each puts on the queue.

Shared by the probe scripts that run a plan's ranks outside the launcher (``probe_faults.py``,
``probe_cpu_share.py``): each rank process is ``target(rank, world, *args, init, queue)`` and puts
one ``(rank, result)`` pair on the queue.
"""

from __future__ import annotations

import multiprocessing
import tempfile
from collections.abc import Callable
from typing import Any


def gather_ranks(target: Callable[..., None], world: int, *args: Any, prefix: str = "paratwin-probe-") -> dict:
    ctx = multiprocessing.get_context("spawn")  # fork after torch has started threads is unsafe
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        init = f"file://{tmp}/rendezvous"
        ranks = [ctx.Process(target=target, args=(r, world, *args, init, queue)) for r in range(world)]
        for p in ranks:
            p.start()
        got = dict(queue.get() for _ in ranks)
        for p in ranks:
            p.join()
    return got
