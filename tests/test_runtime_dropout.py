"""Dropout in the runtime's GPT (``workload_options: {dropout: p}``, Megatron-LM's places): it runs,
it changes training, a recomputed forward draws the masks its forward drew (real gloo runs), and
p 0 builds the same modules and draws no random number."""

from __future__ import annotations

from pathlib import Path

import torch

from exec.launcher import run_plan
from exec.workloads import get_workload
from tests.test_runtime import plan_of


def dropout_plan(p: float, recompute: list[float], name: str):
    plan = plan_of(pp=2, schedule="1f1b", recompute=recompute)
    return plan.replace(name=name, workload_options={"dropout": p})


def final_params(plan, tmp_path: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    result = run_plan(plan, iterations=1, warmup=1, out_dir=tmp_path / plan.name, timeout_s=120, save_params=True)
    params = {}
    for rank in range(plan.world_size):
        params.update({f"{rank}:{k}": v for k, v in torch.load(result.paths["params"] / f"rank{rank}.pt").items()})
    return result.losses, params


def test_recompute_replays_the_forwards_dropout_masks(tmp_path: Path) -> None:
    kept_losses, kept = final_params(dropout_plan(0.1, [0.0, 0.0], "kept"), tmp_path)
    rec_losses, recomputed = final_params(dropout_plan(0.1, [1.0, 1.0], "recomputed"), tmp_path)
    assert rec_losses == kept_losses
    assert kept.keys() == recomputed.keys()
    for name, value in kept.items():  # the same masks in the re-run forward: the same gradients
        torch.testing.assert_close(recomputed[name], value, rtol=0, atol=1e-7, msg=name)


def test_p0_draws_no_random_number_and_p_draws_in_train_mode_only() -> None:
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    for p, draws in ((0.0, False), (0.1, True)):
        workload = get_workload("gpt-tiny", dropout=p) if p else get_workload("gpt-tiny")
        assert workload.stochastic is draws
        layers = workload.build_layers()
        state = torch.get_rng_state()
        h = ids
        for layer in layers[:-1]:
            h = layer(h)
        assert torch.equal(torch.get_rng_state(), state) is not draws, p
        layers.eval()
        state = torch.get_rng_state()
        h = ids
        for layer in layers[:-1]:
            h = layer(h)
        assert torch.equal(torch.get_rng_state(), state), p  # no dropout in eval mode


def test_delta_reruns_replay_the_forwards_dropout_masks(tmp_path: Path) -> None:
    """DELTA deciding at run time (director recompute) drops layers after their forward and re-runs
    them before their backward (exec.delta_runtime): with dropout 0.1 the re-run draws the masks the
    forward drew (exec.activations.RngState), so after two Adam steps on 2 gloo ranks (pp 2) the
    parameters equal the keep-everything run's, and the losses too."""
    from tests.test_delta_runtime import _budgeted
    from traces.runrecord import read_run_record

    delta = _budgeted("gpt-tiny", 2, "gpipe", tiny_mb=0.0, director="recompute")
    delta = delta.replace(name="delta-dropout", workload_options={"dropout": 0.1})
    keep = delta.replace(name="keep-dropout", memory={"policy": "none"})
    kept_losses, kept = final_params(keep, tmp_path)
    delta_losses, rerun = final_params(delta, tmp_path)
    table = read_run_record(tmp_path / delta.name / "record").instructions
    assert (table["kind"] == "DROP").any()  # something was dropped and re-run
    assert delta_losses == kept_losses
    assert kept.keys() == rerun.keys()
    for name, value in kept.items():
        torch.testing.assert_close(rerun[name], value, rtol=0, atol=1e-6, msg=name)
