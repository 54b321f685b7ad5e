"""The validation report: ``ValidationReport``, its Markdown form and its files (``report.json``,
``report.md``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.validation.comm import COMM_KINDS
from exec.commbench import fit_quality_note

MEMORY_NOTE = (
    "compared: the simulator's memory ledger (parameters + gradients + Adam state, all counted from the "
    "start, + saved activations of the micro-batches in flight + communication buffers: received "
    "gradients until their backward, flattened gradient buckets while all-reduced) against the runtime's "
    "tracked bytes on CPU (parameters + Adam state + gradients once they exist + stage inputs and tensors "
    "saved for backward, each storage once, swapped-out ones not counted, + p2p message buffers in "
    "flight), both sampled at instruction ends. 'predicted comparable' leaves out the flattened buckets "
    "(the runtime does not count its bucket buffer); 'measured comparable' adds the gradient bytes of a "
    "stage to the samples taken before that stage's first backward of the iteration wrote them (the "
    "runtime frees gradients at every zero_grad; the ledger does not). The error compares the two "
    "comparable columns. Neither side counts autograd's transient buffers inside a backward or allocator "
    "overhead; the sides count p2p buffers slightly differently (sends in flight: runtime only).")


@dataclass
class ValidationReport:
    plan: str
    out_dir: Path
    world_size: int
    iterations: int
    warmup: int
    predicted_s: float
    measured: dict[str, Any]  # median_s, p10_s, p90_s, min_s, max_s, spread, n, times_s
    per_kind: pd.DataFrame  # kind, predicted_median_s, measured_median_s, error, n_predicted, n_measured
    memory: pd.DataFrame  # rank, predicted_peak, predicted_comparable, measured_peak, measured_comparable, error
    profile: Path
    comm_fits: pd.DataFrame | None
    paths: dict[str, Path] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def measured_s(self) -> float:
        return float(self.measured["median_s"])

    @property
    def error(self) -> float:
        """predicted / measured median - 1."""
        return self.predicted_s / self.measured_s - 1.0

    @classmethod
    def load(cls, path: Path) -> ValidationReport:
        """A report as ``write_report`` wrote it (``report.json``)."""
        d = json.loads(Path(path).read_text())
        return cls(plan=d["plan"], out_dir=Path(d["out_dir"]), world_size=d["world_size"],
                   iterations=d["iterations"], warmup=d["warmup"], predicted_s=d["iteration"]["predicted_s"],
                   measured=d["iteration"]["measured"], per_kind=pd.DataFrame(d["per_kind"]),
                   memory=pd.DataFrame(d["memory"]["ranks"]), profile=Path(d["profile"]),
                   comm_fits=pd.DataFrame(d["comm_fits"]) if d["comm_fits"] else None,
                   paths={k: Path(v) for k, v in d["paths"].items()}, notes=d["notes"], settings=d["settings"])

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan,
            "out_dir": str(self.out_dir),
            "world_size": self.world_size,
            "iterations": self.iterations,
            "warmup": self.warmup,
            "iteration": {"predicted_s": self.predicted_s, "measured": self.measured, "error": self.error},
            "per_kind": _records(self.per_kind),
            "memory": {"note": MEMORY_NOTE, "ranks": _records(self.memory)},
            "profile": str(self.profile),
            "comm_fits": _records(self.comm_fits) if self.comm_fits is not None else [],
            "paths": {k: str(v) for k, v in self.paths.items()},
            "notes": self.notes,
            "settings": self.settings,
        }


def _records(df: pd.DataFrame) -> list[dict]:
    return json.loads(df.to_json(orient="records"))


def _pct(x: float) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:+.1%}"


def _ms(x: float) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x * 1e3:.2f}"


def format_report(report: ValidationReport) -> str:
    """The report as Markdown (also what ``report.md`` holds)."""
    m = report.measured
    lines = [
        f"# Validation of {report.plan}",
        "",
        f"{report.world_size} ranks, {m['n']} measured iterations after {report.warmup} warm-up; "
        f"profile {report.profile}.",
        "",
        "## Iteration time",
        "",
        "| predicted (ms) | measured median (ms) | p10-p90 (ms) | min-max (ms) | spread | error |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| {_ms(report.predicted_s)} | {_ms(m['median_s'])} | {_ms(m['p10_s'])}-{_ms(m['p90_s'])} | "
        f"{_ms(m['min_s'])}-{_ms(m['max_s'])} | {m['spread']:.1%} | {_pct(report.error)} |",
        "",
        "spread = (p90 - p10) / median of the measured iterations (slowest rank of each).",
        "",
        "## Median duration per instruction kind",
        "",
        "| kind | predicted (ms) | measured (ms) | error | rows predicted / measured |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in report.per_kind.itertuples(index=False):
        flag = " (includes waiting)" if row.kind in COMM_KINDS else ""
        lines.append(f"| {row.kind}{flag} | {_ms(row.predicted_median_s)} | {_ms(row.measured_median_s)} | "
                     f"{_pct(row.error)} | {row.n_predicted} / {row.n_measured} |")
    lines += [
        "",
        "Communication rows span posting to completion on both sides, so they include waiting for the "
        "peer: the runtime posts a receive when its program reaches it, the simulator when its "
        "dependencies are met and the matching send has started.",
        "",
        "## Peak memory per rank",
        "",
        "| rank | predicted, ledger peak (MiB) | predicted comparable (MiB) | measured, as tracked (MiB) | "
        "measured comparable (MiB) | error (comparable) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in report.memory.itertuples(index=False):
        lines.append(f"| {row.rank} | {row.predicted_peak / 2**20:.2f} | {row.predicted_comparable / 2**20:.2f} | "
                     f"{row.measured_peak / 2**20:.2f} | {row.measured_comparable / 2**20:.2f} | {_pct(row.error)} |")
    lines += ["", MEMORY_NOTE, ""]
    if report.comm_fits is not None and len(report.comm_fits):
        lines += ["## Communication fits used (alpha-beta, 2 ranks)", "",
                  "| primitive | alpha (us) | bandwidth (GB/s) | r2 | note |", "| --- | --- | --- | --- | --- |"]
        for row in report.comm_fits.itertuples(index=False):
            lines.append(f"| {row.primitive} | {row.alpha_s * 1e6:.1f} | {row.bandwidth_Bps / 1e9:.3f} | "
                         f"{row.r2:.3f} | {fit_quality_note(row.r2)} |")
        lines.append("")
    if report.paths:
        lines += ["## Files", ""] + [f"- {name}: `{path}`" for name, path in report.paths.items()] + [""]
    if report.notes:
        lines += ["## Notes", ""] + [f"- {note}" for note in report.notes] + [""]
    return "\n".join(lines)


def write_report(report: ValidationReport) -> dict[str, Path]:
    out = Path(report.out_dir)
    paths = {"report_json": out / "report.json", "report_md": out / "report.md"}
    report.paths.update(paths)
    paths["report_json"].write_text(json.dumps(report.to_dict(), indent=2, allow_nan=True))
    paths["report_md"].write_text(format_report(report))
    return paths

