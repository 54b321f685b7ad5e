"""Communication for validation: the message sizes of a plan, and a two-rank benchmark of them
(``exec.commbench``) whose alpha-beta fits are stored in the profile bundle, where
``sim.comm.ClusterComm`` picks them up."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sim.compile import compile_plan
from sim.plan import Plan
from sim.program import COLLECTIVE_KINDS, RECV_KINDS, SEND_KINDS
from traces.bundle import read_bundle, write_bundle
from traces.errors import ConfigError

# all_to_all: sharded embeddings (sim.embedding); all_gather and reduce_scatter: sequence parallelism,
# the distributed optimizer and the sparse all-gather baselines (sim.comm prices what it has measured)
COMM_PRIMITIVES = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"]
COMM_POINTS = 7  # sizes per sweep, geometric between half the smallest and twice the largest message
MIN_COMM_BYTES = 1024
COMM_KINDS = {k.value for k in (*SEND_KINDS, *RECV_KINDS, *COLLECTIVE_KINDS)}


def comm_sizes(plan: Plan) -> list[int]:
    """Bytes of every message, gradient bucket and TP all-reduce of ``plan`` (costs from its profile)."""
    compiled = compile_plan(plan, symmetric=False)
    program, resolved = compiled.program, compiled.resolved
    sizes = {ins.bytes for rp in program.ranks.values() for ins in rp.instructions
             if ins.kind.value in COMM_KINDS and ins.bytes > 0}
    if plan.tp > 1:
        sizes |= {resolved.costs.layer_costs(layer, plan.micro_batch, plan.tp).tp_comm_bytes
                  for layer in range(resolved.costs.num_layers)} - {0}
    return sorted(sizes)


def sweep_sizes(message_sizes: list[int], points: int = COMM_POINTS) -> list[int]:
    """Geometric sizes from half the smallest to twice the largest message (at least 1 KiB apart)."""
    lo = max(min(message_sizes, default=MIN_COMM_BYTES) // 2, MIN_COMM_BYTES)
    hi = max(max(message_sizes, default=MIN_COMM_BYTES) * 2, 4 * lo)
    return sorted({int(round(v)) for v in np.geomspace(lo, hi, points)})


def calibrate_comm(bundle_dir: Path, sizes: list[int], repeats: int = 10) -> pd.DataFrame:
    """Benchmark ``COMM_PRIMITIVES`` on two ranks over ``sizes``; store samples and fits in the bundle."""
    from exec.commbench import run_commbench

    samples, fits = run_commbench(nproc=2, sizes=sizes, primitives=COMM_PRIMITIVES, backend="gloo",
                                  repeats=repeats)
    return store_comm_fits(bundle_dir, samples, fits)


def store_comm_fits(bundle_dir: Path, samples: pd.DataFrame, fits: pd.DataFrame) -> pd.DataFrame:
    """Put a benchmark's samples and its usable fits (finite latency and bandwidth) in the bundle."""
    fits = fits[np.isfinite(fits["alpha_s"]) & np.isfinite(fits["bandwidth_Bps"])].reset_index(drop=True)
    bundle = read_bundle(bundle_dir)
    bundle.comm_samples, bundle.comm_fits = samples, fits
    write_bundle(bundle, bundle_dir)
    return fits


def copy_comm_fits(source: Path, bundle_dir: Path) -> None:
    """Give the bundle ``bundle_dir`` the communication samples and fits of the bundle ``source``."""
    donor = read_bundle(source)
    if donor.comm_fits is None:
        raise ConfigError("comm_fits_from", f"{source} has no communication fits",
                          "benchmark first (validate_plan(..., commbench=True)) or pass another bundle")
    bundle = read_bundle(bundle_dir)
    bundle.comm_samples, bundle.comm_fits = donor.comm_samples, donor.comm_fits
    write_bundle(bundle, bundle_dir)



def merge_cpu_fits(bundle_dir: Path, fits: pd.DataFrame) -> pd.DataFrame:
    """Give the bundle's communication fits the CPU columns (``cpu_alpha_s``, ``cpu_bandwidth_Bps``)
    of ``fits``, matched by primitive and world size, keeping the bundle's own times: what a run
    benchmarked before the CPU was measured would have had (issue 12; scripts/suite_repredict.py)."""
    bundle = read_bundle(bundle_dir)
    if bundle.comm_fits is None:
        raise ConfigError("comm_fits", f"{bundle_dir} has no communication fits to add the CPU to",
                          "benchmark the bundle first (paratwin validate runs exec.commbench)")
    cpu = fits.set_index(["primitive", "world_size"])[["cpu_alpha_s", "cpu_bandwidth_Bps"]]
    own = bundle.comm_fits.drop(columns=["cpu_alpha_s", "cpu_bandwidth_Bps"], errors="ignore")
    bundle.comm_fits = own.join(cpu, on=["primitive", "world_size"])
    write_bundle(bundle, bundle_dir)
    return bundle.comm_fits
