"""Does torch's own PowerSGD DDP hook run on gloo with several buckets? A reproducer.

Two gloo ranks on this machine train a small embedding + LSTM + head model under
``DistributedDataParallel(bucket_cap_mb=BUCKET_MB)`` with
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook`` for a few steps, and
report whether every step finished within a timeout (a hang is reported as one, the processes are
then stopped). paratwin's own PowerSGD (``exec.gradient_sync_lowrank``) issues both collectives
from the thread that runs the Program instead (docs/compression.md).

    python -m benchmarks.compression_torch_powersgd [--bucket-mb 0.05] [--steps 6] [--timeout 120]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.lstm = nn.Embedding(2000, 64), nn.LSTM(64, 64, batch_first=True)
        self.head = nn.Linear(64, 2000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(x))[0])


def _worker(rank: int, store: str, bucket_mb: float, steps: int, out: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Model(), bucket_cap_mb=bucket_mb)
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    model.register_comm_hook(state, powersgd.powerSGD_hook)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    for step in range(steps):
        tokens = torch.randint(0, 2000, (8, 17), generator=generator)
        optimizer.zero_grad()
        out_ = model(tokens[:, :-1])
        nn.functional.cross_entropy(out_.reshape(-1, 2000), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        with open(f"{out}/rank{rank}", "a") as handle:
            handle.write(f"{step}\n")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-mb", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="torch-powersgd-")
    context = mp.spawn(_worker, args=(os.path.join(folder, "store"), args.bucket_mb, args.steps, folder), nprocs=2,
                       join=False)
    start = time.monotonic()
    while not context.join(timeout=1.0):
        if time.monotonic() - start > args.timeout:
            for process in context.processes:
                process.kill()
            break
    done = {}
    for r in (0, 1):
        path = os.path.join(folder, f"rank{r}")
        with open(path) if os.path.exists(path) else open(os.devnull) as handle:
            done[r] = handle.read().split()
    finished = all(len(done[r]) == args.steps for r in (0, 1))
    print(f"torch powerSGD_hook, gloo, 2 ranks, bucket_cap_mb={args.bucket_mb}: "
          f"{'finished' if finished else 'DID NOT FINISH'} ({len(done[0])}, {len(done[1])} of {args.steps} steps "
          f"in {time.monotonic() - start:.0f} s)")
    return 0 if finished else 1


if __name__ == "__main__":
    raise SystemExit(main())
