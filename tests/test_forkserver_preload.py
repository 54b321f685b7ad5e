"""The launcher's forkserver imports what a rank needs, so that each launch's ranks start without
importing torch modules of their own (docs/runtime.md: later launches start in well under a second),
whoever starts the forkserver first: Python keeps one per process, with the preload of its first user."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.forked import REPO, run_script

# In a fresh interpreter: import the forkserver's preload, then do what every rank does before its
# first instruction (compile the plan for the run: structural costs build the layers on the meta
# device), and print the torch modules that imported.
CHECK = """
import importlib, sys
from traces.forkserver import FORKSERVER_PRELOAD
from sim.plan import Plan
for name in FORKSERVER_PRELOAD:
    importlib.import_module(name)
plan = Plan.from_dict({"name": "preload", "workload": "gpt-tiny", "cluster": {"preset": "local-cpu-2"},
                       "parallelism": {"pp": 2}, "schedule": {"name": "1f1b", "micro_batch": 2, "microbatches": 2}})
before = set(sys.modules)
from exec.contract import compile_for_run
compile_for_run(plan)
print(sorted(m for m in set(sys.modules) - before if m.startswith("torch")))
"""

# A script (run as a file, so that every worker or rank process imports it as __mp_main__ before its
# target, with the process's name already set): a search whose estimate runs in 2 worker processes,
# then a launch, then the search again. Each such process logs its name and whether torch._dynamo was
# already imported when it started, i.e. whether it came from the forkserver with the preload.
SEARCH_LAUNCH_SEARCH = """
import multiprocessing, os, sys

if __name__ == "__mp_main__":
    with open(os.environ["PARATWIN_TEST_LOG"], "a") as log:
        log.write(f"{multiprocessing.current_process().name} {'torch._dynamo' in sys.modules}\\n")

if __name__ == "__main__":
    import sim.search
    from sim.plan import Plan
    from sim.search import SearchSpace, search

    def log(line):
        with open(os.environ["PARATWIN_TEST_LOG"], "a") as out:
            out.write(line + "\\n")

    sim.search.MIN_PARALLEL_COMBINATIONS = 0  # this small space's estimate, in 2 worker processes
    space = SearchSpace("gpt2-small", "dgx-a100-8", global_batch=16, dtype="fp16", max_micro_batch=1,
                        fractions=(0.5,), tp_overlaps=(0,), bucket_mbs=(25.0,), max_chunks=1)
    assert search(space, top_k=0, sample=0, workers=2).ranked
    log(f"search-only torch {'torch' in sys.modules}")
    from exec.launcher import run_plan
    plan = Plan.from_dict({"name": "after-search", "workload": "gpt-tiny", "cluster": {"preset": "local-cpu-2"},
                           "parallelism": {"pp": 2}, "schedule": {"name": "1f1b", "micro_batch": 1, "microbatches": 2}})
    run_plan(plan, iterations=1, warmup=0, out_dir=sys.argv[1], timeout_s=120)
    log("launched True")
    assert search(space, top_k=0, sample=0, workers=2).ranked
"""


def test_a_rank_compiling_its_plan_imports_no_torch_module_the_forkserver_did_not() -> None:
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-3000:]


@pytest.mark.slow
def test_a_search_alone_starts_no_forkserver_and_a_launch_after_it_forks_its_ranks_with_the_preload(
        tmp_path: Path) -> None:
    log = tmp_path / "forked.log"
    run_script(SEARCH_LAUNCH_SEARCH, tmp_path, str(tmp_path / "run"), env={"PARATWIN_TEST_LOG": str(log)})
    lines = [line.rsplit(" ", 1) for line in log.read_text().splitlines()]
    names = [name for name, _ in lines]
    first_search, launch, second_search = (lines[:names.index("search-only torch")],
                                           lines[names.index("search-only torch") + 1:names.index("launched")],
                                           lines[names.index("launched") + 1:])
    # A process that has only searched: its workers were fresh interpreters (no forkserver started, no
    # torch imported anywhere, the search's own process included).
    assert first_search and all(name.startswith("SpawnProcess") and preloaded == "False"
                                for name, preloaded in first_search), lines
    assert dict(lines)["search-only torch"] == "False", lines
    # The launch that follows starts the forkserver with the preload; the search after it forks from it.
    assert sorted(name for name, _ in launch) == ["paratwin-rank0", "paratwin-rank1"], lines
    assert all(preloaded == "True" for _, preloaded in launch), lines
    assert second_search and all(name.startswith("ForkServerProcess") and preloaded == "True"
                                 for name, preloaded in second_search), lines
