"""The command outputs the README and the docs print are what the commands print today: the README's
simulate example showed 1118.597 ms for weeks after a refit made it 1148.597, and its search excerpt
kept an older search's counts and times (644,284 pruned where the search printed 644,226, 604.8 ms for
604.9; both found by outside-in reviews). Deterministic figures only; wall times and the output paths
vary."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SIMULATE = "paratwin simulate examples/plans/gpt-8.3b-a100-64-merak.yaml"
SEARCH = "paratwin search --workload gpt-8.3b --cluster a100-64"  # README's excerpt and docs/search.md's block
ROW = re.compile(r"^│ (.+?)\s+│ (.+?)\s+│$")
VARYING = {"simulator"}  # its wall time


def figure_rows(lines: list[str]) -> dict[str, str]:
    """The rows of the first rich table in ``lines``, up to its closing border."""
    rows: dict[str, str] = {}
    for line in lines:
        if line.startswith("└"):
            break
        match = ROW.match(line)
        if match and match.group(1) not in VARYING:
            rows[match.group(1)] = match.group(2)
    return rows


def documented_rows(page: str, command: str) -> dict[str, str]:
    lines = (REPO / page).read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"$ {command}"))
    return figure_rows(lines[start:])


@pytest.fixture(scope="module")
def simulated_rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("simulate")
    done = subprocess.run([sys.executable, "-m", "analysis.cli", *SIMULATE.split()[1:], "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})  # wide enough that no row wraps
    assert done.returncode == 0, done.stderr[-2000:]
    return figure_rows(done.stdout.splitlines())


@pytest.mark.parametrize("page", ["README.md", "docs/simulator.md"])
def test_the_documented_simulate_output_is_what_simulate_prints(page: str, simulated_rows: dict[str, str]) -> None:
    assert len(simulated_rows) >= 8  # the table was read: iteration, throughput, FLOP/s, MFU, bubbles, memory
    assert documented_rows(page, SIMULATE) == simulated_rows


# --- the search (README's excerpt, docs/search.md's full block) -------------------------------------------

TABLE_ROW = re.compile(r"^[│┃]")
TIMES = re.compile(r" \([0-9.]+ s: estimate [0-9.]+ s, [^)]*\)$")  # the 'considered' line's wall times
FOLDER = "<out>"


def search_block(page: str) -> tuple[str, list[str]]:
    """The documented search's command line and output lines, up to the block's closing fence."""
    lines = (REPO / page).read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"$ {SEARCH}"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    return lines[start], lines[start + 1:end]


def out_folder(command: str) -> str:
    """Where the documented command wrote (its --out, else the CLI's default folder)."""
    words = command.split("#")[0].split()
    return words[words.index("--out") + 1] if "--out" in words else "runs/search-gpt-8.3b-a100-64"


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in re.split("[│┃]", line)[1:-1]]


def normal(line: str, folder: str) -> str:
    return TIMES.sub("", line.replace(folder, FOLDER).rstrip())


def unmatched(documented: list[str], printed: list[str], folder: str) -> list[str]:
    """The documented lines not found, in order, among the printed ones. A table row matches a printed row
    whose first cells are the documented cells (an excerpt may cut a table to its first columns); any other
    line must equal a printed line (after the output folder and the wall times are normalised); '...' marks
    a cut. Returns [] when every documented line is there."""
    printed = [normal(line, FOLDER) for line in printed]
    missing, at = [], 0
    for line in documented:
        if line.strip() == "..." or line[:1] in "┏┡└":  # cuts and table borders
            continue
        want = normal(line, folder)
        for i in range(at, len(printed)):
            if (cells(want) == cells(printed[i])[:len(cells(want))] if TABLE_ROW.match(want) and
                    TABLE_ROW.match(printed[i]) else want == printed[i]):
                at = i + 1
                break
        else:
            missing.append(line)
    return missing


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """One real run of the documented search (30-60 s on the shared 2-core machine)."""
    out = tmp_path_factory.mktemp("search")
    done = subprocess.run([sys.executable, "-m", "analysis.cli", *SEARCH.split()[1:], "--top", "5", "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return [line.replace(str(out), FOLDER) for line in done.stdout.splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("page", ["README.md", "docs/search.md"])
def test_the_documented_search_output_is_what_search_prints(page: str, searched: list[str]) -> None:
    command, documented = search_block(page)
    assert "--top 5" in command  # the fixture runs what the page shows
    rows = [line for line in documented if line.startswith("│ ") and cells(line)[0].isdigit()]
    assert len(rows) >= 3 and any(line.startswith("considered ") for line in documented) and \
        any(line.startswith("best plan: ") for line in documented)  # the block was read
    assert unmatched(documented, searched, out_folder(command)) == []
