"""The per-rank interpreter: runs this rank's part of a Program with real tensors.

``python -m exec.runtime plan.yaml --out DIR`` runs one rank under torchrun or SLURM (reads RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT or SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID);
``exec.launcher.run_plan`` spawns the ranks itself on one machine. The parts, one concern each:

- ``exec.contract``: the compiled plan a run executes (``compile_for_run``), the run's options,
  and what every rank and the single-process reference agree on (``batch_seed``, Adam);
- ``exec.interpreter``: ``RankRuntime``, one handler per instruction kind;
- ``exec.clock``: the clock shared by the ranks and asynchronous instructions in flight;
- ``exec.activations``: the saved-tensor store and what a rank holds between forward and backward;
- ``exec.rank``: one rank's whole run (``run_rank``): process groups, heartbeat, results, error files;
- ``exec.faults``: fault injection for tests (``PARATWIN_FAULT``) and the phases of a run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from exec.contract import BACKENDS, RunOptions
from exec.rank import run_rank
from sim.plan import Plan
from traces.errors import ConfigError


def _launch_env() -> tuple[int, int, int]:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    raise ConfigError("environment", "neither RANK/WORLD_SIZE (torchrun) nor SLURM_PROCID/SLURM_NTASKS set",
                      "launch with torchrun --nproc-per-node N -m exec.runtime plan.yaml, or srun, "
                      "or use `paratwin run plan.yaml` on one machine")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exec.runtime", description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--out", type=Path, default=Path("runs/run"))
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--backend", choices=list(BACKENDS), default=None)
    parser.add_argument("--timeout", type=float, default=300.0, help="process-group timeout, seconds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank on CPU")
    parser.add_argument("--save-params", action="store_true")
    args = parser.parse_args(argv)
    try:
        plan = Plan.load(args.plan)
        rank, world, local = _launch_env()
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise ConfigError("environment", "MASTER_ADDR and MASTER_PORT must be set",
                              "torchrun sets them; under SLURM export the first node's name and a free port")
        options = RunOptions(args.iterations, args.warmup, args.backend, args.timeout, args.save_params,
                             args.threads)
        run_rank(plan, rank, world, local, args.out, options)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if rank == 0:
        print(f"run record: {args.out / 'record'}; Chrome trace: {args.out / 'trace.json'}")
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without interpreter teardown: destroying torch.distributed's C++ state there
    # occasionally aborted a finished rank here ("terminate called without an active exception"),
    # which torchrun reports as a failed run. Everything is written and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
