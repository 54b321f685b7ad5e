"""The task backends of analysis.executors: the in-process one records each result before the next
task starts, so a killed sweep or HAP run loses only the task in flight (as the pool and Dask do)."""

from __future__ import annotations

import pytest

from analysis.executors import backend


def test_serial_runs_each_task_after_the_previous_result_is_taken() -> None:
    events: list[tuple[str, int]] = []

    def task(x: int) -> int:
        events.append(("run", x))
        return x * x

    where = backend(1, None)
    futures = [where.submit(task, x, f"t{x}") for x in range(3)]
    assert events == []  # nothing runs on submit
    for future in where.as_completed(futures):
        events.append(("recorded", future.result()))
    assert events == [("run", 0), ("recorded", 0), ("run", 1), ("recorded", 1), ("run", 2), ("recorded", 4)]


def test_serial_hands_a_task_error_to_its_future() -> None:
    def task(x: int) -> int:
        if x == 1:
            raise ValueError("bad point")
        return x

    where = backend(1, None)
    futures = list(where.as_completed([where.submit(task, x, f"t{x}") for x in range(3)]))
    assert futures[0].result() == 0 and futures[2].result() == 2
    with pytest.raises(ValueError, match="bad point"):
        futures[1].result()
