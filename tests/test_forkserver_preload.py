"""The launcher's forkserver imports what a rank needs, so that each launch's ranks start without
importing torch modules of their own (docs/runtime.md: later launches start in well under a second)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# In a fresh interpreter: import the forkserver's preload, then do what every rank does before its
# first instruction (compile the plan for the run: structural costs build the layers on the meta
# device), and print the torch modules that imported.
CHECK = """
import importlib, sys
from exec.launcher import FORKSERVER_PRELOAD
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


def test_a_rank_compiling_its_plan_imports_no_torch_module_the_forkserver_did_not() -> None:
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-3000:]
