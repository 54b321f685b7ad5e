"""``paratwin search``: run ``sim.search.search`` with a progress bar, print the ranked table, the
pruning counts and the estimate/engine agreement, and write the best plan (YAML) and every ranked
candidate (Parquet)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import pandas as pd
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from analysis.metrics import rho_text
from analysis.report import console, gib, plain
from sim.cluster import load_cluster
from sim.search import DOES_NOT_FIT, Agreement, Candidate, Ranked, SearchResult, SearchSpace, search
from traces.atomic import atomic_path, atomic_write_text
from traces.errors import ConfigError, Interrupted, NoPlanFits
from traces.outdir import OutputLock, prepare_out_folder

# The files write_search puts in its folder (a folder of the user's holding one is refused).
SEARCH_OUTPUTS = ("best.yaml", "ranked.parquet", "summary.json")
# Plan fields in a fix as `paratwin search` takes them: the checks behind a search are the plan's, and
# their fixes say what to write in a plan file, which a search has none of (pattern -> replacement).
SEARCH_OPTIONS: tuple[tuple[str, str], ...] = (
    (r"\bthen set profile: DIR in the plan\b", "then pass --profile DIR"),
    (r"\bpoint profile: at that bundle\b", "pass that bundle as --profile"),
    (r"\bas the plan sets it\b", "as --workload and --workload-option set it"),
    (r"\bset dtype: (\w+)", r"pass --dtype \1"),
    (r"\bdtype: (\w+)", r"--dtype \1"),
    (r"\bmethod: (\w+)", r"--gradient-sync \1"),
    (r"\bworkload_options: \{(\w+): (\w+)\}", r"--workload-option \1=\2"),
    (r"\bglobal_batch: (\w+)", r"--global-batch \1"),
)


# Plan fields a refusal names, as the search options that set them.
SEARCH_FIELDS = {"gradient_sync.method": "--gradient-sync", "dtype": "--dtype", "profile": "--profile",
                 "global_batch": "--global-batch"}


def search_error(field: str, problem: str, fix: str) -> ConfigError:
    """A refusal of the plan checks behind a search, naming the search's options, not a plan file's fields."""
    return ConfigError(SEARCH_FIELDS.get(field, field), problem, for_search(fix))


def for_search(fix: str) -> str:
    """``fix`` with the plan fields it names written as the search options that set them."""
    for pattern, option in SEARCH_OPTIONS:
        fix = re.sub(pattern, option, fix)
    return fix


def run_search(space: SearchSpace, top: int, simulate_top: int, sample: int, out: Path,
               workers: int | None = None, bound: bool | None = None) -> SearchResult:
    prepare_out_folder(out, SEARCH_OUTPUTS)  # before the search, not after it
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        tasks: dict[str, Any] = {}

        def progress(phase: str, done: int, total: int | None) -> None:
            if phase not in tasks:
                label = "estimating plans" if phase == "estimate" else "simulating the best plans"
                tasks[phase] = bar.add_task(label, total=total)
            bar.update(tasks[phase], completed=done, total=total)

        try:
            result = search(space, top_k=simulate_top, sample=sample, progress=progress, workers=workers,
                            bound=bound)
        except ConfigError as exc:  # e.g. the profile a CPU cluster needs: said as the search's options
            raise search_error(exc.field, exc.problem, exc.fix) from None
        except KeyboardInterrupt:  # Ctrl-C: status 130 and not a word; the outputs are written only below
            raise Interrupted(f"search: interrupted before writing anything: {out} is as it was (fix: run the "
                              "same command again; a search starts over)") from None
    print_search(result, top)
    write_search(result, out)
    # the outputs are written; refused by the search's own checks: exit 2, the options are at fault
    if emptied_by_checks(result):
        raise no_plan_passes(result)
    # exit 3, as simulate does for a plan that does not fit
    if result.best is None and not result.estimate_only:
        raise no_plan_fits(result)
    return result


def emptied_by_checks(result: SearchResult) -> bool:
    """No plan to rank, and none of them refused for memory: the space's choices (options the user gave,
    rules of the methods asked for) left no plan, which more memory would not change."""
    return not result.ranked and not result.pruned[DOES_NOT_FIT]


def no_plan_passes(result: SearchResult) -> ConfigError:
    """Why the search's checks left no plan, in one line: the plans each pruning reason took (most first),
    the words of the check that took the most (its problem, and its fix in the search's options)."""
    counts = ", ".join(f"{count:,} by {reason}" for reason, count in result.pruned.most_common() if count)
    explained = [reason for reason, _ in result.pruned.most_common() if reason in result.pruned_why]
    if not explained:
        return ConfigError("search", f"every one of the {result.considered:,} plans considered was pruned, none for "
                           f"memory: {counts or 'no plan to consider'}", "widen the options given to the search "
                           "(the pruning table above counts each reason)")
    reason = explained[0]
    problem, fix = result.pruned_why[reason]
    return search_error(reason, f"every one of the {result.considered:,} plans considered was pruned, none for "
                        f"memory: {counts}; {reason}: {problem}", fix or "change the option that asks for it")


def no_plan_fits(result: SearchResult) -> NoPlanFits:
    """Why a search found no plan, in one line: how many plans the estimate found too large, how many the
    engine ran over capacity."""
    over = sum(1 for r in result.simulated if r.simulated is not None and r.simulated.oom)
    return NoPlanFits(
        f"no plan fits in memory: of {result.considered:,} plans considered, {result.pruned[DOES_NOT_FIT]:,} do not "
        f"fit by the estimate and {over} of {len(result.simulated)} simulated exceed a device's memory (fix: more "
        "devices or devices with more memory, a smaller global batch, or a smaller model)")


def print_search(result: SearchResult, top: int) -> None:
    space = result.space
    cluster = result.base["cluster"] if isinstance(result.base["cluster"], str) else "an inline cluster"
    plain(f"search: {space.workload} on {cluster} ({result.world_size} devices), global batch "
          f"{result.global_batch}, {space.dtype}")
    plain(f"considered {result.considered:,} plans; {sum(result.pruned.values()):,} pruned; "
          f"{len(result.ranked):,} estimated; {len(result.simulated)} simulated "
          f"({result.timings['total_s']:.1f} s: estimate {result.timings['estimate_s']:.1f} s, engine on the best "
          f"{result.timings['engine_top_s']:.1f} s, agreement sample {result.timings['engine_sample_s']:.1f} s)")
    pruned = Table("pruned because", "plans", title="pruning")
    for reason, count in result.pruned.most_common():
        pruned.add_row(reason, f"{count:,}")
    console.print(pruned)
    for choice, why in result.not_enumerated.items():
        plain(f"not enumerated: {choice}: {why}")

    shown = folded(result.simulated, top)
    # GiB to one decimal printed 0.0 for every stage of a small model; its peaks read in MiB
    unit, scale = ("MiB", 2**20) if all(max(r.simulated.peak_bytes) < 2**30 for r, _ in shown if r.simulated) \
        else ("GiB", 2**30)
    twins = sum(len(same) for _, same in shown)
    table = Table("#", "plan", "engine ms", "estimate ms", "samples/s", "MFU", f"peak {unit} per stage",
                  title=f"best {len(shown)} of {len(result.simulated)} simulated (engine order"
                  + (f"; {twins} more with the same figures folded into their row" if twins else "") + ")"
                  + (": a random sample, not the search's choice" if result.estimate_only else ""))
    for i, (ranked, same) in enumerate(shown, 1):
        sim = ranked.simulated
        assert sim is not None
        peaks = " ".join(f"{b / scale:.1f}" for b in sim.peak_bytes[:8]) + (" ..." if len(sim.peak_bytes) > 8 else "")
        table.add_row(str(i), ranked.candidate.describe() + twins_text(ranked.candidate, same),
                      f"{sim.iteration_s * 1e3:,.1f}" + (" OOM" if sim.oom else ""),
                      f"{ranked.estimate.iteration_s * 1e3:,.1f}", f"{sim.samples_per_s:,.1f}", f"{sim.mfu:.1%}", peaks)
    console.print(table)
    best = result.best
    if best is not None:
        print_breakdown(best)
    if result.agreement is not None:
        for line in agreement_lines(result.agreement, result.top_k):
            plain(line)


# Engine times this close are one time: plans that differ in a setting the engine does not see (a bucket
# size whose sync is hidden either way) give equal times up to float rounding.
SAME_TIME_REL = 1e-9
TWINS_NAMED = 3  # the folded plans a row names; the rest it counts


def same_figures(a: Ranked, b: Ranked) -> bool:
    """The engine cannot tell the two plans apart: the same iteration time, the same peak on every stage."""
    sa, sb = a.simulated, b.simulated
    assert sa is not None and sb is not None
    return (abs(sa.iteration_s - sb.iteration_s) <= SAME_TIME_REL * max(sa.iteration_s, sb.iteration_s)
            and sa.peak_bytes == sb.peak_bytes and sa.oom == sb.oom)


def folded(simulated: list[Ranked], top: int) -> list[tuple[Ranked, list[Ranked]]]:
    """The engine's first ``top`` plans with different figures, each with the later plans whose figures are
    its own: a top 5 of one plan at four bucket sizes showed one choice four times."""
    rows: list[tuple[Ranked, list[Ranked]]] = []
    for ranked in simulated:
        row = next((row for row in rows if same_figures(row[0], ranked)), None)
        if row is not None:
            row[1].append(ranked)
        elif len(rows) < top:
            rows.append((ranked, []))
    return rows


def setting_differences(shown: Candidate, other: Candidate) -> str:
    """What ``other`` sets differently from ``shown``, as plan fields (``gradient_sync.bucket_mb=100.0``)."""
    mine, theirs = shown.sections(), other.sections()
    differences = [f"{section}.{key}={theirs[section][key]}" if key in theirs[section] else f"{section}.{key} unset"
                   for section in theirs for key in {**mine[section], **theirs[section]}
                   if mine[section].get(key) != theirs[section].get(key)]
    return " ".join(differences) or "the same settings"


def twins_text(shown: Candidate, same: list[Ranked]) -> str:
    if not same:
        return ""
    named = "; ".join(setting_differences(shown, r.candidate) for r in same[:TWINS_NAMED])
    rest = f"; {len(same) - TWINS_NAMED} more" if len(same) > TWINS_NAMED else ""
    return f"\n  same figures with: {named}{rest}"


def agreement_lines(agreement: Agreement, top_k: int) -> list[str]:
    """How the estimate's order agreed with the engine's, as printed after a search (a rank correlation where
    the estimates or the engine's times tie throughout is "–", not "nan")."""
    return [f"estimate vs engine: Spearman {rho_text(agreement.spearman_sample)} on a random sample of "
            f"{agreement.sample_size} plans (median |error| {agreement.time_error_median:.1%} in time, "
            f"{agreement.memory_error_median:.1%} in peak memory); Spearman {rho_text(agreement.spearman_top)} "
            f"within the estimate's best {top_k}",
            f"engine's verdict on the estimate's pick: rank {agreement.estimate_best_engine_rank} of the "
            f"best {top_k}, {agreement.estimate_best_slowdown:+.1%} against the engine's best (which the estimate "
            f"ranked {agreement.engine_best_estimate_rank}); {agreement.top10_overlap} of the estimate's top 10 "
            "are in the engine's top 10"]


def print_breakdown(best: Ranked) -> None:
    sim, est = best.simulated, best.estimate
    assert sim is not None
    table = Table("where the time goes", "engine ms", "estimate ms",
                  title=f"why the winner wins: {best.candidate.describe()}")
    table.add_row("compute (forward + backward)", f"{sim.compute_s * 1e3:,.1f}",
                  f"{(est.compute_s + est.tp_comm_s) * 1e3:,.1f}")
    table.add_row("  of which exposed TP all-reduce", "(inside compute)", f"{est.tp_comm_s * 1e3:,.1f}")
    table.add_row("recompute", f"{sim.recompute_s * 1e3:,.1f}", f"{est.recompute_s * 1e3:,.1f}")
    table.add_row("pipeline bubble (incl. p2p)", f"{sim.bubble_s * 1e3:,.1f}",
                  f"{(est.bubble_s + est.p2p_s) * 1e3:,.1f}")
    table.add_row("exposed gradient sync", f"{sim.exposed_comm_s * 1e3:,.1f}", f"{est.dp_comm_s * 1e3:,.1f}")
    table.add_row("optimizer step", f"{sim.optimizer_s * 1e3:,.1f}", f"{est.optimizer_s * 1e3:,.1f}")
    table.add_row("iteration", f"{sim.iteration_s * 1e3:,.1f}", f"{est.iteration_s * 1e3:,.1f}")
    console.print(table)
    plain("(each the critical rank's, the one whose finish sets the iteration (docs/search.md); its bubble is "
          "what is left of the iteration)")


def candidate_settings(candidate: Candidate) -> dict[str, Any]:
    """Every setting of the candidate, read from its fields (a section's settings as JSON text): a setting
    left out (p2p was) makes a plan's twins identical rows, and a row no longer says which plan it is."""
    return {f.name: json.dumps(dict(v)) if isinstance(v := getattr(candidate, f.name), tuple) else v
            for f in fields(candidate)}


def search_record(result: SearchResult) -> dict[str, Any]:
    """Every input that changes the search's result, as ``summary.json`` keeps it: the whole space (workload
    and its options, cluster, batch, dtype, profile, limits, the p2p modes and gradient syncs searched;
    ``SearchSpace.from_record`` reads it back) and how the search ran (``SearchResult.settings``)."""
    space = {**asdict(result.space), "global_batch": result.global_batch}  # the default worked out
    # the cluster as it was read (a YAML file may change after the search)
    cluster = load_cluster(result.space.cluster).model_dump(mode="json")
    return {"space": space, **result.settings, "world_size": result.world_size, "cluster": cluster}


def ranked_frame(result: SearchResult) -> pd.DataFrame:
    rows = []
    for i, ranked in enumerate(result.ranked, 1):
        c, e, s = ranked.candidate, ranked.estimate, ranked.simulated
        rows.append({
            "rank": i, **candidate_settings(c),
            "estimate_s": e.iteration_s, "estimate_compute_s": e.compute_s, "estimate_recompute_s": e.recompute_s,
            "estimate_bubble_s": e.bubble_s, "estimate_tp_comm_s": e.tp_comm_s, "estimate_p2p_s": e.p2p_s,
            "estimate_dp_comm_s": e.dp_comm_s, "estimate_optimizer_s": e.optimizer_s,
            "estimate_peak_bytes": max(e.peak_bytes),
            "simulated": s is not None,
            "engine_s": s.iteration_s if s else float("nan"),
            "engine_samples_per_s": s.samples_per_s if s else float("nan"),
            "engine_mfu": s.mfu if s else float("nan"),
            "engine_peak_bytes": max(s.peak_bytes) if s else -1,
            "engine_oom": bool(s.oom) if s else False,
        })
    return pd.DataFrame(rows)


def write_search(result: SearchResult, out: Path) -> dict[str, Path]:
    # under the folder's lock: one writer at a time, and the lock file marks the folder as paratwin's
    with OutputLock(out):
        paths: dict[str, Path] = {}
        best = result.best
        # an earlier search's best.yaml beside this search's summary (best: null) would be simulated as its plan
        stale = None if best is not None else earlier_best(out)
        if stale is not None:
            (out / "best.yaml").unlink()
        if best is not None:
            plan = result.plan_of(best.candidate).with_absolute_paths()  # read from any directory
            with atomic_path(out / "best.yaml") as tmp:
                plan.dump(tmp)
            paths["best"] = out / "best.yaml"
        with atomic_path(out / "ranked.parquet") as tmp:
            ranked_frame(result).to_parquet(tmp, index=False)
        paths["ranked"] = out / "ranked.parquet"
        summary = {
            "considered": result.considered, "pruned": dict(result.pruned), "estimated": len(result.ranked),
            "simulated": len(result.simulated), "timings": result.timings, "global_batch": result.global_batch,
            "not_enumerated": result.not_enumerated,
            "agreement": result.agreement.__dict__ if result.agreement else None,
            "best_engine_s": best.simulated.iteration_s if best and best.simulated else None,
            "best": best.candidate.describe() if best else None,
            "best_settings": candidate_settings(best.candidate) if best else None,  # its p2p included
            "search": search_record(result),
        }
        paths["summary"] = atomic_write_text(out / "summary.json",
                                             json.dumps(summary, indent=2, default=str))
    if best is not None:
        assert best.simulated is not None
        plain(f"best plan: {paths['best']} ({best.simulated.iteration_s * 1e3:,.1f} ms, peak "
              f"{gib(max(best.simulated.peak_bytes))}); check it with paratwin simulate {paths['best']}")
    else:
        why = no_best_reason(result)
        removed = f"; removed {out / 'best.yaml'}, an earlier search's best plan ({stale})" if stale else ""
        plain(f"{why}: no best.yaml written{removed}")
    plain(f"ranked plans: {paths['ranked']}\nsummary: {paths['summary']}")
    return paths


def no_best_reason(result: SearchResult) -> str:
    if emptied_by_checks(result):
        return "no plan passes the search's checks"
    if result.estimate_only:
        return ("no best plan: --simulate-top 0 simulated none of the estimate's best (the random sample is for the "
                "agreement figures only)")
    return "no plan fits in memory"


def earlier_best(out: Path) -> str | None:
    """The plan that ``out/best.yaml`` holds, as the earlier search that wrote it described it, or None where
    that is not known. A search writes best.yaml with a summary.json naming its plan (read here before this
    search replaces it); a best.yaml in a folder paratwin never wrote in (no lock file) was refused before
    the search (``prepare_out_folder``). A symlink, a folder, or a best.yaml no summary names is left alone."""
    best = out / "best.yaml"
    if best.is_symlink() or not best.is_file():
        return None
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    described = summary.get("best") if isinstance(summary, dict) and "search" in summary else None
    return described if isinstance(described, str) and described else None
