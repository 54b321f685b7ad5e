"""Unfused attention's softmax/dropout rate on an A100, measured: FlashAttention's Appendix E.6 tables
against the project's kernel model of the attention core.

    python benchmarks/flashattention_e6.py [--json docs/results/flashattention_e6_rate.json] [--check]

Data: ``sim/data/flashattention_e6_a100.csv`` (Dao et al. 2022, arXiv:2205.14135, Tables 9-20: the
Megatron and PyTorch attention baselines alone on one A100 40 GB, fp16, batch 16, 8 heads of
dimension 64, seq 128-2,048; provenance, the code that ran and the tables' quirks in
``flashattention_e6_a100.md``). Each row is priced by ``sim.analytic.unfused_attention_core_times``,
the function ``transformer_layer_times`` prices a layer's unfused attention with (no second model):
the score and context bmms on the wave-quantised GEMM roofline (A100 default eff_max), the context's
permute copy at ``mem_eff``, the masked softmax and dropout by the bytes the project counts at
1,555 GB/s x ``attn_mem_eff``.

The rate: per declared row (``DECLARED_ROWS``, fixed before the rate was computed), the
``attn_mem_eff`` at which the modelled time equals the measured one; the rate is their median
(``derive_rate``). ``check_rows``: every row of the CSV at that rate (the ones not used, too).
``--check``: the tables' own consistency (forward + backward against combined).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sim.analytic import AttentionCoreTimes, EfficiencyCurve, uncalibrated_curve, unfused_attention_core_times  # noqa: E402
from sim.hardware import DeviceSpec, get_device  # noqa: E402

DATA = ROOT / "sim" / "data" / "flashattention_e6_a100.csv"
# The paper's setup (E.6 "Setup"): one A100 40 GB, fp16, batch 16, 8 heads of dimension 64.
DEVICE = "A100-40GB"
DTYPE = "fp16"
BATCH, HEADS, HEAD_DIM = 16, 8, 64
# Declared before the rate was computed (sim/data/flashattention_e6_a100.md, "Which rows price
# training's attention"): Megatron's fused scale-mask-softmax family plus dropout, the configuration
# closest to training's causal kernel + dropout; seq >= 512 (smaller calls are launch-bound). The
# backward is Table 10; the forward is Table 11 (combined) minus Table 10, because Table 9's forward
# disagrees with its own combined by up to 8.1 ms. The rate is the median of the six rows' rates.
DECLARED_ROWS = {"implementation": "megatron", "dropout": 1, "padding_mask": 1, "seqs": (512, 1024, 2048),
                 "forward": "combined - backward"}


def load(path: Path = DATA) -> pd.DataFrame:
    return pd.read_csv(path)


def core_times(seq: int, dropout: bool, device: DeviceSpec, curve: EfficiencyCurve) -> AttentionCoreTimes:
    """The project's price of one benchmark call: batch x heads = 128 heads of dimension 64 at ``seq``."""
    return unfused_attention_core_times(BATCH * HEADS, seq, HEAD_DIM, device, DTYPE, curve, dropout=dropout)


def measured_ms(table: pd.DataFrame, implementation: str, dropout: int, mask: int, seq: int, pass_: str) -> float:
    row = table[(table.implementation == implementation) & (table.dropout == dropout)
                & (table.padding_mask == mask) & (table.seq == seq) & (table["pass"] == pass_)]
    if len(row) != 1:
        raise KeyError(f"no single row {implementation} dropout={dropout} mask={mask} seq={seq} {pass_}")
    return float(row.runtime_ms.iloc[0])


def declared_rows(table: pd.DataFrame) -> list[tuple[int, str, float]]:
    """(seq, pass, measured seconds) of the declared rows."""
    d = DECLARED_ROWS
    rows = []
    for seq in d["seqs"]:
        backward, combined = (measured_ms(table, d["implementation"], d["dropout"], d["padding_mask"], seq, p)
                              for p in ("backward", "combined"))
        rows += [(seq, "forward", (combined - backward) / 1e3), (seq, "backward", backward / 1e3)]
    return rows


def row_rate(measured_s: float, core: AttentionCoreTimes, pass_: str, bandwidth_Bps: float) -> float:
    """The attn_mem_eff at which the modelled ``pass_`` takes ``measured_s``: the softmax and dropout
    bytes over the time the bmms and the copy leave them (inf if they leave none)."""
    rest = measured_s - (core.bmm_fwd_s if pass_ == "forward" else core.bmm_bwd_s) - core.copy_s
    moved = core.elementwise_bytes_fwd if pass_ == "forward" else core.elementwise_bytes_bwd
    return moved / (bandwidth_Bps * rest) if rest > 0 else float("inf")


def derive_rate(table: pd.DataFrame, device: DeviceSpec | None = None,
                curve: EfficiencyCurve | None = None) -> tuple[float, pd.DataFrame]:
    """The declared rule: each declared row's rate and their median."""
    device = device or get_device(DEVICE)
    curve = curve or uncalibrated_curve(device, DTYPE)
    rows = []
    for seq, pass_, seconds in declared_rows(table):
        core = core_times(seq, bool(DECLARED_ROWS["dropout"]), device, curve)
        rows.append({"seq": seq, "pass": pass_, "measured_ms": seconds * 1e3,
                     "bmm_ms": (core.bmm_fwd_s if pass_ == "forward" else core.bmm_bwd_s) * 1e3,
                     "copy_ms": core.copy_s * 1e3,
                     "elementwise_GB": (core.elementwise_bytes_fwd if pass_ == "forward"
                                        else core.elementwise_bytes_bwd) / 1e9,
                     "rate": row_rate(seconds, core, pass_, device.memory_bandwidth_Bps)})
    per_row = pd.DataFrame(rows)
    return statistics.median(per_row.rate), per_row


def check_rows(table: pd.DataFrame, rate: float, device: DeviceSpec | None = None,
               curve: EfficiencyCurve | None = None) -> pd.DataFrame:
    """Every row of the CSV priced at ``attn_mem_eff = rate`` (combined = forward + backward), with its
    error (model / measured - 1) and whether it was a declared row."""
    device = device or get_device(DEVICE)
    curve = replace(curve or uncalibrated_curve(device, DTYPE), attn_mem_eff=rate)
    out = []
    for r in table.itertuples():
        core = core_times(int(r.seq), bool(r.dropout), device, curve)
        model_s = {"forward": core.fwd_s, "backward": core.bwd_s, "combined": core.fwd_s + core.bwd_s}[r._3]
        # the declared rows' sources: the backward and the combined (the forward is their difference)
        used = (r.implementation == DECLARED_ROWS["implementation"] and r.dropout == DECLARED_ROWS["dropout"]
                and r.padding_mask == DECLARED_ROWS["padding_mask"] and int(r.seq) in DECLARED_ROWS["seqs"]
                and r._3 != "forward")
        out.append({"implementation": r.implementation, "table": r.table, "pass": r._3, "dropout": r.dropout,
                    "padding_mask": r.padding_mask, "seq": r.seq, "measured_ms": r.runtime_ms,
                    "model_ms": model_s * 1e3, "error": model_s * 1e3 / r.runtime_ms - 1.0, "declared": used})
    return pd.DataFrame(out)


def consistency(table: pd.DataFrame) -> pd.DataFrame:
    """forward + backward - combined (ms) of every configuration: the tables' own check."""
    wide = table.pivot_table(index=["implementation", "dropout", "padding_mask", "seq"], columns="pass",
                             values="runtime_ms")
    wide["fwd_plus_bwd_minus_combined"] = wide["forward"] + wide["backward"] - wide["combined"]
    return wide.reset_index()


def summary(checked: pd.DataFrame) -> dict[str, Any]:
    """Error statistics of the rows not declared, by group, at seq >= 512 and below."""
    groups: dict[str, Any] = {}
    rest = checked[~checked.declared & (checked["pass"] != "combined")]
    for (impl, drop, mask, big), g in rest.groupby(["implementation", "dropout", "padding_mask", rest.seq >= 512]):
        key = f"{impl} dropout={drop} mask={mask} seq{'>=' if big else '<'}512"
        errs = g.error.abs()
        groups[key] = {"rows": len(g), "mape": float(errs.mean()), "max": float(errs.max()),
                       "mean_signed": float(g.error.mean())}
    return groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="write the record here")
    parser.add_argument("--check", action="store_true", help="print the tables' forward + backward vs combined")
    args = parser.parse_args(argv)
    table = load()
    if args.check:
        print(consistency(table).round(2).to_string(index=False))
    rate, per_row = derive_rate(table)
    fwd = statistics.median(per_row[per_row["pass"] == "forward"].rate)
    bwd = statistics.median(per_row[per_row["pass"] == "backward"].rate)
    print(f"declared rows ({DECLARED_ROWS}):")
    print(per_row.round(3).to_string(index=False))
    print(f"attn_mem_eff = {rate:.3f} (median of {len(per_row)}; forward {fwd:.3f}, backward {bwd:.3f}; "
          f"range {per_row.rate.min():.3f}-{per_row.rate.max():.3f})")
    checked = check_rows(table, rate)
    pd.set_option("display.width", 200)
    print(checked.round(3).to_string(index=False))
    stats = summary(checked)
    for key, s in stats.items():
        print(f"{key}: {s['rows']} rows, MAPE {s['mape']:.1%}, max {s['max']:.1%}, mean signed {s['mean_signed']:+.1%}")
    if args.json:
        record = {"source": str(DATA.relative_to(ROOT)),
                  "declared_rows": {**DECLARED_ROWS, "seqs": list(DECLARED_ROWS["seqs"])},
                  "device": DEVICE, "attn_mem_eff": rate, "forward_median": fwd, "backward_median": bwd,
                  "per_row": per_row.to_dict(orient="records"), "checked": checked.to_dict(orient="records"),
                  "not_declared_errors": stats}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
