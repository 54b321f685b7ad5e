"""Sweeps: points from a spec, records written as they complete, resume after kill -9, Dask."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from analysis.sweep import SweepSpec, point_id, read_events, recorded_ids, run_sweep
from tests.interactive import start_as_from_terminal
from traces.errors import ConfigError

BASE = {"workload": "gpt-8.3b", "cluster": "a100-64", "dtype": "fp16",
        "parallelism": {"dp": 2, "tp": 8, "pp": 4}, "schedule": {"name": "1f1b", "micro_batch": 4, "microbatches": 8}}


def small_spec() -> dict:
    return {"name": "t", "base": BASE,
            "grid": {"schedule.microbatches": [8, 16]},
            "axes": {"technique": {"megatron": {"memory": {"policy": "full"}},
                                   "merak": {"schedule": {"name": "merak-shifted"}, "parallelism": {"tp_overlap": 3}},
                                   "bad-tp": {"parallelism": {"tp": 3}},
                                   "too-big": {"schedule": {"name": "gpipe", "micro_batch": 64}}}}}


def test_spec_expands_the_grid_and_axes_with_stable_ids() -> None:
    spec = SweepSpec.from_dict(small_spec())
    assert len(spec.points) == 8
    labels = [(p.labels["schedule.microbatches"], p.labels["technique"]) for p in spec.points]
    assert labels[:4] == [(8, "megatron"), (8, "merak"), (8, "bad-tp"), (8, "too-big")]
    merak = spec.points[1].plan
    # Sections merge like Plan.replace: the base's micro_batch survives a schedule override.
    assert {k: merak["schedule"][k] for k in ("name", "micro_batch", "microbatches")} == \
        {"name": "merak-shifted", "micro_batch": 4, "microbatches": 8}
    assert merak["parallelism"]["tp_overlap"] == 3 and merak["parallelism"]["dp"] == 2
    # The id is the simulated plan's: the same plan spelled another way (defaults written out,
    # another name) is the same point; the ids do not change from one expansion to the next.
    again = SweepSpec.from_dict(small_spec())
    assert [p.id for p in again.points] == [p.id for p in spec.points]
    spelled = {**BASE, "name": "other", "parallelism": {**BASE["parallelism"], "chunks": 1, "tp_overlap": 3},
               "schedule": {"name": "merak-shifted", "micro_batch": 4, "microbatches": 8}}
    assert SweepSpec.from_dict({"points": [spelled]}).points[0].id == spec.points[1].id
    assert len({p.id for p in spec.points}) == 8
    assert point_id(merak, None, False) != point_id(merak, None, True)


def test_bad_points_are_records_with_their_reason(tmp_path: Path) -> None:
    run = run_sweep(small_spec(), tmp_path, workers=1)
    table = run.table.set_index(["schedule.microbatches", "technique"])
    assert run.counts == {"ok": 4, "error": 2, "does-not-fit": 2}
    bad = table.loc[(8, "bad-tp")]
    assert bad["status"] == "error" and "dp x tp x pp: 2 x 3 x 4 = 24" in bad["reason"] and "\n" not in bad["reason"]
    big = table.loc[(16, "too-big")]
    assert big["status"] == "does-not-fit" and big["reason"].startswith("plan does not fit: rank")
    assert big["oom"] and big["peak_memory_gib"] > big["capacity_gib"]
    ok = table.loc[(16, "merak")]
    assert ok["status"] == "ok" and ok["iteration_s"] > 0 and 0 <= ok["bubble_max"] < 1
    # Merak's techniques make the same pipeline faster than the Megatron-style baseline here.
    assert ok["iteration_s"] < table.loc[(16, "megatron")]["iteration_s"]
    merged = pd.read_parquet(tmp_path / "results.parquet")
    assert sorted(merged["id"]) == sorted(p.id for p in SweepSpec.from_dict(small_spec()).points)
    assert (tmp_path / "results.csv").is_file() and len(list((tmp_path / "points").glob("*.json"))) == 8


def test_a_second_run_computes_only_new_points(tmp_path: Path) -> None:
    spec = small_spec()
    first = run_sweep(spec, tmp_path, workers=1)
    assert len(first.computed) == 8 and first.reused == 0
    again = run_sweep(spec, tmp_path, workers=1)
    assert again.computed == [] and again.reused == 8
    spec["grid"]["schedule.microbatches"].append(32)  # the spec grows: only the new points run
    grown = run_sweep(spec, tmp_path, workers=2)
    assert len(grown.computed) == 4 and grown.reused == 8 and len(grown.table) == 12
    assert set(grown.table[grown.table["run"] == grown.run_id]["schedule.microbatches"]) == {32}


def test_dask_local_cluster_gives_the_records_of_local_processes(tmp_path: Path) -> None:
    pytest.importorskip("distributed")
    spec = small_spec()
    local = run_sweep(spec, tmp_path / "local", workers=2)
    dask = run_sweep(spec, tmp_path / "dask", workers=2, scheduler="local-dask", dask_processes=False)
    assert dask.backend == "Dask LocalCluster of 2 workers"
    columns = ["id", "status", "reason", "iteration_s", "peak_memory_gib"]
    pd.testing.assert_frame_equal(local.table[columns].sort_values("id").reset_index(drop=True),
                                  dask.table[columns].sort_values("id").reset_index(drop=True))


def test_dask_scheduler_address(tmp_path: Path) -> None:
    """An existing cluster, reached by its address (here one started in this process)."""
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, processes=False, threads_per_worker=1,
                                  dashboard_address=None) as cluster:
        run = run_sweep(small_spec(), tmp_path, scheduler=cluster.scheduler_address)
    assert run.backend.startswith("Dask scheduler ") and len(run.computed) == 8
    assert run.counts == {"ok": 4, "error": 2, "does-not-fit": 2}


def test_unreachable_scheduler_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(small_spec()))
    done = subprocess.run([sys.executable, "-m", "analysis.cli", "sweep", str(tmp_path / "spec.yaml"),
                           "--out", str(tmp_path / "out"), "--scheduler", "tcp://127.0.0.1:9"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "2s"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "cannot reach the Dask scheduler at tcp://127.0.0.1:9" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr


def _records(out: Path) -> dict[str, bytes]:
    return {p.stem: p.read_bytes() for p in (out / "points").glob("*.json")}


def test_kill_9_then_resume_loses_and_repeats_nothing(tmp_path: Path) -> None:
    """A real sweep in a subprocess, SIGKILLed mid-way, then resumed: every point has exactly one
    record, the first run's records are untouched, and the second run computed only the rest."""
    # ~0.3 s a point (1F1B over 8 stages, 128+ micro-batches): slow enough to be killed mid-way.
    spec = {"name": "kill", "base": {**BASE, "parallelism": {"dp": 1, "tp": 8, "pp": 8},
                                     "schedule": {"name": "1f1b", "micro_batch": 1, "microbatches": 128}},
            "grid": {"schedule.microbatches": list(range(128, 152))}}
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "analysis.cli", "sweep", str(spec_path), "--out", str(out), "--workers", "2"]
    total = len(SweepSpec.load(spec_path).points)
    assert total == 24

    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while len(recorded_ids(out)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)  # kill -9 of the sweep (its pool's workers become orphans)
    proc.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # and the orphans: they hold no record to write anyway
    first = _records(out)
    assert 3 <= len(first) < total, f"{len(first)} of {total} points done when killed: not mid-way"
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "results.parquet").exists()  # killed before the merge
    first_run = {json.loads(b)["run"] for b in first.values()}
    assert len(first_run) == 1

    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"{total} points ({total} ok); computed {total - len(first)} " in resumed.stdout
    final = _records(out)
    assert set(final) == {p.id for p in SweepSpec.load(spec_path).points}  # every point, one record each
    assert all(final[i] == first[i] for i in first)  # completed records untouched: not recomputed
    runs = {i: json.loads(b)["run"] for i, b in final.items()}
    second_run = set(runs.values()) - first_run
    assert len(second_run) == 1
    assert {i for i, r in runs.items() if r in second_run} == set(final) - set(first)
    # The resumed run submitted exactly the points without a record, each once.
    events = read_events(out)
    submitted = [e["id"] for e in events if e.get("event") == "submit" and e["run"] in second_run]
    assert sorted(submitted) == sorted(set(final) - set(first))
    merged = pd.read_parquet(out / "results.parquet")
    assert len(merged) == total and merged["id"].is_unique and set(merged["status"]) == {"ok"}
    assert not list((out / "points").glob(".*"))  # no temporary file left behind by the kill's victims


def test_ctrl_c_says_what_is_recorded_and_how_to_resume(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the sweep's process group, as a terminal sends it) mid-way: one line naming the
    points recorded and the fix, status 130; before, status 130 and not a word."""
    spec = {"name": "ctrl-c", "base": {**BASE, "parallelism": {"dp": 1, "tp": 8, "pp": 8},
                                       "schedule": {"name": "1f1b", "micro_batch": 1, "microbatches": 128}},
            "grid": {"schedule.microbatches": list(range(128, 152))}}  # ~0.3 s a point, as above
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    proc = start_as_from_terminal([sys.executable, "-m", "analysis.cli", "sweep", str(spec_path), "--out", str(out),
                                   "--workers", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while len(recorded_ids(out)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    recorded = len(recorded_ids(out))
    assert proc.returncode == 130, output
    assert 3 <= recorded < 24, output
    last = (output.strip().splitlines() or [""])[-1]
    assert last.startswith("error: sweep ctrl-c: interrupted;") and "Traceback" not in output, output
    assert f"{recorded} of 24 points are recorded in {out}" in last and "run the same command again" in last


def test_full_that_is_not_a_boolean_is_refused() -> None:
    """full: maybe was read as true (bool of a string) and simulated every rank."""
    with pytest.raises(ConfigError, match=r"sweep: full: must be true or false, not 'maybe'"):
        SweepSpec.from_dict({**small_spec(), "full": "maybe"})


def test_zero_workers_is_refused_not_the_default(tmp_path: Path) -> None:
    """workers=0 (--workers 0) was read as "not given" and ran on every usable core."""
    with pytest.raises(ConfigError, match="--workers: 0 workers"):
        run_sweep(small_spec(), tmp_path / "out", workers=0)


def test_sigint_to_the_sweep_alone_ends_its_workers_points(tmp_path: Path) -> None:
    """A SIGINT to the sweep's process alone (`kill -INT`, `timeout`, a batch system; a terminal signals
    the whole group) reaches no worker: the sweep waited, silent, for every point in flight to finish
    (40-60 s in a review's run). It ends them: here long before the two-minute points could finish."""
    from tests.slow_sweep_point import SECONDS

    script = ("import sys\nfrom analysis.sweep import SweepInterrupted, run_sweep\n"
              "from tests.slow_sweep_point import sleep_through\n"
              "if __name__ == '__main__':\n"
              "    try:\n"
              f"        run_sweep({small_spec()!r}, {str(tmp_path / 'out')!r}, workers=2, evaluate=sleep_through)\n"
              "    except SweepInterrupted as exc:\n"
              "        print(exc)\n"
              "        sys.exit(exc.exit_code)\n")
    proc = start_as_from_terminal([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, cwd=Path(__file__).resolve().parent.parent)
    deadline = time.monotonic() + 120
    while not [e for e in read_events(tmp_path / "out") if e.get("event") == "submit"] and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(3)  # the workers have started their first points
    started = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    try:
        output = proc.communicate(timeout=SECONDS + 60)[0]
    finally:  # a sweep that hangs must not outlive the test with its workers
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    waited = time.monotonic() - started
    assert proc.returncode == 130 and "interrupted; 0 of" in output, output
    assert waited < SECONDS / 2, f"exited {waited:.0f} s after the SIGINT: it waited for the points in flight"


@pytest.mark.parametrize(("grid", "where", "problem", "fields"), [
    ({"schedule.bogus": [1, 2]}, "grid.schedule.bogus", "'bogus' is not a field of schedule", "microbatches"),
    ({"bogus": [1, 2]}, "grid.bogus", "'bogus' is not a plan field", "parallelism"),
    ({"workload.seq": [1]}, "grid.workload.seq", "workload is not a section", "parallelism"),
    ({"memory.bogus": [1]}, "grid.memory.bogus", "'bogus' is not a field of memory", "ratio"),
    ({"memory": [{"policy": "full", "bogus": 1}]}, "grid.memory", "'bogus' is not a field of memory", "ratio"),
])
def test_a_grid_key_that_is_no_plan_field_is_refused_before_running(grid: dict, where: str, problem: str,
                                                                     fields: str) -> None:
    """`schedule.bogus: [1, 2]` ran, recorded every point as an error and exited 0 (an outside-in review)."""
    with pytest.raises(ConfigError) as refused:
        SweepSpec.from_dict({"name": "t", "base": BASE, "grid": grid})
    assert refused.value.field == f"sweep: {where}" and refused.value.problem == problem
    assert fields in refused.value.fix


def test_axes_and_points_are_checked_alike_and_fields_any_choice_takes_pass() -> None:
    with pytest.raises(ConfigError, match=r"sweep: axes.technique.fast: 'bogus' is not a field of parallelism"):
        SweepSpec.from_dict({"base": BASE, "axes": {"technique": {"fast": {"parallelism": {"bogus": 1}}}}})
    with pytest.raises(ConfigError, match=r"sweep: points\[0\]: 'schedules' is not a plan field"):
        SweepSpec.from_dict({"base": BASE, "points": [{"schedules": {"name": "1f1b"}}]})
    # a field of some memory policy (stage-aware's ratio), a workload option, costs: the points decide
    spec = SweepSpec.from_dict({"base": BASE, "grid": {"memory.ratio": [0.5], "workload_options.seq": [512]},
                                "points": [{"name": "p", "costs": {"uniform": {"num_layers": 4}}}]})
    assert len(spec.points) == 2


def sweep_cli(spec: dict, tmp_path: Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    return subprocess.run([sys.executable, "-m", "analysis.cli", "sweep", str(spec_path), "--out",
                           str(tmp_path / "out"), "--workers", "1"], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})


@pytest.mark.parametrize(("changes", "status", "line"), [
    ({"parallelism": {"dp": 2, "tp": 3, "pp": 4}}, 2, "error: sweep t: no point is ok (2 error)"),
    ({"schedule": {"name": "gpipe", "micro_batch": 64}}, 3, "error: sweep t: no point fits in memory (2 does-not-fit)"),
])
def test_a_sweep_with_no_point_ok_exits_non_zero(tmp_path: Path, changes: dict, status: int, line: str) -> None:
    """It exited 0. The results are still written; 3 when every point does not fit, as simulate exits."""
    done = sweep_cli({"name": "t", "base": {**BASE, **changes}, "grid": {"schedule.microbatches": [8, 16]}},
                     tmp_path)
    assert done.returncode == status, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith(line), done.stdout
    assert len(pd.read_csv(tmp_path / "out" / "results.csv")) == 2


def test_one_point_is_one_point(tmp_path: Path) -> None:
    done = sweep_cli({"name": "t", "base": BASE}, tmp_path)
    assert done.returncode == 0 and "sweep t: 1 point (1 ok);" in done.stdout, done.stdout + done.stderr


def test_a_relative_base_is_read_from_the_specs_folder_and_a_miss_names_it(tmp_path: Path) -> None:
    """docs/figures.md said only "a plan file path"; the review read it from the current directory."""
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans" / "base.yaml").write_text(yaml.safe_dump(BASE))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = sweep_cli({"name": "t", "base": "plans/base.yaml"}, tmp_path, cwd=elsewhere)
    assert done.returncode == 0, done.stdout + done.stderr
    # a path that exists from the current directory but not from the spec's folder: the fix names it
    (elsewhere / "mine.yaml").write_text(yaml.safe_dump(BASE))
    done = sweep_cli({"name": "t", "base": "mine.yaml"}, tmp_path, cwd=elsewhere)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.strip() == (
        f"error: {tmp_path / 'spec.yaml'}: base: no plan file mine.yaml in {tmp_path}, the spec's folder (a relative "
        f"base is read from there) (fix: write base: elsewhere/mine.yaml, the file of that name in the current "
        "directory)")
