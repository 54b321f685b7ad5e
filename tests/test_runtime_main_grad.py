"""The runtime holds the gradient buffers the memory ledger says (exec.main_grad, sim.model_state):
two gloo ranks of a bf16 GPT-tiny, data parallel, per ``gradient_sync.reduce_dtype``. ``auto`` and
``fp32`` keep Megatron-LM's fp32 main gradients (4 B per parameter), ``param`` bf16 ``.grad`` (2 B)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exec.contract import compile_for_run
from exec.launcher import run_plan
from sim.plan import Plan, migrate_flat
from sim.simulate import simulate


def bf16_plan(choice: str) -> Plan:
    return Plan.from_dict(migrate_flat({
        "name": f"gpt-tiny-dp2-bf16-{choice}", "workload": "gpt-tiny", "dp": 2, "schedule": "1f1b",
        "microbatches": 2, "micro_batch": 2, "dtype": "bf16",
        "cluster": {"preset": "local-cpu-2", "devices_per_node": 2},
    })).replace(gradient_sync={"reduce_dtype": choice})


@pytest.mark.parametrize(("choice", "per_param"), [("auto", 4), ("fp32", 4), ("param", 2)])
def test_the_runtime_holds_the_ledgers_gradient_bytes(tmp_path: Path, choice: str, per_param: int) -> None:
    plan = bf16_plan(choice)
    run = compile_for_run(plan)
    ledger = simulate(plan, costs=run.resolved.costs).memory[0].breakdown["gradients"]
    params = simulate(plan, costs=run.resolved.costs).memory[0].breakdown["parameters"]
    assert ledger == params // 2 * per_param
    result = run_plan(plan, iterations=1, warmup=0, out_dir=tmp_path / choice, timeout_s=120)
    for rank in range(plan.world_size):
        lines = (result.paths["ranks"] / f"rank{rank}.jsonl").read_text().splitlines()
        measured = [json.loads(line)["gradient_bytes"] for line in lines if line.strip()]
        assert measured == [ledger]


def test_fp32_main_gradients_train_as_bf16_gradients_do(tmp_path: Path) -> None:
    """The replicas agree after a step through the fp32 buffers (the all-reduce reached them), and the
    model is the one bf16 gradients give, to bf16's resolution (the sums round differently)."""
    import torch

    final = {}
    for choice in ("auto", "param"):
        out = tmp_path / choice
        run_plan(bf16_plan(choice), iterations=2, warmup=0, out_dir=out, timeout_s=120, save_params=True)
        ranks = [torch.load(out / "params" / f"rank{r}.pt") for r in range(2)]
        assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])
        final[choice] = ranks[0]
    for name, value in final["auto"].items():
        assert value.dtype == torch.bfloat16
        torch.testing.assert_close(value.float(), final["param"][name].float(), rtol=0.02, atol=0.02)
