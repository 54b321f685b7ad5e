"""The process's one forkserver, started with what a launch's ranks need, whoever starts it first.

Python keeps one forkserver per process and fixes what it imports (its preload) when it starts: a
process pool that started it without the preload made every later launch's ranks in that process
import torch._dynamo themselves (2-4 s a rank, docs/runtime.md). So every user of the forkserver takes
its context here: the launcher (``exec.launcher``), the search's worker pools (``sim.search``), the
sweep's and HAP runner's pool (``analysis.executors``) and tests' own processes (``tests.forked``).

The preload is module names, so importing this module imports no torch (``sim`` stays torch-free);
the forkserver process imports them. A process that only ever runs a pool pays that import once, in
the forkserver, when its first pool starts.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import ForkServerContext

# What the forkserver imports once, so that a rank forked from it imports nothing heavy itself.
# torch._dynamo too: building a layer on the meta device (exec.structure, in every rank before its
# first instruction) imports it lazily, 2-4 s per rank per launch (10 of the 13 s a gpt-tiny pp2
# run took on a loaded 2-core machine). tests/test_forkserver_preload.py checks the list.
FORKSERVER_PRELOAD = ("exec.rank", "torch._dynamo")


def forkserver_context() -> ForkServerContext:
    """The forkserver context, its preload set to ``FORKSERVER_PRELOAD`` before anything can start it."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return context
