"""``paratwin demo``: the main job end to end on this machine, in about a minute.

1. Profile a small GPT on the local device and write its trace bundle (per-layer and per-op).
2. Summarise the bundle and export its per-op timeline as a Chrome trace.
3. Simulate a 2-rank pipeline plan on this machine from the measured costs.
4. Ask a what-if of the analytic model: a GPT-style paper-scale plan on A100 nodes.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

WHAT_IF_PLAN = Path(__file__).resolve().parent.parent / "examples" / "plans" / "gpt-8.3b-a100-64-merak.yaml"


def run_demo(out: Path, console: Console) -> None:
    from analysis.report import print_layers, print_sim
    from exec.profiler import profile_workload
    from sim.plan import Plan
    from sim.simulate import simulate
    from traces.bundle import read_bundle, write_bundle

    out.mkdir(parents=True, exist_ok=True)
    workload = "gpt-tiny"
    console.rule(f"1. profile {workload} on this machine")
    # On the CPU whatever else the machine has: step 2 simulates a plan on this machine's CPU ranks.
    bundle = profile_workload(workload, micro_batch=4, repeats=10, warmup=2, device="cpu")
    bundle_dir = write_bundle(bundle, out / "profile-gpt-tiny")
    bundle = read_bundle(bundle_dir)  # what we wrote reads back under its schema
    print_layers(bundle.layers)
    console.print(f"trace bundle: {bundle_dir} ({len(bundle.layers)} layers, {len(bundle.ops)} profiled ops)")

    console.rule("2. simulate a 2-stage 1F1B pipeline from the measured costs")
    local = Plan(name="demo-gpt-tiny-pp2", workload=workload, cluster="local-cpu-2", profile=str(bundle_dir),
                 parallelism={"pp": 2}, schedule={"name": "1f1b", "micro_batch": 4, "microbatches": 8})
    result = simulate(local)
    print_sim(result)
    paths = result.write(out / "sim-gpt-tiny-pp2")
    console.print(f"timeline (open in https://ui.perfetto.dev): {paths['trace']}")

    console.rule(f"3. what if: GPT-8.3B on 64 A100s ({WHAT_IF_PLAN.name})")
    paper = Plan.load(WHAT_IF_PLAN)  # the README's example plan itself, so the two cannot disagree
    result = simulate(paper)
    print_sim(result)
    paths = result.write(out / "sim-gpt-8.3b-a100-64")
    console.print(f"timeline: {paths['trace']}")
