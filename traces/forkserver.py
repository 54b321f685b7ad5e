"""The process's one forkserver, started with what a launch's ranks need, whoever starts it first.

Python keeps one forkserver per process and fixes what it imports (its preload) when it starts: a
process pool that started it without the preload made every later launch's ranks in that process
import torch._dynamo themselves (2-4 s a rank, docs/runtime.md). So every user of the forkserver takes
its context here: processes that run ranks take ``forkserver_context()`` (the launcher, tests' own
ranks in ``tests.forked``); worker pools that need no rank's preload take ``pool_context()`` (the
search's pools in ``sim.search``, the sweep's and HAP runner's in ``analysis.executors``), which forks
from the forkserver only once a launcher has taken it and otherwise starts fresh interpreters: a
process that only searches never starts the forkserver, so never pays its preload's torch import
(about 3.5 s of CPU, docs/runtime.md), and the forkserver is only ever started with the preload.

The preload is module names, so importing this module imports no torch (``sim`` stays torch-free);
the forkserver process imports them.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext, ForkServerContext

# What the forkserver imports once, so that a rank forked from it imports nothing heavy itself.
# torch._dynamo too: building a layer on the meta device (exec.structure, in every rank before its
# first instruction) imports it lazily, 2-4 s per rank per launch (10 of the 13 s a gpt-tiny pp2
# run took on a loaded 2-core machine). tests/test_forkserver_preload.py checks the list.
FORKSERVER_PRELOAD = ("exec.rank", "torch._dynamo")


_taken_for_ranks = False  # forkserver_context() has been called: this process runs ranks


def forkserver_context() -> ForkServerContext:
    """The forkserver context, its preload set to ``FORKSERVER_PRELOAD`` before anything can start it."""
    global _taken_for_ranks
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    _taken_for_ranks = True
    return context


def pool_context() -> BaseContext:
    """For a worker pool: the forkserver (its preload set) once this process has taken it for ranks, so
    forking is cheapest and the workers come with torch imported; before that, ``spawn``: fresh
    interpreters, each importing what its task needs, as workers forked from a forkserver without a
    preload did. Neither lets a worker inherit this process's threads or open files (an output
    folder's lock)."""
    return forkserver_context() if _taken_for_ranks else multiprocessing.get_context("spawn")
