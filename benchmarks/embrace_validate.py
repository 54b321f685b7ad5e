"""EmbRace predicted against measured on 2 gloo ranks over loopback, per embedding method.

    python benchmarks/embrace_validate.py [--iterations 20] [--out runs/embrace-validate]

For each method (dense all-reduce, dense fp16, the parameter server, EmbRace sequential, EmbRace 2D) one
``paratwin validate``: profile the workload here, benchmark all-reduce, all-to-all and send/recv on
2 gloo ranks (alpha-beta fits the simulator then uses), simulate, run, compare. The workload is
``gpt-wordlm`` on real WikiText-2 (vocabulary 33,278) made small enough for a CPU (width 64, seq
32, micro-batch 4), so that the table's gradient (8.5 MB) is a visible part of an iteration.
Prints the per-method table (predicted, measured median and spread, error), the ALLTOALL rows'
predicted and measured medians, and whether the predicted ranking of the methods is the measured one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from analysis.validation.run import validate_plan
from sim.plan import Plan

OPTIONS = {"data": "wikitext-2", "hidden": 64, "heads": 2, "seq": 32}
MICRO_BATCH = 4
METHODS = {
    "allreduce": {"embedding": {"method": "dense"}},
    "fp16": {"gradient_sync": {"method": "fp16"}, "embedding": {"method": "dense"}},
    "ps": {"embedding": {"method": "ps"}},  # one micro-batch: the pull's rows are a micro-batch's
    "embrace-seq": {"embedding": {"method": "embrace", "schedule": "sequential"}},
    "embrace-2d": {"embedding": {"method": "embrace", "schedule": "2d"}},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/embrace-validate"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows_file = args.out / "rows.json"
    if not rows_file.exists():
        from exec.embedding_rows import main as measure_rows

        measure_rows(["--workload", "gpt-wordlm", "--micro-batch", str(MICRO_BATCH), "--batches", "200",
                      "--out", str(rows_file), *[f"--option={k}={v}" for k, v in OPTIONS.items() if k != "data"]])
    results = []
    profile = None
    for name, fields in METHODS.items():
        embedding = dict(fields["embedding"])
        if embedding["method"] != "dense":
            embedding["row_stats"] = str(rows_file.resolve())
        plan = Plan.from_dict({"name": f"embrace-val-{name}", "workload": "gpt-wordlm", "workload_options": OPTIONS,
                               "cluster": {"preset": "local-cpu-2"}, "parallelism": {"dp": 2},
                               "schedule": {"micro_batch": MICRO_BATCH, "microbatches": 1},
                               **fields, "embedding": embedding})
        report = validate_plan(plan, profile=profile, iterations=args.iterations, warmup=args.warmup,
                               out_dir=args.out / name)
        profile = profile or report.profile  # one profile for every method (the same workload)
        kinds = report.per_kind.set_index("kind")
        a2a = kinds.loc["ALLTOALL"] if "ALLTOALL" in kinds.index else None
        results.append({
            "method": name, "predicted_ms": report.predicted_s * 1e3, "measured_ms": report.measured_s * 1e3,
            "p10_ms": report.measured["p10_s"] * 1e3, "p90_ms": report.measured["p90_s"] * 1e3,
            "error": report.error,
            "alltoall_predicted_ms": None if a2a is None else float(a2a["predicted_median_s"]) * 1e3,
            "alltoall_measured_ms": None if a2a is None else float(a2a["measured_median_s"]) * 1e3,
        })
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    for r in results:
        a2a = "" if r["alltoall_predicted_ms"] is None else \
            f"  all-to-all median {r['alltoall_predicted_ms']:.3f} / {r['alltoall_measured_ms']:.3f} ms"
        print(f"{r['method']:<12} predicted {r['predicted_ms']:8.2f} ms  measured {r['measured_ms']:8.2f} ms "
              f"(p10-p90 {r['p10_ms']:.2f}-{r['p90_ms']:.2f})  error {r['error']:+.1%}{a2a}")
    predicted = [r["method"] for r in sorted(results, key=lambda r: r["predicted_ms"])]
    measured = [r["method"] for r in sorted(results, key=lambda r: r["measured_ms"])]
    print(f"ranking predicted {predicted}; measured {measured}; {'same' if predicted == measured else 'differs'}")


if __name__ == "__main__":
    main()
