"""cProfile of one HAP-protocol fit per method: where an epoch's time goes.

    nice -n 5 python benchmarks/hap_fit_profile.py [--dataset PROTEINS] [--methods hap gcn-mean] \\
        [--epochs 2] [--top 14]

Seed 0, fold 0 of the protocol's split, lr 1e-3, ``--epochs`` epochs, 1 thread (``train_model``, so
every epoch's validation pass is in it). Prints per method the wall seconds under the profiler and
the ``--top`` functions by own time. cProfile weighs Python-level work (batching, module calls)
more than torch's kernels; check a finding with ``benchmarks/hap_fit_speed.py`` (docs/hap.md, "Speed").
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from dataclasses import replace

import torch

from analysis.hap_protocol import VARIANTS, candidates, clusters_for, splits
from exec.hap.baselines import METHODS
from exec.hap.data import graph_labels, load_tu
from exec.hap.train import TrainConfig, train_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="PROTEINS")
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dataset = load_tu(args.dataset)
    _, train, val, _ = next(splits(graph_labels(dataset).numpy(), 10, 0))
    base = replace(TrainConfig(), epochs=args.epochs, clusters=clusters_for(dataset))
    for method in args.methods:
        config = candidates(VARIANTS[method], base, (1e-3,))[0]
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        train_model(method, dataset, torch.as_tensor(train), torch.as_tensor(val), config, 0)
        profile.disable()
        print(f"===== {method}: {time.perf_counter() - start:.2f} s under the profiler")
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
