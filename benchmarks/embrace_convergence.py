"""EmbRace against dense data parallelism over a longer run: losses step by step and the largest
parameter difference at the end, on 2 gloo ranks.

    python benchmarks/embrace_convergence.py [--steps 50] [--workload lstm-tiny] [--out runs/embrace-convergence]
    python benchmarks/embrace_convergence.py --workload gpt-wordlm --option vocab=3000 --option hidden=32 \
        --option heads=2 --option seq=16 --wikitext --shard columns

Writes ``losses.csv`` (step, dense, embrace) and prints the largest loss and parameter differences
(the sharded table reassembled from both ranks' shards).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch

from exec.embedding import assemble
from exec.launcher import run_plan
from sim.plan import Plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--workload", default="lstm-tiny")
    parser.add_argument("--shard", default="rows")
    parser.add_argument("--schedule", default="2d")
    parser.add_argument("--option", action="append", default=[], help="workload option KEY=INT (vocab=3000)")
    parser.add_argument("--wikitext", action="store_true", help="real WikiText-2 batches (default: synthetic)")
    parser.add_argument("--out", type=Path, default=Path("runs/embrace-convergence"))
    args = parser.parse_args()
    options = {k: int(v) for k, v in (o.split("=", 1) for o in args.option)}
    extra = {}
    if args.wikitext:
        from exec.embedding_rows import main as measure_rows

        args.out.mkdir(parents=True, exist_ok=True)
        measure_rows(["--workload", args.workload, "--micro-batch", "4", "--batches", "50",
                      "--out", str(args.out / "rows.json"), *[f"--option={o}" for o in args.option]])
        options["data"] = "wikitext-2"
        extra = {"row_stats": str(args.out / "rows.json")}
    base = {"workload": args.workload, "workload_options": options, "cluster": {"preset": "local-cpu-2"},
            "parallelism": {"dp": 2}, "schedule": {"micro_batch": 4, "microbatches": 2}}
    losses, params = {}, {}
    sharded = {"method": "embrace", "shard": args.shard, "schedule": args.schedule, **extra}
    for name, embedding in (("dense", {"method": "dense"}), ("embrace", sharded)):
        out = args.out / name
        result = run_plan(Plan.from_dict({**base, "name": f"conv-{name}", "embedding": embedding}),
                          iterations=args.steps - 1, warmup=1, out_dir=out, save_params=True, force=True)
        losses[name] = result.losses
        params[name] = [torch.load(out / "params" / f"rank{r}.pt") for r in (0, 1)]
    table = pd.DataFrame({"step": range(1, args.steps + 1), **losses})
    table.to_csv(args.out / "losses.csv", index=False)
    key = next(k for k in params["dense"][0] if k.startswith("0.") and "pos" not in k)
    worst = 0.0
    for name, theirs in params["dense"][0].items():
        ours = assemble([params["embrace"][0][name], params["embrace"][1][name]], args.shard) if name == key \
            else params["embrace"][0][name]
        worst = max(worst, float((ours - theirs).abs().max()))
    print(f"{args.workload}, {args.steps} Adam steps, shard {args.shard}, schedule {args.schedule}: loss "
          f"{table['dense'].iloc[0]:.4f} -> {table['dense'].iloc[-1]:.4f}; largest loss difference "
          f"{(table['dense'] - table['embrace']).abs().max():.3g}; largest parameter difference {worst:.3g}")


if __name__ == "__main__":
    main()
