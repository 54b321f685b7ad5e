"""An output folder (``--out``) is checked before any work (session 17's input audit): a folder of the user's
holding a file of the names a command writes is refused, not overwritten; a folder that cannot be written is
refused in one line, not a traceback after the work; a folder paratwin wrote before is reused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sim.search import SearchSpace
from traces.errors import ConfigError
from traces.outdir import LOCK_NAME, OutputError, OutputLock, prepare_out_folder

REPO = Path(__file__).resolve().parents[1]
GPU_PLAN = REPO / "examples" / "plans" / "gpt-8.3b-a100-64-merak.yaml"
RUNS_CSV = REPO / "sim" / "data" / "a100_single_node_megatron.csv"


def paratwin(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "analysis.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def users_folder(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / name).write_text("the user's own")
    return folder


def test_a_users_file_of_an_output_name_is_refused_and_kept(tmp_path: Path) -> None:
    folder = users_folder(tmp_path, "summary.json")
    with pytest.raises(ConfigError, match=r"--out: .*mine already holds summary.json, not written by paratwin "
                                          r"\(fix: choose an empty or new folder \(nothing was overwritten\)\)"):
        prepare_out_folder(folder, ("instructions.parquet", "summary.json"))
    assert (folder / "summary.json").read_text() == "the user's own"
    prepare_out_folder(folder, ("ranked.parquet",))  # other names of the user's are no obstacle


def test_a_folder_paratwin_wrote_is_reused(tmp_path: Path) -> None:
    folder = tmp_path / "runs"
    with OutputLock(folder):  # what every writer holds: it leaves the lock file behind
        (folder / "summary.json").write_text("{}")
    assert (folder / LOCK_NAME).exists()
    prepare_out_folder(folder, ("summary.json",))  # a rerun replaces its own outputs


def test_a_folder_that_cannot_be_written_is_refused_and_nothing_is_created(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("kept")
    with pytest.raises(ConfigError, match=r"--out: cannot write in .*a-file/sub \(Not a directory\) "
                                          r"\(fix: choose a folder in a place you can write\)"):
        prepare_out_folder(tmp_path / "a-file" / "sub", ("summary.json",))
    prepare_out_folder(tmp_path / "new" / "deeper", ("summary.json",))
    assert not (tmp_path / "new").exists()  # tried, then removed: a refused command leaves nothing


def test_simulate_refuses_a_users_folder_before_simulating(tmp_path: Path) -> None:
    """It overwrote the user's summary.json with the simulation's."""
    folder = users_folder(tmp_path, "summary.json")
    done = paratwin("simulate", str(GPU_PLAN), "--out", str(folder))
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error: --out: {folder} already holds summary.json, not written by paratwin" in done.stdout
    assert "Traceback" not in done.stderr
    assert (folder / "summary.json").read_text() == "the user's own"
    assert not (folder / "instructions.parquet").exists()


def test_simulate_refuses_an_unwritable_folder_before_simulating(tmp_path: Path) -> None:
    """It was a FileNotFoundError / NotADirectoryError traceback after the simulation."""
    (tmp_path / "a-file").write_text("kept")
    done = paratwin("simulate", str(GPU_PLAN), "--out", str(tmp_path / "a-file" / "sim"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: --out: cannot write in" in done.stdout and "Traceback" not in done.stderr


def test_search_refuses_a_users_folder_before_searching(tmp_path: Path) -> None:
    """It overwrote the user's best.yaml and summary.json."""
    from analysis.search_report import run_search

    folder = users_folder(tmp_path, "best.yaml")
    space = SearchSpace("gpt2-small", "no-such-cluster", global_batch=16)  # the search itself would fail
    with pytest.raises(ConfigError, match="already holds best.yaml, not written by paratwin"):
        run_search(space, top=1, simulate_top=1, sample=0, out=folder)
    assert (folder / "best.yaml").read_text() == "the user's own"


def test_a_search_folder_is_reused_by_the_next_search(tmp_path: Path) -> None:
    from analysis.search_report import run_search

    space = SearchSpace("gpt2-small", "dgx-a100-8", global_batch=16, max_micro_batch=1, fractions=(),
                        tp_overlaps=(0,), bucket_mbs=(25.0,), max_chunks=1)
    for _ in range(2):
        run_search(space, top=1, simulate_top=1, sample=0, out=tmp_path / "out", workers=1)
    assert (tmp_path / "out" / "best.yaml").exists() and (tmp_path / "out" / LOCK_NAME).exists()


def test_sweep_refuses_a_users_folder(tmp_path: Path) -> None:
    from analysis.sweep import run_sweep

    folder = users_folder(tmp_path, "spec.json")
    spec = {"name": "s", "base": str(GPU_PLAN), "grid": {"schedule.microbatches": [8, 16]}}
    with pytest.raises(ConfigError, match="already holds spec.json, not written by paratwin"):
        run_sweep(spec, folder, workers=1)
    assert (folder / "spec.json").read_text() == "the user's own"
    assert not (folder / "points").exists()


def test_predict_runs_refuses_a_users_folder_and_reuses_its_own(tmp_path: Path) -> None:
    rows = tmp_path / "runs.csv"
    rows.write_text("".join(RUNS_CSV.read_text().splitlines(keepends=True)[:2]))
    folder = users_folder(tmp_path, "predictions.csv")
    done = paratwin("predict-runs", str(rows), "--out", str(folder))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "already holds predictions.csv, not written by paratwin" in done.stdout
    assert (folder / "predictions.csv").read_text() == "the user's own"
    for _ in range(2):  # its own folder, twice
        done = paratwin("predict-runs", str(rows), "--out", str(tmp_path / "own"))
        assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "own" / "predictions.csv").read_text().startswith("# GPUs,")


@pytest.mark.parametrize("where", ["a-file", "a-file/run"])
def test_run_refuses_a_file_or_an_unwritable_out_before_starting(tmp_path: Path, where: str) -> None:
    """Both were FileExistsError / FileNotFoundError tracebacks (from OutputLock's mkdir)."""
    from exec.launcher import run_plan

    (tmp_path / "a-file").write_text("kept")
    with pytest.raises(ConfigError, match=r"^--out: .*(is a file, not a folder|cannot write in)"):
        run_plan(REPO / "examples" / "plans" / "gpt-tiny-pp2-1f1b.yaml", out_dir=tmp_path / where, iterations=1)
    assert (tmp_path / "a-file").read_text() == "kept"


def test_validate_refuses_a_users_folder_before_profiling(tmp_path: Path) -> None:
    """It exited 0 and replaced the user's report.md and plan.yaml with the validation's."""
    folder = users_folder(tmp_path, "report.md")
    (folder / "plan.yaml").write_text("the user's plan")
    done = paratwin("validate", str(REPO / "examples" / "validation" / "gpt-val-pp2-1f1b.yaml"), "--out", str(folder),
                    "--iterations", "2")
    assert done.returncode == 2, done.stdout + done.stderr
    assert (f"error: --out: {folder} already holds plan.yaml, report.md, not written by paratwin (fix: choose an "
            "empty or new folder (nothing was overwritten))") in done.stdout
    assert "Traceback" not in done.stderr
    assert (folder / "report.md").read_text() == "the user's own"
    assert (folder / "plan.yaml").read_text() == "the user's plan"
    assert sorted(p.name for p in folder.iterdir()) == ["plan.yaml", "report.md"]  # no profile/, no run/


def test_demo_refuses_a_users_folder_and_reuses_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It replaced the user's report.md and report.html. Its own folder is reused: the demo stops here at
    its first step (profiling), which is reached both times."""
    import analysis.validation.profiling
    from analysis.demo import run_demo
    from analysis.report import console

    folder = users_folder(tmp_path, "report.md")
    (folder / "report.html").write_text("the user's page")
    with pytest.raises(ConfigError, match="already holds report.md, report.html, not written by paratwin"):
        run_demo(folder, console)
    assert (folder / "report.md").read_text() == "the user's own"
    assert (folder / "report.html").read_text() == "the user's page"
    assert not (folder / "measure").exists()

    class Profiled(Exception):
        pass

    def profiled(*args: object, **kwargs: object) -> None:
        raise Profiled

    monkeypatch.setattr(analysis.validation.profiling, "profile_for_validation", profiled)
    own = tmp_path / "own"
    own.mkdir()
    with pytest.raises(Profiled):
        run_demo(own, console)
    (own / "report.md").write_text("an earlier demo's report")
    with pytest.raises(Profiled):  # not refused: the first demo left its lock file
        run_demo(own, console)


def test_profile_refuses_a_paratwin_folder_that_is_not_a_profile_of_its_workload(tmp_path: Path) -> None:
    """`paratwin profile --workload bert-tiny --out <a gpt-tiny bundle>` replaced that bundle silently."""
    import json

    from traces.bundle import check_profile_target

    bundle = tmp_path / "gpt-tiny"
    bundle.mkdir()
    manifest = {"format": "paratwin.profile-bundle", "meta": {"workload": {"name": "gpt-tiny"}}}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    check_profile_target(bundle, "gpt-tiny")  # re-profiling a workload into its own bundle
    with pytest.raises(ConfigError, match=r"^--out: .*gpt-tiny holds the profile of gpt-tiny, not a profile of "
                                          r"bert-tiny \(fix: choose another folder, or pass --force to replace it"):
        check_profile_target(bundle, "bert-tiny")
    check_profile_target(bundle, "bert-tiny", force=True)
    record = tmp_path / "record"
    record.mkdir()
    (record / "manifest.json").write_text(json.dumps({"format": "paratwin.run-record"}))
    with pytest.raises(ConfigError, match="holds a paratwin.run-record folder, not a profile of gpt-tiny"):
        check_profile_target(record, "gpt-tiny")
    check_profile_target(tmp_path / "new", "gpt-tiny")


def test_validate_suite_refuses_a_users_summary_files_before_any_work(tmp_path: Path) -> None:
    """validate-suite wrote suite.csv / .json / .md at its folder's top without a check (found by an
    outside-in review's follow-up): a user's file of those names is refused, and kept, before profiling."""
    from analysis.validation_suite import run_suite

    folder = tmp_path / "suite"
    folder.mkdir()
    (folder / "suite.md").write_text("mine")
    with pytest.raises(ConfigError, match="already holds suite.md, not written by paratwin"):
        run_suite(folder, plans=[Path(__file__).resolve().parent.parent / "examples" / "validation" /
                                 "gpt-val-pp2-1f1b.yaml"], calibration=[], verbose=False)
    assert (folder / "suite.md").read_text() == "mine" and sorted(p.name for p in folder.iterdir()) == ["suite.md"]


def lock_in_child(folder: str, answer: Any) -> None:
    """A multiprocessing worker's try at the folder's lock (as a re-imported script's call would)."""
    try:
        OutputLock(Path(folder)).acquire()
        answer.put("acquired")
    except Exception as exc:  # the message is what the test reads
        answer.put(str(exc))


def test_a_lock_held_by_the_parent_says_to_guard_the_script(tmp_path: Path) -> None:
    """A script without `if __name__ == "__main__":` that calls validate_plan: each spawned profiling
    process re-ran it and was refused by the script's own lock, named as "another paratwin process"
    (found by a second outside-in review). A multiprocessing worker is told what to change instead; a
    plain child process (another command the holder started) still hears "another paratwin process"."""
    import multiprocessing

    folder = tmp_path / "out"
    context = multiprocessing.get_context("spawn")
    answer = context.Queue()
    with OutputLock(folder):
        worker = context.Process(target=lock_in_child, args=(str(folder), answer))
        worker.start()
        message = answer.get(timeout=120)
        worker.join(60)
        plain = subprocess.run([sys.executable, "-c", "from traces.outdir import OutputLock; "
                                f"OutputLock({str(folder)!r}).acquire()"], capture_output=True, text=True,
                               timeout=60, cwd=REPO)
    assert "in use by this process's parent" in message and 'if __name__ == "__main__":' in message, message
    assert plain.returncode == 1 and "in use by another paratwin process" in plain.stderr
    # The case itself: a script with no guard that takes the lock and starts a spawned worker, which
    # re-runs the script's top level while it is still importing it.
    script = tmp_path / "unguarded.py"
    script.write_text("import multiprocessing\nfrom traces.outdir import OutputLock\n"
                      f"OutputLock({str(tmp_path / 'other')!r}).acquire()\n"
                      "worker = multiprocessing.get_context('spawn').Process(target=print)\n"
                      "worker.start()\nworker.join()\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "in use by this process's parent" in done.stderr and "__main__" in done.stderr, done.stderr[-2000:]


def probe_and_lock(base: str, count: int, together: Any, answer: Any) -> None:
    """What a command does with a new --out, for ``count`` new folders one after the other, each at the same
    moment as the other racer: check it, then take its lock. Only the documented refusal may stop it."""
    problems = []
    for index in range(count):
        folder = Path(base) / str(index)
        together.wait()
        try:
            prepare_out_folder(folder, ("summary.json",))
            with OutputLock(folder):
                pass
        except OutputError:  # "in use by another paratwin process (pid ...)": the other one holds it
            continue
        except Exception as exc:  # noqa: BLE001 - what the test reports
            problems.append(f"{folder.name}: {type(exc).__name__}: {exc}")
    answer.put(problems)


def test_commands_starting_on_one_new_folder_at_once_meet_at_its_lock(tmp_path: Path) -> None:
    """Two `paratwin run --out NEW` at once: the second said "cannot write in NEW (File exists)" (the
    writability probe created NEW and removed it again, racing the other command's probe and lock) or failed
    on a folder the other's probe had removed. Two processes race through many new folders."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    together, answer = context.Barrier(2), context.Queue()
    racers = [context.Process(target=probe_and_lock, args=(str(tmp_path), 300, together, answer)) for _ in range(2)]
    for racer in racers:
        racer.start()
    problems = [answer.get(timeout=300) for _ in racers]
    for racer in racers:
        racer.join(60)
    assert problems == [[], []], [p[:5] for p in problems]
