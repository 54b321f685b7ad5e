"""The runtime's distributed optimizer (exec.distributed_optimizer) on two gloo ranks: after two Adam
steps the parameters equal the dense all-reduce run's (fp32), the replicas agree, and each rank's
optimizer state is its half of the dense run's, the bytes the ledger holds."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from exec.contract import compile_for_run
from exec.launcher import run_plan
from sim.simulate import simulate
from tests.test_runtime import plan_of


def _run(method: str, tmp_path: Path) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, list[int]], list, dict]:
    plan = plan_of(dp=2, microbatches=2, micro_batch=2).replace(
        name=f"gpt-tiny-dp2-{method}", gradient_sync={"method": method, "bucket_mb": 0.05})
    result = run_plan(plan, iterations=1, warmup=1, out_dir=tmp_path / method, timeout_s=120, save_params=True)
    params = {r: torch.load(result.paths["params"] / f"rank{r}.pt") for r in range(2)}
    measured = {r: [json.loads(line)["optimizer_bytes"] for line in
                    (result.paths["ranks"] / f"rank{r}.jsonl").read_text().splitlines() if line.strip()]
                for r in range(2)}
    run = compile_for_run(plan)
    memory = simulate(plan, costs=run.resolved.costs, full=True).memory
    ledger = {r: m.breakdown["optimizer"] for r, m in memory.items()}
    buckets = sum(1 for i in run.program.ranks[0].instructions if i.kind.value == "ALLREDUCE") - (method == "distopt")
    return params, measured, result.losses, {"ledger": ledger, "buckets": buckets}


def test_sharded_steps_train_as_the_dense_all_reduce_does(tmp_path: Path) -> None:
    dense, dense_bytes, dense_losses, dense_info = _run("allreduce", tmp_path)
    sharded, sharded_bytes, sharded_losses, info = _run("distopt", tmp_path)
    assert info["buckets"] > 1  # several buckets, each sharded over the two replicas
    assert sharded_losses == dense_losses
    for rank in (0, 1):
        assert sharded[rank].keys() == dense[rank].keys()
        for name, value in dense[rank].items():
            torch.testing.assert_close(sharded[rank][name], value, rtol=1e-6, atol=1e-7, msg=name)
            assert torch.equal(sharded[rank][name], sharded[1 - rank][name]), name  # the replicas agree
    # The dense run holds the ledger's optimizer state; the sharded replicas hold it between them, each
    # its half as the ledger says, to within one element's moments a bucket (a chunk's padding: odd sizes)
    for rank in (0, 1):
        assert dense_bytes[rank] == [dense_info["ledger"][rank]] * 2
        assert abs(sharded_bytes[rank][-1] - info["ledger"][rank]) <= 8 * info["buckets"]
    assert sharded_bytes[0][-1] + sharded_bytes[1][-1] == dense_bytes[0][-1]
    assert 2 * info["ledger"][0] == dense_info["ledger"][0]


def test_a_sparse_embeddings_gradient_is_sharded_as_the_dense_all_reduce_sends_it(tmp_path: Path) -> None:
    # nn.Embedding(sparse=True) gives a sparse gradient; the flat buffer takes it dense, as the dense
    # all-reduce does (it crashed in the flattening before: "unsupported memory format option")
    losses, params = {}, {}
    for method in ("allreduce", "distopt"):
        plan = plan_of("lstm-tiny", dp=2, microbatches=1, micro_batch=4,
                       workload_options={"vocab": 500, "sparse": True}).replace(
            name=f"lstm-sparse-dp2-{method}", gradient_sync={"method": method, "bucket_mb": 25})
        result = run_plan(plan, iterations=1, warmup=1, out_dir=tmp_path / method, timeout_s=120, save_params=True)
        losses[method] = result.losses
        params[method] = torch.load(result.paths["params"] / "rank0.pt")
    assert losses["distopt"] == losses["allreduce"]
    for name, value in params["allreduce"].items():
        torch.testing.assert_close(params["distopt"][name], value, rtol=1e-6, atol=1e-7, msg=name)
