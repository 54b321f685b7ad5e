"""What a simulation returns: headline figures, per-rank memory and bubbles, the instruction table."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from traces.errors import PlanDoesNotFit
from traces.schema import INSTRUCTION_TABLE

# The files SimResult.write puts in its folder (paratwin simulate refuses a folder of the user's holding one).
SIM_OUTPUTS = ("instructions.parquet", "timeline.json", "summary.json")


@dataclass
class RankMemory:
    rank: int
    peak_bytes: int
    breakdown: dict[str, int]
    capacity_bytes: int
    oom: bool
    oom_at_s: float | None = None
    oom_instruction: str = ""


@dataclass
class SimResult:
    plan_name: str
    iteration_s: float
    samples_per_s: float
    tokens_per_s: float
    model_flops_per_device: float  # model FLOP/s achieved per device (no recompute counted)
    mfu: float
    bubble_fraction: dict[int, float]  # pipeline rank -> idle share of the compute stream
    memory: dict[int, RankMemory]
    table: pd.DataFrame
    symmetric: bool
    wall_s: float = 0.0
    events: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def oom(self) -> bool:
        return any(m.oom for m in self.memory.values())

    def does_not_fit(self) -> PlanDoesNotFit | None:
        """The error to report when a rank exceeds its memory (the rank furthest over), else None."""
        over = [m for m in self.memory.values() if m.oom]
        if not over:
            return None
        worst = max(over, key=lambda m: m.peak_bytes - m.capacity_bytes)
        return PlanDoesNotFit(worst.rank, worst.oom_instruction, worst.peak_bytes - worst.capacity_bytes,
                              worst.capacity_bytes)

    @property
    def peak_memory_bytes(self) -> int:
        return max(m.peak_bytes for m in self.memory.values())

    def summary(self) -> dict[str, Any]:
        return {
            "plan": self.plan_name,
            "iteration_s": self.iteration_s,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_device": self.model_flops_per_device / 1e12,
            "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction,
            "peak_memory_gib": {r: m.peak_bytes / 2**30 for r, m in self.memory.items()},
            "oom": self.oom,
            "memory": {r: asdict(m) for r, m in self.memory.items()},
            "symmetric": self.symmetric,
            "simulator_wall_s": self.wall_s,
            "notes": self.notes,
        }

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """Instruction table (Parquet), Chrome trace (Perfetto) and summary JSON, each written
        atomically, under the folder's lock (a concurrent writer is refused: the three are of one plan)."""
        import json

        from traces.atomic import atomic_write_text
        from traces.chrome import instruction_table_to_chrome
        from traces.outdir import OutputLock
        from traces.tables import write_table

        out = Path(out_dir)
        with OutputLock(out):
            paths = {
                "table": write_table(self.table, INSTRUCTION_TABLE, out / SIM_OUTPUTS[0]),
                "trace": instruction_table_to_chrome(self.table, out / SIM_OUTPUTS[1]),
                "summary": atomic_write_text(out / SIM_OUTPUTS[2],
                                             json.dumps(self.summary(), indent=2, default=str)),
            }
        return paths
