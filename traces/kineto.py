"""Import a Chrome-trace JSON written by torch.profiler (Kineto) into the per-op table (OP_TABLE).

Accepted: a JSON object with a "traceEvents" list or a bare list of events, plain or gzipped
(recognised by content, so ``.json.gz`` and ``.pt.trace.json`` both work). Complete events ("X")
and begin/end pairs ("B"/"E") become rows; metadata, instant, counter and flow events are skipped,
as is Kineto's whole-profile "Trace" span.

Columns filled from the trace:
- ``device``: "cuda" for events on the GPU timeline (kernel, gpu_memcpy, gpu_memset,
  gpu_user_annotation, cuda_sync; ROCm traces use the same names), else "cpu". Runtime calls
  (cuda_runtime, cuda_driver) run on a CPU thread and stay "cpu".
- ``phase``: "bwd" for events inside an ``autograd::engine::evaluate_function`` span or named
  ``...Backward<n>``, or under an annotation saying backward/bwd; "fwd" under an annotation saying
  forward/fwd; else "unknown". A GPU event takes the phase of the CPU launch that has its
  correlation id.
- ``layer``: the number in the nearest enclosing annotation named like ``layer3``, ``layers.3``
  or ``encoder.layer.3.attn`` (record_function labels); -1 when there is none.
- ``start_us``: microseconds since the first imported event; ``tid`` the thread (CPU) or stream
  (GPU) id, an integer (string ids keep their trailing number, others get a stable hash).
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from traces.errors import BundleError
from traces.schema import OP_TABLE
from traces.tables import conform, empty_table

GPU_CATEGORIES = {
    "kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "cuda_sync", "memcpy", "memset"
}
SKIPPED_CATEGORIES = {"trace"}  # the span that covers the whole profile
ANNOTATION_CATEGORIES = {"user_annotation", "gpu_user_annotation"}
_BACKWARD_NAME = re.compile(r"^autograd::engine::evaluate_function|Backward\d*$")
_BACKWARD_LABEL = re.compile(r"\b(backward|bwd)\b", re.IGNORECASE)
_FORWARD_LABEL = re.compile(r"\b(forward|fwd)\b", re.IGNORECASE)
_LAYER_LABEL = re.compile(r"(?:^|[^a-z0-9])layers?[._:#\s_-]?(\d+)(?!\d)", re.IGNORECASE)


@dataclass
class _Event:
    name: str
    category: str
    pid: object
    tid: object
    ts: float
    dur: float
    correlation: object = None
    phase: str = "unknown"
    layer: int = -1

    @property
    def on_gpu(self) -> bool:
        return self.category.lower() in GPU_CATEGORIES


def import_chrome_trace(path: Path) -> pd.DataFrame:
    """Read a Kineto / Chrome-trace JSON (optionally gzipped) and return OP_TABLE rows."""
    path = Path(path)
    events = _complete_events(_load_events(path), path)
    if not events:
        return empty_table(OP_TABLE)
    _attribute_by_nesting(events)
    _attribute_gpu_by_correlation(events)
    origin = min(e.ts for e in events)
    rows = {
        "layer": [e.layer for e in events],
        "phase": [e.phase for e in events],
        "name": [e.name for e in events],
        "device": ["cuda" if e.on_gpu else "cpu" for e in events],
        "start_us": [e.ts - origin for e in events],
        "dur_us": [e.dur for e in events],
        "tid": [_int_id(e.tid) for e in events],
        "category": [e.category for e in events],
    }
    table = pd.DataFrame(rows).sort_values(["start_us", "dur_us"], ascending=[True, False], kind="stable")
    return conform(table.reset_index(drop=True), OP_TABLE, path)


# --- reading -------------------------------------------------------------------------------------


def _load_events(path: Path) -> list:
    if not path.is_file():
        raise BundleError(path, "file not found" if not path.exists() else "not a regular file")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise BundleError(path, f"truncated or corrupt gzip data ({exc})") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise BundleError(path, "not UTF-8 text; expected Chrome-trace JSON") from None
    except json.JSONDecodeError as exc:
        problem = f"malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        raise BundleError(path, problem) from None
    if isinstance(data, dict):
        events = data.get("traceEvents")
        if not isinstance(events, list):
            raise BundleError(path, "no 'traceEvents' list; not a Chrome trace")
        return events
    if isinstance(data, list):
        return data
    kind = type(data).__name__
    raise BundleError(path, f"top level is a JSON {kind}; expected an object or a list of events")


def _complete_events(raw_events: list, path: Path) -> list[_Event]:
    events: list[_Event] = []
    open_spans: dict[tuple, list[dict]] = defaultdict(list)  # (pid, tid) -> stack of "B" events
    for raw in raw_events:
        if not isinstance(raw, dict):
            continue
        phase = raw.get("ph")
        if phase == "X":
            event = _event(raw, raw.get("dur"))
        elif phase == "B":
            open_spans[(_key(raw.get("pid")), _key(raw.get("tid")))].append(raw)
            continue
        elif phase == "E":
            stack = open_spans[(_key(raw.get("pid")), _key(raw.get("tid")))]
            if not stack or not _is_number(raw.get("ts")):
                continue
            begin = stack.pop()
            event = _event(begin, raw["ts"] - begin["ts"] if _is_number(begin.get("ts")) else None)
        else:
            continue
        if event is not None and event.category.lower() not in SKIPPED_CATEGORIES:
            events.append(event)
    return events


def _event(raw: dict, dur: object) -> _Event | None:
    ts = raw.get("ts")
    if not _is_number(ts) or not _is_number(dur) or dur < 0:
        return None
    args = raw.get("args") if isinstance(raw.get("args"), dict) else {}
    return _Event(
        name=str(raw.get("name", "")),
        category=str(raw.get("cat", "")),
        pid=raw.get("pid"),
        tid=raw.get("tid"),
        ts=float(ts),
        dur=float(dur),
        correlation=args.get("correlation"),
    )


# --- attribution ---------------------------------------------------------------------------------


def _attribute_by_nesting(events: list[_Event]) -> None:
    """Give each event the phase and layer of its enclosing spans on the same thread / stream."""
    tracks: dict[tuple, list[_Event]] = defaultdict(list)
    for event in events:
        tracks[(_key(event.pid), _key(event.tid))].append(event)
    for track in tracks.values():
        track.sort(key=lambda e: (e.ts, -e.dur))
        stack: list[_Event] = []
        for event in track:
            while stack and stack[-1].ts + stack[-1].dur <= event.ts:
                stack.pop()
            parent = stack[-1] if stack else None
            event.phase, event.layer = _own_attributes(event, parent)
            stack.append(event)


def _own_attributes(event: _Event, parent: _Event | None) -> tuple[str, int]:
    phase = parent.phase if parent else "unknown"
    layer = parent.layer if parent else -1
    if event.category.lower() in ANNOTATION_CATEGORIES:
        if _BACKWARD_LABEL.search(event.name):
            phase = "bwd"
        elif _FORWARD_LABEL.search(event.name) and phase != "bwd":
            phase = "fwd"
        match = _LAYER_LABEL.search(event.name)
        if match:
            layer = int(match.group(1))
    if _BACKWARD_NAME.search(event.name):
        phase = "bwd"
    return phase, layer


def _attribute_gpu_by_correlation(events: list[_Event]) -> None:
    launches = {e.correlation: e for e in events if not e.on_gpu and e.correlation is not None}
    for event in events:
        launch = launches.get(event.correlation) if event.on_gpu and event.correlation is not None else None
        if launch is None:
            continue
        if event.phase == "unknown":
            event.phase = launch.phase
        if event.layer == -1:
            event.layer = launch.layer


# --- small helpers -------------------------------------------------------------------------------


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _key(value: object) -> object:
    return value if isinstance(value, (int, str)) else repr(value)


def _int_id(value: object) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    digits = re.search(r"(\d+)\s*$", str(value))
    if digits:
        return int(digits.group(1))
    return zlib.crc32(str(value).encode()) & 0x7FFFFFFF  # stable across runs, unlike hash()
