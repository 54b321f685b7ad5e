"""One-GPU check of the cost model (issue 9): profile real GPT models on the CUDA GPU at hand, predict
single-GPU plans from the analytic model (no measurement) and from the profile, run them for real,
and write the comparison table.

    python scripts/gpu_check.py --out docs/results/gpu_check        # on a CUDA machine, < 8 minutes
    python scripts/gpu_check.py --smoke --out /tmp/gpu-check         # the same steps on this CPU (tests)

Cases (GPU): GPT-2 small (124M) and a 1.3B GPT (GPT-3 XL's shape: 24 layers, hidden 2,048, 16 heads;
Brown et al. 2020, Table 2.1), each at sequence 1,024 and 2,048, bf16, 4 micro-batches of 4 through a
one-stage 1F1B plan on one GPU of the catalog's kind (``sim.hardware.catalog_device_for_gpu`` names it
from the GPU, ``--device-name`` where the catalog does not know the name; the analytic model prices it
from its datasheet, sim/data/hardware.yaml). The smoke run uses gpt-tiny at two sequence lengths on one CPU
rank, where the analytic column is empty (the analytic model does not price CPUs). Writes
``gpu_check.csv`` and ``gpu_check.md`` under ``--out`` (and each validation's folder), then times
unfused attention's memory-bound kernels against the model's rate (``scripts/kernel_rates.py``:
``kernel_rates.csv`` / ``.md``).
CI never runs the GPU cases.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd

GPU_CASES = [  # (label, workload, options, micro-batch)
    ("gpt2-small seq 1024", "gpt2-small", {"seq": 1024}, 4),
    ("gpt2-small seq 2048", "gpt2-small", {"seq": 2048}, 4),
    ("gpt-1.3b seq 1024", "gpt2-small", {"hidden": 2048, "heads": 16, "num_layers": 24, "seq": 1024}, 4),
    ("gpt-1.3b seq 2048", "gpt2-small", {"hidden": 2048, "heads": 16, "num_layers": 24, "seq": 2048}, 4),
]
SMOKE_CASES = [("gpt-tiny seq 32", "gpt-tiny", {"seq": 32}, 2), ("gpt-tiny seq 64", "gpt-tiny", {"seq": 64}, 2)]


def plan_for(label: str, workload: str, options: dict, micro_batch: int, device: str | None) -> dict:
    """The case's plan on one GPU of the catalog's ``device``; None: one CPU rank (the smoke run)."""
    smoke = device is None
    return {"name": "gpu-check-" + label.replace(" ", "-"), "workload": workload, "workload_options": options,
            "cluster": ({"preset": "local-cpu-2", "devices_per_node": 1} if smoke
                        else {"nodes": 1, "devices_per_node": 1, "device": device}),
            "dtype": "fp32" if smoke else "bf16",
            "schedule": {"name": "1f1b", "micro_batch": micro_batch, "microbatches": 4}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_check"))
    parser.add_argument("--smoke", action="store_true", help="gpt-tiny on the CPU: the same steps, for tests")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--device-name", default=None, help="the hardware catalog's device (default: from the GPU)")
    args = parser.parse_args(argv)

    from analysis.validation.run import validate_plan
    from sim.hardware import gpu_at_hand
    from sim.plan import Plan
    from sim.simulate import simulate
    from traces.errors import ConfigError

    catalog_device = None
    if not args.smoke:
        try:
            cuda_name, catalog_device = gpu_at_hand(args.device_name)
        except ConfigError as exc:
            print(f"gpu_check: {exc}", file=sys.stderr)
            return 2
    device = "cpu" if args.smoke else f"{cuda_name} (priced as {catalog_device})"
    rows = []
    for label, workload, options, micro_batch in (SMOKE_CASES if args.smoke else GPU_CASES):
        started = time.perf_counter()
        plan = Plan.from_dict(plan_for(label, workload, options, micro_batch, catalog_device))
        # The plan's cluster with no profile: what a what-if gives (the analytic model prices GPUs only).
        analytic = float("nan") if args.smoke else simulate(plan).iteration_s
        report = validate_plan(plan, iterations=args.iterations, warmup=3, commbench=False,
                               out_dir=args.out / plan.name, profile_repeats=5)
        rows.append({"case": label, "device": device, "dtype": plan.dtype, "micro_batch": micro_batch,
                     "analytic_s": analytic, "profiled_s": report.predicted_s, "measured_s": report.measured_s,
                     "analytic_error": analytic / report.measured_s - 1, "profiled_error": report.error,
                     "spread": report.measured["spread"], "wall_s": time.perf_counter() - started})
        print(f"{label}: analytic {analytic * 1e3:.1f} ms, from profile {report.predicted_s * 1e3:.1f} ms, "
              f"measured {report.measured_s * 1e3:.1f} ms", flush=True)
    table = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "gpu_check.csv", index=False)
    lines = [f"# One-device check on {device} ({time.strftime('%Y-%m-%d')})", "",
             "| case | analytic (ms) | from profile (ms) | measured (ms) | analytic error | profile error | "
             "spread |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['case']} | {r['analytic_s'] * 1e3:.1f} | {r['profiled_s'] * 1e3:.1f} | "
              f"{r['measured_s'] * 1e3:.1f} | {r['analytic_error']:+.1%} | {r['profiled_error']:+.1%} | "
              f"{r['spread']:.0%} |" for r in rows]
    (args.out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    # The memory-bound attention kernels against the model's rate (docs/accuracy.md section 11).
    import kernel_rates  # scripts/, beside this file

    kernel_rates.write(kernel_rates.measure(catalog_device, repeats=20), args.out, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
