"""The HAP runner under concurrent use, with real processes: one command per output folder (a second
is refused in one line naming the holder, and loses nothing), the lock is reentrant within a process,
concurrent first loads of a TU data set build its cache once and download it once, a finished cache
loads read-only, and the CLI prints a ConfigError as one line on stderr with exit status 2."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from analysis.hap_protocol import DatasetPlan, Protocol, run_protocol
from exec.hap.data import BUILT_MARKER, TU_URL, load_tu
from traces.outdir import LOCK_NAME, OutputLock
from traces.paths import DATA_ENV

REPO = Path(__file__).resolve().parents[1]
TU = REPO / "exec" / "data" / "TU"  # MUTAG ships in the package: no network, no $PARATWIN_DATA
WAIT_S = 120.0  # a generous deadline for a child to start on a loaded machine; never a timing assertion
# A process that holds a folder's lock until its stdin closes.
HOLD = ("import sys; from traces.outdir import OutputLock; OutputLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); sys.stdin.read()")
# Tries to take a folder's lock once and says whether it could.
TRY = ("import sys; from traces.outdir import OutputLock; from traces.errors import ParatwinError\n"
       "try:\n    OutputLock(sys.argv[1]).acquire()\nexcept ParatwinError as error:\n    print(error)\n"
       "else:\n    print('acquired')")
# Starts three processes running load(go) at the same moment (go: an Event), prints their exit codes.
FORKED = """
fork = multiprocessing.get_context("fork")
go = fork.Event()
loaders = [fork.Process(target=load, args=(go,)) for _ in range(3)]
for loader in loaders:
    loader.start()
go.set()
for loader in loaders:
    loader.join()
print("exit codes", *(loader.exitcode for loader in loaders))
"""
# Three processes load MUTAG into one empty cache at the same moment, forked from one that imported
# the loader once (three imports of torch_geometric would take longer than the rest of this file).
LOAD = """
import multiprocessing, sys
import torch_geometric.datasets
from exec.hap.data import load_tu

def load(go):
    go.wait()
    assert len(load_tu("MUTAG", data_root=sys.argv[2], cache_dir=sys.argv[1])) == 188
""" + FORKED
# Three processes load a TU set that no data root holds, at the same moment, from a fake download
# source: a local zip served by a stand-in for urlopen that logs each download and lingers, so that
# without a lock all three would be downloading at once (MUTAG's files, renamed: no network).
DOWNLOAD = """
import io, multiprocessing, sys, time, urllib.request
import torch_geometric.datasets
from exec.hap.data import load_tu

def fake_urlopen(url, timeout):
    with open(sys.argv[2], "a") as log:
        log.write(url + "\\n")
    time.sleep(1.0)
    return io.BytesIO(open(sys.argv[1], "rb").read())

urllib.request.urlopen = fake_urlopen

def load(go):
    go.wait()
    assert len(load_tu("PROTEINS", cache_dir=sys.argv[3])) == 188
""" + FORKED


def env(tmp: Path) -> dict[str, str]:
    # TMPDIR: a child's default TU cache is its own, never the machine's shared one.
    return {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp)}


def python(code: str, *args: object, tmp: Path, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, env=env(tmp), timeout=WAIT_S, **kwargs)


def hap_cli(*args: object, tmp: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "analysis.hap_experiment", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env(tmp))


def one_line_error(done: subprocess.Popen) -> str:
    """The command's only stderr line (it must have exited with 2, printed no traceback, nothing on stdout)."""
    out, err = done.communicate(timeout=WAIT_S)
    assert done.returncode == 2 and "Traceback" not in out + err and not out.strip(), out[-2000:] + err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    return lines[0]


def contents(folder: Path) -> dict[str, bytes]:
    """Every file of ``folder`` but the lock (whose holder's pid changes), by name."""
    return {path.name: path.read_bytes() for path in folder.iterdir() if path.name != LOCK_NAME}


@pytest.fixture
def hap_run(tmp_path: Path) -> Path:
    """A real (tiny) run's folder, ``tmp_path/out``: one fit's row and curve (the CLI's ``run`` with its
    report is covered by test_hap.py's CLI test, which also needs the lock to be reentrant)."""
    out = tmp_path / "out"
    run_protocol(Protocol((DatasetPlan("MUTAG", (0,), 1, 10, 1, ("gcn-mean",)),), lrs=(0.01,), patience=0), out,
                 data_root=TU, cache_dir=tmp_path / "cache", verbose=False)
    return out


def test_a_second_report_or_run_on_a_locked_folder_is_refused_naming_the_holder_and_loses_nothing(
        tmp_path: Path, hap_run: Path) -> None:
    before = contents(hap_run)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(hap_run)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO, env=env(tmp_path))
    try:
        assert holder.stdout.readline().strip() == "held"
        # A report would rewrite results.md; this run would append the fold 1 row.
        commands = [hap_cli("report", "--out", hap_run, tmp=tmp_path),
                    hap_cli("run", "--out", hap_run, "--plan", "MUTAG:1x2:1", "--data-root", TU, "--methods",
                            "gcn-mean", "--lr", "0.01", "--patience", "0", tmp=tmp_path)]
        for command in commands:
            line = one_line_error(command)
            assert f"--out {hap_run}: in use by another paratwin process (pid {holder.pid})" in line, line
            assert "running \"python -c 'import sys; from traces.outdir import OutputLock;" in line, line
    finally:
        holder.communicate(input="", timeout=WAIT_S)
    assert contents(hap_run) == before  # no row appended, no report written


def test_the_lock_is_reentrant_within_a_process_and_released_by_its_outermost_holder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with OutputLock(out):
        # main holds the folder for `run`, then write_report takes it again (here: another spelling)
        with OutputLock(tmp_path / "other" / ".." / "out"):
            pass
        pid, command = (out / LOCK_NAME).read_text().splitlines()
        assert int(pid) == os.getpid() and command.startswith(Path(sys.orig_argv[0]).name)
        refused = python(TRY, out, tmp=tmp_path).stdout
        assert f"in use by another paratwin process (pid {os.getpid()}) running" in refused, refused
    assert python(TRY, out, tmp=tmp_path).stdout.strip() == "acquired"


def test_concurrent_first_loads_of_a_data_set_build_its_cache_once_and_all_succeed(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    done = python(LOAD, cache, TU, tmp=tmp_path)
    assert done.stdout.strip() == "exit codes 0 0 0", done.stdout + done.stderr[-3000:]
    copy = cache / "MUTAG"
    assert (copy / BUILT_MARKER).is_file() and (copy / "processed" / "data.pt").is_file()
    assert sorted(p.name for p in (copy / "raw").iterdir()) == sorted(p.name for p in (TU / "MUTAG" / "raw").iterdir())
    assert len(load_tu("MUTAG", data_root=TU, cache_dir=cache)) == 188


def test_concurrent_first_loads_of_a_missing_data_set_download_it_once(tmp_path: Path) -> None:
    archive = tmp_path / "PROTEINS.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        for path in sorted((TU / "MUTAG" / "raw").iterdir()):
            zipped.write(path, f"PROTEINS/{path.name.replace('MUTAG', 'PROTEINS')}")
    log = tmp_path / "downloads.log"
    xdg = tmp_path / "xdg"  # the download cache: $XDG_CACHE_HOME/paratwin/TU
    child_env = {key: value for key, value in env(tmp_path).items() if key != DATA_ENV}
    done = subprocess.run([sys.executable, "-c", DOWNLOAD, str(archive), str(log), str(tmp_path / "cache")],
                          capture_output=True, text=True, cwd=REPO, env={**child_env, "XDG_CACHE_HOME": str(xdg)},
                          timeout=WAIT_S)
    assert done.stdout.strip() == "exit codes 0 0 0", done.stdout + done.stderr[-3000:]
    assert log.read_text().splitlines() == [f"{TU_URL}/PROTEINS.zip"]
    raw = xdg / "paratwin" / "TU" / "PROTEINS" / "raw"
    shipped = (TU / "MUTAG" / "raw").glob("MUTAG_*.txt")  # the data files (download_tu keeps those)
    assert sorted(p.name for p in raw.iterdir()) == sorted(p.name.replace("MUTAG", "PROTEINS") for p in shipped)


def test_a_finished_cache_loads_read_only(tmp_path: Path) -> None:
    """A built cache that cannot be written (no lock file can be created there) still loads, unchanged."""
    cache = tmp_path / "cache"
    load_tu("MUTAG", data_root=TU, cache_dir=cache)
    paths = [cache, *cache.rglob("*")]
    before = {path: path.stat().st_mtime_ns for path in paths}
    prefix = []
    if os.geteuid() == 0:  # root writes anywhere: the load runs without the capabilities that allow it
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
    for path in paths:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        code = ("import sys; from exec.hap.data import load_tu; "
                "print(len(load_tu('MUTAG', data_root=sys.argv[1], cache_dir=sys.argv[2])))")
        done = subprocess.run([*prefix, sys.executable, "-c", code, str(TU), str(cache)], capture_output=True,
                              text=True, cwd=REPO, env=env(tmp_path), timeout=WAIT_S)
    finally:
        for path in paths:
            path.chmod(0o755 if path.is_dir() else 0o644)
    assert done.returncode == 0 and done.stdout.strip() == "188", done.stderr[-3000:]
    assert {path: path.stat().st_mtime_ns for path in [cache, *cache.rglob("*")]} == before


def test_the_cli_prints_a_config_error_as_one_line_on_stderr_and_exits_2(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    line = one_line_error(hap_cli("run", "--out", tmp_path / "out", "--plan", "MUTAG:1x1:1", "--data-root", empty,
                                  tmp=tmp_path))
    assert line.startswith(f"error: dataset: no TU dataset 'MUTAG' under {empty}") and "(fix: " in line, line
