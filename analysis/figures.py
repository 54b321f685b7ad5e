"""Paper-scale figures from simulation (``paratwin figures --out DIR``): PDF, PNG and CSV each.

- ``merak``: throughput of GPT 1.5B / 2.5B / 8.3B / 20B on 64 A100s (8 x 8) for a Megatron-LM-style
  and a DeepSpeed-style baseline, each Merak technique alone, all together, and the plan
  ``sim.search`` finds (when it imports); beside it our speedup and the one Merak's paper reports.
- ``schedules``: bubble fraction and throughput of seven pipeline schedules as micro-batches and
  pipeline stages vary (GPT-8.3B, 64 A100s).
- ``validation``: predicted against measured iteration time of every plan of a stored validation
  suite (``paratwin validate-suite --out DIR`` writes ``DIR/suite.csv``).

Every grid runs through ``analysis.sweep`` (one record per point under ``sweeps/``, so a second
call only draws, and ``--scheduler`` spreads the points over Dask). Each figure states its hardware
and assumptions in a note under the plot and in ``DIR/README.md``. Nothing here is fitted to a
paper's numbers: the models, shapes and settings are fixed below, before any result is seen.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.executors import check_workers
from analysis.sweep import SweepSpec, make_point, run_sweep
from traces.atomic import atomic_path, atomic_write_text
from traces.errors import ConfigError, Interrupted
from traces.outdir import prepare_out_folder

# Merak (Lai et al., "Merak: An Efficient Distributed DNN Training Framework With Automated 3D
# Parallelism for Giant Foundation Models", IEEE TPDS 34(5):1466-1478, 2023, doi
# 10.1109/TPDS.2023.3247001), abstract: "Experiments on 64 GPUs show Merak can speedup the training
# performance over the state-of-the-art 3D parallelism frameworks of models with 1.5, 2.5, 8.3, and
# 20 billion parameters by up to 1.42X, 1.39X, 1.43X, and 1.61X, respectively."
PAPER_SPEEDUP = {"gpt-1.5b": 1.42, "gpt-2.5b": 1.39, "gpt-8.3b": 1.43, "gpt-20b": 1.61}
PAPER_CITATION = ("Lai et al., Merak, IEEE TPDS 34(5), 2023, abstract (\"up to\", over state-of-the-art 3D "
                  "parallelism frameworks)")

# One 3D shape per model, fixed before any result was seen: TP inside a node as far as the heads
# allow (a power of two <= 8), PP across nodes, the rest DP; 16 micro-batches of ~4k tokens.
MERAK_SHAPES: dict[str, dict[str, Any]] = {
    "gpt-1.5b": {"parallelism": {"dp": 8, "tp": 1, "pp": 8}, "schedule": {"micro_batch": 4, "microbatches": 16}},
    "gpt-2.5b": {"parallelism": {"dp": 4, "tp": 4, "pp": 4}, "schedule": {"micro_batch": 4, "microbatches": 16}},
    "gpt-8.3b": {"parallelism": {"dp": 2, "tp": 8, "pp": 4}, "schedule": {"micro_batch": 4, "microbatches": 16}},
    "gpt-20b": {"parallelism": {"dp": 1, "tp": 8, "pp": 8}, "schedule": {"micro_batch": 2, "microbatches": 16}},
}
MEGATRON = {"schedule": {"name": "1f1b"}, "parallelism": {"partition": "uniform", "tp_overlap": 0},
            "memory": {"policy": "full"}}
# Each variant: overrides of the Megatron-style baseline.
MERAK_VARIANTS: dict[str, dict[str, Any]] = {
    "Megatron-LM style": {},
    "DeepSpeed style": {"parallelism": {"partition": "parameters"}},
    "shifted critical path": {"schedule": {"name": "merak-shifted"}, "memory": {"policy": "none"}},
    "stage-aware recompute": {"memory": {"policy": "stage-aware"}},  # ratio: see STAGE_AWARE_RATIOS
    "sub-pipelined TP (level 3)": {"parallelism": {"tp_overlap": 3}},
    "time-balanced partition": {"parallelism": {"partition": "time"}},
    "Merak (all)": {"schedule": {"name": "merak-shifted"}, "memory": {"policy": "none"},
                    "parallelism": {"tp_overlap": 3, "partition": "time"}},
}
BASELINES = ("Megatron-LM style", "DeepSpeed style")
# Merak's stage-aware recomputation uses the memory the later stages leave idle: the first stage
# recomputes ``ratio`` of its layers. We try these and keep the fastest that fits in memory.
STAGE_AWARE_RATIOS = (0.0, 0.25, 0.5, 0.75, 1.0)
SEARCHED = "searched best (sim.search)"

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "merak-shifted", "zb-h1", "zb-v", "dualpipev")
SCHEDULE_CHUNKS = {"interleaved-1f1b": 2, "zb-v": 2, "dualpipev": 2}

# The README's accuracy table is the recorded output of benchmarks/accuracy_table.py (a test keeps the two
# equal); captions read it when they are drawn, so a figure states the accuracy of its day.
ACCURACY_RECORD = Path(__file__).resolve().parents[1] / "docs" / "results" / "accuracy_table.json"


def a100_accuracy(record: Path = ACCURACY_RECORD) -> str:
    """The default A100 model's error against Megatron-LM SC'21 Table 1, worded as the README's table."""
    try:
        sc21 = next(row for row in json.loads(Path(record).read_text()) if row["group"] == "sc21")
    except (OSError, ValueError, KeyError, StopIteration):  # an installed copy has no docs/ beside it
        return "its accuracy: README.md, 'How far to trust a what-if'"
    return (f"MAPE {sc21['mape']:.1%} (median {sc21['median']:.1%}, max {sc21['max']:.1%}) on TFLOP/s per GPU "
            f"against Megatron-LM SC'21 Table 1's {sc21['rows']} runs, {sc21['check']} (README's accuracy table)")


def hardware() -> str:
    """The simulated figures' hardware and cost model, with the model's accuracy as recorded today."""
    return ("64 x A100-80GB (8 nodes x 8, NVLink3 inside a node, 4 x HDR InfiniBand per node; paratwin's "
            "a100-64 preset), fp16, costs from paratwin's default A100 model (kernel by kernel; host launch "
            f"cost, GEMM efficiency and send/recv share fitted on public data, README 'What is fitted'; "
            f"{a100_accuracy()}): simulated, not measured")


@dataclass
class Figure:
    name: str
    paths: dict[str, Path]
    caption: str
    table: pd.DataFrame


def _plt():  # noqa: ANN202 - matplotlib.pyplot
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "axes.spines.top": False, "axes.spines.right": False,
                         "pdf.fonttype": 42, "figure.dpi": 100})
    return plt


def _save(fig: Any, table: pd.DataFrame, out: Path, name: str, caption: str) -> dict[str, Path]:
    """PDF and PNG (the caption printed under the plot) and the data as CSV, each written atomically."""
    width, height = fig.get_size_inches()
    wrapped = textwrap.fill(caption, width=int(width * 19))
    lines = wrapped.count("\n") + 1
    caption_h = (lines * 6.5 * 1.25 / 72 + 0.1) / height  # 6.5 pt text, 1.25 line spacing
    fig.set_size_inches(width, height / (1 - caption_h))
    fig.tight_layout(rect=(0, caption_h, 1, 0.93))
    fig.text(0.01, 0.01, wrapped, fontsize=6.5, va="bottom", ha="left", color="0.25")
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for ext in ("pdf", "png"):
        with atomic_path(out / f"{name}.{ext}") as tmp:
            fig.savefig(tmp, format=ext, dpi=150)
        paths[ext] = out / f"{name}.{ext}"
    with atomic_path(out / f"{name}.csv") as tmp:
        table.to_csv(tmp, index=False)
    paths["csv"] = out / f"{name}.csv"
    _plt().close(fig)
    return paths


# ---------------------------------------------------------------------------------------------
# Merak


def merak_spec(models: Sequence[str] = tuple(MERAK_SHAPES), cluster: str = "a100-64") -> SweepSpec:
    """Every (model, variant) point; stage-aware recompute once per ratio of STAGE_AWARE_RATIOS."""
    points = []
    for model in models:
        base = {"workload": model, "cluster": cluster, "dtype": "fp16", **MERAK_SHAPES[model]}
        for variant, changes in MERAK_VARIANTS.items():
            ratios = STAGE_AWARE_RATIOS if variant == "stage-aware recompute" else (None,)
            for ratio in ratios:
                extra = [{"memory": {"policy": "stage-aware", "ratio": ratio}}] if ratio is not None else []
                points.append(make_point(base, [MEGATRON, changes, *extra],
                                         {"model": model, "variant": variant, "ratio": ratio}, sweep_name="merak"))
    return SweepSpec("merak", points, {"models": list(models), "cluster": cluster})


def searched_points(models: Sequence[str], cluster: str, progress: Callable[[str], None] | None = None,
                    top_k: int = 20) -> tuple[list[Any], str]:
    """The plan ``sim.search`` ranks first for each model at the baselines' global batch, as sweep
    points (the engine simulates it again there); ([], why) when search is not available."""
    try:
        from sim.search import SearchSpace, search
    except ImportError as exc:
        return [], f"no searched bar: sim.search does not import here ({exc})"
    points = []
    for model in models:
        shape = MERAK_SHAPES[model]
        batch = shape["parallelism"]["dp"] * shape["schedule"]["micro_batch"] * shape["schedule"]["microbatches"]
        if progress:
            progress(f"searching plans for {model} on {cluster} (global batch {batch})")
        try:
            result = search(SearchSpace(workload=model, cluster=cluster, global_batch=batch, dtype="fp16"),
                            top_k=top_k, sample=0)
        except KeyboardInterrupt:  # Ctrl-C: status 130 and not a word; the figures search before any sweep
            raise Interrupted(f"figures: interrupted while searching plans for {model} (the Merak figure's searched "
                              "bar), before this run's sweeps: nothing was written (fix: run the same command again; "
                              "--no-search leaves the searched bar out)") from None
        if result.best is None:
            continue
        plan = result.plan_of(result.best.candidate).model_dump(mode="json")
        points.append(make_point(plan, [], {"model": model, "variant": SEARCHED, "ratio": None},
                                 sweep_name="merak"))
    return points, f"searched: sim.search, global batch as the baselines', top {top_k} simulated"


def merak_table(results: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, variant): stage-aware keeps its fastest ratio that fits; speedup over the
    better of the two baselines; the paper's speedup beside Merak (all)."""
    rows = []
    for model, group in results.groupby("model", sort=False):
        best_rows = {}
        for variant, rows_v in group.groupby("variant", sort=False):
            fitting = rows_v[rows_v["status"] == "ok"]
            best_rows[variant] = (fitting.loc[fitting["samples_per_s"].idxmax()] if len(fitting)
                                  else rows_v.iloc[0])
        baseline = max((best_rows[b]["samples_per_s"] for b in BASELINES
                        if b in best_rows and best_rows[b]["status"] == "ok"), default=math.nan)
        for variant in [*MERAK_VARIANTS, SEARCHED]:
            if variant not in best_rows:
                continue
            row = best_rows[variant]
            ok = row["status"] == "ok"
            ratio = row.get("ratio")
            rows.append({"model": model, "variant": variant, "status": row["status"],
                         "reason": row["reason"] or "",
                         "samples_per_s": row["samples_per_s"] if ok else math.nan,
                         "tokens_per_s": row["tokens_per_s"] if ok else math.nan,
                         "iteration_s": row["iteration_s"] if ok else math.nan,
                         "mfu": row["mfu"] if ok else math.nan, "peak_memory_gib": row["peak_memory_gib"],
                         "speedup_over_best_baseline": row["samples_per_s"] / baseline if ok else math.nan,
                         "paper_speedup": PAPER_SPEEDUP.get(model) if variant == "Merak (all)" else math.nan,
                         "stage_aware_ratio": ratio if ratio is not None and not pd.isna(ratio) else None,
                         "dp": row["dp"], "tp": row["tp"], "pp": row["pp"], "chunks": row["chunks"],
                         "schedule": row["schedule"], "micro_batch": row["micro_batch"],
                         "microbatches": row["microbatches"], "global_batch": row["global_batch"],
                         "partition": row["partition"], "tp_overlap": row["tp_overlap"],
                         "memory_policy": row["memory_policy"], "id": row["id"]})
    return pd.DataFrame(rows)


def merak_figure(out: Path, sweeps: Path, models: Sequence[str] = tuple(MERAK_SHAPES), cluster: str = "a100-64",
                 include_search: bool = True, workers: int | None = None, scheduler: str | None = None,
                 log: Callable[[str], None] | None = None) -> Figure:
    spec = merak_spec(models, cluster)
    search_note = "searched bar left out (paratwin figures --no-search)"
    if include_search:
        extra, search_note = searched_points(models, cluster, log)
        spec = SweepSpec(spec.name, spec.points + extra, spec.source)
    run = run_sweep(spec, sweeps / "merak", workers=workers, scheduler=scheduler)
    table = merak_table(run.table)
    plt = _plt()
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(2.3 * len(models) + 3.2, 4.6),
                             gridspec_kw={"width_ratios": [1] * len(models) + [1.5]})
    variants = [v for v in [*MERAK_VARIANTS, SEARCHED] if v in set(table["variant"])]
    colors = {v: plt.get_cmap("tab10")(i) for i, v in enumerate([*MERAK_VARIANTS, SEARCHED])}
    for ax, model in zip(axes, models, strict=False):
        sub = table[table["model"] == model].set_index("variant").reindex(variants)
        for x, variant in enumerate(variants):
            value = sub.loc[variant, "samples_per_s"]
            hatch = "//" if variant in BASELINES else ("xx" if variant == SEARCHED else None)
            ax.bar(x, 0 if pd.isna(value) else value, 0.8, color=colors[variant], hatch=hatch, edgecolor="white",
                   linewidth=0.3, label=variant)
            if pd.isna(value):
                ax.text(x, 0, "x", ha="center", va="bottom", color="red", fontsize=9)
        ax.set_xticks([])
        ax.set_title(model.replace("gpt-", "GPT ").replace("b", "B"))
    axes[0].set_ylabel("throughput (samples/s)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(4, len(labels)), fontsize=7, frameon=False,
               bbox_to_anchor=(0.4, 1.0))
    bx = axes[-1]
    ours = table[table["variant"] == "Merak (all)"].set_index("model").reindex(list(models))
    merak_bars = table[~table["variant"].isin([*BASELINES, SEARCHED])]
    best_ours = merak_bars.groupby("model")["speedup_over_best_baseline"].max()
    xs = list(range(len(models)))
    bx.bar([x - 0.27 for x in xs], ours["speedup_over_best_baseline"], 0.27, label="ours: Merak (all)",
           color=colors["Merak (all)"])
    bx.bar(xs, best_ours.reindex(list(models)), 0.27, label="ours: best Merak bar (alone or all)", color="0.6")
    bx.bar([x + 0.27 for x in xs], [PAPER_SPEEDUP.get(m, math.nan) for m in models], 0.27,
           label="paper: up to (Merak, TPDS 2023)", color="black")
    for x, m in zip(xs, models, strict=True):
        bx.text(x + 0.27, PAPER_SPEEDUP.get(m, 0) + 0.02, f"{PAPER_SPEEDUP.get(m, 0):.2f}", ha="center",
                fontsize=6)
        value = ours["speedup_over_best_baseline"].get(m)
        if value is not None and not pd.isna(value):
            bx.text(x - 0.27, value + 0.02, f"{value:.2f}", ha="center", fontsize=6)
    bx.axhline(1.0, color="0.3", lw=0.8, ls="--")
    bx.set_ylim(0, max(2.0, 1.2 * max([*PAPER_SPEEDUP.values(), *best_ours.dropna()])))
    bx.set_xticks(xs, [m.replace("gpt-", "").upper() for m in models])
    bx.set_ylabel("speedup over the better baseline")
    bx.set_title("speedup: ours vs paper")
    bx.legend(fontsize=6.5, loc="upper left", frameon=False)
    shapes = "; ".join(f"{m}: dp{s['parallelism']['dp']} tp{s['parallelism']['tp']} pp{s['parallelism']['pp']}, "
                       f"{s['schedule']['microbatches']} x {s['schedule']['micro_batch']}"
                       for m, s in MERAK_SHAPES.items() if m in models)
    caption = (f"Simulated on {hardware()}. Shapes (dp tp pp, micro-batches x samples): {shapes}. Megatron-LM "
               "style: 1F1B, uniform partition, full recompute, no TP overlap; DeepSpeed style: the same with the "
               "partition balanced by parameters; each Merak technique alone on top of Megatron style (shifted "
               "critical path: Merak's schedule, which checkpoints every stage but the last; stage-aware: fastest "
               f"ratio of {list(STAGE_AWARE_RATIOS)} that fits); Merak (all): shifted + sub-pipelined TP level 3 "
               f"+ time-balanced partition. {search_note}. Red x: does not fit or refused. Paper speedups: "
               f"{PAPER_CITATION}; the paper's hardware and baselines differ (docs/figures.md).")
    paths = _save(fig, table, out, "merak", caption)
    return Figure("merak", paths, caption, table)


# ---------------------------------------------------------------------------------------------
# Schedules


def schedules_spec(pps: Sequence[int] = (2, 4, 8), microbatches: Sequence[int] = (8, 16, 32, 64),
                   schedules: Sequence[str] = SCHEDULES, workload: str = "gpt-8.3b",
                   cluster: str = "a100-64", tp: int = 8, world: int = 64) -> SweepSpec:
    points = []
    for pp in pps:
        base = {"workload": workload, "cluster": cluster, "dtype": "fp16",
                "parallelism": {"dp": world // (tp * pp), "tp": tp, "pp": pp},
                "schedule": {"micro_batch": 1}, "memory": {"policy": "none"}}
        for name in schedules:
            for m in microbatches:
                changes = {"schedule": {"name": name, "microbatches": m},
                           "parallelism": {"chunks": SCHEDULE_CHUNKS.get(name, 1)}}
                points.append(make_point(base, [changes], {"stages": pp, "schedule_name": name, "m": m},
                                         sweep_name="schedules"))
    return SweepSpec("schedules", points, {"pps": list(pps), "microbatches": list(microbatches)})


def schedules_figure(out: Path, sweeps: Path, pps: Sequence[int] = (2, 4, 8),
                     microbatches: Sequence[int] = (8, 16, 32, 64), schedules: Sequence[str] = SCHEDULES,
                     workers: int | None = None, scheduler: str | None = None) -> Figure:
    spec = schedules_spec(pps, microbatches, schedules)
    run = run_sweep(spec, sweeps / "schedules", workers=workers, scheduler=scheduler)
    results = run.table
    columns = ["pp", "schedule", "m", "chunks", "dp", "tp", "status", "reason", "bubble_mean", "bubble_max",
               "samples_per_s", "iteration_s", "mfu", "peak_memory_gib", "id"]
    table = results.drop(columns=["pp", "schedule"]).rename(columns={"stages": "pp", "schedule_name": "schedule"})
    table = table[columns].sort_values(["pp", "schedule", "m"], key=lambda c: c.map(
        {s: i for i, s in enumerate(SCHEDULES)}) if c.name == "schedule" else c).reset_index(drop=True)
    plt = _plt()
    fig, axes = plt.subplots(2, len(pps), figsize=(3.6 * len(pps) + 1, 6.4), squeeze=False, sharex=True)
    colors = plt.get_cmap("tab10")
    markers = "osD^v<>"
    for col, pp in enumerate(pps):
        for i, name in enumerate(schedules):
            sub = table[(table["pp"] == pp) & (table["schedule"] == name) & (table["status"] == "ok")]
            style = {"color": colors(i), "marker": markers[i % len(markers)], "ms": 4, "lw": 1.2,
                     "label": name + (f" x{SCHEDULE_CHUNKS[name]}" if name in SCHEDULE_CHUNKS else "")}
            axes[0][col].plot(sub["m"], sub["bubble_mean"], **style)
            axes[1][col].plot(sub["m"], sub["samples_per_s"], **style)
        axes[0][col].set_title(f"pp = {pp} (tp 8, dp {64 // (8 * pp)})")
        axes[1][col].set_xlabel("micro-batches per iteration")
        axes[1][col].set_xscale("log", base=2)
        axes[1][col].set_xticks(list(microbatches), [str(m) for m in microbatches])
    axes[0][0].set_ylabel("bubble fraction (mean over pipeline ranks)")
    axes[1][0].set_ylabel("throughput (samples/s)")
    axes[0][-1].legend(fontsize=7)
    refused = table[table["status"] != "ok"]
    missing = "; ".join(sorted({f"{r.schedule} pp{r.pp} m{r.m}" for r in refused.itertuples()}))
    caption = (f"Simulated on {hardware()}. GPT-8.3B (72 layers, sequence 1,024), micro-batch 1, tp 8 inside a "
               "node, dp = 64 / (8 pp), no recompute except merak-shifted's own (it checkpoints every stage but "
               "the last, so its throughput includes recompute); interleaved-1f1b, zb-v and dualpipev run 2 "
               "virtual stages per rank. Bubble = idle share of each pipeline rank's compute stream, averaged; "
               "communication (p2p, TP, DP all-reduce) is simulated and its exposed part counts as idle. "
               "Points a schedule refuses (its "
               f"preconditions) or that do not fit are left out: {missing or 'none'}.")
    paths = _save(fig, table, out, "schedules", caption)
    return Figure("schedules", paths, caption, table)


# ---------------------------------------------------------------------------------------------
# Validation scatter


SUITE_NUMBERS = ("predicted_s", "measured_median_s", "measured_p10_s", "measured_p90_s", "error")


def read_suite(suite_dir: Path) -> pd.DataFrame:
    """A validation suite's ``suite.csv``, or a one-line refusal naming the file, row and column at fault
    (a bad value was a TypeError traceback, a header without rows a ValueError one). An empty cell is a
    plan without a measurement (it did not run): kept, and counted in the figure."""
    path = Path(suite_dir) / "suite.csv"
    fix = "pass the output of paratwin validate-suite"
    if not path.is_file():
        raise ConfigError("--suite", f"{path} not found", "run paratwin validate-suite --out DIR first and pass DIR")
    try:
        table = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise ConfigError("--suite", f"{path} is not a CSV table ({str(exc).splitlines()[0]})", fix) from None
    needed = {"plan", *SUITE_NUMBERS}
    if not needed <= set(table.columns):
        raise ConfigError("--suite", f"{path} lacks {sorted(needed - set(table.columns))}", fix)
    if table.empty:
        raise ConfigError("--suite", f"{path} has no rows", f"{fix} (one that ran at least one plan)")
    for column in SUITE_NUMBERS:
        numbers = pd.to_numeric(table[column], errors="coerce")
        bad = numbers.isna() & table[column].notna()
        if bad.any():
            row = int(bad.to_numpy().argmax())
            raise ConfigError("--suite", f"{path} row {row + 1} (plan {table['plan'].iloc[row]}), column {column}: "
                              f"{table[column].iloc[row]!r} is not a number", fix)
        table[column] = numbers
    if table[["predicted_s", "measured_median_s"]].isna().any(axis=1).all():
        raise ConfigError("--suite", f"{path}: no plan has both a prediction and a measurement", fix)
    return table


def spread(positions: Sequence[float], gap: float) -> list[float]:
    """Positions moved apart so that neighbours are at least ``gap`` apart, each crowd of them centred
    on where its members wanted to be (the labels of nearby points overprinted each other)."""
    def first(crowd: list[int]) -> float:  # where a crowd's lowest member goes
        return sum(positions[i] for i in crowd) / len(crowd) - gap * (len(crowd) - 1) / 2

    crowds: list[list[int]] = []  # indices, lowest first; merged while one would reach into the next
    for i in sorted(range(len(positions)), key=lambda i: positions[i]):
        crowds.append([i])
        while len(crowds) > 1 and first(crowds[-2]) + gap * len(crowds[-2]) > first(crowds[-1]):
            last = crowds.pop()
            crowds[-1] += last
    placed = [0.0] * len(positions)
    for crowd in crowds:
        for k, i in enumerate(crowd):
            placed[i] = first(crowd) + k * gap
    return placed


def validation_figure(out: Path, suite_dir: Path) -> Figure:
    """Predicted against measured iteration time of every plan of a suite run (``suite.csv``)."""
    table = read_suite(suite_dir)
    summary: dict[str, Any] = {}
    if (Path(suite_dir) / "suite.json").is_file():
        summary = json.loads((Path(suite_dir) / "suite.json").read_text()).get("summary", {})
    drawn = table.dropna(subset=["predicted_s", "measured_median_s"])
    unmeasured = table.loc[~table.index.isin(drawn.index), "plan"].astype(str).tolist()
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 6))
    ms = 1e3
    measured, predicted = drawn["measured_median_s"] * ms, drawn["predicted_s"] * ms
    yerr = [((drawn["measured_median_s"] - drawn["measured_p10_s"]) * ms).fillna(0),
            ((drawn["measured_p90_s"] - drawn["measured_median_s"]) * ms).fillna(0)]
    steady = drawn["steady"].astype(bool) if "steady" in drawn else pd.Series(True, index=drawn.index)
    ax.errorbar(predicted[steady], measured[steady], yerr=[e[steady] for e in yerr], fmt="o", ms=5,
                capsize=2, label="steady measurement (p10-p90 bar)")
    if (~steady).any():
        ax.errorbar(predicted[~steady], measured[~steady], yerr=[e[~steady] for e in yerr], fmt="o", mfc="white",
                    ms=5, capsize=2, label="not steady")
    lo, hi = 0.85 * min(measured.min(), predicted.min()), 1.15 * max(measured.max(), predicted.max())
    ax.plot([lo, hi], [lo, hi], color="0.3", lw=0.8, label="measured = predicted")
    ax.fill_between([lo, hi], [lo / 1.1, hi / 1.1], [lo * 1.1, hi * 1.1], color="0.85", alpha=0.5, lw=0,
                    label="within 10%")
    # Labels sit right of the diagonal's band, each at its point's height moved just enough that none
    # overprints another (6 pt text: a gap of 2.6% of the axis), with a thin line to its point.
    label_ys = spread(list(measured), 0.026 * (hi - lo))
    for row, x, y, label_y in zip(drawn.itertuples(), predicted, measured, label_ys, strict=True):
        ax.annotate(str(row.plan).replace("gpt-val-", ""), (x, y), xytext=(x + 0.06 * (hi - lo), label_y),
                    textcoords="data", fontsize=6, va="center",
                    arrowprops={"arrowstyle": "-", "color": "0.6", "lw": 0.5, "shrinkA": 0, "shrinkB": 3})
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted iteration time (ms)")
    ax.set_ylabel("measured median iteration time (ms)")
    ax.set_title(f"Validation suite: {len(drawn)} plans" + (f" ({len(unmeasured)} more without a measurement)"
                                                          if unmeasured else ""))
    ax.legend(fontsize=7, loc="upper left")
    stats = ""
    if summary:
        stats = (f" Median |error| {summary.get('median_abs_error', math.nan):.1%}, max "
                 f"{summary.get('max_abs_error', math.nan):.1%}, Spearman {summary.get('spearman', math.nan):.3f}.")
    missing = (f" Not drawn, no prediction or measurement: {', '.join(unmeasured)}." if unmeasured else "")
    caption = (f"Measured on this machine's CPUs: 2 gloo ranks, one thread each, against the simulator fed by "
               f"profiles taken right before and after each run (docs/validation.md); suite {suite_dir}.{stats}"
               f"{missing}")
    paths = _save(fig, table, out, "validation", caption)
    return Figure("validation", paths, caption, table)


# ---------------------------------------------------------------------------------------------


FIGURES = ("merak", "schedules", "validation")
INDEX_HEAD = ["# Figures", "", "Written by `paratwin figures`; each with its PDF, PNG and the data as CSV.", ""]


def read_index(path: Path) -> dict[str, str]:
    """The sections of an index ``write_index`` wrote, by figure name (none when there is no index)."""
    if not path.is_file():
        return {}
    sections: dict[str, str] = {}
    for part in path.read_text().split("\n## ")[1:]:
        name, _, body = part.partition("\n")
        sections[name.strip()] = body.strip("\n")
    return sections


def write_index(out: Path, figures: Sequence[Figure]) -> None:
    """``out/README.md``: this run's captions, and the earlier ones of every figure still in ``out`` that
    this run did not draw (a ``--only`` run rewrote the index with its own figures alone)."""
    drawn = {figure.name: f"![{figure.name}]({figure.paths['png'].name})\n\n{figure.caption}" for figure in figures}
    earlier = read_index(out / "README.md")
    lines = list(INDEX_HEAD)
    for name in FIGURES:
        body = drawn.get(name) or (earlier.get(name) if (out / f"{name}.png").is_file() else None)
        if body:
            lines += [f"## {name}", "", body, ""]
    atomic_write_text(out / "README.md", "\n".join(lines))


def make_figures(out: Path, sweeps: Path | None = None, suite: Path | None = None,
                 only: Sequence[str] = FIGURES, include_search: bool = True,
                 workers: int | None = None, scheduler: str | None = None,
                 log: Callable[[str], None] = print) -> list[Figure]:
    out = Path(out)
    unknown = set(only) - set(FIGURES)
    if unknown:
        raise ConfigError("--only", f"unknown figure {sorted(unknown)}", f"choose {', '.join(FIGURES)}")
    # Every argument is checked before the searches and sweeps (a minute or more), not after them.
    if workers is not None:
        check_workers(workers)
    prepare_out_folder(out, (), "--out")
    sweeps_option = "--out" if sweeps is None else "--sweeps"  # the option that named the folder
    sweeps = out / "sweeps" if sweeps is None else Path(sweeps)
    if {"merak", "schedules"} & set(only):
        prepare_out_folder(sweeps, (), sweeps_option)
    if "validation" in only and suite is not None:
        read_suite(suite)
    if "validation" in only and suite is None:
        if set(only) == {"validation"}:  # nothing would be drawn: exit 0 with an empty index before
            raise ConfigError("--suite", "--only validation draws the validation scatter from a suite's output",
                              "pass --suite DIR (paratwin validate-suite --out DIR writes one)")
        log("validation: skipped (no --suite DIR; paratwin validate-suite --out DIR writes one)")
    figures = []
    if "merak" in only:
        log("merak: baselines, techniques and their combination for 4 GPT models on 64 A100s")
        figures.append(merak_figure(out, sweeps, include_search=include_search, workers=workers,
                                    scheduler=scheduler, log=log))
    if "schedules" in only:
        log("schedules: 7 schedules x pipeline stages x micro-batches, GPT-8.3B on 64 A100s")
        figures.append(schedules_figure(out, sweeps, workers=workers, scheduler=scheduler))
    if "validation" in only and suite is not None:
        figures.append(validation_figure(out, suite))
    write_index(out, figures)
    return figures
