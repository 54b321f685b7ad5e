"""Embedding communication on a shaped network: the plans of scripts/netns_embedding.sh (one per
embedding plan and rate) and the summary of its runs.

    python -m analysis.embedding_validate plans PLAN.yaml... --rate 100mbit --profile BUNDLE --out DIR
    python -m analysis.embedding_validate summary OUT [--to DIR]  # summary.{csv,md}, as for compression

``plans`` keeps each plan (examples/validation/embedding/: dense, ps, EmbRace sequential and 2D)
but its profile and its link, which becomes the veth pair at the tbf rate
(``analysis.compression_validate.at_rate``); each is written as DIR/<method>.yaml, the method being
the plan's name without its ``emb-`` prefix and ``-dp2`` suffix, so the summary names methods.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from analysis.compression_validate import at_rate, summary
from sim.plan import Plan


def method_of(plan: Plan) -> str:
    return plan.name.removeprefix("emb-").removesuffix("-dp2")


def write_plans(plans: list[Path], rate: str, out: Path, profile: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for path in plans:
        plan = Plan.load(path)
        one = at_rate(plan, rate, name=f"{plan.name}-{rate}", profile=str(profile.resolve()))
        target = out / f"{method_of(plan)}.yaml"
        one.dump(target)
        paths.append(target)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plans = sub.add_parser("plans")
    plans.add_argument("plans", type=Path, nargs="+")
    plans.add_argument("--rate", required=True)
    plans.add_argument("--out", type=Path, required=True)
    plans.add_argument("--profile", type=Path, required=True)
    summ = sub.add_parser("summary")
    summ.add_argument("out", type=Path)
    summ.add_argument("--to", type=Path, default=None, help="write summary.{csv,md} here (default: OUT)")
    args = parser.parse_args(argv)
    if args.command == "plans":
        for path in write_plans(args.plans, args.rate, args.out, args.profile):
            print(path)
    else:
        summary(args.out, args.to)


if __name__ == "__main__":
    main()
