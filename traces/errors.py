"""User-facing errors: one line that names the thing at fault and how to fix it."""

from __future__ import annotations


class ParatwinError(Exception):
    """Base of every error paratwin reports to a user (the CLI prints it without a traceback)."""


class BundleError(ParatwinError):
    """A trace bundle, table or trace file that cannot be read as asked."""

    def __init__(self, path: object, problem: str, fix: str = "") -> None:
        super().__init__(f"{path}: {problem}" + (f" (fix: {fix})" if fix else ""))
        self.path = path
        self.problem = problem
        self.fix = fix


class ConfigError(ParatwinError):
    """A plan, cluster spec or workload configuration that fails validation."""

    def __init__(self, field: str, problem: str, fix: str = "") -> None:
        message = f"{field}: {problem}" + (f" (fix: {fix})" if fix else "")
        super().__init__(message)
        self.field = field
        self.problem = problem
        self.fix = fix

    def __reduce__(self) -> tuple:
        # Rebuilt from its three fields when it crosses a process boundary (a process pool's worker
        # raising it): the default pickling passes only the message and fails to unpickle.
        return (type(self), (self.field, self.problem, self.fix))


class Interrupted(ParatwinError):
    """A command stopped by Ctrl-C (SIGINT); the message says what was kept and how to go on. ``exit_code`` 130
    is the shell's convention (``paratwin run`` has its own, ``exec.launcher.RunInterrupted``, which keeps what
    it measured)."""

    exit_code = 130


class NoPlanFits(ParatwinError):
    """A search none of whose plans fits in memory. Its outputs (ranked.parquet, summary.json) are still
    written; the CLI then exits with ``exit_code``, as ``simulate`` does for a plan that does not fit."""

    exit_code = 3


class PlanDoesNotFit(ParatwinError):
    """A simulated plan that exceeds a device's memory. The simulation still completes and writes
    its outputs (marked as OOM); the CLI then exits with ``exit_code`` instead of 0."""

    exit_code = 3

    def __init__(self, rank: int, instruction: str, over_bytes: int, capacity_bytes: int) -> None:
        super().__init__(f"plan does not fit: rank {rank} exceeds its {capacity_bytes / 2**30:.2f} GiB by "
                         f"{over_bytes / 2**30:.2f} GiB ({over_bytes:,} bytes) at its peak; first over capacity "
                         f"at {instruction or 'set-up (model states alone)'} (fix: more stages or TP, recompute, "
                         "swap, or a smaller micro-batch)")
        self.rank = rank
        self.instruction = instruction
        self.over_bytes = over_bytes
        self.capacity_bytes = capacity_bytes

