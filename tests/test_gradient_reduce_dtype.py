"""The dtype of the dense gradient all-reduce (``gradient_sync: {method: allreduce, reduce_dtype: ...}``):
Megatron-LM all-reduces bf16 models' gradients in fp32 and fp16 models' in fp16 (``auto``); the
simulator's bytes and the runtime reducer's agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sim.gradient_sync import GRADIENT_SYNC, DenseAllReduce, GradTensor, SyncContext, vector_wire_bytes
from sim.gradient_sync_context import BucketPlan, bucket_context

CASES = [  # (plan dtype, reduce_dtype, bytes per element on the wire)
    ("bf16", "auto", 4), ("fp16", "auto", 2), ("fp32", "auto", 4),
    ("bf16", "param", 2), ("fp16", "fp32", 4), ("fp32", "fp32", 4),
]


@pytest.mark.parametrize(("dtype", "choice", "wire"), CASES)
def test_the_all_reduce_carries_the_chosen_dtype(dtype: str, choice: str, wire: int) -> None:
    element = {"fp32": 4, "fp16": 2, "bf16": 2}[dtype]
    settings = DenseAllReduce(reduce_dtype=choice, flat_copies=True)
    phases = GRADIENT_SYNC["allreduce"].plan(SyncContext((GradTensor(10, 100, element),), 8, settings, dtype))
    assert [(p.kind, p.nbytes) for p in phases] == [("memory", 4 * wire * 1000), ("allreduce", wire * 1000),
                                                    ("memory", 2 * wire * 1000)]
    # The memory planners' one-vector bucket and a plan's real buckets see the same dtype.
    assert vector_wire_bytes(settings, element * 1000, 8, dtype) == wire * 1000
    plan = BucketPlan("gpt-tiny", {}, dtype, dp=8, tp=1, micro_batch=1, microbatches=1, gradient_sync=settings)
    ctx = bucket_context(plan, [1], lambda layer: element * 1000)
    assert [p.nbytes for p in GRADIENT_SYNC["allreduce"].plan(ctx) if p.kind == "allreduce"] == [wire * 1000]


@pytest.mark.parametrize(("dtype", "choice", "wire"), CASES)
def test_the_runtime_reducer_sends_what_the_simulator_prices(tmp_path: Path, dtype: str, choice: str,
                                                            wire: int) -> None:
    """One gloo rank: the reducer's bytes on the wire are the simulator's, and the gradients come back
    in their own dtype (the fp32 sum is cast back, as Megatron's optimizer reads its main_grad)."""
    import torch.distributed as dist
    from torch import nn

    from exec.gradient_sync import REDUCERS

    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        layer = nn.Linear(50, 20, bias=False).to(torch_dtype)
        grads = torch.randn(20, 50, generator=torch.Generator().manual_seed(0)).to(torch_dtype)
        layer.weight.grad = grads.clone()
        settings = DenseAllReduce(reduce_dtype=choice)
        reducer = REDUCERS["allreduce"]([layer.weight], dist.group.WORLD, 1, settings)
        reducer.wait()
        element = torch.finfo(torch_dtype).bits // 8
        assert reducer.nbytes == vector_wire_bytes(settings, element * 1000, 1, dtype) == wire * 1000
        assert layer.weight.grad.dtype == torch_dtype
        assert torch.equal(layer.weight.grad, grads)  # one rank: the mean is the gradient itself
    finally:
        dist.destroy_process_group()
