"""Freed host memory stays in the process (exec.host_memory, issue 12): a block freed and asked for
again is not page-faulted anew, in a bare process and in a real 2-rank run of the embedding suite's
EmbRace plan, whose compute instructions record their page faults. Counts, not times."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from exec.host_memory import ENV
from exec.launcher import run_plan
from sim.plan import Plan

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "examples" / "validation" / "embedding" / "emb-embrace-2d-dp2.yaml"

# Twelve "iterations" in a fresh process, each holding tensors of the sizes (MB) given, then freeing
# them; the page faults of the last five.
_REALLOCATE = """
import json, resource, sys, torch
torch.set_num_threads(1)
from exec.host_memory import keep_freed_memory, state
if sys.argv[1] == "keep":
    keep_freed_memory()
sizes = [int(float(mb) * 2**18) for mb in sys.argv[2].split(",")]
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    alive = []
    for n in sizes:
        alive.append(torch.empty(n).fill_(1.0))
    del alive
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"faults": faults[-5:], "state": state()}))
"""
# What one step of the embedding suite's plans allocates at most (17 MB logits, 8.5 MB head
# gradient, ...). glibc's default may or may not re-fault these, depending on where the process's
# heap happens to lie (measured: in 5 of 8 fresh processes); 40 MB, above its largest dynamic mmap
# threshold (32 MB on 64-bit), it always does: the control that shows the count sees faults.
STEP_MB = "17,8.5,4.25,17,2"


def _reallocate(mode: str, sizes_mb: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _REALLOCATE, mode, sizes_mb], capture_output=True, text=True,
                         check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_freed_block_is_reused_without_page_faults() -> None:
    control, kept = _reallocate("default", "40"), _reallocate("keep", STEP_MB)
    assert all(f >= 10240 for f in control["faults"]), control  # 40 MB of 4 KB pages, re-faulted each time
    # The typical iteration, not every one: with the policy the heap can still grow to a new peak late, when
    # a small allocation has taken part of a freed block (session 17's CI: [0, 1088, 0] of the last three,
    # 1,088 pages being the 4.25 MB tensor's), as the run test below allows for.
    assert statistics.median(kept["faults"]) < 100, kept
    assert control["state"] == {"policy": "allocator default"}
    assert kept["state"]["policy"] == "keep freed memory"


def _compute_faults(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch, policy: str | None) -> tuple:
    if policy is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, policy)  # the ranks inherit the environment
    result = run_plan(Plan.load(PLAN), iterations=ITERATIONS, warmup=WARMUP, out_dir=tmp_path / name)
    compute = result.table[result.table["kind"].isin(["FWD", "BWD"])]
    assert len(compute) == 2 * ITERATIONS * 2 * 2  # ranks x iterations x micro-batches x (FWD, BWD)
    assert (compute["minor_faults"] >= 0).all()
    assert (result.table.loc[~result.table["kind"].isin(["FWD", "BWD", "OPTIMIZER_STEP"]), "minor_faults"] == -1).all()
    return compute.groupby(["rank", "iteration"])["minor_faults"].sum(), result.summary["host_memory"]


ITERATIONS = 6
# With the policy a rank faults while its heap grows to a new peak, mostly in the first two
# iterations; under heavy load (5+, session 16) more of the timed ones did (median 2,603 pages
# against the default's 9,851). Four warm-up iterations leave fewer of those peaks among the timed ones
# (passed at load 6 in session 17; not a proof that load can never push one through).
WARMUP = 4


@pytest.mark.slow
def test_a_runs_compute_instructions_fault_far_less_once_warm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The EmbRace 2D plan on 2 gloo ranks, 6 iterations after 4 warm-up ones, with the ranks keeping
    freed memory and with glibc's default (``PARATWIN_HOST_MEMORY=default``): in the typical
    (median) rank-iteration the forwards and backwards fault under a tenth as many pages; some
    iteration faults none; the records say which policy ran.

    Medians, not sums: with the policy a rank still faults while its heap grows to a new peak, which
    happens in a few early iterations of each run (measured, 8 timed iterations of 8 runs: 0-1 pages
    in most rank-iterations, 1,040-16,640 in 2-4 of 16, mostly the first two); a sum over 4
    iterations then lands near a quarter of the default's (CI: 18,723 against 73,596) while the
    median stays at 0-2. By default the counts depend on where each process's heap lies: a median of
    4,100-16,600 pages, one rank once at 0-2,221 an iteration in CI, and once (session 22's CI) one rank at
    0 in every iteration, which made the default's median over both ranks 0: so the default is judged by
    the rank that faults more, whose allocator returned its freed pages as glibc's default does; where
    neither did (glibc's dynamic mmap threshold had kept the memory, a later CI run), the policy must do
    no worse."""
    kept, kept_state = _compute_faults(tmp_path, "kept", monkeypatch, None)
    default, default_state = _compute_faults(tmp_path, "default", monkeypatch, "default")
    assert kept_state["policy"] == "keep freed memory" and default_state["policy"] == "allocator default"
    faulting = default.groupby("rank").median().max()
    if faulting > 0:
        assert kept.median() < 0.1 * faulting, (kept.to_dict(), default.to_dict())
    else:  # glibc's dynamic mmap threshold kept this run's memory by itself (session 22's CI, both ranks): no worse
        assert kept.median() <= default.median(), (kept.to_dict(), default.to_dict())
    assert (kept == 0).any(), (kept.to_dict(), default.to_dict())


_FRAGMENT = """
import ctypes, json
from exec.host_memory import release_freed_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
blocks = [libc.malloc(64 * 1024) for _ in range(3200)]  # 200 MB of heap blocks, below the mmap threshold
for b in blocks:
    ctypes.memset(b, 1, 64 * 1024)
top = libc.malloc(64)  # keeps the heap's top, so free() alone cannot shrink it
for b in blocks:
    libc.free(b)
held = resident_mb()
released = release_freed_memory()
print(json.dumps({"held": held, "after": resident_mb(), "released": released}))
"""


def test_release_freed_memory_hands_a_freed_heap_back() -> None:
    """What a long sweep of fits calls between fits (analysis.hap_protocol): 200 MB freed inside the
    heap stays resident until it is released."""
    out = subprocess.run([sys.executable, "-c", _FRAGMENT], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["released"] and got["held"] - got["after"] > 150, got
