"""Where a rank is when it fails, and failing there on purpose (fault testing only).

``PARATWIN_FAULT`` (``FAULT_ENV``) makes one rank fail (raise), stop making progress (hang) or die
(exit) before an instruction of an iteration, or raise on entering a phase of its run (``PHASES``).
The interpreter asks ``Fault.before`` at every instruction; ``Phase`` tracks the phase a rank is in
(for its error file) and injects a phase fault.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from sim.program import Instruction
from traces.errors import ConfigError

# Environment variable for fault testing only: "rank=R,index=I[,iteration=N][,mode=raise|hang|exit]"
# makes rank R fail (raise), stop making progress (hang) or die (exit) before instruction I.
FAULT_ENV = "PARATWIN_FAULT"

# What a rank does outside its instructions; errors there are labelled with the phase.
PHASES = {
    "setup": "setting up (process groups, stages)",
    "iterations": "running iterations",
    "params": "saving parameters",
    "gather": "gathering results to rank 0",
    "record": "writing the run record",
    "finish": "at the final barrier",
}


@dataclass(frozen=True)
class Fault:
    rank: int
    index: int
    iteration: int = 0
    mode: str = "raise"
    phase: str = ""  # with phase=P (a key of PHASES) the rank raises on entering that phase instead

    @classmethod
    def from_env(cls) -> Fault | None:
        text = os.environ.get(FAULT_ENV, "").strip()
        if not text:
            return None
        try:
            fields = dict(item.split("=", 1) for item in text.split(","))
            phase = fields.get("phase", "")
            fault = cls(int(fields["rank"]), int(fields.get("index", -1) if phase else fields["index"]),
                        int(fields.get("iteration", 0)), fields.get("mode", "raise"), phase)
        except (KeyError, ValueError):
            raise ConfigError(FAULT_ENV, f"cannot read {text[:200]!r}",
                              "use rank=R,index=I[,iteration=N][,mode=raise|hang|exit] or rank=R,phase=P") from None
        if fault.mode not in ("raise", "hang", "exit"):
            raise ConfigError(FAULT_ENV, f"unknown mode {fault.mode[:50]!r}", "use raise, hang or exit")
        if fault.phase and fault.phase not in PHASES:
            raise ConfigError(FAULT_ENV, f"unknown phase {fault.phase[:50]!r}", f"use one of {', '.join(PHASES)}")
        return fault

    def before(self, rank: int, iteration: int, instruction: Instruction) -> None:
        """Fail here if this is the rank, iteration and instruction the fault names."""
        if self.rank != rank or self.index != instruction.index or self.iteration != iteration:
            return
        if self.mode == "exit":
            os._exit(17)
        if self.mode == "hang":
            while True:
                time.sleep(1.0)
        raise RuntimeError(f"injected fault ({FAULT_ENV}) at {instruction.label}")


class Phase:
    """The phase a rank is in (for its error file), and the fault injected there, if any."""

    def __init__(self, rank: int) -> None:
        self.rank, self.key = rank, "setup"
        self.fault: Fault | None = None

    @property
    def description(self) -> str:
        return PHASES[self.key]

    def enter(self, key: str) -> None:
        self.key = key
        if key == "setup" and "phase=" in os.environ.get(FAULT_ENV, ""):
            self.fault = Fault.from_env()  # here, so that a malformed value is reported as an error
        f = self.fault
        if f is not None and f.rank == self.rank and f.phase == key:
            raise RuntimeError(f"injected fault ({FAULT_ENV}) while {self.description}")
