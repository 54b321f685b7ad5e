"""Simulated gradient-sync cost of every method against row sparsity and against bandwidth.

One step's gradients of the LSTM LM (``lstm-lm``: 33,278 x 650 sparse embedding, two 650-wide
LSTM layers, the head) on 2 data-parallel ranks of a device joined by one link, priced by the
registry (``sim.gradient_sync``): the collectives by ``sim.collectives`` (alpha-beta ring), the
encode/decode traffic at the device's memory bandwidth. All gradients are one bucket and nothing
overlaps: the figure shows the sync cost itself, not an iteration. Rows touched: measured on
WikiText-2 (``sim/data/row_sparsity.csv``) for the batch of 20 windows of 35 tokens per replica
(Zaremba et al.'s medium LSTM), and swept for panel (a)/(b) with the union of two replicas'
independent rows, 1 - (1 - d)^2.

    python -m analysis.compression_figures --out docs/figures/compression
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path
from typing import Any

from sim.cluster import ClusterSpec, cluster_from_dict
from sim.comm import ClusterComm
from sim.gradient_sync import GRADIENT_SYNC, GradTensor, SyncContext, phases_s, wire_bytes
from sim.gradient_sync_rows import rows_touched

VOCAB, EMBED, HIDDEN, WINDOWS, SEQ = 33278, 650, 650, 20, 35
DEVICE = "A100-80GB"  # sim/data/hardware.yaml (memory bandwidth from the datasheet)
GBITS = [0.1 * 10 ** (i / 8) for i in range(25)]  # 0.1 .. 100 Gbit/s
DENSITIES = [10 ** (-3 + i / 6) for i in range(19)]  # 0.1% .. 100% of the rows


def two_rank_cluster(gbit: float, device: str = DEVICE) -> ClusterSpec:
    """Two devices joined by one link of ``gbit`` Gbit/s (latency: kernel TCP, as the netns plans)."""
    link = {"name": f"link-{gbit:g}gbit", "kind": "ethernet", "bandwidth_Bps": gbit * 1.25e8, "latency_s": 3.0e-5,
            "source": "a swept link bandwidth (analysis/compression_figures.py)"}
    return cluster_from_dict({"name": f"2x{device}", "nodes": 1, "devices_per_node": 2, "device": device,
                              "intra_node_link": link, "source": "two ranks on one link, for the figures"})


def lstm_context(method: str, touched: float, union: float, world: int = 2) -> SyncContext:
    embed = GradTensor(VOCAB, EMBED, 4, touched_rows=touched, union_rows=union)
    lstm = [GradTensor(4 * HIDDEN, EMBED, 4), GradTensor(4 * HIDDEN, HIDDEN, 4), GradTensor(1, 4 * HIDDEN, 4),
            GradTensor(1, 4 * HIDDEN, 4)] * 2
    head = [GradTensor(VOCAB, HIDDEN, 4), GradTensor(1, VOCAB, 4)]
    config = GRADIENT_SYNC[method].config()
    return SyncContext((embed, *lstm, *head), world, config)


def sync_s(method: str, touched: float, union: float, gbit: float, device: str = DEVICE) -> float:
    cluster = two_rank_cluster(gbit, device)
    phases = GRADIENT_SYNC[method].plan(lstm_context(method, touched, union))
    return phases_s(phases, (0, 1), ClusterComm(cluster), cluster.device, method)


def measured_rows() -> tuple[float, float]:
    return (rows_touched("wikitext-2", VOCAB, SEQ, WINDOWS), rows_touched("wikitext-2", VOCAB, SEQ, 2 * WINDOWS))


def crossover_gbit(method: str, touched: float, union: float, device: str = DEVICE) -> float | None:
    """The bandwidth above which dense all-reduce is faster than ``method`` (bisection in log)."""
    def gain(g: float) -> float:
        return sync_s("allreduce", touched, union, g, device) - sync_s(method, touched, union, g, device)
    lo, hi = 0.01, 10_000.0
    if gain(lo) <= 0 or gain(hi) >= 0:
        return None
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if gain(mid) > 0 else (lo, mid)
    return lo


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/figures/compression"))
    parser.add_argument("--device", default=DEVICE, help="a device of sim/data/hardware.yaml; its codec "
                        "rates are the profiled ones where sim/data/codec_rates.csv has them")
    args = parser.parse_args(argv)
    device = args.device
    args.out.mkdir(parents=True, exist_ok=True)
    # The distributed optimizer compresses nothing: its reduce-scatter and the parameter all-gather after
    # the step move what the all-reduce moves, and its sync alone (the reduce-scatter) would plot as half
    # the all-reduce's time (docs/distributed-optimizer.md prices it).
    methods = [m for m in GRADIENT_SYNC if not GRADIENT_SYNC[m].shards_optimizer]
    touched, union = measured_rows()
    rows = []
    for d in DENSITIES:
        k, u = d * VOCAB, (1 - (1 - d) ** 2) * VOCAB
        for m in methods:
            rows.append({"sweep": "density", "density": d, "gbit": 10.0, "method": m,
                         "wire_bytes": wire_bytes(GRADIENT_SYNC[m].plan(lstm_context(m, k, u))),
                         "sync_s": sync_s(m, k, u, 10.0, device)})
    for g in GBITS:
        for m in methods:
            rows.append({"sweep": "bandwidth", "density": touched / VOCAB, "gbit": g, "method": m,
                         "wire_bytes": wire_bytes(GRADIENT_SYNC[m].plan(lstm_context(m, touched, union))),
                         "sync_s": sync_s(m, touched, union, g, device)})
    with (args.out / f"compression_sim_{device}.csv").open("w", newline="") as handle:
        handle.write(f"# lstm-lm gradients, 2 ranks of {device} on one link (latency 30 us), one bucket, no overlap;"
                     f" measured WikiText-2 rows: {touched:.0f} per replica, {union:.0f} union\n")
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    crossings = {m: crossover_gbit(m, touched, union, device) for m in methods if m != "allreduce"}
    for m, g in crossings.items():
        print(f"{m:>10}: faster than dense all-reduce below {g:.3g} Gbit/s" if g else
              f"{m:>10}: no crossover in 0.01..10000 Gbit/s")
    _plot(rows, methods, args.out, touched, crossings, device)


def _plot(rows: list[dict], methods: list[str], out: Path, touched: float, crossings: dict, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for m in methods:
        dens = [r for r in rows if r["sweep"] == "density" and r["method"] == m]
        band = [r for r in rows if r["sweep"] == "bandwidth" and r["method"] == m]
        axes[0].loglog([100 * r["density"] for r in dens], [r["wire_bytes"] / 1e6 for r in dens], label=m)
        axes[1].loglog([100 * r["density"] for r in dens], [1e3 * r["sync_s"] for r in dens], label=m)
        axes[2].loglog([r["gbit"] for r in band], [1e3 * r["sync_s"] for r in band], label=m)
    axes[0].set(xlabel="embedding rows touched per replica (%)", ylabel="bytes on the wire per step (MB)",
                title="(a) communication volume")
    axes[1].set(xlabel="embedding rows touched per replica (%)", ylabel="sync time per step (ms)",
                title="(b) sync time at 10 Gbit/s")
    axes[2].set(xlabel="link bandwidth (Gbit/s)", ylabel="sync time per step (ms)",
                title=f"(c) vs bandwidth, measured rows ({100 * touched / VOCAB:.2f}%)")
    # Panel (b) spans less than a decade: label it at 1-2-5 steps from the decade below (ticks at 200-600
    # alone left the three fastest methods below the lowest label).
    low = min(1e3 * r["sync_s"] for r in rows if r["sweep"] == "density")
    axes[1].set_ylim(bottom=10 ** math.floor(math.log10(low)))
    axes[1].yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axes[1].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axes[1].yaxis.set_minor_formatter(NullFormatter())
    # The reference lines say what they mark.
    pct = 100 * touched / VOCAB
    for ax in axes[:2]:
        _marked(ax, pct, f"measured rows, {pct:.2f}%", ":")
    if crossings.get("s2"):
        gbit = float(f"{crossings['s2']:.3g}")  # 3 digits, written out: 7810, not 7.81e+03
        _marked(axes[2], crossings["s2"], f"s2 = allreduce at {gbit:g} Gbit/s", "--")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Simulated: lstm-lm gradients (sparse 33,278 x 650 embedding), 2 x {device}, one link, "
                 "one bucket, no overlap; codec: profiled rate if any, else memory bandwidth", fontsize=9)
    fig.tight_layout()
    for ext in ("pdf", "png"):
        fig.savefig(out / f"compression_sim_{device}.{ext}")
    plt.close(fig)


def _marked(ax: Any, x: float, label: str, style: str) -> None:
    """A vertical reference line at ``x``, its label written along it."""
    ax.axvline(x, color="grey", lw=0.8, ls=style)
    ax.text(x, 0.98, f" {label}", transform=ax.get_xaxis_transform(), rotation=90, va="top", ha="right",
            fontsize=7, color="0.35", bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})


if __name__ == "__main__":
    main()
