"""Communication for validation: the message sizes of a plan, and a two-rank benchmark of them
(``exec.commbench``) whose alpha-beta fits are stored in the profile bundle, where
``sim.comm.ClusterComm`` picks them up."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from exec.commbench import fit_quality_note
from sim.compile import CompiledPlan, compile_plan
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


def comm_sizes(plan: Plan, compiled: CompiledPlan | None = None) -> list[int]:
    """Bytes of every message, gradient bucket and TP all-reduce of ``plan`` (costs from its profile;
    ``compiled``: the plan compiled for every rank already)."""
    compiled = compiled or compile_plan(plan, symmetric=False)
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


def poor_fit_notes(fits: pd.DataFrame, samples: pd.DataFrame | None, plan_sizes: list[int]) -> list[str]:
    """A validation report's note on each fit that ``paratwin commbench`` flags (``fit_quality_note``),
    saying what of the plan it prices. ``sim.comm`` prices a size within the swept ones from the samples
    themselves (``sim.comm_curve``, interpolated; a message alone takes that time too), and only a size
    beyond them from the fitted line, so a poor line matters only where the plan's sizes leave the sweep."""
    notes = []
    for row in fits.itertuples(index=False):
        quality = fit_quality_note(row.r2)
        if not quality:
            continue
        swept = samples[(samples["primitive"] == row.primitive) & (samples["world_size"] == row.world_size)] \
            if samples is not None else samples
        head = (f"{row.primitive} fit ({row.world_size} ranks): {quality} (r2 {row.r2:.3f}); its bandwidth "
                f"({row.bandwidth_Bps / 1e9:.3g} GB/s) is not the link's")
        if swept is None or not len(swept):
            notes.append(f"{head}, and with no samples its line prices every size of this primitive")
            continue
        lo, hi = int(swept["bytes"].min()), int(swept["bytes"].max())
        outside = [size for size in plan_sizes if not lo <= size <= hi]
        where = (f"{len(outside)} of the plan's {len(plan_sizes)} communication sizes lie outside them "
                 f"({min(outside)}-{max(outside)} B), where the line prices them") if outside else \
            "every communication size of the plan lies within them"
        notes.append(f"{head}; sizes within the swept {lo}-{hi} B are priced from the samples, and {where}")
    return notes


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
