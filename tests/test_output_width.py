"""Piped output keeps whole lines: an error never wraps at a terminal's width."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_long_error_stays_one_line_when_piped(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text("workload: gpt-tiny\npipeline_depth_of_a_deliberately_long_unknown_field_name: 2\n")
    done = subprocess.run([sys.executable, "-m", "analysis.cli", "simulate", str(plan)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, done.stdout
    assert len(lines[0]) > 120  # long enough that an 80-column console would have wrapped it
    assert "pipeline_depth_of_a_deliberately_long_unknown_field_name" in lines[0]

