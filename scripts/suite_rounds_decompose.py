"""Where an interleaved-rounds validation suite's measured iteration exceeds the prediction, per plan
and per kind of instruction, over the rounds (issue 12, eighth session). Reads stored runs only: no
timing is taken, nothing is written.

    python scripts/suite_rounds_decompose.py runs/suite-embedding-9
    python scripts/suite_rounds_decompose.py runs/netns-embedding-9     # per rate (scripts/netns_embedding.sh)

For each plan the prediction is the attempt the suite reported (``rounds.json``'s ``predicted_s``
matched against ``plans/<plan>[-retryN]/report.json``); round 0 is that attempt's run, rounds 1..R-1
``rounds/round<k>/<plan>/record``. A shaped-network folder is read per rate: the prediction
``<rate>/<method>/report/prediction``, round 0 ``<rate>/<method>/run``, then ``rounds/r<k>/run``
(one profile for every method there: no drift between the plans' profiles). Per iteration, on the
rank whose last instruction ends last, the compute thread's time is split into: the first forward
(micro-batch 0), the other forwards, the backwards, the optimizer steps, the synchronous embedding
exchanges (``emb:ids``/``emb:rows`` all-to-alls, which the compute thread waits for: the partner's
arrival and any collective queued ahead of them on the communicator are inside), and idle (the rest:
waits for all-reduces and dispatch). Medians over a block's iterations, then per part the median,
min and max over rounds of measured minus predicted (ms per iteration). Two more lines per plan: the
all-reduces' time in flight (first launch to last end, reported, it overlaps the parts), and the
run's compute (forwards + backwards) per round against dense's in the same round (paired, so drift
common to a round cancels). Last, each forward and backward against its predicted duration (same
rank and instruction), by the share of its time during which a collective of either rank was in
flight (ranks' clocks start after a common barrier): whether the excess needs a transfer beside it.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from traces.errors import ConfigError

SYNC = ("emb:ids", "emb:rows")
PARTS = ("fwd_mb0", "fwd_rest", "bwd", "opt", "sync_exch", "idle")


def _part(kind: str, microbatch: int, name: str) -> str | None:
    if kind == "FWD":
        return "fwd_mb0" if microbatch == 0 else "fwd_rest"
    if kind == "BWD":
        return "bwd"
    if kind == "OPTIMIZER_STEP":
        return "opt"
    if kind == "ALLTOALL" and any(s in name for s in SYNC):
        return "sync_exch"
    return None


def decompose(table: pd.DataFrame) -> pd.DataFrame:
    """One row per iteration: seconds per part on the rank that ends last, ``iter``, ``allreduce``
    (time in flight) and ``compute`` (forwards + backwards)."""
    df = table[table.parent < 0].copy()
    if "iteration" not in df:
        df["iteration"] = 0
    df["dur"] = df.end_s - df.start_s
    df["part"] = [_part(k, m, n) for k, m, n in zip(df.kind, df.microbatch, df.name, strict=True)]
    rows = []
    for _, g in df.groupby("iteration"):
        ends = g.groupby("rank").end_s.max()
        h = g[g["rank"] == ends.idxmax()]
        d = {p: h.loc[h.part == p, "dur"].sum() for p in PARTS[:-1]}
        d["iter"] = ends.max()
        d["idle"] = d["iter"] - sum(d[p] for p in PARTS[:-1])
        ar = h[h.kind == "ALLREDUCE"]
        d["allreduce"] = (ar.end_s.max() - ar.start_s.min()) if len(ar) else 0.0
        d["compute"] = d["fwd_mb0"] + d["fwd_rest"] + d["bwd"]
        rows.append(d)
    return pd.DataFrame(rows)


def _covered(start: float, end: float, intervals: list[tuple[float, float]]) -> float:
    """Seconds of [start, end] inside the union of ``intervals``."""
    clipped = sorted((max(start, s), min(end, e)) for s, e in intervals if e > start and s < end)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in clipped:
        if cur_e is None or s > cur_e:
            total += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (0.0 if cur_e is None else cur_e - cur_s)


def compute_beside_transfers(table: pd.DataFrame, predicted: pd.DataFrame) -> pd.DataFrame:
    """One row per forward/backward of a measured table: measured over predicted duration, and the
    share of it with a collective of any rank in flight."""
    top = predicted[predicted.parent < 0]
    pred = (top.end_s - top.start_s).groupby([top["rank"], top["index"]]).first()
    df = table[table.parent < 0]
    rows = []
    for _, g in df.groupby("iteration"):
        coll = list(zip(g.loc[g.stream == "collective", "start_s"], g.loc[g.stream == "collective", "end_s"],
                        strict=True))
        for x in g[g.kind.isin(["FWD", "BWD"])].itertuples():
            d = x.end_s - x.start_s
            rows.append({"kind": x.kind, "mb": x.microbatch, "ratio": d / pred[(x.rank, x.index)],
                         "beside": _covered(x.start_s, x.end_s, coll) / d})
    return pd.DataFrame(rows)


def _attempt(suite: Path, plan: str, predicted_s: float) -> Path:
    for folder in sorted(suite.glob(f"plans/{plan}*")):
        if folder.name != plan and not folder.name.startswith(f"{plan}-retry"):
            continue
        rep = json.loads((folder / "report.json").read_text())
        if abs(rep["iteration"]["predicted_s"] - predicted_s) < 1e-9:
            return folder
    raise SystemExit(f"{suite}: no attempt of {plan} predicted {predicted_s} s (rounds.json)")


def suite_sources(suite: Path) -> dict[str, tuple[Path, list[Path]]]:
    """plan -> (predicted table, measured tables by round) of an interleaved validation suite."""
    rounds = json.loads((suite / "rounds.json").read_text())
    out = {}
    for plan, predicted_s in rounds["predicted_s"].items():
        attempt = _attempt(suite, plan, predicted_s)
        out[plan] = (attempt / "prediction/instructions.parquet",
                     [attempt / "run/record/instructions.parquet"]
                     + [suite / f"rounds/round{k}/{plan}/record/instructions.parquet"
                        for k in range(1, rounds["rounds"])])
    return out


def netns_sources(rate: Path) -> dict[str, tuple[Path, list[Path]]]:
    """method -> (predicted table, measured tables by round) of one rate of scripts/netns_embedding.sh."""
    out = {}
    for method in sorted(p.parent.parent.name for p in rate.glob("*/report/prediction")):
        folder = rate / method
        later = sorted(folder.glob("rounds/r*/run/record/instructions.parquet"),
                       key=lambda p: int(p.parts[-4].removeprefix("r")))
        out[method] = (folder / "report/prediction/instructions.parquet",
                       [folder / "run/record/instructions.parquet", *later])
    return out


def report(label: str, sources: dict[str, tuple[Path, list[Path]]]) -> None:
    per_plan: dict[str, pd.DataFrame] = {}
    beside = []
    lines = []
    for plan, (predicted_path, files) in sources.items():
        predicted_table = pd.read_parquet(predicted_path)
        pred = decompose(predicted_table).median()
        meas = pd.DataFrame([decompose(pd.read_parquet(f)).median() for f in files])
        beside += [compute_beside_transfers(pd.read_parquet(f), predicted_table).assign(plan=plan) for f in files]
        per_plan[plan] = meas
        excess = (meas - pred) * 1e3
        for p in (*PARTS, "iter", "allreduce"):
            lines.append(dict(plan=plan.removeprefix("emb-").removesuffix("-dp2"), part=p,
                              predicted=pred[p] * 1e3, measured=meas[p].median() * 1e3,
                              excess=excess[p].median(), min=excess[p].min(), max=excess[p].max()))
    pd.set_option("display.width", 200)
    n = {len(f) for _, f in sources.values()}
    print(f"{label}: ms per iteration, slower rank; excess = measured - predicted, median (min, max) over "
          f"{'/'.join(map(str, sorted(n)))} rounds")
    print(pd.DataFrame(lines).round(2).to_string(index=False))
    dense = next((p for p in per_plan if "dense" in p), None)
    if dense:
        print("\nrun's forwards+backwards / dense's, paired by round: median (min, max) [rounds above 1]")
        for plan, meas in per_plan.items():
            ratio = meas["compute"] / per_plan[dense]["compute"]
            print(f"  {plan}: {ratio.median():.3f} ({ratio.min():.3f}, {ratio.max():.3f}) "
                  f"[{int((ratio > 1).sum())} of {len(ratio)}]")
    b = pd.concat(beside)
    b["collective in flight"] = pd.cut(b.beside, [-0.01, 0.02, 0.5, 1.01], labels=["none", "under half", "over half"])
    print("\nforwards and backwards, measured / predicted duration: median [count] by the share of the "
          "instruction with a collective of either rank in flight (all rounds and iterations)")
    print(b.pivot_table(index="plan", columns="collective in flight", values="ratio", observed=True,
                        aggfunc=lambda v: f"{v.median():.3f} [{len(v)}]").to_string())
    print(b.pivot_table(index="plan", columns=["kind", "mb"], values="ratio", aggfunc="median").round(3).to_string())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folders", type=Path, nargs="+")
    for folder in ap.parse_args().folders:
        if (folder / "rounds.json").is_file():
            report(str(folder), suite_sources(folder))
            continue
        rates = sorted(p.parent.parent.parent for p in folder.glob("*/*/report/prediction"))
        if not rates:
            raise ConfigError("folder", f"{folder} is neither an interleaved suite (rounds.json) nor a "
                              "shaped-network run (<rate>/<method>/report)", "give a folder written with --rounds")
        for rate in dict.fromkeys(rates):
            print()
            report(str(rate), netns_sources(rate))


if __name__ == "__main__":
    main()
