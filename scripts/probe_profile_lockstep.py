"""The co-located profile with and without lockstep, against the run, side by side (issue 12).

    python scripts/probe_profile_lockstep.py examples/validation/embedding/emb-dense-dp2.yaml \\
        [--rounds 2] [--iterations 10]

Per round it profiles the plan's workload in as many processes as the plan has ranks, once each
way in alternating order (``analysis.validation.profiling.profile_plan_workload`` with
``lockstep=False``: started together, then each on its own, as before; ``lockstep=True``: every
timed round in all processes at once), then runs the plan (``exec.launcher.run_plan``). It prints
the profile's forward, backward (sums over layers) and optimizer step (per-byte cost x parameter
bytes) per micro-batch, the run's medians of its FWD, BWD and OPTIMIZER_STEP instructions, and the
run over each profile. A timing probe: run it on a quiet machine; the ratios it prints are its
result, side by side within one invocation.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path


def profile_parts(bundle: object) -> dict[str, float]:
    layers = bundle.layers
    per_byte = float(bundle.meta["settings"]["optimizer_s_per_param_byte"])
    return {"FWD": float(layers["fwd_s"].sum()), "BWD": float(layers["bwd_s"].sum()),
            "OPTIMIZER_STEP": per_byte * float(layers["param_bytes"].sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5, help="profile repeats (the suite uses 5)")
    args = parser.parse_args()
    from analysis.validation.profiling import profile_plan_workload
    from exec.launcher import run_plan
    from sim.plan import Plan

    plan = Plan.load(args.plan)
    kinds = ("FWD", "BWD", "OPTIMIZER_STEP")
    seen: dict[str, dict[str, list[float]]] = {m: {k: [] for k in kinds} for m in ("alone", "lockstep", "run")}
    for r in range(args.rounds):
        for lockstep in ((False, True) if r % 2 == 0 else (True, False)):
            parts = profile_parts(profile_plan_workload(plan, plan.world_size, repeats=args.repeats,
                                                        lockstep=lockstep))
            for k in kinds:
                seen["lockstep" if lockstep else "alone"][k].append(parts[k])
        with tempfile.TemporaryDirectory(prefix="paratwin-probe-run-") as tmp:
            result = run_plan(plan, iterations=args.iterations, warmup=2, out_dir=Path(tmp) / "run")
        table = result.table[result.table["parent"] == -1]
        for k in kinds:
            rows = table[table["kind"] == k]
            seen["run"][k].append(float((rows["end_s"] - rows["start_s"]).median()))
    medians = {m: {k: statistics.median(v) for k, v in parts.items()} for m, parts in seen.items()}
    print(f"{plan.name}: {args.rounds} rounds; ms per instruction (profile: per micro-batch, sums over layers)")
    print("| source | " + " | ".join(kinds) + " |\n| --- |" + " ---: |" * len(kinds))
    for m in ("alone", "lockstep", "run"):
        print(f"| {m} | " + " | ".join(f"{medians[m][k] * 1e3:.2f}" for k in kinds) + " |")
    for m in ("alone", "lockstep"):
        print(f"| run / {m} | " + " | ".join(f"{medians['run'][k] / medians[m][k]:.3f}" for k in kinds) + " |")


if __name__ == "__main__":
    main()
