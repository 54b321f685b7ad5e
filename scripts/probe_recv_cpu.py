"""What receiving a message costs the receiving host's CPU (issue 12, ninth session).

The model charges a point-to-point message's CPU to its sender only (``sim.engine.Engine._send``:
the sender's cores ``cpu_s("p2p", bytes)``, the receiver none), and the benchmark's ``send_recv``
CPU is a ping-pong's: each rank sends once and receives once per round trip, so its "per message"
CPU is the mean of a send's and a receive's. This probe measures the two sides apart with the
benchmark's one-way primitives (``exec.commbench``: ``send``, the senders' CPU alone; ``recv``,
the receivers' alone), two gloo ranks on this machine, several rounds (a fresh pair of processes
each), and prints per size the median over rounds of each round's median CPU per message, the
spread over rounds (min-max), and the alpha-beta fits of the three.

    python scripts/probe_recv_cpu.py [--rounds 5] [--repeats 20] [--out DIR]
    python scripts/probe_recv_cpu.py --waits    # does a receive burn CPU while it waits?

``--waits``: the sender sleeps 0, 2 or 8 ms before each send of 1 KiB and 3.5 MB (20 each); the
receiver's CPU per receive, median, against the delay. A receive that blocks costs the same at
every delay; one that spins costs about the delay more (the model assumes the first: waiting for
a peer costs no CPU, ``sim.engine.EngineOptions``).

About a minute on the two-core development machine (``--rounds 5 --repeats 20``). ``--out``: the
table as CSV (``probe_recv_cpu.csv``) and each round's samples. CPU seconds depend less on other
load than wall times, but say whether the machine was quiet.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from exec.commbench import _free_port, _process_cpu_s, fit_alpha_beta, run_commbench

# The message sizes the validation suite benchmarks (runs/netns-embedding-9/*/comm/manifest.json:
# half the smallest to twice the largest message of its plans).
SIZES = [1024, 5214, 26553, 135215, 688543, 3506219, 17854464]
PRIMITIVES = ["send_recv", "send", "recv"]


def measure(rounds: int, repeats: int) -> pd.DataFrame:
    """Every round's samples (``exec.commbench`` rows) with its round number."""
    frames = []
    for round_ in range(rounds):
        samples, _ = run_commbench(nproc=2, sizes=SIZES, primitives=PRIMITIVES, repeats=repeats, warmup=2)
        frames.append(samples.assign(round=round_))
    return pd.concat(frames, ignore_index=True)


def summarize(samples: pd.DataFrame) -> pd.DataFrame:
    """Per size: each primitive's CPU per message (median over rounds, min and max over rounds),
    the one-way time, and what the receiver takes against the sender."""
    by = samples.groupby(["bytes", "primitive"])
    stats = pd.DataFrame({"cpu_s": by["cpu_s"].median(), "cpu_min_s": by["cpu_s"].min(),
                          "cpu_max_s": by["cpu_s"].max(), "time_s": by["median_s"].median()}).unstack("primitive")
    table = pd.DataFrame(index=stats.index)
    for primitive in PRIMITIVES:
        for column in ("cpu_s", "cpu_min_s", "cpu_max_s"):
            table[f"{primitive}_{column}"] = stats[(column, primitive)]
    table["one_way_s"] = stats[("time_s", "recv")]
    table["recv_over_send"] = table["recv_cpu_s"] / table["send_cpu_s"]
    # the cores the receive keeps busy while the message arrives (as sim.host_cpu.cores_taken)
    table["recv_cores"] = table["recv_cpu_s"] / table["one_way_s"]
    return table.reset_index()


def fits(samples: pd.DataFrame) -> pd.DataFrame:
    """The CPU fits of the medians over rounds, as the benchmark fits one round."""
    medians = samples.groupby(["primitive", "backend", "world_size", "bytes"], as_index=False)[
        ["median_s", "min_s", "max_s", "cpu_s"]].median().assign(repeats=0)
    return fit_alpha_beta(medians)[["primitive", "alpha_s", "bandwidth_Bps", "cpu_alpha_s", "cpu_bandwidth_Bps"]]


WAIT_SIZES, WAIT_DELAYS_S, WAIT_REPEATS = [1024, 3506224], [0.0, 0.002, 0.008], 20


def _wait_worker(rank: int, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    rows = []
    try:
        for size in WAIT_SIZES:
            buffer = torch.zeros(size // 4, dtype=torch.float32)
            for delay in WAIT_DELAYS_S:
                cpu, wall = [], []
                for _ in range(WAIT_REPEATS + 2):  # the first two warm up
                    dist.barrier()
                    if rank == 0:
                        time.sleep(delay)
                        dist.send(buffer, 1)
                    else:
                        cpu0, start = _process_cpu_s(), time.perf_counter()
                        dist.recv(buffer, 0)
                        cpu.append(_process_cpu_s() - cpu0)
                        wall.append(time.perf_counter() - start)
                if rank == 1:
                    rows.append({"bytes": size, "delay_s": delay, "recv_cpu_s": float(np.median(cpu[2:])),
                                 "recv_cpu_min_s": min(cpu[2:]), "recv_cpu_max_s": max(cpu[2:]),
                                 "recv_wall_s": float(np.median(wall[2:]))})
    finally:
        dist.destroy_process_group()
    if rank == 1:
        pd.DataFrame(rows).to_csv(out, index=False)


def measure_waits(out: Path) -> pd.DataFrame:
    """The receiver's CPU per receive while the sender sleeps before sending (``--waits``)."""
    import torch.multiprocessing as mp

    result = out / "waits.csv"
    mp.start_processes(_wait_worker, args=(f"tcp://127.0.0.1:{_free_port()}", str(result)), nprocs=2,
                       start_method="spawn")
    return pd.read_csv(result)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="The CPU a receive costs its host, apart from a send's.",
                                     allow_abbrev=False)  # a misspelt option stops, never half-matches
    parser.add_argument("--rounds", type=int, default=5, help="fresh pairs of processes (default 5)")
    parser.add_argument("--repeats", type=int, default=20, help="messages per size and round (default 20)")
    parser.add_argument("--out", type=Path, help="folder for the table and the samples as CSV")
    parser.add_argument("--waits", action="store_true", help="does a receive burn CPU while it waits?")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.waits:
        import tempfile

        with tempfile.TemporaryDirectory() as scratch:
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
            table = measure_waits(args.out or Path(scratch))
        print("receiver's CPU per receive (us), median of 20 (min-max), the sender sleeping before it sends\n")
        print("| bytes | sender's delay (ms) | receive wall (us) | receive CPU (us) |\n| ---: | ---: | ---: | ---: |")
        for r in table.itertuples():
            print(f"| {r.bytes} | {r.delay_s * 1e3:.0f} | {r.recv_wall_s * 1e6:.0f} | {r.recv_cpu_s * 1e6:.0f} "
                  f"({r.recv_cpu_min_s * 1e6:.0f}-{r.recv_cpu_max_s * 1e6:.0f}) |")
        return
    rounds, repeats = args.rounds, args.repeats
    samples = measure(rounds, repeats)
    table = summarize(samples)
    print(f"CPU per message, us: median over {rounds} rounds of each round's median of {repeats} "
          "(min-max over rounds)\n")
    print("| bytes | one way (us) | send | recv | ping-pong per message | recv / send | recv cores |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in table.itertuples():
        cells = [f"{getattr(r, f'{p}_cpu_s') * 1e6:.0f} ({getattr(r, f'{p}_cpu_min_s') * 1e6:.0f}-"
                 f"{getattr(r, f'{p}_cpu_max_s') * 1e6:.0f})" for p in ("send", "recv", "send_recv")]
        print(f"| {r.bytes} | {r.one_way_s * 1e6:.0f} | {' | '.join(cells)} | {r.recv_over_send:.2f} | "
              f"{r.recv_cores:.2f} |")
    print("\nfits of the medians over rounds (cpu_s = cpu_alpha_s + bytes / cpu_bandwidth_Bps):")
    print(fits(samples).to_string(index=False))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        table.to_csv(args.out / "probe_recv_cpu.csv", index=False)
        samples.to_csv(args.out / "samples.csv", index=False)


if __name__ == "__main__":
    main(sys.argv[1:])
