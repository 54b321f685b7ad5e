"""EmbRace in simulation: throughput against GPU count and against network bandwidth, per method,
and the share of communication the 2D schedule hides (``benchmarks/embrace_scaling.py`` runs it).

Every point is one ``sim.simulate`` of a data-parallel plan (pp = tp = 1, one micro-batch of 8 per
GPU unless told otherwise, fp32) of an embedding-dominated Transformer LM (``gpt-wordlm``, WikiText-2's 33,278-word
vocabulary) on a catalog cluster, with the embedding communicated by each method:

- ``allreduce`` / ``fp16``: dense tables, the whole gradient in the gradient-sync buckets (DDP);
- ``ps``: a Parallax-like parameter server colocated with the workers (sim.embedding_ps): the
  iteration's rows pulled before its forwards, their gradients pushed after its backwards;
- ``embrace-seq`` / ``embrace-2d``: tables sharded, touched rows by all-to-all (sim.embedding_embrace),
  lookups before each forward, or the 2D schedule; ``embrace-2d+fp16``: the same with the dense
  layers' buckets in fp16 (any gradient-sync method composes with a sharded embedding).

Per-destination volumes come from the unique rows of real WikiText-2 batches
(``sim/data/embrace_rows_wikitext2.json``). Compute is the analytic kernel model of the device.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.figures import _plt, _save
from sim.plan import Plan
from sim.simulate import simulate

ROW_STATS = "sim/data/embrace_rows_wikitext2.json"
METHODS: dict[str, dict[str, Any]] = {
    "allreduce": {"gradient_sync": {"method": "allreduce"}, "embedding": {"method": "dense"}},
    "fp16": {"gradient_sync": {"method": "fp16"}, "embedding": {"method": "dense"}},
    "ps": {"embedding": {"method": "ps", "row_stats": ROW_STATS}},
    "embrace-seq": {"embedding": {"method": "embrace", "schedule": "sequential", "row_stats": ROW_STATS}},
    "embrace-2d": {"embedding": {"method": "embrace", "schedule": "2d", "row_stats": ROW_STATS}},
    # The methods compose: the dense layers' buckets in fp16, the tables sharded.
    "embrace-2d+fp16": {"gradient_sync": {"method": "fp16"},
                        "embedding": {"method": "embrace", "schedule": "2d", "row_stats": ROW_STATS}},
}
BASELINES = ("allreduce", "fp16", "ps")
# Clusters of the catalog (sim/data/hardware.yaml, examples/clusters): GPUs per node, their source.
CLUSTERS = {"a100-64": ({"preset": "a100-64"}, 8),
            "rtx3090-ethernet": ("examples/clusters/rtx3090-ethernet.yaml", 2)}
# EmbRace's abstract (arXiv:2110.09132): "up to 2.41X speedup compared to the state-of-the-art
# distributed training baselines".
PAPER_SPEEDUP = 2.41


def _cluster(name: str, nodes: int, inter_Bps: float | None = None) -> dict[str, Any]:
    base, _ = CLUSTERS[name]
    if isinstance(base, str):
        import yaml

        base = dict(yaml.safe_load(Path(base).read_text())["cluster"])
    cluster = {**base, "nodes": nodes}
    if inter_Bps is not None:
        cluster["overrides"] = {"inter_node_link": {"bandwidth_Bps": inter_Bps}}
    return cluster


def point(method: str, cluster: dict[str, Any], gpus: int, workload_options: dict[str, Any],
          micro_batch: int = 8, microbatches: int = 1) -> dict[str, Any]:
    plan = Plan.from_dict({
        "name": f"embrace-{method}-{gpus}", "workload": "gpt-wordlm",
        "workload_options": {"data": "wikitext-2", **workload_options}, "cluster": cluster, "dtype": "fp32",
        "parallelism": {"dp": gpus}, "schedule": {"micro_batch": micro_batch, "microbatches": microbatches},
        **METHODS[method]})
    result = simulate(plan)
    top = result.table[result.table["parent"] == -1]
    rank0 = top[top["rank"] == top["rank"].min()]
    comm = rank0[rank0["kind"].isin(["ALLREDUCE", "ALLTOALL"])]
    compute = rank0[rank0["stream"] == "compute"]
    busy = float((compute["end_s"] - compute["start_s"]).sum())
    comm_s = float((comm["end_s"] - comm["start_s"]).sum())
    exposed = max(result.iteration_s - busy, 0.0)
    return {"method": method, "gpus": gpus, "iteration_ms": result.iteration_s * 1e3,
            "samples_per_s": result.samples_per_s, "comm_ms": comm_s * 1e3, "exposed_comm_ms": exposed * 1e3,
            "hidden_share": 1.0 - exposed / comm_s if comm_s > 0 else float("nan"),
            "wire_MB": float(comm["bytes"].sum()) / 1e6}


def scaling(cluster: str, workload_options: dict[str, Any], gpus: Iterable[int], **batch: int) -> pd.DataFrame:
    per_node = CLUSTERS[cluster][1]
    rows = [{"cluster": cluster, **point(m, _cluster(cluster, max(g // per_node, 1)), g, workload_options, **batch)}
            for g in gpus for m in METHODS]
    return pd.DataFrame(rows)


def bandwidth(cluster: str, workload_options: dict[str, Any], gpus: int, inter_Bps: Iterable[float],
              **batch: int) -> pd.DataFrame:
    per_node = CLUSTERS[cluster][1]
    rows = [{"cluster": cluster, "inter_node_GBps": b / 1e9,
             **point(m, _cluster(cluster, gpus // per_node, b), gpus, workload_options, **batch)}
            for b in inter_Bps for m in METHODS]
    return pd.DataFrame(rows)


def speedups(table: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """EmbRace-2D's throughput over the best and the worst baseline at each point."""
    wide = table.pivot_table(index=keys, columns="method", values="samples_per_s")
    best = wide[list(BASELINES)].max(axis=1)
    return pd.DataFrame({"over_allreduce": wide["embrace-2d"] / wide["allreduce"],
                         "over_ps": wide["embrace-2d"] / wide["ps"],
                         "over_best_baseline": wide["embrace-2d"] / best,
                         "2d_over_sequential": wide["embrace-2d"] / wide["embrace-seq"],
                         "2d_fp16_over_allreduce": wide["embrace-2d+fp16"] / wide["allreduce"],
                         "2d_fp16_over_best_baseline": wide["embrace-2d+fp16"] / best}).reset_index()


def draw(scale: pd.DataFrame, band: pd.DataFrame, out: Path, caption: str, tag: str) -> dict[str, dict[str, Path]]:
    """The scaling figure (samples/s over GPUs per cluster, and below each its speedup over dense
    all-reduce: on a100-64 the methods are within a few percent, so their throughput curves lie on top of
    each other) and the bandwidth figure; one legend above each figure, so it covers no curve."""
    plt = _plt()
    paths = {}
    colors = dict(zip(METHODS, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    clusters = list(dict.fromkeys(scale["cluster"]))
    fig, axes = plt.subplots(2, len(clusters), figsize=(3.2 * len(clusters), 4.6), squeeze=False, sharex="col")
    for col, name in enumerate(clusters):
        part = scale[scale["cluster"] == name]
        allreduce = part[part["method"] == "allreduce"].set_index("gpus")["samples_per_s"]
        for method in METHODS:
            rows = part[part["method"] == method]
            style = {"marker": "o", "ms": 3, "label": method, "color": colors[method]}
            axes[0][col].plot(rows["gpus"], rows["samples_per_s"], **style)
            axes[1][col].plot(rows["gpus"], rows["samples_per_s"].to_numpy() / allreduce.loc[rows["gpus"]].to_numpy(),
                              **style)
        gpus = sorted(set(part["gpus"]))
        axes[1][col].set_xscale("log", base=2)
        axes[1][col].set_xticks(gpus, [str(g) for g in gpus])
        axes[1][col].minorticks_off()
        axes[1][col].set_xlabel("GPUs")
        axes[0][col].set_title(name, fontsize=9)
    axes[0][0].set_ylabel("samples/s (simulated)")
    axes[1][0].set_ylabel("speedup over allreduce")
    _legend_above(fig, axes[0][0])
    paths["scaling"] = _save(fig, scale, out, f"embrace-scaling-{tag}", caption)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(6.4, 2.6))
    for method in METHODS:
        rows = band[band["method"] == method]
        ax1.plot(rows["inter_node_GBps"], rows["samples_per_s"], marker="o", ms=3, label=method,
                 color=colors[method])
        if method.startswith("embrace"):
            ax2.plot(rows["inter_node_GBps"], rows["hidden_share"] * 100, marker="o", ms=3, color=colors[method])
    ticks = sorted(set(band["inter_node_GBps"]))
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("inter-node bandwidth (GB/s per adapter)")
    ax1.set_ylabel("samples/s (simulated)")
    ax2.set_ylabel("communication hidden (%)")
    _legend_above(fig, ax1)
    paths["bandwidth"] = _save(fig, band, out, f"embrace-bandwidth-{tag}", caption)
    return paths


def _legend_above(fig: Any, ax: Any) -> None:
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=7, frameon=False)
