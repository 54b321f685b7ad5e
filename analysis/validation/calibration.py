"""Constants the simulator may need on this machine, fitted on validation runs of plans outside
the suite: ``ValidationCalibration`` (a compute scale and a per-all-reduce overhead), the cost
model wrappers that apply it to a ``ResolvedPlan`` (``with_calibration``), and its fit
(``fit_calibration``). Not the A100 curve calibration of ``analysis.calibrate``."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from analysis.validation.report import ValidationReport
from analysis.validation.runtime_costs import measure_runtime_costs
from sim.compile import ResolvedPlan, resolve_plan
from sim.embedding import ids_request_host_s
from sim.engine import EngineOptions
from sim.plan import Plan
from sim.simulate import simulate
from traces.errors import ConfigError


@dataclass(frozen=True)
class ValidationCalibration:
    """Constants the simulator may need on this machine, measured on plans that are not validated
    with them (``fit_calibration``), never tuned to the plans they are then tested on."""

    compute_scale: float = 1.0  # x every compute time (layer passes and the optimizer step)
    allreduce_overhead_s: float = 0.0  # + every all-reduce, data-parallel bucket or TP (fitted)
    dispatch_s: float = 0.0  # before every compute instruction but a rank's first (measured)
    p2p_overhead_s: float = 0.0  # + every point-to-point message and synchronous embedding exchange (measured)
    source: str = ""

    @property
    def identity(self) -> bool:
        return (self.compute_scale == 1.0 and self.allreduce_overhead_s == 0.0 and self.dispatch_s == 0.0
                and self.p2p_overhead_s == 0.0)

    def engine_options(self, options: EngineOptions | None = None) -> EngineOptions:
        return replace(options or EngineOptions(), dispatch_s=self.dispatch_s)


class CalibratedCosts:
    """A cost model whose compute times are ``compute_scale`` x those of ``base``."""

    def __init__(self, base: Any, compute_scale: float) -> None:
        self.base, self.compute_scale = base, float(compute_scale)
        self.num_layers = base.num_layers
        # host work, not layer compute: not scaled (exec.embedding.request_host_work)
        self.ids_request_host_s = ids_request_host_s(base)

    def layer_costs(self, layer: int, micro_batch: int, tp: int) -> Any:
        c, k = self.base.layer_costs(layer, micro_batch, tp), self.compute_scale
        # a time k times as long has k times its standard deviation (the profile's spread is relative)
        return replace(c, fwd_s=c.fwd_s * k, bwd_input_s=c.bwd_input_s * k, bwd_weight_s=c.bwd_weight_s * k,
                       recompute_s=c.recompute_s * k, fwd_sd_s=c.fwd_sd_s * k, bwd_sd_s=c.bwd_sd_s * k,
                       bwd_input_sd_s=c.bwd_input_sd_s * k, bwd_weight_sd_s=c.bwd_weight_sd_s * k,
                       recompute_sd_s=c.recompute_sd_s * k,
                       **{f"{p}_offsets_s": tuple(v * k for v in getattr(c, f"{p}_offsets_s"))
                          for p in ("fwd", "bwd", "bwd_input", "bwd_weight", "recompute")})

    def optimizer_step_s(self, param_bytes: int) -> float:
        return self.base.optimizer_step_s(param_bytes) * self.compute_scale

    def layer_weights(self, by: str) -> list[float]:
        return self.base.layer_weights(by)


class CalibratedComm:
    """``base`` (a ``sim.comm.ClusterComm``) with ``allreduce_overhead_s`` added to every all-reduce.

    Why: inside a run, a gloo all-reduce also waits for the peer to arrive and for both processes
    to be scheduled at once; commbench, which starts every repeat from a barrier, does not see
    that. It matters most for TP, whose all-reduces sit inside every forward and backward."""

    def __init__(self, base: Any, allreduce_overhead_s: float, p2p_overhead_s: float = 0.0) -> None:
        self.base, self.overhead, self.p2p_overhead = base, float(allreduce_overhead_s), float(p2p_overhead_s)
        self.capacity_bytes, self.cluster = base.capacity_bytes, base.cluster
        # A synchronous embedding exchange (sim.embedding.exchange_s) is a message the thread waits
        # for after unaligned work, as a pipeline's receive is: the same measured overhead, once.
        self.message_overhead_s = self.p2p_overhead

    def p2p_route(self, src: int, dst: int, concurrent: int = 1) -> tuple[str, float, float]:
        link, latency, bandwidth = self.base.p2p_route(src, dst, concurrent)
        return link, latency + self.p2p_overhead, bandwidth

    def p2p_weight(self, nbytes: int) -> float:
        return self.base.p2p_weight(nbytes)

    def collective_s(self, primitive: str, nbytes: int, ranks: Any, concurrent: int = 1) -> float:
        seconds = self.base.collective_s(primitive, nbytes, ranks, concurrent)
        return seconds + self.overhead if primitive == "allreduce" else seconds

    def host_copy(self) -> tuple[float, float]:
        return self.base.host_copy()

    def cpu_s(self, primitive: str, nbytes: int, group_size: int) -> float:
        return self.base.cpu_s(primitive, nbytes, group_size) if hasattr(self.base, "cpu_s") else 0.0

    @property
    def measures_cpu(self) -> bool:
        return bool(getattr(self.base, "measures_cpu", False))


def with_calibration(resolved: ResolvedPlan, calibration: ValidationCalibration) -> ResolvedPlan:
    """``resolved`` with the calibration applied (swapped in after ``resolve_plan``, which keeps the
    bundle's communication fits; ``resolve_plan(plan, costs=...)`` would drop them)."""
    costs = CalibratedCosts(resolved.costs, calibration.compute_scale) if calibration.compute_scale != 1.0 \
        else resolved.costs
    comm = CalibratedComm(resolved.comm, calibration.allreduce_overhead_s, calibration.p2p_overhead_s) \
        if calibration.allreduce_overhead_s or calibration.p2p_overhead_s else resolved.comm
    return replace(resolved, costs=costs, comm=comm)


def fit_calibration(reports: list[ValidationReport], max_overhead_s: float = 0.02,
                    options: EngineOptions | None = None) -> ValidationCalibration:
    """The runtime's measured dispatch time and message overhead (``runtime_costs``, from the
    reports' instruction tables), then the all-reduce overhead that minimises the squared log errors
    of the iteration times of ``reports`` (validated without calibration), re-simulated with each
    candidate and the measured costs.

    The compute scale stays 1: with profiles taken right before and after each run, compute
    matched within a few percent whenever the machine's load was steady, and a scale measured in
    one window of load was wrong in the next (docs/validation.md). ``options``: the engine's options
    the plans will be simulated with (the fit must see the same model)."""
    from scipy.optimize import minimize_scalar

    cases = []
    for report in reports:
        plan = Plan.load(Path(report.out_dir) / "plan.yaml")
        cases.append((plan, resolve_plan(plan), report.measured_s))
    if not cases:
        raise ConfigError("calibration", "no calibration reports", "validate some calibration plans first")

    tables = [(Path(r.paths["run"]) / "record" / "instructions.parquet",
               Path(r.paths["prediction"]) / "instructions.parquet") for r in reports
              if "run" in r.paths and "prediction" in r.paths]
    dispatch, p2p = measure_runtime_costs(tables)
    measured_costs = ValidationCalibration(dispatch_s=dispatch, p2p_overhead_s=p2p)

    def loss(overhead: float) -> float:
        calibration = replace(measured_costs, allreduce_overhead_s=overhead)
        return sum(math.log(simulate(plan, full=True, options=calibration.engine_options(options),
                                     resolved=with_calibration(resolved, calibration)).iteration_s / measured) ** 2
                   for plan, resolved, measured in cases)

    best = minimize_scalar(loss, bounds=(0.0, max_overhead_s), method="bounded", options={"xatol": 1e-5})
    # Bounded Brent never evaluates the bounds themselves: when no overhead is best it stops a few
    # microseconds inside, slightly worse than none. Compare with none and keep the better.
    overhead = float(best.x) if best.fun < loss(0.0) else 0.0
    return replace(measured_costs, allreduce_overhead_s=overhead,
                   source=f"measured and fitted on {', '.join(r.plan for r in reports)}")

