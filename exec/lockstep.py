"""Profiling processes that move in lockstep (issue 12).

The ranks of a CPU run compute the same instruction at the same time (every iteration starts at a
barrier and data parallelism meets at every all-reduce), so each rank's kernels run while its peer
runs the same kernels. A co-located profile (``analysis.validation.profiling``) must time its
layers under that same contention. Started together but left alone, its processes drift apart:
each decides for itself how long to warm up and which layer to re-measure, and the last one to
finish times its last layers alone (measured on gpt-wordlm, whose 33,278-word head is 95% of the
compute: one process had the other in the same layer for 55% of its head rounds, the other for
100%; scripts/probe_compute.py documents the probe).

``Lockstep.any`` is the one primitive: every process votes, all wait for all, and each learns
whether any voted yes. The profiler asks it before every timed round (one more round?) and before
every decision that changes how many rounds it runs (warm up once more? measure the layer again?),
so the processes run the same rounds of the same layer at the same time. ``Alone`` is the
single-process case: a vote is its own answer.
"""

from __future__ import annotations

from typing import Any, Protocol

# A process that waits longer than this for its peers has lost one (it failed or hung): the
# barrier breaks and every process stops with an error instead of waiting forever.
LOCKSTEP_TIMEOUT_S = 600.0


class Together(Protocol):
    def any(self, vote: bool) -> bool: ...


class Alone:
    """One process: nothing to wait for."""

    def any(self, vote: bool) -> bool:
        return vote


class Lockstep:
    """``processes`` processes sharing ``barrier`` (a multiprocessing Barrier) and ``votes`` (a
    multiprocessing Array of at least ``processes`` ints); ``index`` is this process's slot."""

    def __init__(self, barrier: Any, votes: Any, index: int) -> None:
        self.barrier, self.votes, self.index = barrier, votes, index

    def any(self, vote: bool) -> bool:
        self.votes[self.index] = int(vote)
        self.barrier.wait(LOCKSTEP_TIMEOUT_S)  # every vote is in
        result = any(self.votes[:self.barrier.parties])
        self.barrier.wait(LOCKSTEP_TIMEOUT_S)  # every process has read them before any votes again
        return result
