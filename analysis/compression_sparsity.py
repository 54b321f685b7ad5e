"""Measure how many embedding rows one iteration's real batches touch: sim/data/row_sparsity.csv.

For a vocabulary and a window length, cut ``windows`` seeded WikiText-2 windows exactly as the
runtime's LSTM workload does (``exec.workloads.data.token_windows``, the packaged valid split
unless $PARATWIN_DATA points elsewhere), count the distinct input tokens (the embedding rows the
backward writes), and average over seeds. The simulator interpolates these counts
(``sim.gradient_sync_rows``).

    python -m analysis.compression_sparsity --vocab 1000 --seq 16 --vocab 33278 --seq 35
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from exec.workloads.data import WIKITEXT_DEFAULT_SPLIT, token_windows
from sim.gradient_sync_rows import ROWS_FILE
from traces.commented_csv import read_rows, write_rows

WINDOWS = tuple(2**i for i in range(0, 12))  # 1 .. 2048 windows per iteration
HEADER = ("data", "split", "vocab", "seq", "windows", "mean_rows", "stdev_rows", "samples")


def measure(vocab: int, seq: int, windows: int, samples: int) -> tuple[float, float]:
    counts = []
    for seed in range(samples):
        inputs = token_windows("wikitext-2", windows, seq + 1, vocab, seed)[:, :-1]
        counts.append(float(inputs.unique().numel()))
    return statistics.fmean(counts), statistics.stdev(counts) if samples > 1 else 0.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, action="append", required=True)
    parser.add_argument("--seq", type=int, action="append", required=True)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROWS_FILE)
    args = parser.parse_args(argv)
    if len(args.vocab) != len(args.seq):
        parser.error("give --vocab and --seq in pairs")
    remeasured = set(zip(args.vocab, args.seq, strict=True))
    rows: list[dict] = [r for r in read_rows(args.out) if (int(r["vocab"]), int(r["seq"])) not in remeasured]
    for vocab, seq in zip(args.vocab, args.seq, strict=True):
        for windows in WINDOWS:
            mean, stdev = measure(vocab, seq, windows, args.samples)
            rows.append({"data": "wikitext-2", "split": WIKITEXT_DEFAULT_SPLIT, "vocab": vocab, "seq": seq,
                         "windows": windows, "mean_rows": f"{mean:.2f}", "stdev_rows": f"{stdev:.2f}",
                         "samples": args.samples})
            print(f"vocab {vocab} seq {seq} windows {windows}: {mean:.1f} rows ({100 * mean / vocab:.2f}%)")
    write_rows(args.out, ["Distinct input tokens (embedding rows touched) of `windows` seeded WikiText-2 windows of",
                          "`seq` tokens, mean and stdev over `samples` seeds;",
                          "written by analysis/compression_sparsity.py"], HEADER, rows)


if __name__ == "__main__":
    main()
