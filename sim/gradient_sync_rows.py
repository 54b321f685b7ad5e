"""Rows of an embedding table one iteration touches: what row-sparse gradient sync sends.

An LSTM language model's embedding gradient is non-zero exactly in the rows of the input tokens
of the batch. For uniform synthetic tokens the expected number of distinct rows among T draws
from V is exact: V (1 - (1 - 1/V)^T). For real text it is measured: ``analysis.compression_sparsity``
cuts the same windows the runtime trains on (``exec.workloads.data.token_windows``) and writes
the mean distinct input tokens per number of windows to ``sim/data/row_sparsity.csv``; here it is
interpolated linearly in log(windows) between measured counts, never extrapolated. The union over
a data-parallel group of n replicas is the rows of n times the windows (the replicas' windows are
drawn independently, as the runtime's seeds draw them). Imports neither torch nor simpy.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

from traces.commented_csv import read_rows
from traces.errors import ConfigError

ROWS_FILE = Path(__file__).parent / "data" / "row_sparsity.csv"
MEASURE = "python -m analysis.compression_sparsity --vocab {vocab} --seq {seq}"


@lru_cache(maxsize=1)
def measured() -> dict[tuple[str, int, int], list[tuple[int, float]]]:
    """(data, vocab, seq) -> [(windows, mean distinct rows)] ascending in windows."""
    table: dict[tuple[str, int, int], list[tuple[int, float]]] = {}
    for row in read_rows(ROWS_FILE):
        key = (row["data"], int(row["vocab"]), int(row["seq"]))
        table.setdefault(key, []).append((int(row["windows"]), float(row["mean_rows"])))
    return {k: sorted(v) for k, v in table.items()}


def rows_touched(data: str, vocab: int, seq: int, windows: int) -> float:
    """Mean distinct rows of a ``vocab``-row embedding that ``windows`` inputs of ``seq`` tokens touch."""
    if data == "synthetic":
        tokens = windows * seq
        return vocab * -math.expm1(tokens * math.log1p(-1.0 / vocab)) if vocab > 1 else float(min(1, tokens))
    points = measured().get((data, vocab, seq))
    fix = f"measure it: {MEASURE.format(vocab=vocab, seq=seq)} (adds it to {ROWS_FILE.name})"
    if not points:
        raise ConfigError("workload_options.data", f"no measured row sparsity for {data} with vocab {vocab}, "
                          f"seq {seq}", fix)
    for (w0, r0), (w1, r1) in zip(points, points[1:], strict=False):
        if w0 <= windows <= w1:
            if w0 == w1:
                return r0
            t = (math.log(windows) - math.log(w0)) / (math.log(w1) - math.log(w0))
            return r0 + t * (r1 - r0)
    if len(points) == 1 and points[0][0] == windows:
        return points[0][1]
    raise ConfigError("schedule.micro_batch", f"{windows} windows per iteration is outside the measured "
                      f"{points[0][0]}..{points[-1][0]} for {data} (vocab {vocab}, seq {seq})", fix)
