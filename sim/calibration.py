"""Calibrating the analytic cost model on public measurements, with a held-out part never fitted.

The data: 1,440 Megatron-LM GPT iteration times on one 8 x A100 node (vTrain, Bang et al. MICRO 2024),
shipped as ``sim/data/a100_single_node_megatron.csv`` (source and licence in
``sim/data/a100_single_node_megatron.md``). ``hold_out_model`` holds out a whole *model shape*
(hidden, heads, seq) with every layer count of it, so no held-out row has a fitted row of the same
width at another depth (a straight line through those would predict it almost exactly);
``model_splits`` gives one such split per shape. ``fit_efficiency`` fits the efficiency curve's two
parameters to any predictor; ``quick_predict`` is a 1F1B predictor from per-layer costs (no lowering,
no event simulation; its pipeline is the fast estimate's, ``sim.estimate_pipeline``).

Run ``python -m sim.calibration`` to fit the closed form on each split and print every split's errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sim.analytic import AnalyticCostModel, EfficiencyCurve, LayerCosts, tp_comm_times, uncalibrated_curve
from sim.cluster import ClusterSpec, load_cluster
from sim.collectives import collective_time, p2p_time
from sim.comm import concurrent_senders
from sim.estimate_pipeline import StageTime, pipeline_time
from sim.hardware import get_device
from sim.implementations import MEGATRON_LM, implementation_options
from sim.tied_embedding import tied_embedding_bytes, tied_ranks
from sim.workloads import TransformerConfig, transformer_layers
from traces.errors import BundleError, ConfigError

MEGATRON_A100_CSV = Path(__file__).resolve().parent / "data" / "a100_single_node_megatron.csv"

_COLUMNS = {
    "# GPUs": "gpus", "global batch": "global_batch", "micro batch": "micro_batch",
    "hidden size": "hidden", "attention heads": "heads", "# layers": "layers",
    "sequence length": "seq", "tensor parallelism": "tp", "data parallelism": "dp",
    "pipeline parallelism": "pp", "iteration time (ms)": "iter_time_ms",
}
# A model shape: its width, heads and sequence. The layer count is not part of it, so a split holds out
# every depth of a shape together. The vTrain data has two shapes: hidden 1,024 and 2,048 (16 heads,
# sequence 1,024), each at 12, 16, 20 and 24 layers.
MODEL_COLUMNS = ["hidden", "heads", "seq"]
ModelShape = tuple[int, int, int]
# Not stated by the data set; assumed as its README says: GPT-2 vocabulary padded to 51,200
# (Shoeybi et al. 2019) and fp16 mixed precision with Adam. A100 memory size is not stated either:
# the 80 GB part (2,039 GB/s) of the dgx-a100-8 preset is assumed.
MEGATRON_VOCAB = 51200
MEGATRON_DTYPE = "fp16"
# Megatron-LM's plain 1F1B exchanges whole tensors and computes on only once they are through: every
# send and receive of its schedule goes through _communicate with wait_on_reqs=True, then
# torch.cuda.synchronize() under batch_p2p_comm and batch_p2p_sync (megatron/core/pipeline_parallel/
# p2p_communication.py, read at 00c2c0ad; v2.5's megatron/p2p_communication.py waits the same way). The core
# code has no scatter/gather; whole tensors. The row plans (analysis.calibrate.row_to_plan) and quick_predict.
MEGATRON_P2P = "blocking"
MEGATRON_DEVICE = "A100-80GB"
MEGATRON_CLUSTER = "dgx-a100-8"
# A run on more than one node: 8-GPU A100 nodes joined by the network of vTrain's multi-node
# configurations, the a100-64 preset (4 x HDR 200 Gbit/s per node; its source is in sim/cluster.py).
MEGATRON_MULTI_NODE_CLUSTER = "a100-64"
MEGATRON_GPUS_PER_NODE = 8
# What Megatron-LM ran (unfused attention, dropout 0.1, a tied head) is sim.implementations' MEGATRON_LM.


def megatron_cluster(gpus: int, nvlink_efficiency: float = 1.0) -> dict[str, Any]:
    """The cluster a Megatron row of ``gpus`` GPUs ran on, as a ``load_cluster`` mapping: the one home of
    that choice (``analysis.calibrate.row_to_plan``, ``SimulatorPredictor``, ``quick_predict``).

    Up to 8 GPUs: one DGX A100 node with the row's GPU count (the vTrain single-node data). Above 8: nodes
    of 8 over the a100-64 preset's network, ``gpus / 8`` of them. Ranks are placed node-major, and the
    plan's rank order is Megatron-LM's (tensor-parallel ranks innermost, then data-parallel, then
    pipeline; ``sim.program.Program.rank_of``), so a tensor-parallel group of up to 8 that divides 8 stays
    inside a node, as Megatron places it. ``nvlink_efficiency`` overrides the catalog's NVLink efficiency.
    """
    if isinstance(gpus, bool) or int(gpus) != gpus or gpus < 1:
        raise ConfigError("gpus", f"must be a positive integer, got {gpus!r}", "give the run's GPU count")
    gpus = int(gpus)
    if gpus <= MEGATRON_GPUS_PER_NODE:
        cluster: dict[str, Any] = {"preset": MEGATRON_CLUSTER, "devices_per_node": gpus}
    else:
        nodes, rest = divmod(gpus, MEGATRON_GPUS_PER_NODE)
        if rest:
            raise ConfigError("gpus", f"{gpus} GPUs is not a whole number of {MEGATRON_GPUS_PER_NODE}-GPU A100 nodes",
                              f"use 1-{MEGATRON_GPUS_PER_NODE} GPUs (one node) or a multiple of "
                              f"{MEGATRON_GPUS_PER_NODE} (e.g. {(nodes + 1) * MEGATRON_GPUS_PER_NODE})")
        cluster = {"preset": MEGATRON_MULTI_NODE_CLUSTER, "name": f"a100-{nodes}x{MEGATRON_GPUS_PER_NODE}",
                   "nodes": nodes, "devices_per_node": MEGATRON_GPUS_PER_NODE}
    if nvlink_efficiency != 1.0:
        cluster["overrides"] = {"intra_node_link": {"efficiency": float(nvlink_efficiency)}}
    return cluster


@lru_cache(maxsize=64)
def megatron_cluster_spec(gpus: int, nvlink_efficiency: float = 1.0) -> ClusterSpec:
    """``megatron_cluster`` loaded (cached: a fit asks for the same few clusters thousands of times)."""
    return load_cluster(megatron_cluster(gpus, nvlink_efficiency))


MEGATRON_TIME_COLUMN = "iteration time (ms)"


def read_megatron_csv(path: str | Path) -> pd.DataFrame:
    """A table in the vTrain column format with short column names, row by row as written (nothing
    checked but the columns). The iteration-time column is optional: without it (a run to predict,
    not a measurement) ``iter_time_ms`` and ``iter_time_s`` are empty (NaN)."""
    path = Path(path)
    if not path.is_file():
        raise BundleError(path, "Megatron runs CSV not found")
    df = read_csv_rows(path)
    missing = [c for c in _COLUMNS if c not in df.columns and c != MEGATRON_TIME_COLUMN]
    if missing:
        raise BundleError(path, f"missing column(s) {missing}; the header must name {list(_COLUMNS)} "
                          f"({MEGATRON_TIME_COLUMN!r} optional)")
    if df.empty:  # predict-runs predicted 0 of 0 rows and exited 0
        raise BundleError(path, "a header and no runs (fix: one run per line under the header)")
    if MEGATRON_TIME_COLUMN not in df.columns:
        df[MEGATRON_TIME_COLUMN] = float("nan")
    times = pd.to_numeric(df[MEGATRON_TIME_COLUMN], errors="coerce")
    not_numbers = times.isna() & df[MEGATRON_TIME_COLUMN].notna()
    if not_numbers.any():
        first = int(not_numbers.to_numpy().argmax())
        value = df[MEGATRON_TIME_COLUMN].iloc[first]
        raise BundleError(path, f"{MEGATRON_TIME_COLUMN!r} of row {first} (CSV line {first + 2}) is {value!r}, "
                          "not a number (fix: milliseconds, or leave it empty)")
    df[MEGATRON_TIME_COLUMN] = times
    df = df.rename(columns=_COLUMNS)[list(_COLUMNS.values())]
    df["iter_time_s"] = df["iter_time_ms"] / 1e3
    return df


def read_csv_rows(path: Path, as_written: bool = False) -> pd.DataFrame:
    """The CSV's rows under its header, or a BundleError naming the file: empty, not UTF-8, or a row with
    more fields than the header (pandas took a first such row's extra leading fields as an index and
    shifted every column of the rows after them: '# GPUs' read the micro-batch). A space after a comma is
    not part of the next field (a header written "# GPUs, global batch" named no column the reader knows).
    ``as_written``: every cell as its text (a column with an empty cell was read as floats, 2 -> 2.0)."""
    text = {"dtype": str, "keep_default_na": False} if as_written else {}
    try:
        df = pd.read_csv(path, skipinitialspace=True, **text)
    except pd.errors.EmptyDataError:
        raise BundleError(path, "empty file (fix: a header line naming the columns, then one run per line)") from None
    except UnicodeDecodeError as exc:
        raise BundleError(path, f"not UTF-8 text (byte {exc.start}) (fix: save the CSV as UTF-8)") from None
    except pd.errors.ParserError as exc:
        raise BundleError(path, f"{str(exc).strip().removeprefix('Error tokenizing data. C error: ')} "
                          "(fix: one value per header column on every line)") from None
    if not isinstance(df.index, pd.RangeIndex):
        raise BundleError(path, f"a row has more fields than the header's {len(df.columns)} (the first data line "
                          "holds the extra ones) (fix: one value per header column on every line)")
    return df


def load_megatron_a100(path: str | Path = MEGATRON_A100_CSV) -> pd.DataFrame:
    """The vTrain single-node Megatron table with short column names and ``iter_time_s`` added; every row
    must have tp x dp x pp GPUs (``read_megatron_csv`` reads a table without that check)."""
    df = read_megatron_csv(path)
    bad = df[df["gpus"] != df["tp"] * df["dp"] * df["pp"]]
    if len(bad):
        raise BundleError(Path(path), f"{len(bad)} rows where GPUs != tp * dp * pp (first: row {bad.index[0]})")
    return df


def model_shapes(df: pd.DataFrame) -> list[ModelShape]:
    """The distinct (hidden, heads, seq) of ``df``, sorted."""
    return sorted(tuple(int(v) for v in row) for row in df[MODEL_COLUMNS].drop_duplicates().to_numpy())


def hold_out_model(df: pd.DataFrame, shape: ModelShape) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(fit rows, held-out rows): every row of model ``shape`` (all its layer counts) is held out."""
    is_held = (df[MODEL_COLUMNS] == pd.Series(shape, index=MODEL_COLUMNS)).all(axis=1)
    if not is_held.any():
        raise ConfigError("shape", f"no rows of model (hidden, heads, seq) = {tuple(shape)}",
                          f"use one of {model_shapes(df)}")
    if is_held.all():
        raise ConfigError("rows", "every row belongs to the held-out model; nothing is left to fit",
                          "calibrate on data with at least two model shapes")
    return df[~is_held].reset_index(drop=True), df[is_held].reset_index(drop=True)


def model_splits(df: pd.DataFrame) -> list[tuple[ModelShape, pd.DataFrame, pd.DataFrame]]:
    """Leave one model shape out, once per shape: [(held-out shape, fit rows, held-out rows)]."""
    return [(shape, *hold_out_model(df, shape)) for shape in model_shapes(df)]


def depth_splits(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame, pd.DataFrame]]:
    """Fit on the shallower half of the layer counts and test on the deeper half, then the reverse:
    [(label, fit rows, held-out rows)]. Every width is in both halves, so this tests whether a fit
    carries to depths it has not seen (what a what-if on a deeper model needs)."""
    depths = sorted(int(d) for d in df["layers"].unique())
    if len(depths) < 2:
        raise ConfigError("layers", f"only one layer count ({depths}) in the data", "a depth split needs two or more")
    shallow = depths[: len(depths) // 2]
    is_shallow = df["layers"].isin(shallow)
    low, high = df[is_shallow].reset_index(drop=True), df[~is_shallow].reset_index(drop=True)
    deep = depths[len(depths) // 2:]
    return [(f"layers {min(deep)}-{max(deep)} (fit on {min(shallow)}-{max(shallow)})", low, high),
            (f"layers {min(shallow)}-{max(shallow)} (fit on {min(deep)}-{max(deep)})", high, low)]


# --- a 1F1B predictor without lowering ----------------------------------------------------------------------

@lru_cache(maxsize=256)
def _layer_costs(model: AnalyticCostModel, hidden: int, heads: int, layers: int, seq: int,
                 micro_batch: int, tp: int) -> tuple[LayerCosts, LayerCosts, LayerCosts]:
    cfg = TransformerConfig("gpt", vocab=MEGATRON_VOCAB, hidden=hidden, heads=heads, num_layers=layers,
                            seq=seq, **implementation_options(MEGATRON_LM, "gpt"))
    specs = transformer_layers(cfg)
    embed, block, head = specs[0], specs[1], specs[-1]  # all blocks are identical
    return tuple(model.layer_costs(spec, micro_batch, tp) for spec in (embed, block, head))  # type: ignore


def quick_predict(row: Mapping[str, Any], model: AnalyticCostModel,
                  cluster: ClusterSpec | None = None) -> float:
    """Seconds per Megatron iteration: 1F1B with Megatron's full recompute (the transformer blocks re-run,
    one at a time inside the backward), from per-layer costs without lowering.

    The pipeline is priced by the rule the fast estimate and the engine share
    (``sim.estimate_pipeline.pipeline_time``: the 1F1B action graph weighted with each stage's own
    forward, recompute and backward seconds, TP all-reduces included, and one point-to-point hop on
    every edge that crosses stages, blocking the sender's compute as Megatron-LM's exchange does), then
    the un-overlapped data-parallel gradient all-reduce (no bucketing), the tied-embedding gradient
    all-reduce between first and last stage, and the Adam step. Megatron's rank order puts TP ranks
    innermost, then DP, then PP; its partition puts layers / pp blocks on each stage, the embedding on
    the first and the head on the last.

    Until session 7 the pipeline was (m + pp - 1) x the slowest stage (each stage paying both hops
    per micro-batch), which charges the ramp at the slowest stage: with the LM head (about 3.5
    blocks at hidden 1,024) on the last stage it overpriced the vTrain pp 4 rows (docs/accuracy.md,
    section 9).
    """
    cluster = cluster or megatron_cluster_spec(int(row["gpus"]))
    tp, dp, pp, b = int(row["tp"]), int(row["dp"]), int(row["pp"]), int(row["micro_batch"])
    m = int(row["global_batch"]) // (dp * b)
    if m < 1:
        raise ConfigError("global_batch", f"{row['global_batch']} < dp x micro_batch = {dp * b}",
                          "raise the global batch")
    embed, block, head = _layer_costs(model, int(row["hidden"]), int(row["heads"]), int(row["layers"]),
                                      int(row["seq"]), b, tp)
    tp_ranks = list(range(tp))
    tp_time = {id(c): tp_comm_times(c, tp_ranks, cluster) for c in (embed, block, head)}
    per_stage_blocks = [len(a) for a in np.array_split(np.arange(int(row["layers"])), pp)]

    stages, stage_grad_bytes, stage_param_bytes = [], [], []
    for s, n_blocks in enumerate(per_stage_blocks):
        members = [(block, n_blocks)] + [(embed, 1)] * (s == 0) + [(head, 1)] * (s == pp - 1)
        # Full recompute as Megatron checkpoints: the forward, then each transformer block re-run inside
        # the backward (its TP all-reduces again; the embedding and the LM head are outside the
        # checkpointed stack, sim.memory.megatron_checkpointed), then the backward with its own.
        fwd = sum(n * (c.fwd_s + tp_time[id(c)][0]) for c, n in members)
        recompute = n_blocks * (block.recompute_s + tp_time[id(block)][0])
        bwd_input = sum(n * (c.bwd_input_s + tp_time[id(c)][1]) for c, n in members)
        bwd_weight = sum(n * c.bwd_weight_s for c, n in members)
        stages.append(StageTime(fwd, bwd_input + bwd_weight, recompute, bwd_input, bwd_weight))
        stage_grad_bytes.append(sum(n * c.grad_bytes for c, n in members))
        stage_param_bytes.append(sum(n * c.param_bytes for c, n in members))

    # the activation forward and its gradient back, between ranks tp x dp apart, while the stage's other
    # ranks of the node send off it too (they share its adapters, as the engine prices it)
    hop = 0.0
    if pp > 1:
        senders = concurrent_senders(cluster, tp * dp, 0, tp * dp)
        hop = p2p_time(block.output_bytes, 0, tp * dp, cluster, senders)
    total = pipeline_time("1f1b", pp, m, 1, stages, [st.fwd_s + st.recompute_s + st.bwd_s for st in stages],
                          [hop] * pp, blocking=MEGATRON_P2P == "blocking").makespan
    if dp > 1:
        dp_ranks = [tp * d for d in range(dp)]
        total += max(collective_time("all_reduce", g, dp_ranks, cluster) for g in stage_grad_bytes)
    if pp > 1:
        # Megatron ties the word embedding to the LM head by default (--untie-embeddings-and-output-weights
        # is store_true: megatron/arguments.py line 558 at 23.04 2360d73; v2.5 has no flag, GPTModel always
        # shares) and, with more than one stage, all-reduces that weight's gradient between the first and
        # last stage after the DP all-reduce and before the step (megatron/training.py lines 371-394 at v2.5
        # e269e20; optimizer.py allreduce_word_embedding_grads, lines 202-228 at 23.04). The bytes and the
        # ranks are sim.tied_embedding's, the rule the lowering and the fast estimate apply to the plans
        # that ask for implementation: megatron-lm (fp16 here: the gradients are held in their own dtype).
        total += collective_time("all_reduce", tied_embedding_bytes(head), list(tied_ranks(tp, dp, pp - 1)), cluster)
    total += model.optimizer_step_s(max(stage_param_bytes))
    return total


Predictor = Callable[[Mapping[str, Any], EfficiencyCurve], float]


def megatron_predictor(cluster: ClusterSpec | None = None) -> Predictor:
    """``predict(row, curve)`` for ``fit_efficiency``: quick_predict on the assumed A100 setup
    (``cluster``, or each row's own, ``megatron_cluster_spec``)."""
    device = get_device(MEGATRON_DEVICE)
    models: dict[EfficiencyCurve, AnalyticCostModel] = {}

    def predict(row: Mapping[str, Any], curve: EfficiencyCurve) -> float:
        if curve not in models:
            models.clear()  # the optimiser moves on; keep the cache small
            models[curve] = AnalyticCostModel(device, MEGATRON_DTYPE, curve,
                                              attention=implementation_options(MEGATRON_LM, "gpt")["attention"])
        return quick_predict(row, models[curve], cluster)

    return predict


# --- fitting and scoring ----------------------------------------------------------------------------------

def _rows(rows: pd.DataFrame | Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return rows.to_dict("records") if isinstance(rows, pd.DataFrame) else list(rows)


def fit_efficiency(rows: pd.DataFrame | Sequence[Mapping[str, Any]],
                   predict: Callable[[Mapping[str, Any], EfficiencyCurve], float],
                   initial: EfficiencyCurve | None = None, target: str = "iter_time_s") -> EfficiencyCurve:
    """Least-squares fit of (eff_max, flops_half) on log(predicted / measured) over ``rows``.

    Relative (log) residuals weigh a 100 ms and a 2 s iteration alike; a soft-L1 loss keeps a few
    outliers from steering the fit. Only the rows given are used: pass the calibration part only.
    """
    from scipy.optimize import least_squares  # scipy is slow to import; only fitting needs it

    data = _rows(rows)
    if not data:
        raise ConfigError("rows", "no rows to fit", "pass the calibration part of the data")
    measured = np.array([float(r[target]) for r in data])
    start = initial or EfficiencyCurve(eff_max=0.5, flops_half=1e9)
    mem_eff, attn_mem_eff = start.mem_eff, start.attn_mem_eff

    def curve_of(theta: np.ndarray) -> EfficiencyCurve:
        return EfficiencyCurve(eff_max=float(theta[0]), flops_half=float(10 ** theta[1]), mem_eff=mem_eff,
                               attn_mem_eff=attn_mem_eff)

    def residuals(theta: np.ndarray) -> np.ndarray:
        curve = curve_of(theta)
        return np.log(np.array([predict(r, curve) for r in data]) / measured)

    x0 = np.array([start.eff_max, math.log10(max(start.flops_half, 1e6))])
    fit = least_squares(residuals, x0, bounds=([0.05, 6.0], [1.0, 15.0]), loss="soft_l1", f_scale=0.1,
                        diff_step=1e-3, xtol=1e-6, ftol=1e-6)
    return curve_of(fit.x)


def score(rows: pd.DataFrame, predict: Callable[[Mapping[str, Any], EfficiencyCurve], float],
          curve: EfficiencyCurve, target: str = "iter_time_s") -> pd.DataFrame:
    """``rows`` with ``predicted_s`` and ``rel_error`` = (predicted - measured) / measured."""
    out = rows.copy()
    out["predicted_s"] = [predict(r, curve) for r in _rows(rows)]
    out["rel_error"] = (out["predicted_s"] - out[target]) / out[target]
    return out


def summarize(scored: pd.DataFrame) -> dict[str, float]:
    err = scored["rel_error"].abs()
    return {"rows": int(len(scored)), "median_abs_error": float(err.median()),
            "p90_abs_error": float(err.quantile(0.9)), "max_abs_error": float(err.max()),
            "mean_signed_error": float(scored["rel_error"].mean())}


def main() -> None:
    df = load_megatron_a100()
    predict = megatron_predictor()
    default = uncalibrated_curve(get_device(MEGATRON_DEVICE), MEGATRON_DTYPE)
    for shape, fit_rows, held in model_splits(df):
        fitted = fit_efficiency(fit_rows, predict, initial=default)
        print(f"held out: model (hidden, heads, seq) = {shape}, {len(held)} rows; fitted on the other "
              f"{len(fit_rows)}: eff_max={fitted.eff_max:.3f} flops_half={fitted.flops_half:.3g}")
        for label, curve in (("default", default), ("fitted", fitted)):
            s = summarize(score(held, predict, curve))
            print(f"  {label:8s} held-out median|err|={s['median_abs_error']:.1%} "
                  f"p90|err|={s['p90_abs_error']:.1%} max|err|={s['max_abs_error']:.1%} "
                  f"mean err={s['mean_signed_error']:+.1%}")


if __name__ == "__main__":
    main()
