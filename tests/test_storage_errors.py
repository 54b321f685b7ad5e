"""A file system that refuses a write (full, over quota, read-only) is one line naming the file, exit 2, with
no temporary left behind (outside-in review B, item 8b: `profile` and `search` printed an OSError traceback,
exit 1; `run` said "rank 1 died (exit code 1) at iteration -1 instruction -1" and left 0-byte temporaries).

The writes fail for real: on /dev/full (every write is ENOSPC), and in a 16 KiB tmpfs where mounting one is
permitted (root), with the commands a user runs.
"""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from analysis.report import run_cli
from traces.atomic import atomic_directory, atomic_path

REPO = Path(__file__).resolve().parents[1]
FULL = Path("/dev/full")


def write_to_full() -> None:
    """Write as a writer would, into a device that is always full (the write's error names no file)."""
    with open(FULL, "wb") as handle:
        handle.write(b"x" * 65536)
        handle.flush()


@pytest.mark.skipif(not FULL.exists(), reason="needs /dev/full (Linux)")
def test_a_failed_atomic_write_names_its_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "summary.json"
    with pytest.raises(OSError) as info, atomic_path(target) as tmp:
        tmp.write_text("half")
        write_to_full()
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(target)
    folder = tmp_path / "bundle"
    with pytest.raises(OSError) as info, atomic_directory(folder) as tmp:
        (tmp / "layers.parquet").write_text("half")
        write_to_full()
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(folder)
    assert list(tmp_path.iterdir()) == []  # neither target, nor a temporary beside it


@pytest.mark.skipif(not FULL.exists(), reason="needs /dev/full (Linux)")
def test_the_command_line_says_a_full_disk_in_one_line(tmp_path: Path) -> None:
    target = tmp_path / "out" / "summary.json"

    def command() -> None:
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            write_to_full()

    printed = io.StringIO()
    with pytest.raises(SystemExit) as info:
        run_cli(command, to=Console(file=printed, width=250, soft_wrap=True))
    assert info.value.code == 2
    assert printed.getvalue() == (f"error: --out: no space left on device while writing {target} (fix: free "
                                  "space or choose another folder)\n")
    with pytest.raises(ZeroDivisionError):  # any other error is still a bug's traceback
        run_cli(lambda: 1 / 0, to=Console(file=printed))


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 KiB tmpfs: room for a lock file and a few small files, not for a bundle, a search or a run."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def paratwin(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "analysis.cli", *args], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def temporaries(folder: Path) -> list[str]:
    return [str(p.relative_to(folder)) for p in folder.rglob("*") if ".tmp" in p.name or ".old-" in p.name]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["profile", "search", "run"])
def test_a_full_disk_is_one_line_and_leaves_no_temporary(full_disk: Path, command: str) -> None:
    out = full_disk / "out"
    done = paratwin(*{
        "profile": ("profile", "--workload", "gpt-tiny", "--micro-batch", "1", "--repeats", "1", "--warmup", "0",
                    "--no-ops", "--device", "cpu"),
        "search": ("search", "--workload", "gpt-2.5b", "--cluster", "a100-64", "--simulate-top", "3", "--sample", "0"),
        "run": ("run", "examples/plans/gpt-tiny-dp2.yaml", "--iterations", "2", "--warmup", "0"),
    }[command], "--out", str(out))
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    line = output.strip().splitlines()[-1]
    if command == "run":  # a rank's death, with the error the rank met
        assert line.startswith("error: rank ") and "OSError: [Errno 28] No space left on device" in line, line
        assert "iteration -1" not in line and len(output.strip().splitlines()) == 1, output[-3000:]
    else:
        assert line.startswith(f"error: --out: no space left on device while writing {out}/"), line
        assert line.endswith("(fix: free space or choose another folder)"), line
    assert temporaries(full_disk) == []
