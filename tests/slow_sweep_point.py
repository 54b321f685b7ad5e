"""A sweep point that takes two minutes: what a worker is busy with when a sweep is interrupted."""

from __future__ import annotations

import time
from typing import Any

SECONDS = 120


def sleep_through(point: Any) -> dict[str, Any]:  # noqa: ARG001 - the evaluate interface's
    time.sleep(SECONDS)
    raise AssertionError("an interrupted sweep waited for its workers' points")
