"""Every accuracy check of the README's table in one command: per check, the rows it has, MAPE, median and
max |error| and Spearman, printed as the README's markdown table (and, with ``--json``, written out).

    python benchmarks/accuracy_table.py [--only sc21,korthikanti,...] [--json OUT.json]

The checks, each computed by the code its own benchmark runs (so the two cannot disagree):
- ``sc21``, ``mtnlg``, ``neox``, ``bloom``: the public at-scale tables of ``benchmarks/megatron_at_scale.py``
  (error on TFLOP/s per GPU; positive: predicted too fast), never fitted;
- ``korthikanti``: Korthikanti et al. 2022, ``benchmarks/korthikanti_layers.py --no-tp-backward-overlap``:
  Table 5 with full recompute (and with the 2022 backward overlap, the script's default), Table 5's "present
  work", Table 4's present-work forward and backward times
  (error on times; positive: predicted too slow). Table 4's other rows fitted the A100's eff_max and are
  not a test;
- ``vtrain``: vTrain's single-node runs, held out by whole model shape and by depth; on each split the
  default model's one fitted scalar (host seconds per launch) is fitted on the other side, 240 rows drawn
  at seed 0, exactly as ``python -m analysis.calibrate`` does (fit ``sim_host``);
- ``trends``: SC'21 Figures 13-15 (stated rankings kept) and Figures 12/18 (stated findings), ranking only.

About 15 minutes on the shared 2-core machine for everything (vTrain's fits are most of it). Nothing here
fits anything to a table it reports.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import benchmarks.korthikanti_layers as korthikanti  # noqa: E402
import benchmarks.megatron_at_scale as at_scale  # noqa: E402
import benchmarks.megatron_sc21_trends as trends  # noqa: E402
import sim.compile  # noqa: E402
from analysis.calibrate import (  # noqa: E402
    MAX_FIT_ROWS,
    SimulatorPredictor,
    default_calibration,
    error_metrics,
    fit_on,
    load_rows,
    predict_rows,
    shape_label,
    subsample,
)
from sim.calibration import depth_splits, model_splits  # noqa: E402


@dataclass(frozen=True)
class Check:
    """One line of the table: a check on one data set, and its errors (None where it ranks only)."""

    group: str  # the --only name that produced it
    check: str
    data: str
    rows: int
    mape: float | None = None
    median: float | None = None
    max: float | None = None
    spearman: float | None = None
    note: str = ""

    def cells(self) -> list[str]:
        def pct(x: float | None) -> str:
            return "–" if x is None else f"{x:.1%}"
        return [self.check, self.data, str(self.rows), pct(self.mape), pct(self.median), pct(self.max),
                "–" if self.spearman is None else f"{self.spearman:.3f}", self.note]


def _from_stats(group: str, check: str, data: str, rows: int, stats: dict[str, Any], note: str = "") -> Check:
    """A Check from either benchmark's statistics (``summarise``'s or ``error_stats``' or ``error_metrics``' keys)."""
    def get(*keys: str) -> float:
        return float(next(stats[k] for k in keys if k in stats))
    rho = get("spearman")  # NaN on one row: no ranking to report
    return Check(group, check, data, rows, get("mape"), get("median_abs_error", "median"),
                 get("max_abs_error", "max"), None if math.isnan(rho) else rho, note)


# --- the checks -------------------------------------------------------------------------------------------

AT_SCALE = {  # --table name: what the line says (sections: docs/accuracy.md's)
    "sc21": "Megatron-LM SC'21 Table 1: 10 GPT models 1.7B-1T, 32-3,072 A100, the authors' run-script settings "
            "and Megatron-LM v2.5's mechanics (sections 11, 17)",
    "mtnlg": "MT-NLG 530B (Smith et al. 2022 §2.4): 3 runs, 2,240-3,360 A100, Megatron-DeepSpeed's plain 1F1B, "
             "assumptions declared first (section 15)",
    "neox": "GPT-NeoX-20B (Black et al. 2022): 1 run at tp 2 / pp 4 / dp 12, 96 A100-40GB, DeepSpeed's pipeline "
            "engine with ZeRO-1, assumptions declared first (section 19)",
    "bloom": "BLOOM-176B's training logs (BigScience 2022): 6 configurations at tp 1, 2 and 4 / pp 12-72, 192-384 "
             "A100 on Omni-Path, DeepSpeed's pipeline engine, rows chosen by a rule declared first (section 26)",
}


def at_scale_check(table: str) -> list[Check]:
    """One public table as ``benchmarks/megatron_at_scale.py --table TABLE`` simulates it (the rows' own
    run-script settings, Megatron-LM v2.5's mechanics, the default cost model)."""
    rows = at_scale.load_named(table).to_dict("records")
    results = [at_scale.simulate_row(row, "interleaved-1f1b", None) for row in rows]
    return [_from_stats(table, "at scale, never fitted", AT_SCALE[table], len(results), at_scale.summarise(results))]


# The script's own default prices the 2022 backward overlap; every Korthikanti line but the overlap one is
# what it prints with this flag, and the line says so.
NO_OVERLAP = "`benchmarks/korthikanti_layers.py --no-tp-backward-overlap`"


def korthikanti_check() -> list[Check]:
    """Korthikanti et al. 2022 as ``benchmarks/korthikanti_layers.py --no-tp-backward-overlap`` reports it."""
    curve = at_scale.curve_of("default")
    iterations = korthikanti.load_iterations()
    out = []
    for column, overlap, data in (
            ("full", False, "Korthikanti et al. 2022 Table 5: 22B-1T, pp up to 64, full recompute (section 5; "
                            f"{NO_OVERLAP})"),
            ("full", True, "the same with the 2022 backward overlap of TP all-reduces (section 6; "
                           "`benchmarks/korthikanti_layers.py`, the script's default)"),
            ("present", False, "Korthikanti et al. 2022 Table 5 \"present work\": 22B-1T with sequence parallelism "
                               f"and selective recompute (section 5; {NO_OVERLAP})")):
        rows = korthikanti.compare_iterations(iterations, curve, overlap, column)
        stats = korthikanti.error_stats([r["measured_s"] for r in rows], [r["pred_s"] for r in rows])
        out.append(_from_stats("korthikanti", "at scale, never fitted", data, len(rows), stats))
    present = korthikanti.compare_layers(korthikanti.load_layer_times(), curve, False, rows="present")
    times = [(r[k], r["pred_" + k]) for r in present for k in ("forward_ms", "backward_ms")]
    stats = korthikanti.error_stats([m for m, _ in times], [p for _, p in times])
    out.append(_from_stats("korthikanti", "at scale, never fitted",
                           "Korthikanti et al. 2022 Table 4: a 22B layer's forward and backward times with "
                           f"sequence parallelism and/or selective recompute (section 5; {NO_OVERLAP})",
                           len(times), stats))
    return out


def vtrain_check(seed: int = 0, max_fit_rows: int | None = MAX_FIT_ROWS) -> list[Check]:
    """vTrain's single-node runs, each split held out: the host scalar fitted on the other side (the fit
    ``sim_host`` of ``analysis.calibrate``), the held-out rows predicted by the full simulator."""
    data = load_rows()
    start = default_calibration()
    splits = [(f"held-out {shape_label(shape)}", fit, held) for shape, fit, held in model_splits(data)]
    splits += [(f"held-out {label}", fit, held) for label, fit, held in depth_splits(data)]
    out = []
    for label, fit_side, held in splits:
        fitted = fit_on(subsample(fit_side, max_fit_rows, seed), SimulatorPredictor, start, host=True)
        metrics = error_metrics(held["iter_time_s"], predict_rows(held, SimulatorPredictor(), fitted))
        note = f"host {fitted.curve.host_launch_s * 1e6:.1f} us fitted on the other side"
        out.append(_from_stats("vtrain", f"single node, {label}", "vTrain (Bang et al. 2024): Megatron-LM on one "
                               "8 x A100 node (sections 4, 27)", len(held), metrics, note))
    return out


def trends_check() -> list[Check]:
    """SC'21's stated rankings (Figures 13-15) and findings (Figures 12/18): how many hold."""
    verdicts = trends.ranking_verdicts()
    points = [trends.interleaving_point(batch) for batch in trends.INTERLEAVING_BATCHES]
    findings = trends.interleaving_findings(points)
    verdicts_text = [f"finding {claim.split('.')[0]} {'holds' if holds else 'does not hold'}"
                     for claim, holds in findings]
    verdicts_text[1] += f" (interleaved ahead by {points[-1].interleaving_without:+.1%} at batch {points[-1].batch})"
    verdicts_text.append(f"scatter/gather up to {max(p.scatter_gather for p in points):.1%} "
                         "(the send/recv share's fit target, not a check)")
    return [Check("trends", "at scale, ranking only", "SC'21 Figures 13-15: one model over every split of 64 A100s "
                  "(tp 1-32, pp 1-32; section 23)",
                  len(verdicts), note=f"{sum(h for *_, h in verdicts)} of {len(verdicts)} stated rankings reproduced"),
            Check("trends", "findings of one figure", "SC'21 Figures 12/18: GPT-3 175B on 12 nodes, interleaved or "
                  "not, with scatter/gather or not (sections 24, 27)",
                  len(points), note="; ".join(verdicts_text))]


CHECKS: dict[str, Callable[[], list[Check]]] = {
    **{table: (lambda t=table: at_scale_check(t)) for table in AT_SCALE},
    "korthikanti": korthikanti_check,
    "vtrain": vtrain_check,
    "trends": trends_check,
}


# --- output -----------------------------------------------------------------------------------------------

HEADER = ["check", "data", "rows", "MAPE", "median", "max", "Spearman", "note"]


def markdown(checks: Sequence[Check]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(c.cells()) + " |" for c in checks]
    return "\n".join(lines)


def run(names: Sequence[str]) -> list[Check]:
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise SystemExit(f"--only: no check named {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    sim.compile.MAX_INSTRUCTIONS = max(sim.compile.MAX_INSTRUCTIONS, at_scale.INSTRUCTION_LIMIT)
    out: list[Check] = []
    for name in names:
        started = time.perf_counter()
        out += CHECKS[name]()
        print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(CHECKS),
                        help=f"comma-separated checks (default: all of {', '.join(CHECKS)})")
    parser.add_argument("--json", type=Path, default=None, help="write the checks here")
    args = parser.parse_args(argv)
    checks = run([n for n in args.only.split(",") if n])
    print(markdown(checks))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(c) for c in checks], indent=1) + "\n")


if __name__ == "__main__":
    main()
