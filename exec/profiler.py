"""Per-layer profiler: time, memory and FLOPs of every layer of a workload, as a ProfileBundle.

Each layer is built alone (a pipeline rank never holds more) and fed the activation that layers
0..i-1 produce, once and without autograd, from the seeded batch. Then, on the local device:

- times (CUDA events on a GPU, ``perf_counter`` on a CPU), taken once the layer is warm (see
  "Steady measurements" below): the median and spread of ``repeats`` rounds of: forward; full
  backward (input and parameter gradients in one ``autograd.grad`` call); recompute (a forward
  with autograd right after a no-grad forward, as activation checkpointing runs it); B, the input gradient alone
  (``autograd.grad`` w.r.t. the layer input: autograd skips every weight-gradient kernel); and
  W, the parameter gradients alone given the graph B left: every module that owns parameters
  had its output's gradient captured during B, and W is ``autograd.grad`` from those outputs to
  the module's own parameters, which runs only the weight-gradient kernels. A layer whose input
  is not a float tensor (token ids) has no B; its W is then the whole backward. For an LSTM the
  weight gradients need the whole backward through time, so its W is close to its full backward.
- bytes: parameters, gradients (same dtype), Adam state (two fp32 moments per parameter),
  activations saved for backward (``saved_tensors_hooks``; each storage counted once; the
  layer's parameters excluded; the layer *input* counted when an op of the layer saves it, which
  is how a stage holds it), the output, and the peak transient: how far memory rises above both
  the level before and the level after a phase, the larger of forward and backward. GPU:
  ``torch.cuda`` allocator statistics. CPU: a dispatch-level tracker that adds the bytes of every
  new storage an operator returns and subtracts them when the storage dies; buffers private to a
  kernel (e.g. inside the CPU attention kernel) never reach the dispatcher and are not seen.
- FLOPs of the forward and of the full backward (``FlopCounterMode``; matmuls and convolutions
  only, as it counts).
- the per-op drill-down of one forward and backward under ``torch.profiler``, inside
  ``record_function("layer{i}.fwd" / ".bwd")`` ranges (OP_TABLE). Layers are laid end to end on
  one time axis in that table.

The last layer is profiled together with ``workload.loss``: it runs on the last pipeline stage,
so its output is the scalar loss and its backward starts from d(loss) = 1.

Steady measurements (``Steadiness``). A layer's first calls pay one-off costs (allocator growth,
lazy initialisation, oneDNN primitive creation, thread-pool start) and a shared machine has slow
periods; a fixed two-round warm-up let a 50x outlier through as a median. So:

1. warm-up until stable: at least ``warmup`` rounds, then more until the last ``window`` rounds'
   total times agree within ``band`` (relative), capped at ``max_warmup`` rounds, and at
   ``max_warmup_s`` seconds unless the rounds are still getting faster;
2. robust statistics: median, and spread = interquartile range / median, per timed quantity;
3. a layer whose spread exceeds ``max_spread`` in any quantity that is not negligible (IQR above
   ``floor_s``) is measured again, warm-up included, up to ``retries`` more times;
4. identical layers (same kind, bytes and FLOPs) must cost the same: once every layer is
   measured, a layer whose time differs from the median of its identical siblings by more than
   ``sibling_tolerance`` (relative) is rebuilt and measured again, up to ``retries`` times, until
   it agrees. This catches a slow period that lasts a whole layer's measurement (steady but wrong).
   The siblings that count are those agreeing with their group (total time within the tolerance
   of the median total of every member's best attempt), steady ones first, so one bad layer is no
   one's reference, whatever order the layers are settled in; a pair that disagrees has no
   consensus, and each is checked against the other;
5. of a layer's attempts the profiler keeps a steady one (agreeing with its siblings, when it has
   any) and among those the fastest: contention and one-off costs only ever add time. A layer
   with no such attempt is flagged: column ``unsteady`` and ``meta.settings.unsteady_layers``
   (layer, name, why), which ``paratwin profile`` prints. Its times are the median of its
   identical siblings that agree with their group when there are two or more (they do the same
   work), else those of its fastest attempt (steady ones first).
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge, saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from exec.host_memory import state as host_memory_state
from exec.lockstep import Alone, Together
from exec.selective import COMPUTE_INTENSIVE, selective_saved_bytes
from exec.selective import storage_key as _selective_key
from exec.stderr_filter import filtered_stderr
from exec.workloads import Workload, get_workload
from traces.bundle import ProfileBundle, environment_info
from traces.errors import ConfigError
from traces.kineto import import_chrome_trace
from traces.schema import LAYER_TABLE, OP_TABLE
from traces.tables import conform, empty_table

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ADAM_STATE_BYTES_PER_PARAM = 2 * 4  # exp_avg and exp_avg_sq, kept in fp32
OP_GAP_US = 10.0  # space between layers on the op table's common time axis
# Profiled forwards whose pointwise share (``_pointwise_share``) is taken, median.
SHARE_RUNS = 5
TIME_KEYS = ("fwd", "bwd", "recompute", "bwd_input", "bwd_weight")


@dataclass(frozen=True)
class Steadiness:
    """How hard the profiler works for a steady time per layer (module docstring, "Steady
    measurements"). ``Steadiness.fixed()`` is the old behaviour: ``warmup`` rounds, no retries."""

    window: int = 3  # warm-up ends when this many consecutive rounds agree (0: fixed warm-up)
    band: float = 0.2  # ... within this relative band: (max - min) <= band * median of their totals
    max_warmup: int = 30  # warm-up rounds at most (never fewer than ``warmup``)
    # and seconds, per attempt, unless the last round still clearly beat all earlier ones: rounds
    # that stop getting faster yet never agree are contention, which warming longer does not cure.
    max_warmup_s: float = 2.0
    # Interquartile range / median above which a quantity is unsteady. The standard error of a
    # median of n samples is about 0.93 IQR / sqrt(n): 0.5 with 10 repeats is +-15% (one sigma).
    # None: no spread check (a profile's manifest must stay strict JSON, so not infinity).
    max_spread: float | None = 0.5
    retries: int = 2  # extra attempts for an unsteady layer, and again for a sibling outlier
    sibling_tolerance: float | None = 0.5  # |t / siblings' median - 1| above this: re-measure
    # Re-measurements together may take this multiple of the first measurements' time (at least
    # 5 s); past it a layer that needs one is flagged instead. Bounds the cost on a busy machine.
    retry_budget: float = 1.0
    # Differences below this many seconds are timer and interpreter jitter, never "unsteady"
    # (a 20 us layer is not re-measured for a 10 us wobble). CUDA events resolve ~1 us.
    floor_s: float = 20e-6

    @classmethod
    def fixed(cls) -> Steadiness:
        return cls(window=0, max_warmup=0, retries=0, sibling_tolerance=None, max_spread=None)


@dataclass
class _Budget:
    """Seconds spent on first measurements and on re-measurements (Steadiness.retry_budget)."""

    share: float
    first_s: float = 0.0
    retry_s: float = 0.0

    def allows_retry(self) -> bool:
        return self.retry_s < self.share * max(self.first_s, 5.0)

    def timed(self, fn: Callable[[], _Attempt], retry: bool) -> _Attempt:
        t0 = time.perf_counter()
        out = fn()
        if retry:
            self.retry_s += time.perf_counter() - t0
        else:
            self.first_s += time.perf_counter() - t0
        return out


def profile_workload(
    workload: Workload | str,
    micro_batch: int,
    seq: int | None = None,
    dtype: str = "float32",
    device: str = "auto",
    warmup: int = 2,
    repeats: int = 10,
    with_ops: bool = True,
    layers: range | None = None,
    seed: int = 0,
    steady: Steadiness | None = None,
    together: Together | None = None,
) -> ProfileBundle:
    """Profile ``layers`` (default all) of ``workload`` at ``micro_batch`` on the local device.

    ``warmup`` is the least number of warm-up rounds; ``steady`` (default ``Steadiness()``) says how
    many more, and when a layer is measured again or flagged unsteady. ``together``: processes
    profiling at once in lockstep (``exec.lockstep.Lockstep``): every timed round starts in all of
    them at once and they decide together how many rounds to run, so each layer is timed while
    the others run the same layer, as the ranks of a run do (default: alone)."""
    started = time.perf_counter()
    wl = _resolve_workload(workload, seq)
    dev = _resolve_device(device)
    torch_dtype = _resolve_dtype(dtype)
    if micro_batch < 1:
        raise ConfigError("micro_batch", f"must be at least 1, not {micro_batch}",
                          "pass --micro-batch 1 or more")
    if repeats < 1 or warmup < 0:
        raise ConfigError("repeats", f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}",
                          "use e.g. warmup=2, repeats=10")
    span = _resolve_layers(layers, wl.num_layers)
    names = wl.layer_names()
    timer = _Timer(dev, together or Alone())
    policy = Steadiness() if steady is None else steady
    budget = _Budget(policy.retry_budget)

    batch = wl.make_batch(micro_batch, seed=seed, device=dev)
    x = batch.inputs.to(torch_dtype) if batch.inputs.is_floating_point() else batch.inputs
    rows: list[dict[str, object]] = []
    op_tables: list[pd.DataFrame] = []
    op_offset = 0.0
    optimizer_s = 0.0
    inputs: dict[int, torch.Tensor] = {}  # each layer's input, kept for a re-measurement at the end
    attempts: dict[int, list[_Attempt]] = {}

    def probe_of(index: int, layer: nn.Module, x: torch.Tensor) -> _LayerProbe:
        targets = batch.targets if index == wl.num_layers - 1 else None
        return _LayerProbe(index, layer, x.to(dev), targets, wl.loss, seed)

    for index in range(span.stop):
        layer = wl.build_layers(index, index + 1, device=dev, dtype=torch_dtype, seed=seed)[0]
        if index in span:
            probe = probe_of(index, layer, x)
            inputs[index] = x.detach().to("cpu") if dev.type == "cuda" else x.detach()
            attempts[index] = _measure_steady(probe, timer, warmup, repeats, policy, budget)
            rows.append({"layer": index, "name": names[index], "kind": _kind(wl, index),
                         **_measure_bytes(probe, dev), **_measure_flops(probe),
                         "selective_saved_bytes": _selective_bytes(probe),
                         "pointwise_share": _measure_pointwise_share(probe, dev)})
            optimizer_s += _measure_optimizer_step(layer, timer, warmup, repeats)
            if with_ops:
                ops = _op_table(probe, dev, op_offset)
                if len(ops):
                    op_offset = float((ops["start_us"] + ops["dur_us"]).max()) + OP_GAP_US
                op_tables.append(ops)
        if index + 1 < span.stop:
            with torch.no_grad():
                x = layer(x)
        del layer

    def remeasure(index: int) -> _Attempt:
        layer = wl.build_layers(index, index + 1, device=dev, dtype=torch_dtype, seed=seed)[0]
        probe = probe_of(index, layer, inputs[index])
        return budget.timed(lambda: _measure_attempt(probe, timer, warmup, repeats, policy), retry=True)

    notes = _settle(rows, attempts, remeasure, policy, budget, timer.together)
    inputs.clear()
    for row in rows:
        chosen = row.pop("_chosen")
        row.update(chosen.columns())
        row["unsteady"] = bool(notes.get(row["layer"]))
        row["warmup_rounds"] = chosen.warmup_rounds  # extra columns: how the times were obtained
        row["attempts"] = len(attempts[row["layer"]])
        # every round run for the layer, warm-up included (in lockstep: the same in every process)
        row["rounds_run"] = sum(a.warmup_rounds + len(a.samples["fwd"]) for a in attempts[row["layer"]])
        row["steadiness"] = notes.get(row["layer"], "")
        share = row["pointwise_share"]
        row["selective_recompute_s"] = row["recompute_s"] * share if share >= 0 else -1.0

    layer_table = conform(pd.DataFrame(rows), LAYER_TABLE, "profiler")
    ops_table = conform(pd.concat(op_tables, ignore_index=True), OP_TABLE, "profiler") if op_tables \
        else empty_table(OP_TABLE)
    settings = {
        "micro_batch": micro_batch, "seq": getattr(wl, "seq", None), "dtype": dtype, "device": str(dev),
        "warmup": warmup, "repeats": repeats, "with_ops": with_ops, "layers": [span.start, span.stop],
        "seed": seed, "torch_threads": torch.get_num_threads(),
        "host_memory": host_memory_state(),  # exec.host_memory (absent in older bundles: allocator default)
        "lockstep": not isinstance(timer.together, Alone),
        "timer": "cuda events" if dev.type == "cuda" else "time.perf_counter",
        "statistic": "median over repeats; spread = interquartile range / median",
        "steadiness": {**asdict(policy), "min_warmup": warmup},
        "retry_s": budget.retry_s,
        "load_average_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "unsteady_layers": [{"layer": row["layer"], "name": row["name"], "why": row["steadiness"]}
                            for row in rows if row["unsteady"]],
        "bwd_weight": "autograd.grad from each parameter-owning module's output (gradient captured "
                      "during B) to its own parameters; whole backward when the input is not a float",
        "saved_bytes": "saved_tensors_hooks, each storage once, parameters excluded, layer input "
                       "included when saved (also in the extra column saved_input_bytes)",
        "peak_transient": "torch.cuda max_memory_allocated" if dev.type == "cuda" else
                          "dispatch-level storage tracker (kernel-private scratch not seen)",
        "last_layer": "profiled with workload.loss; output is the scalar loss",
        "selective": "selective_saved_bytes: one forward under torch's selective checkpointing "
                     "(exec.selective), saved and kept storages once; selective_recompute_s: recompute_s x "
                     "pointwise_share, the share of a forward under torch.profiler outside the kept "
                     "operators (median of SHARE_RUNS forwards)",
        # Adam (torch.optim defaults) stepped over each layer's own parameters, medians summed;
        # the simulator charges an optimizer step this many seconds per parameter byte.
        "optimizer_s_per_param_byte": optimizer_s / max(int(layer_table["param_bytes"].sum()), 1),
        "profile_wall_s": time.perf_counter() - started,
    }
    meta = {**environment_info(), "workload": wl.describe(), "settings": settings}
    return ProfileBundle(meta=meta, layers=layer_table, ops=ops_table)


# --- settings ------------------------------------------------------------------------------------


def _resolve_workload(workload: Workload | str, seq: int | None) -> Workload:
    if isinstance(workload, str):
        return get_workload(workload, **({} if seq is None else {"seq": seq}))
    if seq is not None and getattr(workload, "seq", None) != seq:
        built = getattr(workload, "seq", None)
        raise ConfigError("seq", f"workload {workload.name} was built for seq {built}, not {seq}",
                          "pass the workload by name, or build it with this seq")
    return workload


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError("device", f"unknown device {device!r}", "use auto, cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "CUDA is not available on this machine", "use --device cpu or auto")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError("device", f"cannot profile on {dev.type}", "use auto, cpu or cuda[:N]")
    return dev


def _resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ConfigError("dtype", f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _resolve_layers(layers: range | None, count: int) -> range:
    span = range(count) if layers is None else layers
    if not isinstance(span, range) or span.step != 1 or not 0 <= span.start < span.stop <= count:
        raise ConfigError("layers", f"{layers!r} is not a contiguous range inside 0..{count}",
                          f"pass e.g. range(0, {count})")
    return span


def _kind(wl: Workload, index: int) -> str:
    kind_of = getattr(wl, "layer_kind", None)
    return kind_of(index) if callable(kind_of) else wl.layer_names()[index].rstrip("0123456789.")


# --- one layer -----------------------------------------------------------------------------------


@dataclass
class _LayerProbe:
    """A built layer with its input, and how to run its forward and backward."""

    index: int
    layer: nn.Module
    x: torch.Tensor
    targets: torch.Tensor | None  # set for the last layer, whose forward includes the loss
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    seed: int
    params: list[nn.Parameter] = field(init=False)
    _grad_out: torch.Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.x = self.x.detach()
        if self.x.is_floating_point():
            self.x.requires_grad_(True)
        self.params = [p for p in self.layer.parameters() if p.requires_grad]

    @property
    def has_input_grad(self) -> bool:
        return self.x.requires_grad

    def forward(self) -> torch.Tensor:
        y = self.layer(self.x)
        return y if self.targets is None else self.loss(y, self.targets)

    def grad_out(self, y: torch.Tensor) -> torch.Tensor:
        """A fixed, seeded gradient of the output (ones for the scalar loss)."""
        if self._grad_out is None:
            if y.dim() == 0:
                self._grad_out = torch.ones_like(y)
            else:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.index)
                self._grad_out = torch.randn(y.shape, generator=gen).to(device=y.device, dtype=y.dtype)
        return self._grad_out

    def backward(self, y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = ([self.x] if self.has_input_grad else []) + self.params
        return torch.autograd.grad(y, inputs, self.grad_out(y), allow_unused=True)

    def backward_input(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(y, [self.x], self.grad_out(y), retain_graph=True)

    def backward_weight(self, y: torch.Tensor, captures: list[_Capture]) -> None:
        covered: set[int] = set()
        for cap in captures:
            if cap.grad is None:
                continue
            torch.autograd.grad([cap.edge], cap.params, [cap.grad], retain_graph=True, allow_unused=True)
            covered.update(id(p) for p in cap.params)
        rest = [p for p in self.params if id(p) not in covered]
        if rest:  # parameters whose module output B never reached: backward from the layer output
            torch.autograd.grad(y, rest, self.grad_out(y), retain_graph=True, allow_unused=True)


@dataclass
class _Capture:
    """The output edge of one parameter-owning module and the gradient that reached it in B."""

    params: list[nn.Parameter]
    edge: GradientEdge
    grad: torch.Tensor | None = None
    handle: object = None

    def store(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        self.grad = grad_outputs[self.edge.output_nr]


@contextmanager
def _capture_weight_edges(layer: nn.Module) -> Iterator[list[_Capture]]:
    """While active, every forward of a module with its own parameters records its output edge
    (taken before any in-place op can move the tensor on) and a pre-hook that keeps its gradient.
    The pre-hooks outlive the block (they must see B); ``_release_prehooks`` removes them."""
    captures: list[_Capture] = []

    def on_forward(module: nn.Module, args: object, output: object) -> None:
        out = next((t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)), None)
        if out is None or out.grad_fn is None:
            return
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        cap = _Capture(own, get_gradient_edge(out))
        cap.handle = cap.edge.node.register_prehook(lambda grads, cap=cap: cap.store(grads))
        captures.append(cap)

    owners = [m for m in layer.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    handles = [m.register_forward_hook(on_forward) for m in owners]
    try:
        yield captures
    finally:
        for handle in handles:
            handle.remove()


def _release_prehooks(captures: list[_Capture]) -> None:
    for cap in captures:
        if cap.handle is not None:
            cap.handle.remove()
            cap.handle = None


# --- time ----------------------------------------------------------------------------------------


class _Timer:
    def __init__(self, device: torch.device, together: Together | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.together: Together = together or Alone()  # processes timing in lockstep (exec.lockstep)

    def __call__(self, fn: Callable[[], object]) -> tuple[float, object]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3, out
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out


def _round(probe: _LayerProbe, timer: _Timer) -> tuple[float, ...]:
    """One round of every timed quantity, in TIME_KEYS order."""
    t_fwd, y = timer(probe.forward)
    t_bwd, _ = timer(lambda y=y: probe.backward(y))
    del y
    with torch.no_grad():  # the first, non-saving forward of a checkpointed layer
        probe.forward()
    with _capture_weight_edges(probe.layer) as captures:
        t_recompute, y = timer(probe.forward)
    t_b = 0.0
    if probe.has_input_grad:
        t_b, _ = timer(lambda y=y: probe.backward_input(y))
    _release_prehooks(captures)
    t_w, _ = timer(lambda y=y, c=captures: probe.backward_weight(y, c))
    del y, captures
    return t_fwd, t_bwd, t_recompute, t_b, t_w


def _iqr(values: list[float]) -> float:
    q1, q3 = np.percentile(values, [25, 75])
    return float(q3 - q1)


@dataclass
class _Attempt:
    """One warm-up and ``repeats`` timed rounds of a layer."""

    samples: dict[str, list[float]]
    warmup_rounds: int
    warm: bool  # the warm-up ended because rounds agreed, not at its cap

    def median(self, key: str) -> float:
        return statistics.median(self.samples[key])

    def spread(self, key: str) -> float:
        median = self.median(key)
        return _iqr(self.samples[key]) / median if median > 0 else 0.0

    @property
    def total(self) -> float:
        return sum(self.median(k) for k in TIME_KEYS)

    def unsteady(self, policy: Steadiness) -> dict[str, float]:
        """Quantities whose spread exceeds the policy's, with their spreads."""
        return {k: self.spread(k) for k in TIME_KEYS
                if policy.max_spread is not None and self.spread(k) > policy.max_spread
                and _iqr(self.samples[k]) > policy.floor_s}

    def columns(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for key in TIME_KEYS:
            out[f"{key}_s"] = self.median(key)
            out[f"{key}_spread"] = self.spread(key)
        return out


def _warm_up(probe: _LayerProbe, timer: _Timer, warmup: int, policy: Steadiness) -> tuple[int, bool]:
    """Unrecorded rounds: at least ``warmup``, then until the last ``policy.window`` round totals
    agree within ``policy.band`` (or ``policy.floor_s``), at most ``policy.max_warmup`` rounds, and
    past ``policy.max_warmup_s`` seconds only while the rounds still get faster. Returns (rounds
    run, whether they agreed). In lockstep, every process warms up while any of them wants to."""
    totals: list[float] = []
    started = time.perf_counter()
    while True:
        stop, warm = _warm_verdict(totals, warmup, policy, time.perf_counter() - started)
        if not timer.together.any(not stop):
            return len(totals), warm
        totals.append(sum(_round(probe, timer)))


def _warm_verdict(totals: list[float], warmup: int, policy: Steadiness, elapsed_s: float) -> tuple[bool, bool]:
    """(stop warming up, the rounds agreed) after the round totals ``totals``."""
    done = len(totals)
    if done < warmup:
        return False, False
    if policy.window <= 0:
        return True, True
    if done >= policy.window:
        last = totals[-policy.window:]
        if max(last) - min(last) <= max(policy.band * statistics.median(last), policy.floor_s):
            return True, True
    if done >= policy.max_warmup:
        return True, False
    # Past the time cap, stop unless the layer is still getting faster (its last round
    # clearly beat every earlier one): that is a one-off cost still wearing off.
    improving = done >= 2 and totals[-1] < (1 - policy.band) * min(totals[:-1])
    return elapsed_s > policy.max_warmup_s and not improving, False


def _measure_attempt(probe: _LayerProbe, timer: _Timer, warmup: int, repeats: int,
                     policy: Steadiness) -> _Attempt:
    rounds, warm = _warm_up(probe, timer, warmup, policy)
    samples: dict[str, list[float]] = {k: [] for k in TIME_KEYS}
    done = 0
    while timer.together.any(done < repeats):  # in lockstep: every round starts in all processes at once
        times = _round(probe, timer)
        if done < repeats:
            for key, value in zip(TIME_KEYS, times, strict=True):
                samples[key].append(value)
        done += 1
    return _Attempt(samples, rounds, warm)


def _measure_steady(probe: _LayerProbe, timer: _Timer, warmup: int, repeats: int,
                    policy: Steadiness, budget: _Budget) -> list[_Attempt]:
    """Attempts until one is steady, at most 1 + ``policy.retries`` (and within the budget)."""
    def attempt() -> _Attempt:
        return _measure_attempt(probe, timer, warmup, repeats, policy)

    attempts = [budget.timed(attempt, retry=False)]
    while timer.together.any(bool(attempts[-1].unsteady(policy)) and len(attempts) <= policy.retries
                             and budget.allows_retry()):
        attempts.append(budget.timed(attempt, retry=True))
    return attempts


def _signature(row: dict[str, object]) -> tuple[object, ...]:
    """Layers with equal signatures are identical (same kind and shapes): they must cost the same."""
    return tuple(row[k] for k in ("kind", "param_bytes", "saved_bytes", "output_bytes", "flops_fwd",
                                  "flops_bwd"))


def _off_siblings(attempt: _Attempt, reference: dict[str, float], policy: Steadiness) -> dict[str, float]:
    """Quantities of ``attempt`` that differ from the siblings' medians: {key: ratio}."""
    if policy.sibling_tolerance is None:
        return {}
    return {key: attempt.median(key) / ref if ref > 0 else float("inf")
            for key, ref in reference.items() if not _agrees(attempt.median(key), ref, policy)}


def _agrees(t: float, ref: float, policy: Steadiness) -> bool:
    """``t`` is within the sibling tolerance of ``ref`` (or of the timer's floor); a policy without one
    compares nothing."""
    return policy.sibling_tolerance is None or abs(t - ref) <= max(policy.sibling_tolerance * ref, policy.floor_s)


def _settle(rows: list[dict[str, object]], attempts: dict[int, list[_Attempt]],
            remeasure: Callable[[int], _Attempt], policy: Steadiness, budget: _Budget,
            together: Together | None = None) -> dict[int, str]:
    """Compare identical layers, re-measure the odd ones out, choose each layer's times (sets
    row["_chosen"], an attempt) and say why a layer is unsteady: {layer: note}. In lockstep a
    layer is measured again in every process when it is off in any."""
    together = together or Alone()
    groups: dict[tuple[object, ...], list[int]] = {}
    for row in rows:
        groups.setdefault(_signature(row), []).append(int(row["layer"]))

    def best(index: int) -> _Attempt:
        return min(attempts[index], key=lambda a: (bool(a.unsteady(policy)), a.total))

    def steady_siblings(index: int, group: list[int]) -> list[_Attempt]:
        # Only steady siblings are a reference: an unsteady one must not drag the others along.
        return [a for a in (best(j) for j in group if j != index) if not a.unsteady(policy)]

    def medians(chosen: list[_Attempt]) -> dict[str, float]:
        return {k: statistics.median(a.median(k) for a in chosen) for k in TIME_KEYS}

    def agreeing_siblings(index: int, group: list[int]) -> list[_Attempt]:
        # Siblings whose best total agrees with the group's median total (every member's best, this
        # layer's and unsteady ones' included). Without that rule a group of three where one is 10x
        # slow handed the other two a reference halfway there. Totals, not each quantity: one noisy
        # quantity must not cost a sibling its place.
        if policy.sibling_tolerance is None:  # siblings are not compared at all
            return []
        middle = statistics.median(best(j).total for j in group)
        return [best(j) for j in group if j != index and _agrees(best(j).total, middle, policy)]

    def reference(index: int, group: list[int]) -> dict[str, float]:
        agreeing = agreeing_siblings(index, group)
        # Steady agreeing siblings first; else the agreeing ones however unsteady; with no agreement
        # at all (a pair that disagrees) each is checked against the other's steady times, as ever.
        chosen = [a for a in agreeing if not a.unsteady(policy)] or agreeing or steady_siblings(index, group)
        return medians(chosen) if chosen else {}

    notes: dict[int, str] = {}
    for row in rows:
        index = int(row["layer"])
        group = groups[_signature(row)]
        ref = reference(index, group)
        if together.any(bool(_off_siblings(best(index), ref, policy))):
            # A steady but wrong measurement (a slow period that lasted the whole layer): rebuild
            # the layer and measure it again, warm, until it agrees with its siblings.
            for _ in range(policy.retries):
                if together.any(not budget.allows_retry()):
                    break
                attempts[index].append(remeasure(index))
                settled = not _off_siblings(attempts[index][-1], ref, policy) and \
                    not attempts[index][-1].unsteady(policy)
                if not together.any(not settled):
                    break
        agreeing = [a for a in attempts[index] if not a.unsteady(policy) and not _off_siblings(a, ref, policy)]
        chosen = min(agreeing, key=lambda a: a.total) if agreeing else \
            min(attempts[index], key=lambda a: (bool(a.unsteady(policy)), a.total))
        row["_chosen"] = chosen
        if agreeing:
            continue
        why = [f"{k} spread {v:.2f}" for k, v in chosen.unsteady(policy).items()]
        why += [f"{k} {v:.2f}x its {len(group) - 1} identical siblings' median"
                for k, v in _off_siblings(chosen, ref, policy).items()]
        note = f"{'; '.join(why)} after {len(attempts[index])} attempt(s)" + \
            ("" if budget.allows_retry() else " (retry time budget spent)")
        siblings = agreeing_siblings(index, group)
        if len(siblings) >= 2:
            # Identical layers do identical work: when two or more of them agree with their group
            # and this one never did, their median is the better estimate of its cost (flagged all
            # the same), even where load left one of them with a wide spread.
            row["_chosen"] = _Attempt({k: [a.median(k) for a in siblings] for k in TIME_KEYS}, 0, True)
            note += f"; times are the median of its {len(siblings)} identical siblings that agree with their group"
        notes[index] = note
    return notes


def _measure_optimizer_step(layer: nn.Module, timer: _Timer, warmup: int, repeats: int) -> float:
    """Median seconds of one Adam step over the layer's parameters (gradients set, state warm); in
    lockstep every step starts in all processes at once."""
    params = [p for p in layer.parameters() if p.requires_grad]
    if not params:
        return 0.0
    saved = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = torch.optim.Adam(params, lr=1e-6)
    samples = []
    round_ = 0
    while timer.together.any(round_ < warmup + repeats):  # in lockstep: as many steps as any process takes
        elapsed, _ = timer(optimizer.step)
        if round_ >= warmup:
            samples.append(elapsed)
        round_ += 1
    with torch.no_grad():  # the layer's weights stay as built, for the measurements that follow
        for p, original in zip(params, saved, strict=True):
            p.copy_(original)
            p.grad = None
    return statistics.median(samples)


# --- bytes ---------------------------------------------------------------------------------------


def _selective_bytes(probe: _LayerProbe) -> int:
    """What the layer keeps under torch's selective checkpointing (exec.selective); the last
    layer's loss runs outside the checkpointed layer, as on the last pipeline stage."""
    loss = None if probe.targets is None else (lambda y: probe.loss(y, probe.targets))
    return selective_saved_bytes(probe.layer, probe.x, {_selective_key(p) for p in probe.params}, loss)


def _measure_pointwise_share(probe: _LayerProbe, dev: torch.device) -> float:
    """``_pointwise_share`` of the fastest of ``SHARE_RUNS`` profiled forwards (contention only
    ever adds time, and one forward on a shared machine is easily interrupted); -1 if the profiler
    saw no forward range."""
    def forward() -> None:
        probe.forward()  # the profiler's first operators pay its start-up: not the measured ones
        with torch.profiler.record_function(f"layer{probe.index}.fwd"):
            probe.forward()
            _sync(dev)

    runs = []
    for _ in range(SHARE_RUNS):
        ops = _profiled_ops(dev, forward)
        span = ops[ops["name"] == f"layer{probe.index}.fwd"]["dur_us"]
        runs.append((float(span.iloc[0]) if len(span) else float("inf"), _pointwise_share(ops, probe.index)))
    return min(runs)[1]


def _pointwise_share(ops: pd.DataFrame, index: int) -> float:
    """Share of the layer's profiled forward (the operators directly inside its ``layer{i}.fwd``
    range, so the profiler's own start-up inside the range does not count) spent outside the
    operators selective checkpointing keeps (exec.selective.COMPUTE_INTENSIVE): what its backward
    recomputes. -1 when the table has no such range or no operator in it."""
    span = ops[ops["name"] == f"layer{index}.fwd"]
    if not len(span):
        return -1.0
    start, end = float(span["start_us"].iloc[0]), float(span["start_us"].iloc[0] + span["dur_us"].iloc[0])
    inside = ops[(ops["start_us"] >= start) & (ops["start_us"] < end) & ops["name"].str.startswith("aten::")]
    kept_names = {f"aten::{op.name().split('::')[-1].split('.')[0]}" for op in COMPUTE_INTENSIVE}
    top, kept, last_end = 0.0, 0.0, -math.inf
    for row in inside.sort_values("start_us").itertuples():
        if row.start_us >= last_end:  # not nested in the previous top-level operator
            top += row.dur_us
            last_end = row.start_us + row.dur_us
        if row.name in kept_names:
            kept += row.dur_us
    return max(0.0, 1.0 - kept / top) if top > 0 else -1.0


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def _measure_bytes(probe: _LayerProbe, dev: torch.device) -> dict[str, int]:
    saved: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.setdefault(_storage_key(t), t.untyped_storage().nbytes())
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        y = probe.forward()
    param_keys = {_storage_key(p) for p in probe.params}
    saved = {k: n for k, n in saved.items() if k not in param_keys and n > 0}
    param_bytes = sum(p.numel() * p.element_size() for p in probe.params)
    n_params = sum(p.numel() for p in probe.params)
    out = {
        "param_bytes": param_bytes,
        "grad_bytes": param_bytes,
        "optimizer_bytes": n_params * ADAM_STATE_BYTES_PER_PARAM,
        "saved_bytes": sum(saved.values()),
        "output_bytes": y.numel() * y.element_size(),
        # Extra columns: the parts of saved_bytes that are the layer's input / output storage, so
        # a stage total can count a tensor saved on both sides of a layer boundary once.
        "saved_input_bytes": saved.get(_storage_key(probe.x), 0),
        "saved_output_bytes": saved.get(_storage_key(y), 0),
    }
    del y  # free this forward's graph before measuring the next one's memory
    out["peak_transient_bytes"] = _peak_transient(probe, dev)
    return out


class _StorageTracker(TorchDispatchMode):
    """Bytes of live storages created by operators while active, and their high-water mark.

    A storage counts from the operator that returns it first (outputs that alias an input, i.e.
    views and in-place results, are not new) until it is freed, wherever that happens.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        out = func(*args, **(kwargs or {}))
        inputs = {s.data_ptr() for t in tree_flatten((args, kwargs))[0] for s in _storages(t)}
        for t in tree_flatten(out)[0]:
            for storage in _storages(t):
                self._track(storage, inputs)
        return out

    def _track(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        ptr, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or ptr in inputs or ptr in self._tracked:
            return
        self._tracked.add(ptr)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, ptr, size)

    def _free(self, ptr: int, size: int) -> None:
        self._tracked.discard(ptr)
        self.live -= size


def _storages(t: object) -> list[torch.UntypedStorage]:
    """The storages a tensor's bytes live in: its own, or a sparse COO tensor's indices and values
    (a sparse embedding's gradient has no storage of its own)."""
    if not isinstance(t, torch.Tensor):
        return []
    if t.layout == torch.sparse_coo:
        return [t._indices().untyped_storage(), t._values().untyped_storage()]
    if t.layout != torch.strided:
        return []
    return [t.untyped_storage()]


def _peak_transient(probe: _LayerProbe, dev: torch.device) -> int:
    """max over forward and backward of (peak during the phase - max(level before, level after))."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        start = torch.cuda.memory_allocated(dev)
        y = probe.forward()
        torch.cuda.synchronize(dev)
        fwd_peak, fwd_end = torch.cuda.max_memory_allocated(dev), torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        grads = probe.backward(y)
        torch.cuda.synchronize(dev)
        bwd_peak, bwd_end = torch.cuda.max_memory_allocated(dev), torch.cuda.memory_allocated(dev)
    else:
        tracker = _StorageTracker()
        with tracker:
            start = 0
            y = probe.forward()
            fwd_peak, fwd_end = tracker.peak, tracker.live
            tracker.peak = tracker.live
            grads = probe.backward(y)
            bwd_peak, bwd_end = tracker.peak, tracker.live
    del y, grads
    return int(max(fwd_peak - max(start, fwd_end), bwd_peak - max(fwd_end, bwd_end), 0))


# --- FLOPs ---------------------------------------------------------------------------------------


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args,  # noqa: ANN001
                             out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _lstm_flops(input_shape, w_ih_shape, w_hh_shape, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001
    # Every step multiplies [batch, in] by w_ih^T [in, 4H] and [batch, H] by w_hh^T [H, 4H].
    steps_times_batch = input_shape[0] * input_shape[1]
    return 2 * steps_times_batch * w_ih_shape[0] * (w_ih_shape[1] + w_hh_shape[1])


def _lstm_backward_flops(input_shape, w_ih_shape, w_hh_shape, *args, out_shape=None,  # noqa: ANN001
                         **kwargs) -> int:
    return 2 * _lstm_flops(input_shape, w_ih_shape, w_hh_shape)  # input (and h) grads + weight grads


def _flop_formulas() -> dict[object, object]:
    # FlopCounterMode (torch 2.13) knows the CUDA attention kernels but neither the CPU one that
    # SDPA dispatches to here nor the CPU (oneDNN) LSTM layer, and would count them as free.
    aten = torch.ops.aten
    formulas = {
        "_scaled_dot_product_flash_attention_for_cpu": _cpu_sdpa_flops,
        "_scaled_dot_product_flash_attention_for_cpu_backward": _cpu_sdpa_backward_flops,
        "mkldnn_rnn_layer": _lstm_flops,
        "mkldnn_rnn_layer_backward": _lstm_backward_flops,
    }
    return {getattr(aten, name): f for name, f in formulas.items() if hasattr(aten, name)}


def _measure_flops(probe: _LayerProbe) -> dict[str, int]:
    with FlopCounterMode(display=False, custom_mapping=_flop_formulas()) as counter:
        y = probe.forward()
    flops_fwd = counter.get_total_flops()
    with FlopCounterMode(display=False, custom_mapping=_flop_formulas()) as counter:
        probe.backward(y)
    return {"flops_fwd": int(flops_fwd), "flops_bwd": int(counter.get_total_flops())}


# --- per-op drill-down ---------------------------------------------------------------------------


def _op_table(probe: _LayerProbe, dev: torch.device, offset_us: float) -> pd.DataFrame:
    """One forward and backward under torch.profiler, as OP_TABLE rows of this layer."""
    def forward_backward() -> None:
        with torch.profiler.record_function(f"layer{probe.index}.fwd"):
            y = probe.forward()
            _sync(dev)
        with torch.profiler.record_function(f"layer{probe.index}.bwd"):
            probe.backward(y)
            _sync(dev)

    ops = _profiled_ops(dev, forward_backward)
    if not len(ops):
        return ops
    # Everything in this profile is this layer's work; backward ops that run on autograd's
    # device thread sit outside the annotation but carry phase "bwd" from their own names.
    ops["layer"] = probe.index
    ops["start_us"] = ops["start_us"] + offset_us
    return ops


def _profiled_ops(dev: torch.device, body: Callable[[], None]) -> pd.DataFrame:
    """``body()`` run under torch.profiler (CPU, and CUDA on a GPU), its operators as a Kineto op
    table (traces.kineto.import_chrome_trace)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with filtered_stderr(), torch.profiler.profile(activities=activities) as prof:  # kineto's start/stop lines
        body()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return import_chrome_trace(path)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
