"""Keep freed host memory in the process, so that an iteration never page-faults memory the one
before it freed (issue 12).

glibc's malloc, which torch's CPU allocator calls, hands blocks above a threshold straight to the
kernel (``mmap``/``munmap``) and trims the top of its heap when enough of it is free; the next
allocation of that size then touches fresh pages, one minor page fault each (the kernel zeroes the
page). The threshold moves with what the process freed before (glibc's dynamic mmap threshold), so
whether a forward's 17 MB of logits fault depends on the allocation history, which differs from
plan to plan and from the profile to the run. Measured (``scripts/probe_sharded_compute.py``, a
2-rank gloo run of the embedding suite's plans, one plan per process pair as the suite runs them):
9,300 faults per iteration in dense's forwards and backwards, 11,900-12,400 in the sharded
methods', 0 with this policy; a fault costs about 2.4 us here (``docs/embrace.md``, "Page faults").

``keep_freed_memory`` turns both off (``mallopt``: no mmap for any size, no trimming): freed
blocks stay in the heap and serve the next request. The process's resident memory then stays at
its peak, which a training process reaches every iteration anyway. Called by every CPU rank
(``exec.rank``) and every validation profiling process (``analysis.validation.profiling``), so the
profile and the run time the same kind of memory; both record ``state()``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource

# glibc <malloc.h>: the mallopt parameters
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# mallopt takes an int: the largest trim threshold it accepts, i.e. never trim
NEVER_TRIM = 2**31 - 1

ENV = "PARATWIN_HOST_MEMORY"  # "default": leave glibc's policy as it is
_state: dict[str, object] = {"policy": "allocator default"}


def keep_freed_memory() -> dict[str, object]:
    """Apply the policy to this process (glibc only); returns ``state()``. Elsewhere (musl, macOS,
    Windows), or with ``PARATWIN_HOST_MEMORY=default`` in the environment (to measure what the policy
    changes: the runs and profiles of a suite inherit it), nothing is changed and the state says why."""
    global _state
    if os.environ.get(ENV) == "default":
        _state = {"policy": "allocator default", "why": f"{ENV}=default"}
        return state()
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        library = ctypes.util.find_library("c")
        _state = {"policy": "allocator default", "why": f"no mallopt in the C library ({library})"}
        return state()
    if mallopt(M_MMAP_MAX, 0) != 1 or mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) != 1:
        _state = {"policy": "allocator default", "why": "mallopt refused M_MMAP_MAX / M_TRIM_THRESHOLD"}
        return state()
    _state = {"policy": "keep freed memory", "mallopt": {"M_MMAP_MAX": 0, "M_TRIM_THRESHOLD": NEVER_TRIM}}
    return state()


def release_freed_memory() -> bool:
    """Hand the memory glibc holds free back to the kernel now (``malloc_trim(0)``); False where the C
    library has no ``malloc_trim``. The opposite of ``keep_freed_memory``, for a long sweep of
    separate fits in one process (``analysis.hap_protocol``), where nothing is asked for again at once:
    measured on PROTEINS HAP fits (15 epochs each), the resident size rose 436 -> 565 MB over five
    fits and fell to 408 MB after each trim; the protocol's PROTEINS run grew about 200 MB per fit
    without it (9.5 GB after 59 fits)."""
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


def _libc_function(name: str):  # noqa: ANN202 (a ctypes foreign function, or None)
    """The C library's function ``name``; None where there is no such library or function."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):
        return None


def state() -> dict[str, object]:
    """What this process's allocator does with freed memory: ``{"policy": "keep freed memory", ...}``
    once ``keep_freed_memory`` applied it, else ``{"policy": "allocator default"}`` (records
    without the field were taken so: freed memory returned to the kernel, page faults in the times)."""
    return dict(_state)


def thread_faults() -> int:
    """Minor page faults of the calling thread so far (Linux); -1 where the count is not kept."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return resource.getrusage(who).ru_minflt if who is not None else -1
