"""The validation suite: many plans, each predicted and run on this machine, in one table.

``run_suite`` groups the plans by what their profile depends on (workload, its options,
micro-batch, dtype), profiles each group once and benchmarks communication once for all sizes
the group's plans send, then validates every plan with that bundle (``analysis.validation``). It
returns one row per plan: predicted and measured iteration time, spread and error, and summarises
the suite by the median and largest |error|, the Spearman rank correlation between predicted
and measured times, and the pairs of plans the measurement orders beyond its noise with how many
of them the prediction orders the same way (``analysis.ranking``).

    .venv/bin/python -m analysis.validation_suite --out runs/validation

The default plans are ``examples/validation/*.yaml``; ``examples/validation/calibration/`` holds
plans that are *not* in the suite, reserved for calibrating a constant the simulator may need
(used by default; ``--calibration`` with no plans turns it off).

Sections: every other subfolder ``examples/validation/<section>/`` is a named suite of its own
(``--section compression``), run and summarised like the default one; ``netns/`` is not one (its
plans need root and network namespaces: scripts/netns_*.sh run them).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.ranking import describe, rank_pairs
from analysis.rounds import DEFAULT_SEED, ROUNDS_FILE, record_rounds, round_orders
from analysis.rounds import describe as describe_rounds
from analysis.validation.calibration import ValidationCalibration, fit_calibration
from analysis.validation.common_profile import CommonProfile
from analysis.validation.profiling import profile_for_validation
from analysis.validation.report import ValidationReport
from analysis.validation.run import validate_plan, validate_record
from sim.plan import Plan
from traces.errors import ConfigError
from traces.outdir import OutputLock, prepare_out_folder

SUITE_DIR = Path(__file__).resolve().parent.parent / "examples" / "validation"
# A measurement is steady when the profiles before and after the run agree within STEADY_DRIFT and
# the run's (p90 - p10) / median is under STEADY_SPREAD; on this machine a single-thread matmul
# varies 10-30% within a run (measured), so anything beyond these saw the load change.
STEADY_DRIFT = 0.10
STEADY_SPREAD = 0.20
PROFILE_REPEATS = 5  # per process and per side of the bracket: 2 x 2 x 5 timings of every layer
COLUMNS = ["plan", "predicted_s", "measured_median_s", "measured_p10_s", "measured_p90_s", "measured_spread",
           "error", "abs_error", "memory_error_max", "profile_drift", "predicted_uncalibrated_s", "attempts",
           "steady", "timeline", "profile"]
# The name of the common profile's place in a round's order (run_suite's ``common_profile``).
PROFILE_SLOT = "(profile)"


# Subfolders of SUITE_DIR that are not sections: plans kept out of every suite on purpose.
NOT_SECTIONS = ("calibration", "netns")


# What a suite writes at its folder's top (besides each plan's validation folder inside plans/, calibration/
# and rounds/, which validate_plan checks itself).
SUITE_OUTPUTS = ("suite.csv", "suite.json", "suite.md", ROUNDS_FILE, "rounds.md", "plans", "calibration", "profiles",
                 "rounds")


def sections() -> list[str]:
    """The named sections: subfolders of examples/validation/ with plans, but calibration/ and netns/."""
    return sorted(d.name for d in SUITE_DIR.iterdir()
                  if d.is_dir() and d.name not in NOT_SECTIONS and any(d.glob("*.yaml")))


def default_plans(section: str | None = None) -> list[Path]:
    """The plans of ``section`` (``examples/validation/<section>/*.yaml``); None: the top-level plans."""
    if section is None:
        return sorted(SUITE_DIR.glob("*.yaml"))
    if section not in sections():
        raise ConfigError("--section", f"no validation section {section!r}",
                          f"use one of {', '.join(sections()) or '(none)'}, or leave it out for the default plans")
    return sorted((SUITE_DIR / section).glob("*.yaml"))


def default_calibration() -> list[Path]:
    return sorted((SUITE_DIR / "calibration").glob("*.yaml"))


def _profile_key(plan: Plan) -> str:
    return json.dumps([plan.workload, plan.workload_options, plan.micro_batch, plan.dtype], sort_keys=True)


def unsteadiness(report: ValidationReport) -> float:
    """How far a measurement is from steady: the larger of |log drift| / log(1 + STEADY_DRIFT) and
    spread / STEADY_SPREAD; at most 1 when steady. Never looks at the error."""
    drift = report.settings.get("profile_drift") or 1.0
    return max(abs(math.log(drift)) / math.log(1 + STEADY_DRIFT), report.measured["spread"] / STEADY_SPREAD)


def run_suite(out_dir: Path, plans: list[Path] | None = None, iterations: int = 20, warmup: int = 3,
              calibration: list[Path] | None = None, verbose: bool = True,
              profile_repeats: int = PROFILE_REPEATS, retries: int = 1, section: str | None = None,
              rounds: int = 1, seed: int | None = None, common_profile: bool = False) -> pd.DataFrame:
    """Validate every plan (default: ``examples/validation/*.yaml``, or the plans of ``section``
    when it is given: ``examples/validation/<section>/*.yaml``); write ``suite.csv``,
    ``suite.json`` and ``suite.md`` to ``out_dir`` and return the per-plan table (its
    ``attrs["summary"]`` holds the suite's summary).

    Communication is benchmarked once per group of plans that share a workload and micro-batch;
    compute is profiled for every plan right before and right after its run (co-located, one
    thread per process, see ``analysis.validation.run``), because this machine's load drifts by tens of
    percent within minutes and a profile taken ten minutes earlier describes another machine.

    ``calibration`` (default ``examples/validation/calibration/*.yaml``; ``[]`` for none): plans
    that are not in the suite, validated first without calibration;
    ``analysis.validation.calibration.fit_calibration`` fits a per-all-reduce overhead on their iteration times
    (with the same communication fits the suite then uses), and the suite is predicted with it
    (the summary also keeps the uncalibrated errors). Why: inside a run a blocking gloo
    all-reduce of half a megabyte took about 3 ms here, while commbench's medians for that size
    came out at 0.5 ms in one benchmark and 3.5 ms in the next (bimodal: the peer is or is not
    scheduled when the call starts).

    ``retries``: a plan whose measurement was not steady (``unsteadiness`` > 1: the load changed
    between the profiles or during the run) is validated again, up to ``retries`` times, and the
    steadiest attempt is kept; the table says how many attempts were made and whether the kept
    one is steady, and the summary gives the errors over all plans and over the steady ones.

    ``rounds`` (``analysis.rounds``): R > 1 interleaves the plans. Round 0 validates every plan as
    above (profile, run, prediction: one prediction per plan); rounds 1..R-1 run every plan again for
    ``iterations`` after ``warmup`` on its round-0 profile, no new prediction. Each round's order is
    a fresh permutation drawn from ``seed`` (default ``analysis.rounds.DEFAULT_SEED``; ``seed`` with
    R = 1 shuffles the one round), so the machine's drift hits every plan alike; the measured
    columns are then the median and the 10th/90th percentiles of the plans' per-round medians, and
    ``rounds.json`` / ``rounds.md`` hold the orders, every block's times and the paired ranking
    (per-round ratios, sign-test intervals), also in the summary as ``paired_ranking``. R = 1
    without a seed is the suite as it was: every plan once, in the given order.

    ``common_profile`` (``analysis.validation.common_profile``): every plan of a workload is predicted
    from one profile instead of its own. The workload is profiled once per round, at a position in
    the round drawn like a plan's (the slot ``PROFILE_SLOT`` of the round's permutation; first in
    every round without a seed), and the rounds' profiles are pooled (per layer, the median); every
    plan's round-0 run is then compared with the prediction from that pool, calibrated as the suite
    is. Why: plans profiled minutes apart on a host whose speed drifts were priced from different
    moments (issue 12: the same block 0.38-0.68 ms forward across run 9's profiles), so a difference
    between two predictions could be when each was profiled; one pooled profile prices every plan
    from the same layers, sampled over the same rounds and with the same statistic as the measured
    side. No per-plan profile, bracket or retry (its drift is what the rounds average); the table's
    ``profile`` column names the bundle that priced each plan (the pool, or for a plan with sharded
    tables the pool with that plan's ids request host work, timed in the same slots)."""
    out = Path(out_dir)
    prepare_out_folder(out, SUITE_OUTPUTS)  # a user's file of these names is refused before any work
    out.mkdir(parents=True, exist_ok=True)
    with OutputLock(out):  # one suite per folder; the lock file marks it as paratwin's for a rerun
        return _run_suite_in(out, plans, iterations, warmup, calibration, verbose, profile_repeats, retries,
                             section, rounds, seed, common_profile)


def _run_suite_in(out: Path, plans: list[Path] | None, iterations: int, warmup: int,
                  calibration: list[Path] | None, verbose: bool, profile_repeats: int, retries: int,
                  section: str | None, rounds: int, seed: int | None, common_profile: bool) -> pd.DataFrame:
    if plans is not None and section is not None:
        raise ConfigError("--section", "both plans and a section given", "give one of them")
    paths = [Path(p) for p in (plans if plans is not None else default_plans(section))]
    if not paths:
        raise ConfigError("plans", "no plans to validate", f"put plan files in {SUITE_DIR} or pass some")
    calibration_paths = [Path(p) for p in (calibration if calibration is not None else default_calibration())]
    loaded = {path: Plan.load(path) for path in [*paths, *calibration_paths]}
    names = [p.name for p in loaded.values()]
    if len(set(names)) != len(names) or len(loaded) != len(paths) + len(calibration_paths):
        raise ConfigError("plans", "a plan is given twice, or two plans share a name (calibration plans must "
                          "not be in the suite)", "give every plan its own name and keep the two sets apart")
    if rounds > 1 and seed is None:
        seed = DEFAULT_SEED
    by_name = {loaded[p].name: p for p in paths}
    if common_profile and PROFILE_SLOT in by_name:
        raise ConfigError("plans", f"a plan is named {PROFILE_SLOT!r}, the suite's name for its profile slot",
                          "rename the plan")
    # drawn (and checked) before anything runs; with a common profile, its slot is drawn like a plan's
    slots = round_orders(([PROFILE_SLOT] if common_profile else []) + list(by_name), rounds, seed)
    orders = [[name for name in order if name != PROFILE_SLOT] for order in slots]
    started = time.perf_counter()

    groups: dict[str, list[Path]] = defaultdict(list)
    for path, plan in loaded.items():
        groups[_profile_key(plan)].append(path)
    bundles: dict[str, Path] = {}
    groups_first: dict[str, Plan] = {}  # the plan each group is profiled as (its widest)
    for number, (key, members) in enumerate(groups.items()):
        plans_here = [loaded[p] for p in members]
        widest = max(plans_here, key=lambda p: p.world_size)
        groups_first[key] = widest
        if verbose:
            print(f"profiling {widest.workload} {widest.workload_options} micro-batch {widest.micro_batch} "
                  f"in {widest.world_size} processes, then benchmarking communication", flush=True)
        # This group profile only serves to size the benchmark; every plan is profiled afresh.
        bundles[key] = profile_for_validation(widest, out / "profiles" / f"group{number}", comm_plans=plans_here,
                                              profile_repeats=2)

    def validate(path: Path, folder: str, calibration: ValidationCalibration | None) -> ValidationReport:
        plan = loaded[path]
        attempts: list[ValidationReport] = []
        while len(attempts) <= retries and (not attempts or unsteadiness(attempts[-1]) > 1.0):
            tag = "" if not attempts else f"-retry{len(attempts)}"
            if verbose:
                print(f"validating {plan.name} ({path}){' again: not steady' if attempts else ''}", flush=True)
            report = validate_plan(plan, iterations=iterations, warmup=warmup,
                                   out_dir=out / folder / f"{plan.name}{tag}", commbench=False,
                                   comm_fits_from=bundles[_profile_key(plan)], bracket=True,
                                   profile_repeats=profile_repeats, calibration=calibration)
            attempts.append(report)
            if verbose:
                m = report.measured
                print(f"  predicted {report.predicted_s * 1e3:.1f} ms, measured {m['median_s'] * 1e3:.1f} ms "
                      f"(spread {m['spread']:.0%}, profile drift {report.settings.get('profile_drift') or 1:.2f}), "
                      f"error {report.error:+.1%}", flush=True)
        kept = min(attempts, key=unsteadiness)
        kept.settings["attempts"] = len(attempts)
        return kept

    fitted = ValidationCalibration()
    if calibration_paths:
        fitted = fit_calibration([validate(path, "calibration", None) for path in calibration_paths])
        if verbose:
            print(f"calibration ({fitted.source}): +{fitted.allreduce_overhead_s * 1e3:.2f} ms per all-reduce, "
                  f"+{fitted.dispatch_s * 1e3:.3f} ms dispatch per compute instruction, "
                  f"+{fitted.p2p_overhead_s * 1e3:.3f} ms per message, compute x {fitted.compute_scale:.3f}",
                  flush=True)
    reports: dict[str, ValidationReport] = {}
    blocks: dict[str, list[list[float]]] = defaultdict(list)  # plan -> each round's iteration times
    common = CommonProfile(out, [loaded[p] for p in paths], _profile_key, groups_first,
                           {key: number for number, key in enumerate(bundles)}, profile_repeats, verbose) \
        if common_profile else None
    for number, order in enumerate(slots):
        if verbose and rounds > 1:
            print(f"round {number + 1} of {rounds}: {', '.join(order)}", flush=True)
        for name in order:
            if name == PROFILE_SLOT:
                assert common is not None
                common.take(number)
            elif common is not None:  # every round only runs; the prediction waits for the pooled profile
                plan = loaded[by_name[name]]
                folder = out / ("plans" if number == 0 else f"rounds/round{number}") / name
                blocks[name].append(_run_block(plan, bundles[_profile_key(plan)], iterations, warmup,
                                               folder / "run" if number == 0 else folder))
            elif number == 0:  # the validation: profile, run, prediction
                reports[name] = validate(by_name[name], "plans", fitted)
                m = reports[name].measured
                blocks[name].append(list(m.get("times_s") or [m["median_s"]]))
            else:
                blocks[name].append(_run_block(loaded[by_name[name]], reports[name].profile, iterations, warmup,
                                               out / "rounds" / f"round{number}" / name))
    if common is not None:
        common.pool(bundles)
        for name, path in by_name.items():
            plan = loaded[path]
            reports[name] = validate_record(plan, out / "plans" / name / "run", common.bundles[name],
                                            out / "plans" / name, calibration=fitted, notes=[common.note(plan)])
            reports[name].settings["attempts"] = 1
            if verbose:
                print(f"{name}: predicted {reports[name].predicted_s * 1e3:.1f} ms from the common profile",
                      flush=True)
    rows = []
    times: dict[str, list[float]] = {}
    for path in paths:
        plan = loaded[path]
        report = reports[plan.name]
        m = dict(report.measured)
        times[plan.name] = blocks[plan.name][0]
        if rounds > 1:  # the measured figures over rounds: the median and percentiles of the round medians
            medians = [float(np.median(b)) for b in blocks[plan.name]]
            m["median_s"], m["p10_s"], m["p90_s"] = (float(v) for v in np.percentile(medians, [50, 10, 90]))
            m["spread"] = (m["p90_s"] - m["p10_s"]) / m["median_s"]
        error = report.predicted_s / m["median_s"] - 1
        memory_errors = report.memory["error"].abs()
        rows.append({"plan": plan.name, "predicted_s": report.predicted_s, "measured_median_s": m["median_s"],
                     "measured_p10_s": m["p10_s"], "measured_p90_s": m["p90_s"], "measured_spread": m["spread"],
                     "error": error, "abs_error": abs(error),
                     "memory_error_max": float(memory_errors.max()) if len(memory_errors) else math.nan,
                     "profile_drift": report.settings.get("profile_drift"),
                     "predicted_uncalibrated_s": report.settings.get("predicted_uncalibrated_s")
                     or report.predicted_s,
                     "attempts": report.settings["attempts"], "steady": unsteadiness(report) <= 1.0,
                     "timeline": str(report.paths.get("timeline_png", "")), "profile": str(report.profile)})
    table = pd.DataFrame(rows, columns=COLUMNS)
    table.attrs["summary"] = summarise(table, times) | {
        "wall_s": time.perf_counter() - started, "iterations": iterations, "warmup": warmup,
        "calibration": asdict(fitted), "calibration_plans": [loaded[p].name for p in calibration_paths],
        "section": section or "default", "rounds": rounds, "seed": seed,
        "common_profile": common.summary([order.index(PROFILE_SLOT) for order in slots]) if common else None}
    if rounds > 1 or seed is not None:
        record = record_rounds(out, orders, seed, iterations, blocks,
                               dict(zip(table["plan"], table["predicted_s"], strict=True)))
        table.attrs["summary"]["paired_ranking"] = record["ranking"]
    write_suite(table, out)
    return table


def _run_block(plan: Plan, profile: Path, iterations: int, warmup: int, out: Path) -> list[float]:
    """One more block of ``plan`` (a round after the first): its iteration times, on the profile
    its validation used (recorded in the plan written beside the run)."""
    from exec.launcher import run_plan

    return list(run_plan(plan.replace(profile=str(profile)), nproc=plan.world_size, iterations=iterations,
                         warmup=warmup, out_dir=out, force=True).iteration_times)


def summarise(table: pd.DataFrame, times: dict[str, list[float]] | None = None) -> dict:
    """The suite's figures; with ``times`` (plan -> its measured per-iteration times) also the
    ranking judged on the pairs the measurement resolves (``analysis.ranking.rank_pairs``)."""
    from analysis.metrics import spearman

    errors = table["abs_error"].to_numpy(dtype=float)
    rho = spearman(table["predicted_s"], table["measured_median_s"])
    plain = (table["predicted_uncalibrated_s"] / table["measured_median_s"] - 1).abs().to_numpy(dtype=float)
    plain_rho = spearman(table["predicted_uncalibrated_s"], table["measured_median_s"])
    steady = table[table["steady"].astype(bool)] if "steady" in table else table
    steady_rho = spearman(steady["predicted_s"], steady["measured_median_s"])
    return {"plans": int(len(table)), "median_abs_error": float(np.median(errors)),
            "steady": {"plans": int(len(steady)),
                       "median_abs_error": float(steady["abs_error"].median()) if len(steady) else math.nan,
                       "max_abs_error": float(steady["abs_error"].max()) if len(steady) else math.nan,
                       "spearman": steady_rho},
            "uncalibrated": {"median_abs_error": float(np.median(plain)), "max_abs_error": float(plain.max()),
                             "spearman": plain_rho},
            "max_abs_error": float(errors.max()), "mean_error": float(table["error"].mean()), "spearman": rho,
            "memory_max_abs_error": float(table["memory_error_max"].max())} | (
        {"ranking": rank_pairs(times, dict(zip(table["plan"], table["predicted_s"], strict=True))).to_dict()}
        if times else {})


def stored_times(suite: Path, table: pd.DataFrame) -> dict[str, list[float]]:
    """Each plan's measured per-iteration times from a stored suite folder: the attempt the suite
    kept is the folder its ``timeline`` names (``plans/<plan>`` or ``plans/<plan>-retryN``)."""
    times = {}
    for row in table.itertuples(index=False):
        timeline = str(row.timeline) if isinstance(row.timeline, str) else ""
        folder = suite / "plans" / (Path(timeline).parent.name if timeline else row.plan)
        if not (folder / "report.json").is_file():
            raise ConfigError("timeline", f"{folder / 'report.json'} does not exist for plan {row.plan}",
                              "give the suite folder written by paratwin validate-suite, with its plans/")
        measured = json.loads((folder / "report.json").read_text())["iteration"]["measured"]
        times[row.plan] = list(measured.get("times_s") or [measured["median_s"]])
    return times


def resummarise(suite: Path, out: Path) -> pd.DataFrame:
    """A stored suite summarised again from its kept measurements and predictions (no timing):
    its ``suite.{csv,json,md}`` written to ``out``, with the ranking by resolved pairs."""
    if not (suite / "suite.csv").is_file():
        raise ConfigError("suite", f"{suite} has no suite.csv", "give a folder written by paratwin validate-suite")
    table = pd.read_csv(suite / "suite.csv", keep_default_na=False, na_values=[""])
    table["timeline"] = table["timeline"].fillna("")
    stored = json.loads((suite / "suite.json").read_text()).get("summary", {}) \
        if (suite / "suite.json").is_file() else {}
    table.attrs["summary"] = stored | summarise(table, stored_times(suite, table))
    out.mkdir(parents=True, exist_ok=True)
    write_suite(table, out)
    return table


def format_suite(table: pd.DataFrame) -> str:
    s = table.attrs.get("summary") or summarise(table)
    lines = [f"Section: {s['section']}.", ""] if s.get("section", "default") != "default" else []
    ranking = s.get("ranking")
    # with rounds the measured columns are over the round medians, and so is the interval shown
    shown_ranking = s.get("paired_ranking") or ranking
    intervals = shown_ranking["median_intervals_s"] if shown_ranking else {}
    level = f"{shown_ranking['level']:.0%}" if shown_ranking else ""
    over = " over rounds" if s.get("paired_ranking") else ""
    lines += ["| plan | predicted (ms) | measured median (ms) | "
              + (f"median {level} interval{over} (ms) | " if ranking else "")
              + "spread | error | peak memory error (max over ranks) | profile drift | attempts | steady |",
              "| --- | --- | --- | " + ("--- | " if ranking else "") + "--- | --- | --- | --- | --- | --- |"]
    for row in table.itertuples(index=False):
        drift = f"{row.profile_drift:.2f}" if row.profile_drift is not None and math.isfinite(row.profile_drift) \
            else "-"
        interval = intervals.get(row.plan)
        shown = (f"{interval[0] * 1e3:.1f}-{interval[1] * 1e3:.1f} | " if interval else "- | ") if ranking else ""
        lines.append(f"| {row.plan} | {row.predicted_s * 1e3:.1f} | {row.measured_median_s * 1e3:.1f} | {shown}"
                     f"{row.measured_spread:.0%} | {row.error:+.1%} | {row.memory_error_max:.1%} | {drift} | "
                     f"{row.attempts} | {'yes' if row.steady else 'no'} |")
    lines += ["", f"{s['plans']} plans: median |error| {s['median_abs_error']:.1%}, max |error| "
              f"{s['max_abs_error']:.1%}, mean error {s['mean_error']:+.1%}, Spearman rank correlation "
              f"{s['spearman']:.3f}; peak memory |error| at most {s['memory_max_abs_error']:.1%}."]
    if ranking:
        lines.append(f"Ranking{' (round 0 alone)' if s.get('paired_ranking') else ''}: {describe(ranking)}")
    if s.get("paired_ranking"):
        lines.append(f"Ranking over rounds (seed {s.get('seed')}; measured columns: median of the round medians): "
                     f"{describe_rounds(s['paired_ranking'])}")
    common = s.get("common_profile")
    if common:
        lines.append(f"Every plan predicted from its workload's common profile (column profile): the per-layer "
                     f"median of one profile per round, taken at slot(s) {common['slots']} of the rounds' orders: "
                     f"{', '.join(common['bundles'])}.")
    st = s["steady"]
    lines.append(f"Steady measurements only ({st['plans']} plans: profile drift within {STEADY_DRIFT:.0%}, spread "
                 f"under {STEADY_SPREAD:.0%}): median |error| {st['median_abs_error']:.1%}, max "
                 f"{st['max_abs_error']:.1%}, Spearman {st['spearman']:.3f}.")
    lines.append(f"spread = (p90 - p10) / median of the {'round medians' if over else 'measured iterations'}; "
                 "profile drift = compute time of the profile taken after the run / before it"
                 f"{' (round 0)' if over else ''}.")
    if s.get("calibration_plans"):
        c, u = s["calibration"], s["uncalibrated"]
        lines.append(f"Calibrated on {', '.join(s['calibration_plans'])} (not in the suite): "
                     f"+{c['allreduce_overhead_s'] * 1e3:.2f} ms per all-reduce (fitted), "
                     f"+{c.get('dispatch_s', 0.0) * 1e3:.3f} ms dispatch per compute instruction and "
                     f"+{c.get('p2p_overhead_s', 0.0) * 1e3:.3f} ms per message (measured), "
                     f"compute x {c['compute_scale']:.3f}. "
                     f"Uncalibrated: median |error| {u['median_abs_error']:.1%}, max {u['max_abs_error']:.1%}, "
                     f"Spearman {u['spearman']:.3f}.")
    if "wall_s" in s:
        lines.append(f"{s['iterations']} measured iterations after {s['warmup']} warm-up per plan; "
                     f"suite wall time {s['wall_s'] / 60:.1f} min.")
    return "\n".join(lines)


def write_suite(table: pd.DataFrame, out: Path) -> None:
    table.to_csv(out / "suite.csv", index=False)
    (out / "suite.json").write_text(json.dumps({"summary": table.attrs.get("summary", {}),
                                                "plans": json.loads(table.to_json(orient="records"))}, indent=2))
    (out / "suite.md").write_text(format_suite(table) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.validation_suite", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/validation"))
    parser.add_argument("--plans", type=Path, nargs="*", default=None, help="default: examples/validation/*.yaml")
    parser.add_argument("--section", default=None,
                        help="run examples/validation/<SECTION>/*.yaml instead (e.g. compression)")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--retries", type=int, default=1, help="re-validations of an unsteady plan")
    parser.add_argument("--rounds", type=int, default=1,
                        help="interleaved rounds (analysis.rounds): every plan once per round, fresh order")
    parser.add_argument("--seed", type=int, default=None,
                        help=f"seed of the rounds' orders (default {DEFAULT_SEED} when --rounds > 1)")
    parser.add_argument("--common-profile", action="store_true",
                        help="predict every plan from one profile per workload: one profile per round, pooled "
                             "(the per-layer median)")
    parser.add_argument("--calibration", type=Path, nargs="*", default=None,
                        help="plans outside the suite to fit the all-reduce overhead on (default: "
                             "examples/validation/calibration/*.yaml; the option without plans: none)")
    args = parser.parse_args(argv)
    table = run_suite(args.out, args.plans, args.iterations, args.warmup, args.calibration, retries=args.retries,
                      section=args.section, rounds=args.rounds, seed=args.seed, common_profile=args.common_profile)
    print()
    print(format_suite(table))
    return 0


if __name__ == "__main__":
    from analysis.report import error_console, run_cli

    run_cli(lambda: sys.exit(main()), to=error_console)  # a bad plan or option: one line, status 2
