"""Why AP-ADMMiRNN diverged on Tiny Shakespeare at rho_o = 0.1: staleness, block order, or the
number of weight steps per dual update? (docs/admm.md, "AP's divergence ... explained").

``python -m analysis.admm_ap_check --out docs/results/admm`` runs, for the step as it was before
issue 15 (``ADMM_BEFORE``: step 1/Lipschitz, no re-anchoring) and for the current defaults:
serial in the forward and the local-first order, AP with 1 worker / staleness 0, 2 workers /
staleness 0 and 2 workers / staleness 2 (real gloo ranks), and a serial local-first run that
takes two weight updates per iteration from the same statistics (what AP with 2 workers does per
data pass, without any staleness). Writes ``ap_check.csv``: training loss every 6 data passes.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from analysis.admm_suite import ADMM_BEFORE
from exec.admm.data import SequenceData, load_task
from exec.admm.parallel import run_ap
from exec.admm.rnn_admm import (
    ADMMConfig,
    evaluate,
    init_params,
    init_state,
    output_stats,
    recurrent_stats,
    train_admm,
    update_local,
    update_output_params,
    update_recurrent_params,
)

HIDDEN = 64  # as in the Shakespeare experiment


def repeated_weight_updates(train: SequenceData, iterations: int, cfg: ADMMConfig, repeats: int) -> list[float]:
    """Serial local-first ADMM taking ``repeats`` weight updates per iteration from one set of
    statistics; the training loss after every iteration."""
    params = init_params(train.input_dim, HIDDEN, train.num_classes, 0, train.x.dtype)
    state = init_state(params, train)
    losses = []
    for _ in range(iterations):
        update_local(params, state, train, cfg)
        recurrent, output = recurrent_stats(train, state, cfg), output_stats(train, state, cfg)
        for _ in range(repeats):
            params = update_output_params(update_recurrent_params(params, recurrent, cfg), output, cfg)
        losses.append(evaluate(params, train)[0])
    return losses


def run(iterations: int = 60) -> pd.DataFrame:
    torch.set_num_threads(1)
    train = load_task("shakespeare", 0).train
    rows = []

    def record(config: str, run_name: str, passes: list[float], losses: list[float]) -> None:
        rows.extend({"config": config, "run": run_name, "data_passes": p, "train_loss": loss}
                    for p, loss in zip(passes, losses, strict=True))

    for label, cfg in (("before issue 15", ADMM_BEFORE), ("defaults", ADMMConfig(rho_o=0.1))):
        for sweep in ("forward", "local-first"):
            _, history = train_admm(train, HIDDEN, iterations, replace(cfg, sweep=sweep), 0)
            record(label, f"serial {sweep}", [r["iteration"] for r in history], [r["train_loss"] for r in history])
        for workers, staleness in ((1, 0), (2, 0), (2, 2)):
            ap = run_ap(train, HIDDEN, iterations, cfg, workers=workers, staleness=staleness, seed=0)
            template = ap.params
            record(label, f"AP {workers} worker(s), staleness {staleness}", [s[2] for s in ap.snapshots],
                   [evaluate(template.load_flat(s[3]), train)[0] for s in ap.snapshots])
        losses = repeated_weight_updates(train, iterations, replace(cfg, sweep="local-first"), 2)
        record(label, "serial local-first, 2 weight updates per iteration", list(range(1, iterations + 1)), losses)
    df = pd.DataFrame(rows)
    return df[df.data_passes % 6 == 0].reset_index(drop=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/results/admm"))
    parser.add_argument("--iterations", type=int, default=60)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    df = run(args.iterations)
    df.to_csv(args.out / "ap_check.csv", index=False)
    print(df.groupby(["config", "run"]).train_loss.agg(["max", "last"]).to_string())


if __name__ == "__main__":
    main()
