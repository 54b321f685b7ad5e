"""PowerSGD in the runtime's reducer path (``sim.gradient_sync_lowrank`` prices it).

Per compressible gradient matrix M (+ its error-feedback residual): P = M Q with the warm-started
Q; the first all-reduce sums every P together with the bucket's uncompressed gradients, and it is
waited for here, in the main thread; P is orthonormalised (reduced QR), Q = M^T P, and the second
all-reduce (asynchronous) sums the Qs. The mean is P Q^T / n. Both collectives are issued by the
thread that runs the Program, in bucket order, the same on every rank, which is what torch's
``powerSGD_hook`` cannot promise on gloo with several buckets (its second all-reduce is issued
from the first one's completion callback; docs/compression.md).
"""

from __future__ import annotations

import torch

from exec.parallel.dp import BucketReduce
from sim.gradient_sync import GradTensor
from sim.gradient_sync_lowrank import PowerSGD, compressible


class PowerSGDReduce(BucketReduce):
    def start(self) -> None:
        cfg = self.settings if isinstance(self.settings, PowerSGD) else PowerSGD()
        self.cfg, r = cfg, cfg.rank
        self.matrices, plain = [], []
        for t, grad in enumerate(self.grads):
            matrix = grad.reshape(grad.shape[0], -1) if grad.dim() >= 2 else grad.reshape(1, -1)
            if not compressible(GradTensor(matrix.shape[0], matrix.shape[1], grad.element_size()), r):
                plain.append(grad)
                continue
            if cfg.error_feedback and ("residual", t) in self.state:
                matrix = matrix + self.state[("residual", t)]
            q = self.state.get(("q", t))
            if q is None:  # the same random start on every rank: seeded by the shared seed
                generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + t)
                # drawn on the CPU, so every device starts from the same Q
                q = torch.linalg.qr(torch.randn(matrix.shape[1], r, generator=generator)).Q.to(matrix.device)
            self.matrices.append((t, grad, matrix, matrix @ q))
        self.plain = plain
        first = torch.cat([p.reshape(-1) for _t, _g, _m, p in self.matrices] + [g.reshape(-1) for g in plain])
        self.all_reduce(first, wait=True)
        offset, qs = 0, []
        self.ps = []
        for _t, _grad, matrix, p in self.matrices:
            p_sum = first[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
            p_orth = torch.linalg.qr(p_sum).Q
            self.ps.append(p_orth)
            qs.append(matrix.T @ p_orth)
        self.plain_sum = first[offset:]
        self.q_wire = self.all_reduce(torch.cat([q.reshape(-1) for q in qs])) if qs else None

    def finish(self) -> None:
        if self.plain:
            self.write_back(self.plain, self.plain_sum / self.size)
        offset = 0
        for (t, grad, matrix, _p), p in zip(self.matrices, self.ps, strict=True):
            assert self.q_wire is not None
            q = self.q_wire[offset: offset + matrix.shape[1] * p.shape[1]].view(matrix.shape[1], p.shape[1])
            offset += q.numel()
            self.state[("q", t)] = q.clone()  # warm start: the same on every rank
            approx = p @ q.T / self.size
            if self.cfg.error_feedback:
                # What this replica's share did not get through: M - (its projection P P^T M).
                self.state[("residual", t)] = matrix - p @ (p.T @ matrix)
            grad.copy_(approx.view_as(grad))
