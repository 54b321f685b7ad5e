"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): low-rank gradient compression.

Every gradient matrix M (n x m) that a rank-r factorisation shrinks ((n + m) r < n m) is sent as
P = M Q (n x r, all-reduced, orthogonalised) and then Q = M^T P (m x r, all-reduced); the mean
gradient is P Q^T, and with error feedback each replica keeps M - P Q^T for the next step. Q is
reused across steps (warm start), so one power iteration per step suffices. Vectors and matrices
too small to shrink travel uncompressed in the first all-reduce. Two collectives per bucket, the
second waiting for the first's result: the runtime issues both from its main thread in program
order (``exec.gradient_sync_lowrank``), which is what keeps every rank's collectives in the same
order on gloo.

Memory phase: the error-feedback add (read g and the residual, write: 3 n m e), M Q and M^T P
(each reads M once; r is small, so the products are memory-bound), P Q^T written, the residual
(read, write): 8 n m e per compressed matrix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from sim.gradient_sync import GradientSyncConfig, GradTensor, Phase, SyncContext, register_gradient_sync
from sim.gradient_sync_context import SHAPES
from sim.workloads import workload_family
from traces.errors import ConfigError

if TYPE_CHECKING:
    from sim.plan import Plan


class PowerSGD(GradientSyncConfig):
    """PowerSGD: rank-r factors P and Q of every gradient matrix, two all-reduces, with error
    feedback and warm-started Q; vectors go uncompressed."""

    method: Literal["powersgd"] = "powersgd"
    # Vogels et al. 2019 compare ranks 1 to 4; 4 is what they train their LSTM language model with.
    rank: int = Field(4, ge=1, description="r: columns of the factors P and Q")
    error_feedback: bool = Field(True, description="carry M - P Q^T to the next step")
    seed: int = Field(0, ge=0, description="seed of the initial Q, the same on every rank")


def compressible(t: GradTensor, rank: int) -> bool:
    return t.rows > 1 and t.cols > 1 and (t.rows + t.cols) * rank < t.rows * t.cols


def _powersgd(ctx: SyncContext) -> tuple[Phase, ...]:
    cfg = ctx.settings
    assert isinstance(cfg, PowerSGD)
    r = cfg.rank
    matrices = [t for t in ctx.tensors if compressible(t, r)]
    p_bytes = sum(t.rows * r * t.element_bytes for t in matrices)
    q_bytes = sum(t.cols * r * t.element_bytes for t in matrices)
    plain = sum(t.nbytes for t in ctx.tensors if not compressible(t, r))
    moved = sum((8 if cfg.error_feedback else 5) * t.nbytes for t in matrices)
    phases = [Phase("allreduce", p_bytes + plain)]
    if matrices:
        phases += [Phase("allreduce", q_bytes), Phase("memory", moved)]
    return tuple(phases)


def needs_shapes(plan: Plan) -> None:
    if workload_family(plan.workload) not in SHAPES or plan.tp != 1:
        raise ConfigError("gradient_sync.method", f"powersgd factors gradient matrices; the simulator knows "
                          f"their shapes for {' and '.join(SHAPES)} workloads at tp 1 only, not {plan.workload!r} "
                          f"(tp {plan.tp})", f"use an {' or '.join(SHAPES)} workload at tp 1, or method: allreduce / "
                          "fp16 / topk")


register_gradient_sync("powersgd", PowerSGD, _powersgd, exact=False, check=needs_shapes)
