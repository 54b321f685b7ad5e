"""Export an instruction table (INSTRUCTION_TABLE) as Chrome-trace JSON for Perfetto / chrome://tracing.

One process per rank (pid = rank + pid_offset, named "rank N"), one thread per stream
(tid = stream number, named after the stream), complete "X" events in microseconds. Child rows
(parent != -1, e.g. per-layer events inside an instruction) go on their parent's track when they
run on the same stream, so the viewer nests them under it; a child on another stream (a TP
collective inside a forward) gets that stream's track. Device memory after each instruction is a
counter track per rank.

To lay a prediction over a measurement, build both event lists with ``chrome_events`` (different
``pid_offset`` and ``process_prefix``) and write them together with ``write_chrome_trace``.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pandas as pd

from traces.atomic import atomic_write_bytes
from traces.errors import BundleError
from traces.schema import INSTRUCTION_TABLE
from traces.tables import conform

# Fixed track order, so every trace of every plan lists the streams the same way.
STREAM_ORDER = ("compute", "p2p_send", "p2p_recv", "collective", "copy")


def instruction_table_to_chrome(df: pd.DataFrame, path: Path, time_offset_s: float = 0.0) -> Path:
    """Write the Chrome trace of one instruction table to ``path`` (gzipped if it ends in .gz)."""
    return write_chrome_trace(chrome_events(df, time_offset_s=time_offset_s, source=path), path)


def chrome_events(
    df: pd.DataFrame,
    time_offset_s: float = 0.0,
    pid_offset: int = 0,
    process_prefix: str = "rank",
    source: object = "instruction table",
) -> list[dict]:
    table = conform(df, INSTRUCTION_TABLE, source).reset_index(drop=True)
    backwards = table.index[table["end_s"] < table["start_s"]]
    if len(backwards):
        raise BundleError(source, f"row {int(backwards[0])} ends before it starts (end_s < start_s)")
    table["stream"] = table["stream"].fillna("").astype(str)
    streams = _stream_ids(table["stream"])
    tids = _track_ids(table, streams)
    stream_names = {tid: name for name, tid in streams.items()}

    events: list[dict] = []
    for rank in sorted(table["rank"].unique()):
        pid = int(rank) + pid_offset
        events.append(_meta("process_name", pid, 0, {"name": f"{process_prefix} {int(rank)}"}))
        events.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
        for tid in sorted(set(tids[table["rank"] == rank])):
            events.append(_meta("thread_name", pid, int(tid), {"name": stream_names[tid]}))
            events.append(_meta("thread_sort_index", pid, int(tid), {"sort_index": int(tid)}))

    spans = []
    for row, tid in zip(table.itertuples(index=False), tids, strict=True):
        start_us = (row.start_s + time_offset_s) * 1e6
        spans.append(
            {
                "ph": "X",
                "name": _label(row),
                "cat": str(row.kind),
                "pid": int(row.rank) + pid_offset,
                "tid": int(tid),
                "ts": round(start_us, 3),
                "dur": round((row.end_s - row.start_s) * 1e6, 3),
                "args": {
                    "index": int(row.index),
                    "kind": str(row.kind),
                    "stage": int(row.stage),
                    "microbatch": int(row.microbatch),
                    "stream": row.stream,
                    "bytes": int(row.bytes),
                    "mem_after": int(row.mem_after),
                    "parent": int(row.parent),
                    "layer": int(row.layer),
                },
            }
        )
    # Parents before their children at equal start, so a viewer nests rather than stacks them.
    spans.sort(key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"], e["args"]["parent"] != -1))
    events += spans

    tops = table[table["parent"] == -1].sort_values(["rank", "end_s"], kind="stable")
    for row in tops.itertuples(index=False):
        events.append(
            {
                "ph": "C",
                "name": "memory (bytes)",
                "pid": int(row.rank) + pid_offset,
                "tid": 0,
                "ts": round((row.end_s + time_offset_s) * 1e6, 3),
                "args": {"mem_after": int(row.mem_after)},
            }
        )
    return events


def op_table_events(ops: pd.DataFrame, pid: int = 0, process: str = "profile") -> list[dict]:
    """A per-op table (OP_TABLE) as Chrome-trace events: one thread per (device, tid)."""
    tracks = {key: i for i, key in enumerate(sorted(set(zip(ops["device"], ops["tid"], strict=True))))}
    events = [_meta("process_name", pid, 0, {"name": process})]
    events += [_meta("thread_name", pid, tid, {"name": f"{device} {raw}"}) for (device, raw), tid in tracks.items()]
    for row in ops.itertuples(index=False):
        events.append({
            "ph": "X", "name": row.name, "pid": pid, "tid": tracks[(row.device, row.tid)],
            "ts": float(row.start_us), "dur": max(float(row.dur_us), 0.0),
            "args": {"layer": int(row.layer), "phase": row.phase, "category": getattr(row, "category", "")},
        })
    return events


def write_chrome_trace(events: list[dict], path: Path) -> Path:
    path = Path(path)
    document = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"producer": "paratwin"}}
    data = json.dumps(document, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if path.suffix == ".gz":
        data = gzip.compress(data)
    return atomic_write_bytes(path, data)


def _stream_ids(streams: pd.Series) -> dict[str, int]:
    ids = {name: i for i, name in enumerate(STREAM_ORDER)}
    for name in sorted(set(streams) - set(ids)):
        ids[name] = len(ids)
    return ids


def _track_ids(table: pd.DataFrame, streams: dict[str, int]) -> pd.Series:
    """The stream track (tid) of every row: a child joins its parent's track when it can nest."""
    tops = table[table["parent"] == -1]
    parent_stream = dict(zip(zip(tops["rank"], tops["index"], strict=True), tops["stream"], strict=True))
    effective = []
    for rank, stream, parent in zip(table["rank"], table["stream"], table["parent"], strict=True):
        inherited = parent_stream.get((rank, parent)) if parent != -1 else None
        effective.append(inherited if inherited is not None and stream in ("", inherited) else stream)
    return pd.Series([streams[s] for s in effective], index=table.index, dtype="int64")


def _label(row: object) -> str:
    name = row.name if isinstance(row.name, str) and row.name else ""
    if name:
        return name
    if row.parent != -1:
        return f"{row.kind} layer {row.layer}" if row.layer >= 0 else str(row.kind)
    parts = [str(row.kind)]
    if row.stage >= 0:
        parts.append(f"s{row.stage}")
    if row.microbatch >= 0:
        parts.append(f"mb{row.microbatch}")
    return " ".join(parts)


def _meta(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args}
