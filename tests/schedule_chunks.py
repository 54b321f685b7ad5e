"""A drawn chunk count put into a schedule's range, for property tests that should mostly reach their
checks rather than the schedule's refusal (``check_schedule``: chunks outside min..max chunks)."""

from __future__ import annotations

from sim.schedules import SCHEDULES


def chunks_in_range(schedule: str, drawn: int) -> int:
    info = SCHEDULES[schedule]
    return min(max(drawn, info.min_chunks), info.max_chunks or drawn)
