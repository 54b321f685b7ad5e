"""Every gradient-sync method trains an embedding-heavy language model on WikiText-2 on 2 real
gloo ranks: loss per step against dense all-reduce, as a CSV and a curve figure.

    PARATWIN_DATA=/work/shared/datasets python -m benchmarks.compression_convergence --steps 200 \
        --out runs/compression-convergence
    python -m benchmarks.compression_convergence --workload gpt-wordlm --steps 100 \
        --out runs/compression-convergence-gpt

Workloads (``--workload``, ``WORKLOADS``): ``lstm-tiny`` with a sparse embedding (the default), and
``gpt-wordlm`` (a 2-block Transformer LM on WikiText-2's 33,278-word vocabulary, whose token table
and head are 91% of its parameters) with a sparse token table.

The runtime reads the packaged valid split (``exec.workloads.data``); windows are drawn at seeded
offsets, a fresh batch every step. Hardware: the CPU this runs on, 2 processes, 1 thread each.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
from pathlib import Path

from exec.launcher import run_plan
from sim.gradient_sync import GRADIENT_SYNC
from sim.plan import Plan

BASE = {"workload": "lstm-tiny", "workload_options": {"sparse": True, "data": "wikitext-2"},
        "cluster": {"preset": "local-cpu-2"}, "parallelism": {"dp": 2},
        "schedule": {"micro_batch": 8, "microbatches": 1}}
# Every workload the benchmark trains, as a plan without its gradient sync, and the figure's title.
WORKLOADS: dict[str, tuple[dict, str]] = {
    "lstm-tiny": (BASE, "lstm-tiny (sparse embedding), WikiText-2 valid, 2 gloo ranks, Adam lr 1e-3"),
    # micro-batch 4: ~1 s per step here; row counts measured for seq 64 (sim/data/row_sparsity.csv)
    "gpt-wordlm": ({**BASE, "workload": "gpt-wordlm", "schedule": {"micro_batch": 4, "microbatches": 1}},
                   "gpt-wordlm (sparse token table), WikiText-2 valid, 2 gloo ranks, Adam lr 1e-3"),
}


def method_plan(method: str, base: dict = BASE, **settings: object) -> Plan:
    return Plan.from_dict({**base, "name": f"{base['workload']}-{method}",
                           "gradient_sync": {"method": method, **settings}})


def losses(method: str, steps: int, out: Path | None = None, base: dict = BASE) -> list[float]:
    out = out or Path(tempfile.mkdtemp(prefix=f"conv-{method}-"))
    return run_plan(method_plan(method, base), iterations=steps - 1, warmup=1, out_dir=out, force=True).losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--methods", nargs="*", default=list(GRADIENT_SYNC))
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="lstm-tiny")
    parser.add_argument("--out", type=Path, default=Path("runs/compression-convergence"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    base, title = WORKLOADS[args.workload]
    curves = {}
    for method in args.methods:
        curves[method] = losses(method, args.steps, args.out / method, base)
        tail = statistics.fmean(curves[method][-20:])
        print(f"{method:>10}: first {curves[method][0]:.3f}, mean of the last 20 steps {tail:.3f}", flush=True)
    with (args.out / "losses.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", *curves])
        writer.writerows([i, *(f"{curves[m][i]:.5f}" for m in curves)] for i in range(args.steps))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    window = 10
    for method, curve in curves.items():
        smooth = [statistics.fmean(curve[max(0, i - window + 1): i + 1]) for i in range(len(curve))]
        ax.plot(smooth, label=method, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss ({window}-step mean)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    for ext in ("pdf", "png"):
        fig.savefig(args.out / f"convergence.{ext}")


if __name__ == "__main__":
    main()
