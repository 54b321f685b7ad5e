"""Whether a plan's ranks fit this machine's memory, asked before any of them starts.

A run on one machine starts one process per rank. Ranks that together need more memory than the
machine has are stopped by the kernel's OOM killer, which picks the largest process it finds: on the
development machine a validation of a GPU-sized plan took two unrelated jobs with it. So ``paratwin
run`` and ``paratwin validate`` refuse such a plan first, with what it needs and what is there.

What a plan needs is the simulator's memory ledger, summed over its ranks, run on the plan's exact
structural costs (``exec.structure``): parameters, gradients, Adam's two moments, and the saved
activations of the micro-batches in flight. It is a lower bound of the processes' resident memory
(the interpreter and torch themselves come on top), so a plan refused here could not have run. The
ledger runs only where a quick upper bound (every rank holding the whole model state of its shard
and every micro-batch's activations) comes near the memory available.
"""

from __future__ import annotations

from pathlib import Path

from exec.contract import ExecutablePlan
from traces.errors import ConfigError

# torch.optim.Adam (exec.contract.make_optimizer): weights, gradients and two moments, each of the
# parameters' dtype and size.
MODEL_STATE_COPIES = 4


def available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of memory that new work can take without swapping (MemAvailable); None
    where there is no such file (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def quick_upper_bytes(executable: ExecutablePlan) -> int:
    """Every rank holding its shard's whole model state and every micro-batch's activations at once."""
    plan = executable.plan
    facts = executable.structure.facts(plan.micro_batch, plan.tp)
    per_replica_shard = sum(MODEL_STATE_COPIES * f.param_bytes + plan.microbatches * (f.saved_bytes + f.output_bytes)
                            for f in facts)
    return plan.dp * plan.tp * per_replica_shard


def ledger_bytes(executable: ExecutablePlan) -> int:
    """The simulator's memory ledger at each rank's peak, summed over the ranks."""
    from sim.simulate import simulate

    result = simulate(executable.plan, full=True, costs=executable.structure, resolved=executable.resolved
                      if not executable.plan.profile else None)
    return sum(memory.peak_bytes for memory in result.memory.values())


def check_host_memory(executable: ExecutablePlan, available: int | None = None) -> None:
    """Refuse (ConfigError) a plan whose ranks need more memory than this machine has available."""
    available = available_bytes() if available is None else available
    if available is None or 2 * quick_upper_bytes(executable) <= available:
        return
    needed = ledger_bytes(executable)
    if needed > available:
        plan = executable.plan
        raise ConfigError("workload", f"{plan.workload!r} on {plan.world_size} ranks needs about "
                          f"{needed / 2**30:.1f} GiB at the ranks' peaks (the simulator's memory ledger on the "
                          f"plan's exact sizes; Python and torch come on top), and this machine has "
                          f"{available / 2**30:.1f} GiB available",
                          "run a smaller workload, micro-batch or fewer ranks here, or on a machine with more "
                          "memory; `paratwin simulate` predicts the plan on its cluster without running it")
