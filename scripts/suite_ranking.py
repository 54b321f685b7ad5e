"""Summarise stored validation runs again, no timing: is the method ranking preserved on the pairs
of plans the measurement resolves (issue 12, ``analysis.ranking``)?

    python scripts/suite_ranking.py runs/suite-6 runs/suite-embedding-6 runs/netns-embedding-6 --out DIR

A validation-suite folder (``suite.csv`` and ``plans/``) is written again as ``DIR/<name>/suite.{csv,
json,md}`` from the measurements and predictions it kept (``analysis.validation_suite.resummarise``);
a shaped-network folder (``<rate>/<method>/report``, scripts/netns_*.sh) as ``DIR/<name>/summary.
{csv,md}`` (``analysis.compression_validate.summary``). The stored folders are only read. Prints, per
suite and per rate: Spearman, resolved pairs, concordant among them, the discordant ones; and where
the run was made in interleaved rounds (``rounds.json``, ``analysis.rounds``) the pairs judged over
rounds (``python -m analysis.rounds show RUN`` prints their full table).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from analysis.compression_validate import summary
from analysis.ranking import describe
from analysis.rounds import ROUNDS_FILE
from analysis.rounds import describe as describe_rounds
from analysis.validation_suite import resummarise
from traces.errors import ConfigError


def resummarise_any(run: Path, out: Path) -> list[str]:
    """``run`` summarised into ``out``; one line per suite or rate, and one per set of rounds."""
    over_rounds = [f"{path.parent.relative_to(run.parent)} over rounds: "
                   f"{describe_rounds(json.loads(path.read_text())['ranking'])}"
                   for path in sorted(run.rglob(ROUNDS_FILE))]
    if (run / "suite.csv").is_file():
        s = resummarise(run, out).attrs["summary"]
        return [f"{run.name}: {s['plans']} plans, Spearman {s['spearman']:.3f}; {describe(s['ranking'])}",
                *over_rounds]
    if any(run.glob("*/*/report/report.json")):
        rankings = summary(run, out).attrs["rankings"]
        return [*(f"{run.name} {rate}: {describe(ranking)}" for rate, ranking in rankings.items()), *over_rounds]
    raise ConfigError("run", f"{run} is neither a validation suite (suite.csv) nor a shaped-network run "
                      "(<rate>/<method>/report/report.json)", "give a folder paratwin validate-suite or "
                      "scripts/netns_*.sh wrote")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, required=True, help="DIR/<run name>/ receives each summary")
    args = parser.parse_args(argv)
    for run in args.runs:
        for line in resummarise_any(run, args.out / run.name):
            print(line)
    return 0


if __name__ == "__main__":
    from analysis.report import error_console, run_cli

    run_cli(lambda: sys.exit(main()), to=error_console)  # a bad option: one line, status 2
