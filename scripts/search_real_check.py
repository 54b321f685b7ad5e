"""Search the validation workload on the local 2-rank CPU cluster, then run the search's top 3 and a
naive baseline for real (gloo) and compare the measured order with the predicted one.

    .venv/bin/python scripts/search_real_check.py [--out runs/search-real-check] [--iterations 10]

Steps: profile the validation workload (examples/validation/gpt-val-*.yaml: gpt-tiny widened to
hidden 256, 4 heads, 4 layers, seq 128) at its micro-batch of 4 as ``paratwin validate`` does (both
rank processes at once, plus gloo communication fits for the pp2, dp2 and tp2 plans); search on
``local-cpu-2`` with that profile (micro-batch 4 only, the profiled one; global batch 16 as in the
validation plans); run the three best simulated plans and the baseline (pp 2, GPipe, 4 x 4
micro-batches, uniform, no recompute) with ``exec.launcher.run_plan``. Two plans whose measured
medians are within the larger of their p10-p90 spreads count as a tie: the machine is shared and
noisy, so an order inside the noise is not an order.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "search-real-check")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    validation = yaml.safe_load((ROOT / "examples/validation/gpt-val-pp2-1f1b.yaml").read_text())
    workload, options = validation["workload"], validation["workload_options"]
    micro_batch = validation["schedule"]["micro_batch"]
    global_batch = micro_batch * validation["schedule"]["microbatches"]

    from analysis.validation.profiling import profile_for_validation
    from sim.plan import Plan

    plans = [Plan.load(ROOT / f"examples/validation/gpt-val-{name}.yaml") for name in ("pp2-1f1b", "dp2", "tp2")]
    profile = out / "profile"
    if not (profile / "layers.parquet").exists():
        # as paratwin validate profiles: both ranks' processes at once, then the gloo fits the plans need
        profile = profile_for_validation(plans[0], out, comm_plans=plans)

    from exec.launcher import run_plan
    from sim.search import SearchSpace, search
    from sim.simulate import simulate

    space = SearchSpace(workload, "local-cpu-2", global_batch=global_batch, dtype="fp32", workload_options=options,
                        profile=str(profile), micro_batch_sizes=(micro_batch,), tp_overlaps=(0,))
    result = search(space, top_k=20, sample=20)
    a = result.agreement
    print(f"searched {result.considered} plans, {len(result.ranked)} estimated, {len(result.simulated)} simulated; "
          f"Spearman estimate vs engine {a.spearman_sample:.3f} on {a.sample_size}" if a else "")
    picks = [(f"search #{i + 1}", result.plan_of(r.candidate, name=f"search-{i + 1}"))
             for i, r in enumerate(result.simulated[:3])]
    baseline = Plan.from_dict({**result.base, "name": "naive-baseline", "parallelism": {"pp": 2},
                               "schedule": {"name": "gpipe", "micro_batch": micro_batch,
                                            "microbatches": global_batch // micro_batch}})
    picks.append(("naive baseline", baseline))

    rows = []
    for label, plan in picks:
        predicted = simulate(plan).iteration_s
        run = run_plan(plan, iterations=args.iterations, warmup=args.warmup, out_dir=out / plan.name, force=True)
        times = sorted(run.iteration_times)
        median = times[len(times) // 2]
        p10, p90 = times[int(0.1 * (len(times) - 1))], times[int(0.9 * (len(times) - 1))]
        rows.append((label, plan, predicted, median, p10, p90))
        print(f"{label}: predicted {predicted * 1e3:.1f} ms, measured median {median * 1e3:.1f} ms "
              f"(p10-p90 {p10 * 1e3:.1f}-{p90 * 1e3:.1f})")

    print("\n| plan | configuration | predicted (ms) | measured median (ms) | p10-p90 (ms) | predicted rank | "
          "measured rank |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    by_pred = sorted(rows, key=lambda r: r[2])
    by_meas = sorted(rows, key=lambda r: r[3])
    for label, plan, predicted, median, p10, p90 in rows:
        p = plan.parallelism
        config = (f"dp{p.dp} tp{p.tp} pp{p.pp} {plan.schedule.name}"
                  f"{' x' + str(p.chunks) if p.chunks > 1 else ''} {plan.memory.policy} "
                  f"{plan.gradient_sync.method}")
        print(f"| {label} | {config} | {predicted * 1e3:.1f} | {median * 1e3:.1f} | {p10 * 1e3:.1f}-{p90 * 1e3:.1f} | "
              f"{[r[0] for r in by_pred].index(label) + 1} | {[r[0] for r in by_meas].index(label) + 1} |")
    print()
    for i in range(len(by_pred) - 1):
        a_, b_ = by_pred[i], by_pred[i + 1]
        spread = max(a_[5] - a_[4], b_[5] - b_[4])
        gap = b_[3] - a_[3]
        verdict = ("tie (inside the noise)" if abs(gap) <= spread
                   else "agrees" if gap > 0 else "DISAGREES")
        print(f"predicted {a_[0]} < {b_[0]}: measured difference {gap * 1e3:+.1f} ms, spread {spread * 1e3:.1f} ms: "
              f"{verdict}")


if __name__ == "__main__":
    main()
