"""The runtime's saved-tensor hooks keep autograd's memory pattern (issue 12).

The interpreter saves activations behind ``saved_tensors_hooks`` (``exec.activations.SavedStore``)
so it can swap and count them. It used to hold every saved tensor until the whole backward of the
micro-batch was done, where autograd alone frees each node's saved tensors as soon as the node
has run; a large head's 17 MB log-softmax then stayed alive through the backward, whose own
temporaries took fresh pages instead (3,100 more minor page faults per backward than the profile
measures, scripts/probe_faults.py). These tests look at what is still alive, not at time.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from exec.activations import SavedStore, unique_bytes
from exec.contract import compile_for_run
from sim.plan import Plan, migrate_flat


@pytest.fixture
def one_rank(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _plan(**extra: object) -> Plan:
    return Plan.from_dict(migrate_flat({
        "name": "saved-pattern", "workload": "gpt-tiny", "dp": 1, "tp": 1, "pp": 1, "schedule": "1f1b",
        "microbatches": 2, "micro_batch": 2, "cluster": {"preset": "local-cpu-2", "devices_per_node": 1}, **extra}))


def _held_when_gradient_reaches_layer0(plan: Plan) -> list[tuple[int, int, int]]:
    """Run one iteration; each time the gradient reaches the first layer's output, note
    (micro-batch, bytes the store still holds from layers above the first, bytes it saved in all)."""
    from exec.interpreter import RankRuntime

    runtime = RankRuntime(compile_for_run(plan), 0, torch.device("cpu"), None, None)
    seen: list[tuple[int, int, int]] = []
    totals: dict[int, int] = {}

    def on_forward(module: torch.nn.Module, args: object, output: torch.Tensor) -> None:
        if not output.requires_grad:
            return
        mb = runtime.current.microbatch

        def on_grad(grad: torch.Tensor) -> None:
            store = runtime.slots[(0, mb)].store
            above = [t for t, layer in zip(store.tensors, store.layers, strict=True) if layer > 0]
            alive = [t() if isinstance(t, weakref.ref) else t for t in above]
            seen.append((mb, unique_bytes([t for t in alive if t is not None]), totals[mb]))

        output.register_hook(on_grad)

    runtime.layer_modules[0].register_forward_hook(on_forward)
    forward = runtime._forward

    def counting_forward(ins: object) -> None:
        forward(ins)
        slot = runtime.slots[(0, ins.microbatch)]
        totals[ins.microbatch] = unique_bytes(slot.store.held())

    runtime._forward = counting_forward  # type: ignore[method-assign]
    runtime.run_iteration(0)
    return seen


def test_backward_frees_each_saved_tensor_as_autograd_does(one_rank) -> None:
    """When the gradient reaches the first layer, every tensor the layers above saved is gone."""
    seen = _held_when_gradient_reaches_layer0(_plan())
    assert [mb for mb, _, _ in seen] == [0, 1]
    for _, held, total in seen:
        assert total > 100_000  # the blocks and the head saved real activations ...
        assert held == 0  # ... and autograd freed each once its node had run


def test_a_store_outside_a_freeing_backward_keeps_its_tensors() -> None:
    """Without ``releasing`` (a split backward keeps its graph for BWD_W) the store holds on."""
    x = torch.randn(8, 16, requires_grad=True)
    layer = torch.nn.Linear(16, 32)
    for releasing, expect_alive in ((False, True), (True, False)):
        store = SavedStore({p.untyped_storage().data_ptr() for p in layer.parameters()})
        with store.hooks():
            y = torch.nn.functional.gelu(layer(x)).sum()
        saved = unique_bytes(store.held())
        store.releasing = releasing
        y.backward()
        assert saved > 0
        assert (unique_bytes(store.held()) == saved) is expect_alive
