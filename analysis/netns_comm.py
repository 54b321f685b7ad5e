"""The shaped network's communication measured as the loopback suite measures loopback (issue 12):
``exec.commbench`` on the two ranks of the namespaces, over the sizes the plans send, and its
alpha-beta fits (latency, bandwidth per collective kind) put in a copy of the profile bundle, where
``sim.comm.ClusterComm`` prices every collective from them instead of the tbf rate (from the
samples, interpolated: ``sim.comm_curve``; a message from the fit).

    # in each namespace, with RANK, WORLD_SIZE=2, MASTER_ADDR, MASTER_PORT, GLOO_SOCKET_IFNAME set
    python -m analysis.netns_comm measure PLAN.yaml... --profile BASE --out RATE/comm
    # then, once, outside them
    python -m analysis.netns_comm spec RATE/comm --profile BASE --out RATE/profile

``measure`` takes the sizes and primitives of ``analysis.validation.comm`` (the suite's own:
all_reduce, all_to_all, send_recv from half the smallest to twice the largest message of the
plans, 7 sizes); rank 0 writes the benchmark folder. ``spec`` copies the bundle, stores the fits in
it and writes ``RATE/comm/spec.md``, the table of what the prediction now uses.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pandas as pd

from analysis.validation.comm import COMM_PRIMITIVES, comm_sizes, store_comm_fits, sweep_sizes
from sim.plan import Plan
from traces.bundle import read_bundle
from traces.errors import ConfigError


def measure(plans: list[Path], profile: Path, out: Path, repeats: int = 10) -> pd.DataFrame:
    """Benchmark the plans' message sizes in the process group the environment describes."""
    from exec.commbench import _launched_by_torchrun, run_commbench

    if not _launched_by_torchrun():
        raise ConfigError("environment", "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are not all set",
                          "run it once per namespace as scripts/netns_lib.sh's netns_commbench does")
    read_bundle(profile)  # a bad bundle fails here, naming it, not in the middle of a sweep
    sizes = sweep_sizes([s for p in plans for s in comm_sizes(Plan.load(p).replace(profile=str(profile.resolve())))])
    _, fits = run_commbench(sizes=sizes, primitives=COMM_PRIMITIVES, backend="gloo", repeats=repeats, out=out)
    return fits


def write_spec(comm: Path, profile: Path, out: Path) -> pd.DataFrame:
    """``out``: a copy of the bundle ``profile`` with the fits of the benchmark folder ``comm``."""
    from exec.commbench import read_comm_results

    samples, fits, meta = read_comm_results(comm)
    if profile.resolve() != out.resolve():
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(profile, out)
    kept = store_comm_fits(out, samples, fits)
    (comm / "spec.md").write_text(spec_markdown(kept, samples, meta))
    return kept


def spec_markdown(fits: pd.DataFrame, samples: pd.DataFrame, meta: dict) -> str:
    settings, host = meta.get("settings", {}), meta.get("hardware", {}).get("hostname", "?")
    lines = [f"Measured with exec.commbench ({settings.get('repeats', '?')} repeats per size, sizes "
             f"{min(samples['bytes'])}-{max(samples['bytes'])} B, host {host}); "
             "the prediction prices each kind from the samples, straight between two measured sizes, and "
             "beyond them from the line latency + bytes / bandwidth (sim.comm.ClusterComm, sim.comm_curve).", "",
             "A rank's CPU per call (every thread, sim.host_cpu) is fitted alike: CPU latency + bytes / "
             "bytes per CPU-second.", "",
             "| primitive | ranks | latency (us) | bandwidth (GB/s) | R^2 | CPU (us) | GB per CPU-s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in fits.itertuples(index=False):
        lines.append(f"| {row.primitive} | {row.world_size} | {row.alpha_s * 1e6:.1f} | "
                     f"{row.bandwidth_Bps / 1e9:.4g} | {row.r2:.3f} | {row.cpu_alpha_s * 1e6:.0f} | "
                     f"{row.cpu_bandwidth_Bps / 1e9:.3g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure")
    m.add_argument("plans", type=Path, nargs="+")
    m.add_argument("--profile", type=Path, required=True)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--repeats", type=int, default=10)
    s = sub.add_parser("spec")
    s.add_argument("comm", type=Path)
    s.add_argument("--profile", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "measure":
        measure(args.plans, args.profile, args.out, args.repeats)
    else:
        write_spec(args.comm, args.profile, args.out)
        print((args.comm / "spec.md").read_text())


if __name__ == "__main__":
    main()
