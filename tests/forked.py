"""Start a test's own processes from the launcher's forkserver instead of fresh interpreters."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from traces.forkserver import forkserver_context

REPO = Path(__file__).resolve().parents[1]


def start_ranks(fn: Callable, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.start_processes(fn, args, nprocs)`` (joined; a failed rank raises), forked
    from the process's forkserver (``traces.forkserver``): it has imported torch once, where each spawned
    interpreter imports it again (3-10 s a process on a loaded 2-core machine)."""
    import torch.multiprocessing as mp

    forkserver_context()  # start_processes takes a method's name: this sets the preload it starts with
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def run_script(source: str, folder: Path, *args: str, env: dict[str, str] | None = None) -> None:
    """Run ``source`` as a script file in ``folder`` (a fresh interpreter, the repository on its path)
    and raise with its stderr if it fails. Every process that forks from its forkserver imports the
    script as ``__mp_main__`` (multiprocessing's preparation, the process's name already set) before
    its target runs: code under ``if __name__ == "__mp_main__":`` observes or changes what a rank or
    worker starts with."""
    script = folder / "script.py"
    script.write_text(source)
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, cwd=REPO,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
