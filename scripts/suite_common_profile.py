"""What-if (issue 12, eighth session): a suite's plans predicted from one common compute profile
instead of each from its own, to measure how much of the predicted differences between methods is
the moment each plan was profiled. Reads stored runs; writes only temporary copies of the bundles.

    python scripts/suite_common_profile.py runs/suite-embedding-9

Every plan of a validation suite (one workload) is profiled on its own, minutes apart, and on a
host whose CPUs drift (docs/embrace.md, "Run 8") the same layer then costs up to 1.6x more in one
plan's profile than in another's. Interleaving the measured rounds (analysis.rounds) removes that
drift from the measured side only. Here each plan's bundle is copied with every layer's compute
times (``fwd_s``, ``bwd_input_s``, ``bwd_weight_s``, ``bwd_s``, ``recompute_s``) replaced by their
median over every profile the suite took of the workload (each plan's attempts): the suite's own
measurements of the same layers, nothing taken from the runs, no constant fitted. Each plan keeps
its own spreads, per-process offsets, communication fits and settings (the ids request's host work).
Predicted with the calibration the suite fits (``scripts/suite_repredict.py``), then judged by the
paired rounds (``rounds.json``'s per-round medians, ``analysis.rounds.paired_ranking``) with the
suite's predictions and with these. A diagnostic: it is not a prediction protocol the suite uses.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pandas as pd

from analysis.rounds import describe, paired_ranking, per_round_medians
from analysis.validation.calibration import with_calibration
from analysis.validation.pooled_profile import median_layers
from sim.compile import resolve_plan
from sim.engine import EngineOptions
from sim.plan import Plan
from sim.simulate import simulate
from traces.bundle import read_bundle, write_bundle

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suite_repredict import repredict  # noqa: E402

TIMES = ("fwd_s", "bwd_input_s", "bwd_weight_s", "bwd_s", "recompute_s")


def common_layers(profiles: list[Path]) -> pd.DataFrame:
    """Per layer, the median over ``profiles`` of each compute time (the profiles must hold the
    same layers: same names, kinds and parameter bytes; ``analysis.validation.pooled_profile``)."""
    return median_layers([read_bundle(p).layers for p in profiles], list(profiles)).set_index("layer")[list(TIMES)]


def with_common_layers(profile: Path, common: pd.DataFrame, scratch: Path) -> Path:
    bundle = read_bundle(profile)
    layers = bundle.layers.copy()
    for column in TIMES:
        layers[column] = layers["layer"].map(common[column]).astype(float)
    bundle.layers = layers
    out = scratch / f"{len(list(scratch.iterdir()))}-{profile.parent.name}"
    write_bundle(bundle, out)
    return out


def main(argv: list[str]) -> None:
    options = EngineOptions()
    for suite in [Path(a) for a in argv if not a.startswith("--")]:
        calibration, table = repredict(suite, True, options)
        suite_csv = pd.read_csv(suite / "suite.csv", keep_default_na=False, na_values=[""])
        folders = {r["plan"]: Path(str(r["timeline"])).parent if str(r["timeline"]) else suite / "plans" / r["plan"]
                   for _, r in suite_csv.iterrows()}
        profiles = sorted(p for p in (suite / "plans").glob("*/profile") if (p / "layers.parquet").is_file())
        common = common_layers(profiles)
        print(f"{suite}: compute times of every layer the median over {len(profiles)} profiles "
              f"({', '.join(p.parent.name for p in profiles)})")
        print((common * 1e3).round(3).to_string())
        before = dict(zip(table["plan"], table["predicted_s"], strict=True))
        after = {}
        with tempfile.TemporaryDirectory(prefix="paratwin-common-") as scratch:
            for name, folder in folders.items():
                plan = Plan.load(folder / "plan.yaml")
                plan = plan.model_copy(update={"profile": str(with_common_layers(Path(str(plan.profile)), common,
                                                                                  Path(scratch)))})
                resolved = with_calibration(resolve_plan(plan), calibration)
                after[name] = simulate(plan, full=True, options=calibration.engine_options(options),
                                       resolved=resolved).iteration_s
        rounds = json.loads((suite / "rounds.json").read_text())
        per_round = per_round_medians(rounds["times_s"])
        print("| plan | measured (ms) | own profile (ms) | error | common profile (ms) | error |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for name in sorted(per_round):
            m = float(pd.Series(per_round[name]).median())
            print(f"| {name} | {m * 1e3:.1f} | {before[name] * 1e3:.1f} | {before[name] / m - 1:+.1%} | "
                  f"{after[name] * 1e3:.1f} | {after[name] / m - 1:+.1%} |")
        for label, predicted in (("own profiles", before), ("common profile", after)):
            print(f"{label}: {describe(paired_ranking(per_round, predicted).to_dict())}")


if __name__ == "__main__":
    main(sys.argv[1:])
