"""Versioned schemas of everything paratwin writes: profile bundles and instruction tables.

A schema is a name, a version and typed columns. Readers check all three and say exactly what is
wrong; writers refuse a table that does not match, so nothing malformed ever reaches disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROFILE_BUNDLE_FORMAT = "paratwin.profile-bundle"
PROFILE_BUNDLE_VERSION = 1
RUN_RECORD_FORMAT = "paratwin.run-record"
RUN_RECORD_VERSION = 1
COMM_BENCH_FORMAT = "paratwin.comm-bench"
COMM_BENCH_VERSION = 1


@dataclass(frozen=True)
class TableSchema:
    name: str
    version: int
    columns: dict[str, str]  # column -> pandas dtype ("int64", "float64", "string", "bool")
    # Columns added after a table was first published carry a default, so that tables written
    # before (and producers that do not know the column yet) still conform.
    defaults: dict[str, object] = field(default_factory=dict)
    # Columns whose values must be finite and >= 0 (times, sizes, counts), and columns that must
    # not be negative but may be NaN or infinite (fits that record "could not be fitted" as NaN).
    # ``traces.tables.conform`` refuses a table that breaks either, naming table, row and column.
    finite_nonnegative: tuple[str, ...] = ()
    nonnegative: tuple[str, ...] = ()

    @property
    def column_names(self) -> list[str]:
        return list(self.columns)


# One row per layer of the profiled workload. Times in seconds, sizes in bytes, medians over
# the repeated measurements; *_spread is the interquartile range / median over those repeats
# ((max - min) / median in bundles older than the `unsteady` column; meta settings["statistic"]).
LAYER_TABLE = TableSchema(
    "layers",
    1,
    {
        "layer": "int64",
        "name": "string",
        "kind": "string",
        "fwd_s": "float64",
        "fwd_spread": "float64",
        "bwd_input_s": "float64",
        "bwd_input_spread": "float64",
        "bwd_weight_s": "float64",
        "bwd_weight_spread": "float64",
        "bwd_s": "float64",  # whole backward (input + weight) measured in one call
        "bwd_spread": "float64",
        "recompute_s": "float64",  # forward re-run under no_grad->enable_grad, as checkpointing does
        "recompute_spread": "float64",
        "param_bytes": "int64",
        "grad_bytes": "int64",
        "optimizer_bytes": "int64",  # Adam: two fp32 moments per parameter
        "saved_bytes": "int64",  # activations saved for backward, each storage counted once
        "output_bytes": "int64",  # the layer's output activation (a pipeline stage's message)
        "peak_transient_bytes": "int64",
        "flops_fwd": "int64",
        "flops_bwd": "int64",
        # True when the profiler got no steady measurement of the layer after its retries (bundle
        # meta settings["unsteady_layers"] says why); absent in older bundles, hence the default.
        "unsteady": "bool",
        # Under torch's selective checkpointing (exec.selective): bytes the layer keeps, and the
        # seconds its backward spends recomputing the rest; -1 in bundles taken before (unknown).
        "selective_saved_bytes": "int64",
        "selective_recompute_s": "float64",
    },
    defaults={"unsteady": False, "selective_saved_bytes": -1, "selective_recompute_s": -1.0},
    finite_nonnegative=(
        "fwd_s", "fwd_spread", "bwd_input_s", "bwd_input_spread", "bwd_weight_s", "bwd_weight_spread",
        "bwd_s", "bwd_spread", "recompute_s", "recompute_spread", "param_bytes", "grad_bytes",
        "optimizer_bytes", "saved_bytes", "output_bytes", "peak_transient_bytes", "flops_fwd", "flops_bwd",
    ),
)

# Each co-located profiling process's own per-layer medians (analysis.validation.profiling, issue 12):
# LAYER_TABLE keeps the median over the processes; this keeps what each measured, so a systematic
# difference between processes (one doing the same work slower, every round) is a measurement the
# simulator can use (sim.meeting). Optional in a bundle: absent from single-process and older ones.
PROCESS_LAYER_TABLE = TableSchema(
    "process_layers",
    1,
    {
        "process": "int64",
        "layer": "int64",
        "fwd_s": "float64",
        "bwd_input_s": "float64",
        "bwd_weight_s": "float64",
        "bwd_s": "float64",
        "recompute_s": "float64",
    },
    finite_nonnegative=("fwd_s", "bwd_input_s", "bwd_weight_s", "bwd_s", "recompute_s"),
)

# The per-op drill-down, from torch.profiler (Kineto) or an imported Chrome-trace JSON.
OP_TABLE = TableSchema(
    "ops",
    1,
    {
        "layer": "int64",  # -1 when the op is not attributed to a layer (imported traces)
        "phase": "string",  # fwd / bwd / unknown
        "name": "string",
        "device": "string",  # cpu / cuda
        "start_us": "float64",
        "dur_us": "float64",
        "tid": "int64",
        "category": "string",  # Kineto category: cpu_op, kernel, gpu_memcpy, cuda_runtime, ...
    },
    defaults={"category": ""},
)

# Communication benchmark samples and alpha-beta fits (time = alpha + bytes / bandwidth).
COMM_SAMPLE_TABLE = TableSchema(
    "comm_samples",
    1,
    {
        "primitive": "string",
        "backend": "string",
        "world_size": "int64",
        "bytes": "int64",
        "median_s": "float64",
        "min_s": "float64",
        "max_s": "float64",
        "repeats": "int64",
        # median over repeats of one rank's process CPU seconds (every thread: the backend's, and
        # the kernel's work in their system calls) per call, the mean over ranks; NaN: not measured
        "cpu_s": "float64",
    },
    defaults={"cpu_s": float("nan")},
    finite_nonnegative=("world_size", "bytes", "median_s", "min_s", "max_s", "repeats"),
)

COMM_FIT_TABLE = TableSchema(
    "comm_fits",
    1,
    {
        "primitive": "string",
        "backend": "string",
        "world_size": "int64",
        "alpha_s": "float64",
        "bandwidth_Bps": "float64",
        "r2": "float64",
        "note": "string",  # how the backend implements the primitive, when that matters for the fit
        # a rank's CPU seconds per call = cpu_alpha_s + bytes / cpu_bandwidth_Bps (the samples'
        # cpu_s, fitted as the times are); NaN where the CPU was not measured
        "cpu_alpha_s": "float64",
        "cpu_bandwidth_Bps": "float64",
    },
    defaults={"note": "", "cpu_alpha_s": float("nan"), "cpu_bandwidth_Bps": float("nan")},
    nonnegative=("alpha_s", "bandwidth_Bps", "cpu_alpha_s", "cpu_bandwidth_Bps"),  # NaN: not fitted
)

# The table that the simulator and the runtime both write, one row per executed instruction
# (parent == -1) and optional per-layer child rows (parent = index of their instruction).
INSTRUCTION_TABLE = TableSchema(
    "instructions",
    1,
    {
        "rank": "int64",
        "index": "int64",  # position of the instruction in its rank's program
        "kind": "string",  # FWD, BWD, BWD_I, BWD_W, RECOMPUTE, SEND_ACT, ..., OPTIMIZER_STEP
        "stage": "int64",  # virtual stage, -1 when not stage-bound
        "microbatch": "int64",  # -1 when not microbatch-bound
        "stream": "string",  # compute / p2p_send / p2p_recv / collective / copy
        "start_s": "float64",
        "end_s": "float64",
        "bytes": "int64",  # bytes moved (communication, swap), 0 for compute
        "mem_after": "int64",  # device memory in use once the instruction ends
        "parent": "int64",
        "layer": "int64",
        "name": "string",
    },
)

TABLES = {t.name: t for t in (LAYER_TABLE, PROCESS_LAYER_TABLE, OP_TABLE, COMM_SAMPLE_TABLE, COMM_FIT_TABLE,
                              INSTRUCTION_TABLE)}
