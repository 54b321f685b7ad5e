"""torch's profiler wrote ~70 "USDT: ... profiler_start/stop" lines to stderr per `paratwin profile`
(found by an outside-in review): they are dropped, and every other line of stderr is kept, in order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
USDT = "USDT:2026-12-07 21:17:19 13846:13846 SyncActivityProfilerHandler.cpp:52] profiler_start\n"


def stderr_of(body: str) -> subprocess.CompletedProcess:
    """``body`` run in a fresh interpreter under ``filtered_stderr`` (fd 2 is the process's own there)."""
    script = ("import os, sys\nfrom exec.stderr_filter import filtered_stderr\nwith filtered_stderr():\n"
              + "".join(f"    {line}\n" for line in body.strip().splitlines()))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_kineto_lines_are_dropped_and_the_rest_kept_in_order() -> None:
    done = stderr_of(f"""
os.write(2, b"first, from C\\n")
os.write(2, {USDT.encode()!r})
print("second, from Python", file=sys.stderr)
os.write(2, b"third\\n")
""")
    assert done.returncode == 0 and done.stderr == "first, from C\nsecond, from Python\nthird\n", done.stderr


def test_what_was_held_is_written_even_when_the_block_raises() -> None:
    done = stderr_of("""
os.write(2, b"before the error\\n")
raise RuntimeError("boom")
""")
    assert done.returncode == 1 and done.stderr.startswith("before the error\n"), done.stderr
    assert "RuntimeError: boom" in done.stderr


def test_profile_prints_no_kineto_lines(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "analysis.cli", "profile", "--workload", "gpt-tiny",
                           "--micro-batch", "1", "--device", "cpu", "--out", str(tmp_path / "bundle")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "USDT:" not in done.stderr and "profiler_start" not in done.stderr
