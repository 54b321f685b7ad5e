"""Ctrl-C during ``paratwin search`` and the search phase of ``paratwin figures``: one line saying it was
interrupted and what was kept, status 130, and no worker left running. Found by an outside-in review:
status 130 and not a word (a worker that was starting up printed a KeyboardInterrupt traceback instead),
as the sweep phase had said since session 17 (tests/test_sweep.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from analysis.search_report import SEARCH_OUTPUTS
from tests.interactive import live_processes_in_group, start_as_from_terminal
from traces.outdir import LOCK_NAME

REPO = Path(__file__).resolve().parents[1]
# 5,000 plans for the engine on 2 worker processes, started some seconds in: over a minute of work queued
# when the signal comes (a pool that waits for it takes that long to end).
SEARCH = [sys.executable, "-m", "analysis.cli", "search", "--workload", "gpt2-small", "--cluster", "dgx-a100-8",
          "--workers", "2", "--simulate-top", "5000", "--sample", "0", "--top", "3"]


def interrupt_once_workers_run(argv: list[str], log: Path, whole_group: bool = True) -> tuple[int, str, float]:
    """Start ``argv`` as from a terminal, wait until it runs two worker processes, then send SIGINT to its
    process group (a terminal's Ctrl-C) or to it alone (``kill -INT``); its status, its output and the
    seconds it took to end after the signal."""
    with log.open("w") as sink:
        proc = start_as_from_terminal(argv, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + 240
        # the command, its two workers and the resource tracker of spawned processes
        while len(live_processes_in_group(proc.pid)) < 4 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, f"ended before its workers started: {log.read_text()}"
        time.sleep(1.0)  # the workers are importing or simulating
        if whole_group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT)
        signalled = time.monotonic()
        try:
            status = proc.wait(timeout=120)
        finally:
            left = live_processes_in_group(proc.pid)
            if left:
                os.killpg(proc.pid, signal.SIGKILL)
        took = time.monotonic() - signalled
    deadline = time.monotonic() + 15  # a terminated worker may take a moment to go
    while live_processes_in_group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not live_processes_in_group(proc.pid), f"processes left running: {left}"
    return status, log.read_text(), took


@pytest.mark.parametrize("whole_group", [True, False], ids=["ctrl-c", "kill-int-to-the-search-alone"])
def test_an_interrupted_search_says_the_folder_is_as_it_was_and_stops_its_workers(tmp_path: Path,
                                                                                  whole_group: bool) -> None:
    """The earlier search's outputs stay byte for byte; the workers stop at once, also when the SIGINT
    reached the search alone (its pool waited for every queued plan before)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).touch()  # as an earlier search left it
    earlier = {name: f"an earlier search's {name}\n" for name in SEARCH_OUTPUTS}
    for name, text in earlier.items():
        (out / name).write_text(text)
    status, output, took = interrupt_once_workers_run([*SEARCH, "--out", str(out)], tmp_path / "log", whole_group)
    assert status == 130, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    last = output.strip().splitlines()[-1]
    assert last == f"error: search: interrupted before writing anything: {out} is as it was (fix: run the same " \
                   "command again; a search starts over)", output
    assert {name: (out / name).read_text() for name in earlier} == earlier
    assert took < 20, f"{took:.0f} s from the signal to the end"


def test_an_interrupted_figures_search_says_nothing_was_written(tmp_path: Path) -> None:
    """The Merak figure searches before its sweep: an interrupt there writes nothing."""
    out = tmp_path / "figs"
    status, output, _ = interrupt_once_workers_run(
        [sys.executable, "-m", "analysis.cli", "figures", "--out", str(out), "--only", "merak", "--workers", "2"],
        tmp_path / "log")
    assert status == 130, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    last = output.strip().splitlines()[-1]
    # whichever model's search the signal lands in (on an idle machine the first, gpt-1.5b, may be done)
    assert re.match(r"error: figures: interrupted while searching plans for gpt-[\d.]+b \(the Merak figure's "
                    r"searched bar\), before this run's sweeps: nothing was written", last), output
    assert "(fix: run the same command again; --no-search leaves the searched bar out)" in last
    assert not out.exists()
