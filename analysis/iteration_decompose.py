"""Where a simulated iteration's time goes, on one rank: compute by kind of work, recompute, tensor-
parallel all-reduces, the optimizer step, and the time the compute stream waits (pipeline bubble and
exposed point-to-point transfers; exposed gradient all-reduces before the step).

The split of compute into kinds (weight GEMMs, memory-bound kernels, attention, LM head and loss,
embedding) comes from the analytic kernel model (``sim.analytic.transformer_layer_times``), so it
applies to engines run on ``sim.analytic_costs.AnalyticCosts``; what a compute instruction took
beyond its kernels is its layers' TP all-reduces (the engine serialises them when tp_overlap is 0).
The parts sum to the iteration time.
"""

from __future__ import annotations

from collections import defaultdict

from sim.analytic import has_kernel_shape, transformer_layer_times
from sim.analytic_costs import AnalyticCosts
from sim.engine import Engine
from sim.program import Kind

# The columns, in order. "pipeline_wait": the compute stream idle before a forward, recompute or
# backward (bubble, and transfers it had to wait for); "sync_wait": idle before the optimizer step
# (data-parallel and embedding all-reduces not hidden behind the backward).
KINDS = ("gemm", "attention", "memory", "lm_head_loss", "embedding", "per_call", "host", "recompute", "grad_accumulate",
         "tp_allreduce", "optimizer", "pipeline_wait", "sync_wait", "p2p_transfer")


def decompose_rank(engine: Engine, costs: AnalyticCosts, rank: int) -> dict[str, float]:
    """Seconds of ``engine``'s finished run by kind on ``rank`` (a rank the Program holds).
    ``p2p_transfer`` is the rank's sends' total duration, for reference: it overlaps compute unless
    the compute waited for it, which is then part of ``pipeline_wait``; it is not in the sum."""
    program = engine.program
    instructions = program.ranks[rank].instructions
    rows = sorted((r for r in engine.rows if r.rank == rank and r.parent < 0), key=lambda r: r.start_s)
    out: dict[str, float] = defaultdict(float)
    model = costs.model
    clock = 0.0
    for row in rows:
        ins = instructions[row.index]
        duration = row.end_s - row.start_s
        if ins.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
            out["p2p_transfer"] += duration
        if not ins.kind.is_compute:
            continue
        out["sync_wait" if ins.kind is Kind.OPTIMIZER_STEP else "pipeline_wait"] += row.start_s - clock
        clock = row.end_s
        if ins.kind is Kind.OPTIMIZER_STEP:
            out["optimizer"] += duration
            continue
        kernels = 0.0
        if ins.kind in (Kind.BWD, Kind.BWD_W) and ins.microbatch > 0:  # as the engine charges it
            accumulate = sum(costs.layer_costs(layer, engine.micro_batch, program.tp).grad_accumulate_s
                             for layer in ins.layers)
            out["grad_accumulate"] += accumulate
            kernels += accumulate
        for layer in ins.layers:
            spec = costs.specs[layer]
            if not has_kernel_shape(spec):
                continue
            k = transformer_layer_times(spec, engine.micro_batch, program.tp, model.device, model.dtype,
                                        model.efficiency, model.attention)
            for part, (f, bi, bw) in k.parts:
                seconds = f if ins.kind in (Kind.FWD, Kind.RECOMPUTE) else bi + bw
                out["recompute" if ins.kind is Kind.RECOMPUTE else part] += seconds
                kernels += seconds
        out["tp_allreduce"] += duration - kernels
    out["pipeline_wait"] += max(0.0, engine.env.now - clock)  # after its step, until the slowest rank ends
    return {kind: out.get(kind, 0.0) for kind in KINDS}
