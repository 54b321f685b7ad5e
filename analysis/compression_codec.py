"""Profile each gradient-sync method's encode + decode on this machine: sim/data/codec_rates.csv.

The simulator prices a method's ``memory`` phase (the bytes its encoding and decoding move,
``sim.gradient_sync``) at the device's memory bandwidth unless a measured rate for that device
and method is here. This measures it: the plan's workload takes one real backward (its batches,
sparse embedding included), then each method's reducer runs on those gradients with its
collectives replaced by the identity of a one-rank group (so only encoding and decoding are
timed), one torch thread as a runtime rank has; the rate is the modelled memory bytes of that
bucket divided by the median time. Like a compute profile, it belongs to the machine it was
taken on (the device name of the plan's cluster) and to roughly the sizes it was taken at.

    python -m analysis.compression_codec examples/validation/netns/lstm-compression-dp2.yaml
    python scripts/gpu_codec.py --out runs/gpu_codec        # the same on a CUDA GPU (scripts/gpu_codec.py)

On a GPU (``--torch-device cuda --device-name H200``) the model, its gradients and every reducer's
buffers live on the GPU and each timing ends with a synchronize.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch

from exec.contract import load_workload
from exec.gradient_sync import REDUCERS
from exec.parallel.dp import BucketReduce
from exec.workloads.base import run_layers
from sim.cluster import load_cluster
from sim.gradient_sync import CODEC_FILE, GRADIENT_SYNC, GradTensor, SyncContext
from sim.plan import Plan
from traces.commented_csv import read_rows, write_rows

HEADER = ("device", "method", "rate_Bps", "median_s", "memory_bytes", "workload", "measured")


def _local(cls: type[BucketReduce]) -> type[BucketReduce]:
    """The reducer with a one-rank group's collectives: the sum is the tensor itself."""

    class Local(cls):  # type: ignore[misc, valid-type]
        def all_reduce(self, tensor: torch.Tensor, wait: bool = False, op: object = None) -> torch.Tensor:
            return tensor

        def all_gather(self, tensor: torch.Tensor, wait: bool = False) -> list[torch.Tensor]:
            return [tensor]

    return Local


def measure(plan: Plan, repeats: int, torch_device: str = "cpu", device_name: str | None = None) -> list[dict]:
    """One row per method with a memory phase; ``device_name``: the hardware catalog's name of the
    device the rates belong to (default: the plan's cluster's device)."""
    torch.set_num_threads(1)
    device = torch.device(torch_device)
    workload = load_workload(plan)
    layers = workload.build_layers().to(device)
    batch = workload.make_batch(plan.micro_batch * plan.microbatches, seed=0, device=device)
    workload.loss(run_layers(layers, batch.inputs), batch.targets).backward()
    params = [p for p in layers.parameters() if p.requires_grad]
    grads = [p.grad.clone() for p in params]
    tensors = []
    for g in grads:
        rows = int(g.coalesce().indices()[0].unique().numel()) if g.is_sparse else None
        shape = (g.shape[0], g[0].numel()) if g.dim() >= 2 else (1, g.numel())
        tensors.append(GradTensor(*shape, g.element_size() if not g.is_sparse else 4,
                                  touched_rows=rows, union_rows=rows))
    name = device_name or load_cluster(plan.cluster).device.name

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    out = []
    for method, sync in GRADIENT_SYNC.items():
        settings = plan.gradient_sync if plan.gradient_sync.method == method else sync.config()
        memory = sum(p.nbytes for p in sync.plan(SyncContext(tuple(tensors), 1, settings)) if p.kind == "memory")
        if not memory:
            continue
        reducer, times = _local(REDUCERS[method]), []
        for _ in range(repeats + 1):  # the first fills error-feedback state; not timed
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            synchronize()
            start = time.perf_counter()
            reducer(params, None, 1, settings).wait()
            synchronize()
            times.append(time.perf_counter() - start)
        median = statistics.median(times[1:])
        out.append({"device": name, "method": method, "rate_Bps": f"{memory / median:.4g}",
                    "median_s": f"{median:.5f}", "memory_bytes": memory,
                    "workload": f"{plan.workload} {plan.workload_options} x{plan.micro_batch * plan.microbatches}",
                    "measured": datetime.date.today().isoformat()})
        print(f"{method:>10}: {1e3 * median:8.2f} ms for {memory / 1e6:.1f} MB modelled -> "
              f"{memory / median / 1e9:.2f} GB/s", flush=True)
    return out


def write_rates(rows: list[dict], out: Path) -> None:
    """Replace ``out``'s rows of the measured device with ``rows`` (the codec_rates.csv format)."""
    devices = {r["device"] for r in rows}
    kept = [r for r in read_rows(out) if r["device"] not in devices]
    write_rows(out, ["Effective rate of each method's encode + decode (modelled memory bytes / measured seconds),",
                     "one torch thread, collectives excluded; written by analysis/compression_codec.py.",
                     "local-cpu: the paratwin development machine (2-core VM shared with other work: loaded);",
                     "GPU rows: scripts/gpu_codec.py on that GPU."],
               HEADER, [*kept, *rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=CODEC_FILE)
    parser.add_argument("--torch-device", default="cpu", help="cpu or cuda")
    parser.add_argument("--device-name", default=None,
                        help="the hardware catalog's device the rates are for (default: the plan's cluster's)")
    args = parser.parse_args(argv)
    write_rates(measure(Plan.load(args.plan), args.repeats, args.torch_device, args.device_name), args.out)


if __name__ == "__main__":
    main()
