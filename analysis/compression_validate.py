"""Gradient compression on a shaped network: the plans of scripts/netns_compression.sh and the
summary of its runs (predicted vs measured iteration time per method and bandwidth, and whether
the simulator ranks the methods as the runs do).

    python -m analysis.compression_validate plans BASE.yaml --rate 100mbit --profile BUNDLE --out DIR
    python -m analysis.compression_validate summary OUT [--to DIR]                    # OUT/summary.{csv,md}

The summary judges the ranking per rate twice: Spearman over every method, and on the pairs of
methods the measured per-iteration times resolve (``analysis.ranking``: how many, how many of them
the prediction orders the same way, which not).

``plans`` keeps everything of the base plan but the profile, the method and the
link's bandwidth, which is the tbf rate: tc's units, decimal (1gbit = 10^9 bit/s = 1.25e8 B/s).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

import pandas as pd

from analysis.ranking import describe, rank_pairs
from sim.estimate import spearman
from sim.gradient_sync import GRADIENT_SYNC
from sim.plan import Plan
from traces.errors import ConfigError

_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_Bps(rate: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate.strip().lower())
    if not match:
        raise ConfigError("--rate", f"{rate!r} is not a tc rate", "write it as tc does: 100mbit, 1gbit, 10gbit")
    return float(match[1]) * _UNITS[match[2]] / 8


# A veth pair's latency when the base plan names none: the estimate of the netns plans
# (examples/validation/netns/*.yaml: kernel TCP over veth, as hardware.yaml's ethernet links).
VETH_LATENCY_S = 3.0e-5


def at_rate(plan: Plan, rate: str, **fields: object) -> Plan:
    """``plan`` (with ``fields`` replaced) whose two ranks talk over the veth pair shaped to ``rate``."""
    data = plan.model_dump(mode="json", exclude_none=True)
    link = dict(data["cluster"].get("intra_node_link") or {"kind": "ethernet", "latency_s": VETH_LATENCY_S})
    link.update(name=f"veth-tbf-{rate}", bandwidth_Bps=rate_Bps(rate),
                source=f"tc tbf rate {rate} on both ends of the veth pair (scripts/netns_lib.sh)")
    return Plan.from_dict({**data, **fields, "cluster": {**data["cluster"], "intra_node_link": link}})


def write_plans(base: Path, rate: str, out: Path, methods: list[str], profile: Path) -> list[Path]:
    plan = Plan.load(base).replace(profile=str(profile.resolve()))
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for method in methods:
        sync = {"method": method, "bucket_mb": plan.gradient_sync.bucket_mb}
        one = at_rate(plan, rate, name=f"{plan.name}-{method}-{rate}", gradient_sync=sync)
        path = out / f"{method}.yaml"
        one.dump(path)
        paths.append(path)
    return paths


def summary(out: Path, dest: Path | None = None) -> pd.DataFrame:
    """The table of a folder of runs (``<rate>/<method>/report/report.json``), written as
    ``summary.{csv,md}`` to ``dest`` (default ``out``: a stored run is re-summarised elsewhere)."""
    dest = out if dest is None else dest
    rows, times = [], {}
    for report in sorted(out.glob("*/*/report/report.json")):
        data = json.loads(report.read_text())
        measured = data["iteration"]["measured"]
        rate, method = report.parts[-4], report.parts[-3]
        times[rate, method] = measured.get("times_s") or [measured["median_s"]]
        rows.append({"rate": rate, "rate_Bps": rate_Bps(rate), "method": method,
                     "predicted_s": data["iteration"]["predicted_s"], "measured_median_s": measured["median_s"],
                     "measured_min_s": min(times[rate, method]), "measured_max_s": max(times[rate, method]),
                     "spread": (max(times[rate, method]) - min(times[rate, method])) / measured["median_s"],
                     "n": len(times[rate, method]),
                     "error": data["iteration"]["error"]})
    if not rows:
        raise ConfigError("out", f"{out} has no <rate>/<method>/report/report.json",
                          "give the folder a scripts/netns_*.sh run wrote")
    table = pd.DataFrame(rows).sort_values(["rate_Bps", "predicted_s"])
    # per rate: which pairs of methods the measurement orders (analysis.ranking), from the times alone
    rankings = {rate: rank_pairs({m: times[rate, m] for m in group["method"]},
                                 dict(zip(group["method"], group["predicted_s"], strict=True)))
                for rate, group in table.groupby("rate", sort=False)}
    table["median_low_s"] = [rankings[r.rate].intervals[r.method][0] for r in table.itertuples()]
    table["median_high_s"] = [rankings[r.rate].intervals[r.method][1] for r in table.itertuples()]
    table.attrs["rankings"] = {rate: ranking.to_dict() for rate, ranking in rankings.items()}
    dest.mkdir(parents=True, exist_ok=True)
    table.to_csv(dest / "summary.csv", index=False)
    level = next(iter(rankings.values())).level if rankings else 0.95
    lines = [f"| rate | method | predicted (ms) | measured median (ms) | median {level:.0%} interval (ms) | "
             "min-max (ms) | error |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in table.itertuples():
        lines.append(f"| {r.rate} | {r.method} | {1e3 * r.predicted_s:.1f} | {1e3 * r.measured_median_s:.1f} | "
                     f"{1e3 * r.median_low_s:.1f}-{1e3 * r.median_high_s:.1f} | "
                     f"{1e3 * r.measured_min_s:.1f}-{1e3 * r.measured_max_s:.1f} | {100 * r.error:+.1f}% |")
    lines += ["", "| rate | predicted order | measured order | Spearman | resolved pairs | concordant | "
              "discordant resolved pairs |", "|---|---|---|---:|---:|---:|---|"]
    for rate, group in table.groupby("rate", sort=False):
        predicted = list(group.sort_values("predicted_s")["method"])
        measured = list(group.sort_values("measured_median_s")["method"])
        rho = spearman(list(group["predicted_s"]), list(group["measured_median_s"]))
        ranking = rankings[rate]
        discordant = ", ".join(f"{p.faster} < {p.slower}" for p in ranking.discordant) or "none"
        lines.append(f"| {rate} | {' < '.join(predicted)} | {' < '.join(measured)} | {rho:.2f} | "
                     f"{len(ranking.resolved)} of {len(ranking.pairs)} | {len(ranking.concordant)} | {discordant} |")
    lines += [""] + [f"{rate}: {describe(ranking.to_dict())}" for rate, ranking in rankings.items()]
    errors = [abs(e) for e in table["error"]]
    lines += ["", f"median |error| {100 * statistics.median(errors):.1f}%, max {100 * max(errors):.1f}% "
              f"over {len(table)} runs"]
    (dest / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plans = sub.add_parser("plans")
    plans.add_argument("base", type=Path)
    plans.add_argument("--rate", required=True)
    plans.add_argument("--out", type=Path, required=True)
    plans.add_argument("--profile", type=Path, required=True)
    plans.add_argument("--methods", nargs="*", default=list(GRADIENT_SYNC))
    summ = sub.add_parser("summary")
    summ.add_argument("out", type=Path)
    summ.add_argument("--to", type=Path, default=None, help="write summary.{csv,md} here (default: OUT)")
    args = parser.parse_args(argv)
    if args.command == "plans":
        for path in write_plans(args.base, args.rate, args.out, args.methods, args.profile):
            print(path)
    else:
        summary(args.out, args.to)


if __name__ == "__main__":
    main()
