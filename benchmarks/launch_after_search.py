"""Launches after a search in the same process: wall time of each ``run_plan`` call.

    python benchmarks/launch_after_search.py [--launches 5] [--no-search] [--out DIR]

A small search (gpt2-small on dgx-a100-8; its estimate in 2 worker processes) starts the process's
forkserver first, as a script or notebook that searches and then runs does; then gpt-tiny pp2 1F1B
(2 gloo ranks, 1 iteration, no warm-up) is launched ``--launches`` times. Before ``traces.forkserver``
the search's pool started the forkserver without the launcher's preload, and every launch's ranks
imported torch._dynamo themselves. ``--no-search``: the launches alone (the launcher starts the
forkserver); ``--launches 0``: the search alone. Prints the search's wall time (its first pool starts
the forkserver, preload included) and, per launch, its wall time; then the median over the
launches after the first (the first includes the forkserver's start when there is no search) and the
spread (min-max). To compare with an older checkout, run this file with ``PYTHONPATH=<that checkout>``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from exec.launcher import run_plan
from sim.plan import Plan

PLAN = {"name": "launch-after-search", "workload": "gpt-tiny", "cluster": {"preset": "local-cpu-2"},
        "parallelism": {"pp": 2}, "schedule": {"name": "1f1b", "micro_batch": 1, "microbatches": 2}}


def run_search() -> float:
    import sim.search
    from sim.search import SearchSpace, search

    sim.search.MIN_PARALLEL_COMBINATIONS = 0  # this small space's estimate, in 2 worker processes
    space = SearchSpace("gpt2-small", "dgx-a100-8", global_batch=16, dtype="fp16", max_micro_batch=1,
                        fractions=(0.5,), tp_overlaps=(0,), bucket_mbs=(25.0,), max_chunks=1)
    started = time.perf_counter()
    search(space, top_k=0, sample=0, workers=2)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=5)
    parser.add_argument("--no-search", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    args = parser.parse_args()
    if args.launches == 1 or args.launches < 0 or (args.no_search and args.launches == 0):
        parser.error("--launches: need 0 (the search alone) or 2 or more (the median is over the launches "
                     "after the first), and with --no-search 2 or more")
    if not args.no_search:
        print(f"search: {run_search():.2f} s")
    if args.launches == 0:
        return
    out = args.out or Path(tempfile.mkdtemp(prefix="paratwin-launch-after-search-"))
    walls = []
    for i in range(args.launches):
        started = time.perf_counter()
        run_plan(Plan.from_dict(PLAN), iterations=1, warmup=0, out_dir=out / f"run{i}", timeout_s=300)
        walls.append(time.perf_counter() - started)
        print(f"launch {i}: {walls[-1]:.2f} s")
    later = walls[1:]
    print(f"launches 1-{len(walls) - 1}: median {statistics.median(later):.2f} s, "
          f"spread {min(later):.2f}-{max(later):.2f} s")


if __name__ == "__main__":
    main()
