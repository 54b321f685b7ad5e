"""Timing: a clock shared by the ranks, and asynchronous instructions in flight (``Pending``)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from sim.program import Instruction


class Clock:
    """Offsets from the start of the iteration (taken right after a barrier on every rank)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.t0 = 0.0
        self.base: Any = None

    def start(self) -> None:
        self.t0 = time.perf_counter()
        if self.cuda:
            self.base = torch.cuda.Event(enable_timing=True)
            self.base.record()

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter() - self.t0

    def seconds(self, mark: Any) -> float:
        return self.base.elapsed_time(mark) / 1e3 if self.cuda else float(mark)



class Pending:
    """An asynchronous instruction in flight (send, receive, bucket all-reduce, swap).

    gloo's send and receive handles report completion only from ``wait()``, so on CPUs a watcher
    thread waits for each handle and stamps its end (the waiting releases the GIL); the main
    thread only waits for the watcher. On GPUs the end is an event recorded when waited for."""

    def __init__(self, instruction: Instruction, start: Any, work: Any, nbytes: int,
                 tensor: torch.Tensor | None, then: Any, clock: Clock,
                 watchers: ThreadPoolExecutor | None) -> None:
        self.instruction, self.start, self.work, self.nbytes = instruction, start, work, nbytes
        self.tensor, self.then, self.clock = tensor, then, clock
        self.end: Any = None
        self.future = watchers.submit(self._watch) if watchers is not None and work is not None else None

    def _watch(self) -> Any:
        self.work.wait()
        return self.clock.mark()

    def finish(self) -> Any:
        """Wait for completion; return the end mark."""
        if self.future is not None:
            end = self.future.result()  # re-raises a failed wait (e.g. the process-group timeout)
        else:
            if self.work is not None:
                self.work.wait()
            end = self.clock.mark()
        if self.then is not None:
            self.then()
        return end

