"""Validate a plan: predict it with measured costs, run it, and compare the two, instruction by instruction.

The command line of ``analysis.validation`` (how a validation works: ``analysis.validation.run``)::

    python -m analysis.validate run PLAN --out DIR           # profile, benchmark, simulate, run, compare
    python -m analysis.validate profile PLAN --out DIR       # bundle + plan with profile: set
    python -m analysis.validate record PLAN RUN_DIR --profile BUNDLE --out DIR   # a run made elsewhere
"""

from __future__ import annotations

from pathlib import Path

from analysis.validation.profiling import profile_plan_workload
from analysis.validation.report import format_report
from analysis.validation.run import validate_plan, validate_record
from sim.plan import Plan
from traces.bundle import write_bundle


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m analysis.validate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="profile, benchmark, simulate, run and compare a plan")
    run.add_argument("plan", type=Path)
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--iterations", type=int, default=20)
    run.add_argument("--warmup", type=int, default=3)
    run.add_argument("--profile", type=Path, default=None, help="reuse this bundle")
    run.add_argument("--no-commbench", action="store_true")
    prof = sub.add_parser("profile", help="profile a plan's workload here: OUT/profile and OUT/plan.yaml "
                          "(the plan with profile: set), e.g. before launching it elsewhere")
    prof.add_argument("plan", type=Path)
    prof.add_argument("--out", type=Path, required=True)
    rec = sub.add_parser("record", help="compare a run record made elsewhere with its prediction")
    rec.add_argument("plan", type=Path)
    rec.add_argument("run_dir", type=Path, help="the --out of python -m exec.runtime")
    rec.add_argument("--profile", type=Path, required=True)
    rec.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "run":
        report = validate_plan(args.plan, profile=args.profile, iterations=args.iterations, warmup=args.warmup,
                               out_dir=args.out, commbench=not args.no_commbench)
    elif args.command == "profile":
        plan = Plan.load(args.plan)
        bundle = write_bundle(profile_plan_workload(plan, processes=plan.world_size), args.out / "profile")
        plan.replace(profile=str(bundle.resolve())).dump(args.out / "plan.yaml")
        print(f"profiled {plan.workload} {plan.workload_options} at micro-batch {plan.micro_batch} in "
              f"{plan.world_size} processes: {bundle}; plan with profile: {args.out / 'plan.yaml'}")
        return 0
    else:
        report = validate_record(args.plan, args.run_dir, args.profile, args.out)
    print(format_report(report))
    return 0


if __name__ == "__main__":
    import sys

    from analysis.report import error_console, run_cli

    # a bad plan, a dead profiling process, Ctrl-C, a full disk: one line, as `paratwin validate` says them
    run_cli(lambda: sys.exit(main()), to=error_console)
