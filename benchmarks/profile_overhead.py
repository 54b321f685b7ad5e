"""How long the per-layer profiler takes, as a multiple of one plain training step.

    python benchmarks/profile_overhead.py [--workload gpt2-small] [--micro-batch 1] [--seq 64]

A training step is forward + backward + Adam over the whole model, built once; the profiler is
one full ``profile_workload`` call (every layer, its defaults: at least 2 warm-up rounds and
more until rounds agree, repeats 10, re-measurements of unsteady layers and of outliers among
identical siblings, op table on). Both are medians over repeats, with spread = (max - min) /
median. It also prints how many warm-up rounds and attempts the profiler needed and what the
re-measurements cost, and the sum of the profiled per-layer forward and backward times beside
the step's own forward + backward, a first check that per-layer profiles add up to the model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from exec.profiler import profile_workload  # noqa: E402
from exec.workloads import get_workload, run_layers  # noqa: E402


def median_spread(values: list[float]) -> tuple[float, float]:
    median = statistics.median(values)
    return median, (max(values) - min(values)) / median if median else 0.0


def time_training_steps(
    name: str, micro_batch: int, seq: int | None, steps: int
) -> tuple[list[float], list[float]]:
    """Per step: (fwd+bwd+Adam seconds, fwd+bwd seconds), after one unrecorded warm-up step."""
    wl = get_workload(name, **({} if seq is None else {"seq": seq}))
    model = wl.build_layers()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    batch = wl.make_batch(micro_batch)
    totals, compute = [], []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        wl.loss(run_layers(model, batch.inputs), batch.targets).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if step:
            totals.append(t2 - t0)
            compute.append(t1 - t0)
    return totals, compute


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="gpt2-small")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="profiler runs to take the median of")
    parser.add_argument("--steps", type=int, default=5, help="training steps to take the median of")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print(f"profile_overhead: {args.workload}, micro-batch {args.micro_batch}, seq {args.seq}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    totals, compute = time_training_steps(args.workload, args.micro_batch, args.seq, args.steps)
    step, step_spread = median_spread(totals)
    step_compute, _ = median_spread(compute)
    print(f"training step (fwd+bwd+Adam): median {step:.3f} s, spread {step_spread:.0%} "
          f"over {len(totals)} steps (fwd+bwd alone {step_compute:.3f} s)")

    walls, layer_sums, warmups, attempts, retry_s, unsteady = [], [], [], [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        bundle = profile_workload(args.workload, args.micro_batch, seq=args.seq)
        walls.append(time.perf_counter() - t0)
        layers = bundle.layers
        layer_sums.append(float((layers["fwd_s"] + layers["bwd_s"]).sum()))
        warmups += list(layers["warmup_rounds"])
        attempts += list(layers["attempts"])
        retry_s.append(float(bundle.meta["settings"]["retry_s"]))
        unsteady.append(int(layers["unsteady"].sum()))
    wall, wall_spread = median_spread(walls)
    print(f"profiler (warm-up >= 2 until stable, repeats 10, op table): median {wall:.1f} s, "
          f"spread {wall_spread:.0%} over {len(walls)} runs")
    print(f"steadiness: warm-up rounds per layer median {statistics.median(warmups):g} (max {max(warmups)}), "
          f"attempts per layer median {statistics.median(attempts):g} (max {max(attempts)}), re-measuring "
          f"{statistics.median(retry_s):.1f} s of each run (median), unsteady layers per run {unsteady}")
    print(f"ratio profiler / training step: {wall / step:.0f}x")
    print(f"sum of profiled per-layer fwd+bwd: {statistics.median(layer_sums):.3f} s "
          f"(the step's own fwd+bwd: {step_compute:.3f} s)")


if __name__ == "__main__":
    main()
