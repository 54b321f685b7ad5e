"""Run ``tests/recompute_after_kept_run.py`` in a subprocess (its test-only policy must register in
the script the runtime's ranks re-import, not in the pytest process) and return its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_recompute_after_kept(workload: str, layers: list[int], micro_batch: int = 2) -> dict:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MICRO_BATCH": str(micro_batch),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(root / "tests" / "recompute_after_kept_run.py"), workload,
                           *(str(layer) for layer in layers)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
