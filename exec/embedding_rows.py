"""Measure which embedding rows real batches touch: the input of EmbRace's all-to-all volumes.

    python -m exec.embedding_rows --workload lstm-lm --data wikitext-2 --micro-batch 8 --out rows.json

draws ``--batches`` micro-batches with the workload's own ``make_batch`` (the very batches the
runtime trains on, ``exec.contract.batch_seed``) and records, per micro-batch size, the mean and
spread of the unique ids of one micro-batch (what a lookup sends and receives), and for each dp the
largest share of those ids owned by one rank under row sharding (id mod dp): the skew an all-to-all
waits for. A plan points at the file with ``embedding: {method: embrace, row_stats: rows.json}``;
entries for other sizes already in the file are kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from exec.contract import batch_seed
from exec.workloads import get_workload
from sim.embedding import embedding_tables


def measure(workload: str, options: dict, micro_batch: int, batches: int, dps: list[int]) -> dict:
    model = get_workload(workload, **options)
    table = embedding_tables(workload, options)[0]
    unique, shares = [], {dp: [] for dp in dps}
    for index in range(batches):
        ids = model.make_batch(micro_batch, seed=batch_seed(index, 0, 0, 1, 1)).inputs
        uniq = torch.unique(ids)
        unique.append(uniq.numel())
        for dp in dps:
            per_owner = torch.bincount(uniq % dp, minlength=dp)
            shares[dp].append(float(per_owner.max()) / uniq.numel())
    return {"workload": workload, "data": options.get("data", "synthetic"), "vocab": table.rows,
            "micro_batch": micro_batch, "tokens": int(ids.numel()), "batches": batches,
            "unique_rows_mean": statistics.fmean(unique), "unique_rows_std": statistics.pstdev(unique),
            "owner_share_max_mean": {str(dp): statistics.fmean(v) for dp, v in shares.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--data", default="wikitext-2")
    parser.add_argument("--option", action="append", default=[], help="workload option KEY=INT (e.g. vocab=2000)")
    parser.add_argument("--micro-batch", type=int, action="append", required=True)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--dp", type=int, action="append", default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    options: dict = {"data": args.data, **{k: int(v) for k, v in (o.split("=", 1) for o in args.option)}}
    old = json.loads(args.out.read_text())["entries"] if args.out.is_file() else []
    entries = [measure(args.workload, options, mb, args.batches, args.dp or [2, 8, 64]) for mb in args.micro_batch]
    fresh = {(e["tokens"], e["vocab"], e["data"]) for e in entries}
    kept = [e for e in old if (e.get("tokens"), e.get("vocab"), e.get("data")) not in fresh]
    args.out.write_text(json.dumps({"entries": kept + entries}, indent=1) + "\n")
    for e in entries:
        print(f"{e['workload']} {e['data']} micro-batch {e['micro_batch']} ({e['tokens']} tokens): "
              f"{e['unique_rows_mean']:.1f} unique rows (std {e['unique_rows_std']:.1f}) of {e['vocab']}")


if __name__ == "__main__":
    main()
