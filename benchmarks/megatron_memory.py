"""Peak memory of Megatron-LM configurations: the simulator's ledger against what Megatron-LM holds.

    python benchmarks/megatron_memory.py [--rows 0,1,2] [--json OUT.json]

Part 1, SC'21 Table 1 (Narayanan et al.; the plans of benchmarks/megatron_at_scale.py, Megatron-LM
v2.5 mechanics, fp16): per row, the engine's peak (the rank with the highest) and its breakdown, the
parameter count n on that rank (its fp16 parameter bytes / 2), and the model state Megatron-LM v2.5
holds at its optimizer step, when the activations are gone: 20 B per parameter (fp16 weights 2, fp16
gradients 2, the fp32 copies of the gradients Float16OptimizerWithFloat16Params._copy_model_grads_
to_main_grads makes 4, fp32 master weights 4, Adam moments 8; megatron/optimizer/optimizer.py lines
247 and 309 at v2.5; the same 20 in Megatron's docs/distrib_optimizer.md at 23.04). The ledger holds
those copies during the step (sim.model_state.step_copy_bytes), so its peak is at least 20 n.

Part 2, Korthikanti et al. 2022 (arXiv:2205.05198) section 4: activation bytes of one transformer
layer with tensor parallelism and no sequence parallelism, s b h (10 + 24/t + 5 a s / (h t)) (their
eq. 2), and under full recomputation 2 s b h (section 4.3: only the layer input is kept), against the
ledger's saved bytes of one block (unfused attention and dropout 0.1, as Megatron-LM ran: the
ledger equals eq. 2 plus the layernorms' statistics, tests/test_korthikanti_activations.py) and its
checkpoint bytes. The same for the paper's other settings (its Table 2): sequence parallelism
(``workload_options.sequence_parallel``), s b h / t (34 + 5 a s / h) (eq. 3); selective recomputation
(``memory: selective-attention``) without it, s b h (10 + 24 / t), and with it, 34 s b h / t (eq. 6).
The paper gives these settings' memory only as formulas (and Figure 1 as bars), no measured bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import benchmarks.korthikanti_layers as korth  # noqa: E402
import benchmarks.megatron_at_scale as sc21  # noqa: E402
import sim.compile  # noqa: E402
from sim.analytic_costs import AnalyticCosts  # noqa: E402
from sim.cluster import load_cluster  # noqa: E402
from sim.memory import attention_core_view, checkpoint_bytes  # noqa: E402
from sim.workloads import transformer_config, transformer_layers  # noqa: E402

GiB = 2**30
# Bytes per parameter Megatron-LM v2.5's fp16 optimizer holds at its step (module docstring).
MEGATRON_FP16_STEP_BYTES = 20


def table1_row(row: dict[str, Any]) -> dict[str, Any]:
    plan = sc21.plan_for(row)  # the authors' run-script settings (micro-batch, interleaving, DDP)
    engine, _, _, _ = sc21.run_plan(plan, sc21.curve_of("default"))
    rank, ledger = max(engine.ledgers.items(), key=lambda item: item[1].peak)
    n = ledger.static["parameters"] // 2
    step = MEGATRON_FP16_STEP_BYTES * n
    return {"params_b": row["params_b"], "tp": int(row["tp"]), "pp": int(row["pp"]), "rank": rank,
            "params_on_rank_b": n / 1e9, "ledger_peak_GiB": ledger.peak / GiB,
            "breakdown_GiB": {k: v / GiB for k, v in ledger.peak_breakdown.items()},
            "megatron_step_GiB": step / GiB, "megatron_peak_GiB": max(ledger.peak, step) / GiB,
            "fits_80GB": max(ledger.peak, step) <= 80e9}


def korthikanti_row(row: dict[str, Any]) -> dict[str, Any]:
    """One block's activation bytes: the paper's formulas against the ledger's (micro-batch and tp as run),
    without and with sequence parallelism, without and with its selective recomputation."""
    s, b, h, a, t = 2048, int(row["micro_batch"]), int(row["hidden"]), int(row["heads"]), int(row["tp"])
    block = 2  # a middle block (layer 0 is the embedding)
    sbh = s * b * h
    paper = {(False, "none"): sbh * (10 + 24 / t + 5 * a * s / (h * t)),  # eq. 2
             (True, "none"): sbh / t * (34 + 5 * a * s / h),  # eq. 3
             (False, "selective"): sbh * (10 + 24 / t),  # section 5 without sequence parallelism
             (True, "selective"): 34 * sbh / t}  # eq. 6
    out: dict[str, Any] = {"model": row["model"], "tp": t, "micro_batch": b}
    for sp in (False, True):
        plan = korth.row_plan(row, "none", sequence_parallel=sp)
        cluster = load_cluster(plan.cluster)
        config = transformer_config(plan.workload, **plan.workload_options)
        costs = AnalyticCosts(transformer_layers(config), cluster.device, "fp16", cluster, sc21.curve_of("default"),
                              attention=config.attention)
        c = costs.layer_costs(block, b, t)
        for recompute, held in (("none", c.saved_bytes), ("selective", attention_core_view(c).saved_bytes)):
            key = f"{'sp' if sp else 'tp'}_{recompute}"
            out[f"paper_{key}_MiB"] = paper[sp, recompute] / 2**20
            out[f"ledger_{key}_MiB"] = held / 2**20
            out[f"error_{key}"] = held / paper[sp, recompute] - 1
        if not sp:
            checkpoint = checkpoint_bytes(block, lambda layer, m=costs: m.layer_costs(layer, b, t))
            out.update({"paper_layer_MiB": out["paper_tp_none_MiB"], "ledger_layer_MiB": out["ledger_tp_none_MiB"],
                        "error": out["error_tp_none"], "paper_full_recompute_MiB": 2 * sbh / 2**20,
                        "ledger_checkpoint_MiB": checkpoint / 2**20})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", help="comma-separated Table 1 row indices (default: all)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    table = sc21.load_table()
    rows = [int(i) for i in args.rows.split(",")] if args.rows else range(len(table))
    sim.compile.MAX_INSTRUCTIONS = max(sim.compile.MAX_INSTRUCTIONS, sc21.INSTRUCTION_LIMIT)  # as sc21.main does
    results = [table1_row(table.iloc[i].to_dict()) for i in rows]
    print(f"{'model':>7} {'tp':>2} {'pp':>3} {'n/rank':>7} {'ledger':>7} {'act':>6} {'buf':>6} "
          f"{'step20B':>7} {'megatron':>8} fits80GB")
    for r in results:
        bd = r["breakdown_GiB"]
        print(f"{r['params_b']:>6}B {r['tp']:>2} {r['pp']:>3} {r['params_on_rank_b']:>6.2f}B "
              f"{r['ledger_peak_GiB']:>7.1f} {bd.get('activations', 0):>6.1f} {bd.get('comm_buffers', 0):>6.1f} "
              f"{r['megatron_step_GiB']:>7.1f} {r['megatron_peak_GiB']:>8.1f} {r['fits_80GB']}")
    layers = [korthikanti_row(row) for row in korth.load_iterations().to_dict("records")]
    print("\nKorthikanti 2022 eq. 2 (one layer, tp, no sequence parallelism) vs the ledger, MiB")
    for r in layers:
        print(f"{r['model']:>5} t={r['tp']} b={r['micro_batch']}: paper {r['paper_layer_MiB']:.0f}, ledger "
              f"{r['ledger_layer_MiB']:.0f} ({r['error']:+.1%}); full recompute paper "
              f"{r['paper_full_recompute_MiB']:.0f}, ledger {r['ledger_checkpoint_MiB']:.0f}")
    print("\nThe same with sequence parallelism (eq. 3) and selective recomputation (sbh (10 + 24/t); eq. 6 with SP), "
          "MiB paper / ledger (the ledger adds the layernorm statistics)")
    for r in layers:
        cells = [f"{key} {r[f'paper_{key}_MiB']:.1f} / {r[f'ledger_{key}_MiB']:.2f} ({r[f'error_{key}']:+.2%})"
                 for key in ("sp_none", "tp_selective", "sp_selective")]
        print(f"{r['model']:>5}: " + "; ".join(cells))
    if args.json:
        args.json.write_text(json.dumps({"table1": results, "korthikanti_layers": layers}, indent=1) + "\n")


if __name__ == "__main__":
    main()
