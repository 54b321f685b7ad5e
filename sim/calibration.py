"""Calibrating the analytic cost model on public measurements, with a held-out part never fitted.

The data: 1,440 Megatron-LM GPT iteration times on one 8 x A100 node (vTrain, Bang et al. MICRO 2024;
see shared/validation/README.md). ``split_calibration`` holds out whole *model shapes*, so every
held-out configuration belongs to a model the fit has never seen. ``fit_efficiency`` fits the
efficiency curve's two parameters to any predictor (the lead plugs in the full simulator later);
``quick_predict`` is a closed-form 1F1B predictor to have something measurable now.

Run ``python -m sim.calibration`` to fit on the calibration part and print the errors of both parts.
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
from sim.hardware import get_device
from sim.workloads import TransformerConfig, transformer_layers
from traces.errors import BundleError, ConfigError
from traces.paths import validation_root

MEGATRON_A100_CSV = validation_root() / "a100_single_node_megatron.csv"

_COLUMNS = {
    "# GPUs": "gpus", "global batch": "global_batch", "micro batch": "micro_batch",
    "hidden size": "hidden", "attention heads": "heads", "# layers": "layers",
    "sequence length": "seq", "tensor parallelism": "tp", "data parallelism": "dp",
    "pipeline parallelism": "pp", "iteration time (ms)": "iter_time_ms",
}
SHAPE_COLUMNS = ["hidden", "heads", "layers", "seq"]
# Not stated by the data set; assumed as its README says: GPT-2 vocabulary padded to 51,200
# (Shoeybi et al. 2019) and fp16 mixed precision with Adam. A100 memory size is not stated either:
# the 80 GB part (2,039 GB/s) of the dgx-a100-8 preset is assumed.
MEGATRON_VOCAB = 51200
MEGATRON_DTYPE = "fp16"
MEGATRON_DEVICE = "A100-80GB"
MEGATRON_CLUSTER = "dgx-a100-8"


def load_megatron_a100(path: str | Path = MEGATRON_A100_CSV) -> pd.DataFrame:
    """The vTrain single-node Megatron table with short column names and ``iter_time_s`` added."""
    path = Path(path)
    if not path.is_file():
        raise BundleError(path, "validation CSV not found")
    df = pd.read_csv(path)
    missing = [c for c in _COLUMNS if c not in df.columns]
    if missing:
        raise BundleError(path, f"missing column(s) {missing}")
    df = df.rename(columns=_COLUMNS)[list(_COLUMNS.values())]
    df["iter_time_s"] = df["iter_time_ms"] / 1e3
    bad = df[df["gpus"] != df["tp"] * df["dp"] * df["pp"]]
    if len(bad):
        raise BundleError(path, f"{len(bad)} rows where GPUs != tp * dp * pp (first: row {bad.index[0]})")
    return df


def split_calibration(df: pd.DataFrame, holdout_fraction: float = 0.5,
                      seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(calibration, holdout), split by model shape and stratified by hidden size.

    Within each hidden size, the shapes (hidden, heads, layers, seq) are sorted, shuffled with
    ``seed`` and ``round(fraction x count)`` of them are held out (at least one kept on each side
    when there are two or more), so both parts span every hidden size and no held-out row shares its
    model with a calibration row. Deterministic for a given seed.
    """
    if not 0 < holdout_fraction < 1:
        raise ConfigError("holdout_fraction", f"must be in (0, 1), got {holdout_fraction}", "use e.g. 0.5")
    rng = np.random.default_rng(seed)
    shapes = df[SHAPE_COLUMNS].drop_duplicates().sort_values(SHAPE_COLUMNS)
    held: list[tuple[int, ...]] = []
    for _, group in shapes.groupby("hidden", sort=True):
        keys = [tuple(int(v) for v in row) for row in group.to_numpy()]
        order = rng.permutation(len(keys))
        k = round(holdout_fraction * len(keys))
        if len(keys) >= 2:
            k = min(max(k, 1), len(keys) - 1)
        held.extend(keys[i] for i in order[:k])
    held_set = set(held)
    is_held = pd.Series([tuple(int(v) for v in r) in held_set for r in df[SHAPE_COLUMNS].to_numpy()],
                        index=df.index)
    return df[~is_held].reset_index(drop=True), df[is_held].reset_index(drop=True)


# --- a closed-form 1F1B predictor -------------------------------------------------------------------------

@lru_cache(maxsize=256)
def _layer_costs(model: AnalyticCostModel, hidden: int, heads: int, layers: int, seq: int,
                 micro_batch: int, tp: int) -> tuple[LayerCosts, LayerCosts, LayerCosts]:
    cfg = TransformerConfig("gpt", vocab=MEGATRON_VOCAB, hidden=hidden, heads=heads, num_layers=layers,
                            seq=seq)
    specs = transformer_layers(cfg)
    embed, block, head = specs[0], specs[1], specs[-1]  # all blocks are identical
    return tuple(model.layer_costs(spec, micro_batch, tp) for spec in (embed, block, head))  # type: ignore


def _layer_step_s(c: LayerCosts, tp_fwd_s: float, tp_bwd_s: float) -> float:
    # Full recompute: forward, re-forward before backward (its TP all-reduces again), backward.
    return c.fwd_s + c.recompute_s + c.bwd_s + 2 * tp_fwd_s + tp_bwd_s


def quick_predict(row: Mapping[str, Any], model: AnalyticCostModel,
                  cluster: ClusterSpec | None = None) -> float:
    """Seconds per Megatron iteration: 1F1B with full recompute, closed form.

    (m + p - 1) x the slowest stage's per-micro-batch time (compute, TP all-reduces, p2p sends),
    then the un-overlapped data-parallel gradient all-reduce (no bucketing), the tied-embedding
    gradient all-reduce between first and last stage, and the Adam step. Megatron's rank order puts
    TP ranks innermost, then DP, then PP.
    """
    cluster = cluster or load_cluster(MEGATRON_CLUSTER)
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

    stage_s, stage_grad_bytes, stage_param_bytes = [], [], []
    for s, n_blocks in enumerate(per_stage_blocks):
        members = [(block, n_blocks)] + [(embed, 1)] * (s == 0) + [(head, 1)] * (s == pp - 1)
        t = sum(n * _layer_step_s(c, *tp_time[id(c)]) for c, n in members)
        if pp > 1:  # send the activation forward and the gradient back, once each per micro-batch
            t += 2 * p2p_time(block.output_bytes, 0, tp * dp, cluster)
        stage_s.append(t)
        stage_grad_bytes.append(sum(n * c.grad_bytes for c, n in members))
        stage_param_bytes.append(sum(n * c.param_bytes for c, n in members))

    total = (m + pp - 1) * max(stage_s)
    if dp > 1:
        dp_ranks = [tp * d for d in range(dp)]
        total += max(collective_time("all_reduce", g, dp_ranks, cluster) for g in stage_grad_bytes)
    if pp > 1:
        total += collective_time("all_reduce", embed.grad_bytes, [0, tp * dp * (pp - 1)], cluster)
    total += model.optimizer_step_s(max(stage_param_bytes))
    return total


Predictor = Callable[[Mapping[str, Any], EfficiencyCurve], float]


def megatron_predictor(cluster: ClusterSpec | None = None) -> Predictor:
    """``predict(row, curve)`` for ``fit_efficiency``: quick_predict on the assumed A100 setup."""
    cluster = cluster or load_cluster(MEGATRON_CLUSTER)
    device = get_device(MEGATRON_DEVICE)
    models: dict[EfficiencyCurve, AnalyticCostModel] = {}

    def predict(row: Mapping[str, Any], curve: EfficiencyCurve) -> float:
        if curve not in models:
            models.clear()  # the optimiser moves on; keep the cache small
            models[curve] = AnalyticCostModel(device, MEGATRON_DTYPE, curve)
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
    mem_eff = start.mem_eff

    def curve_of(theta: np.ndarray) -> EfficiencyCurve:
        return EfficiencyCurve(eff_max=float(theta[0]), flops_half=float(10 ** theta[1]), mem_eff=mem_eff)

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
    calib, holdout = split_calibration(df, 0.5, seed=0)
    predict = megatron_predictor()
    default = uncalibrated_curve(get_device(MEGATRON_DEVICE), MEGATRON_DTYPE)
    fitted = fit_efficiency(calib, predict, initial=default)
    held_shapes = sorted(map(tuple, holdout[SHAPE_COLUMNS].drop_duplicates().to_numpy().tolist()))
    print(f"held-out shapes (hidden, heads, layers, seq): {held_shapes}")
    for label, curve in (("default", default), ("fitted", fitted)):
        print(f"{label} curve: eff_max={curve.eff_max:.3f} flops_half={curve.flops_half:.3g} "
              f"mem_eff={curve.mem_eff}")
        for part, rows in (("calibration", calib), ("holdout", holdout)):
            s = summarize(score(rows, predict, curve))
            print(f"  {part:11s} rows={s['rows']:4d} median|err|={s['median_abs_error']:.1%} "
                  f"p90|err|={s['p90_abs_error']:.1%} max|err|={s['max_abs_error']:.1%} "
                  f"mean err={s['mean_signed_error']:+.1%}")


if __name__ == "__main__":
    main()
