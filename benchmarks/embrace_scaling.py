"""EmbRace simulated at scale: throughput vs GPU count and vs bandwidth, per method, the share of
communication the 2D schedule hides, and the best speedup beside the paper's 2.41x.

    python benchmarks/embrace_scaling.py [--hidden 256] [--out docs/figures]

Writes embrace-scaling-TAG.{pdf,png,csv}, embrace-bandwidth-TAG.{pdf,png,csv} and
embrace-speedups-TAG.csv, TAG = h<hidden>-mb<micro-batch>x<micro-batches>.
Simulation only (sim.simulate, analytic kernel model, no calibration): see analysis/embrace_figures.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from analysis.embrace_figures import PAPER_SPEEDUP, bandwidth, draw, scaling, speedups

GPUS = (8, 16, 32, 64)
# 10, 25, 50, 100, 200 Gbit/s per adapter (one adapter per node on the a100-64 preset is 25 GB/s HDR).
INTER_BPS = (1.25e9, 3.125e9, 6.25e9, 12.5e9, 25e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256, help="embedding width of gpt-wordlm")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("docs/figures"))
    args = parser.parse_args()
    options = {"hidden": args.hidden}
    batch = {"micro_batch": args.micro_batch, "microbatches": args.microbatches}
    scale = pd.concat([scaling(c, options, GPUS, **batch) for c in ("a100-64", "rtx3090-ethernet")],
                      ignore_index=True)
    band = bandwidth("a100-64", options, 64, INTER_BPS, **batch)
    caption = (f"Simulated (paratwin sim, analytic kernel model, uncalibrated): gpt-wordlm (vocabulary 33,278, "
               f"width {args.hidden}, 2 blocks, seq 64), data parallel, {args.microbatches} micro-batch(es) of "
               f"{args.micro_batch} per GPU, fp32; all-to-all "
               "volumes from the unique rows of real WikiText-2 batches. a100-64: 8 x A100 per node, NVLink, "
               "IB HDR; rtx3090-ethernet: 2 x RTX 3090 per node, PCIe, 10 GbE (examples/clusters). Bandwidth "
               "sweep: a100-64 at 64 GPUs, inter-node link bandwidth overridden.")
    tag = f"h{args.hidden}-mb{args.micro_batch}x{args.microbatches}"
    paths = draw(scale, band, args.out, caption, tag)
    table = pd.concat([speedups(scale, ["cluster", "gpus"]).assign(sweep="gpus"),
                       speedups(band, ["cluster", "inter_node_GBps"]).assign(sweep="bandwidth")], ignore_index=True)
    table.to_csv(args.out / f"embrace-speedups-{tag}.csv", index=False)
    pd.set_option("display.width", 200)
    print(scale.round(3).to_string(index=False))
    print(band.round(3).to_string(index=False))
    print(table.round(3).to_string(index=False))
    print(f"EmbRace-2D over dense all-reduce: {table['over_allreduce'].min():.2f}x to "
          f"{table['over_allreduce'].max():.2f}x; over the parameter server: {table['over_ps'].min():.2f}x to "
          f"{table['over_ps'].max():.2f}x; over the best baseline (allreduce, fp16 or ps): "
          f"{table['over_best_baseline'].min():.2f}x to {table['over_best_baseline'].max():.2f}x; "
          f"with fp16 buckets: up to {table['2d_fp16_over_allreduce'].max():.2f}x over all-reduce, "
          f"{table['2d_fp16_over_best_baseline'].max():.2f}x over the best (paper: up to {PAPER_SPEEDUP}x)")
    for kind, files in paths.items():
        print(kind, files["png"])


if __name__ == "__main__":
    main()
