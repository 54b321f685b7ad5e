"""Korthikanti et al.'s selective recomputation in the runtime (``memory: {policy: selective-attention}``,
exec.selective.checkpoint_attention_cores): the unfused attention core runs under torch's
checkpoint, so a layer keeps neither the softmax output nor the causal mask, and its backward
re-runs the core. Real gloo runs: training is unchanged (the same operations on the same values,
bit for bit), and each rank's activation peak is what the ledger says, below the run without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exec.launcher import run_plan
from exec.structure import StructuralCosts
from exec.workloads import get_workload
from tests.test_runtime import plan_of
from tests.test_runtime_sequence_parallel import ledger_peaks, measured_peaks, params_of


def test_one_block_drops_its_softmax_output_and_mask() -> None:
    b, s, a = 2, 32, 4  # gpt-tiny
    unfused = StructuralCosts(get_workload("gpt-tiny", attention="unfused"), b, "fp32", 1)
    flash = StructuralCosts(get_workload("gpt-tiny"), b, "fp32", 1)
    assert unfused.layer_costs(1, b, 1).attention_core_bytes == 4 * b * a * s * s + s * s  # fp32 probs, bool mask
    assert flash.layer_costs(1, b, 1).attention_core_bytes == 0  # nothing to drop: the policy refuses flash
    assert unfused.layer_costs(0, b, 1).attention_core_bytes == unfused.layer_costs(5, b, 1).attention_core_bytes == 0


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_selective_attention_trains_as_none_and_holds_what_the_ledger_says(dropout: float, tmp_path: Path) -> None:
    """With dropout the re-run core draws the forward's attention-dropout mask again (torch's
    checkpoint keeps the RNG state), so training is still bit for bit the same."""
    base = plan_of(pp=2, schedule="1f1b", microbatches=4)
    options = {"attention": "unfused", **({"dropout": dropout} if dropout else {})}
    base = base.replace(name="none", workload_options=options)
    selective = base.replace(name="selective-attention", memory={"policy": "selective-attention"})
    runs = {p.name: run_plan(p, iterations=2, warmup=1, out_dir=tmp_path / p.name, timeout_s=120, save_params=True)
            for p in (base, selective)}
    assert runs["selective-attention"].losses == runs["none"].losses
    kept, dropped = params_of(tmp_path / "none", base), params_of(tmp_path / "selective-attention", selective)
    for rank, params in kept.items():
        for name, value in params.items():
            assert torch.equal(dropped[rank][name], value), f"rank {rank} {name}"
    measured = measured_peaks(tmp_path / "selective-attention", selective)
    assert measured == ledger_peaks(selective)
    assert all(measured[r] < measured_peaks(tmp_path / "none", base)[r] for r in measured)
