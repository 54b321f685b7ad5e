"""Run records: what one simulated or real run produced, in one directory.

    my-run/
      manifest.json        format paratwin.run-record, version, the summary (any JSON object:
                           plan, iteration time, peak memory, ...), table list and checksums
      instructions.parquet INSTRUCTION_TABLE (or .csv)
      trace.json           the Chrome trace of the instruction table (open it in Perfetto)

The simulator and the runtime write the same layout, so a validation reads two run records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from traces.bundle import read_table_dir, write_table_dir
from traces.chrome import instruction_table_to_chrome
from traces.errors import BundleError
from traces.schema import INSTRUCTION_TABLE, RUN_RECORD_FORMAT, RUN_RECORD_VERSION

CHROME_TRACE_NAME = "trace.json"


@dataclass
class RunRecord:
    instructions: pd.DataFrame  # INSTRUCTION_TABLE
    summary: dict = field(default_factory=dict)


def write_run_record(record: RunRecord, directory: Path, fmt: str = "parquet", chrome: bool = True) -> Path:
    """Write ``record`` atomically to ``directory``; with ``chrome`` also its Chrome trace."""
    directory = Path(directory)
    if not isinstance(record.summary, dict):
        raise BundleError(directory / "manifest.json", "summary must be a dict")

    def write_trace(tmp: Path) -> list[str]:
        if not chrome:
            return []
        try:
            instruction_table_to_chrome(record.instructions, tmp / CHROME_TRACE_NAME)
        except BundleError as exc:  # name the final path, not the temporary directory
            raise BundleError(directory / CHROME_TRACE_NAME, exc.problem) from None
        return [CHROME_TRACE_NAME]

    tables = {"instructions": (record.instructions, INSTRUCTION_TABLE)}
    extra = {"summary": record.summary}
    return write_table_dir(
        directory, RUN_RECORD_FORMAT, RUN_RECORD_VERSION, tables, extra, fmt, extra_files=write_trace
    )


def read_run_record(directory: Path) -> RunRecord:
    manifest, tables = read_table_dir(
        directory,
        RUN_RECORD_FORMAT,
        RUN_RECORD_VERSION,
        {"instructions": INSTRUCTION_TABLE},
        required=("instructions",),
    )
    summary = manifest.get("summary", {})
    if not isinstance(summary, dict):
        raise BundleError(Path(directory) / "manifest.json", "'summary' must be a JSON object")
    return RunRecord(tables["instructions"], summary)
