"""The command line as a user runs it: profile writes a readable bundle and a Perfetto trace."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from traces.bundle import read_bundle


def paratwin(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "analysis.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_simulate_with_a_missing_profile_is_one_line(tmp_path: Path) -> None:
    """`paratwin simulate --profile DIR` where DIR is not there: exit 2, the field and the fix, no traceback."""
    plan = Path(__file__).resolve().parents[1] / "examples" / "plans" / "gpt-tiny-pp2-1f1b.yaml"
    done = paratwin("simulate", str(plan), "--profile", str(tmp_path / "nope"),
                    "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error: profile: '{tmp_path / 'nope'}': no such folder" in done.stdout
    assert "paratwin profile --workload gpt-tiny" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    assert not (tmp_path / "out").exists()


def test_the_profile_command_a_refusal_prints_profiles_the_plans_workload_options(tmp_path: Path) -> None:
    """A plan with workload_options on a CPU cluster is refused with a profile command; run as printed (with
    fewer repeats, to be quick), it writes the bundle the plan then simulates with. It printed the preset's
    command, which has no --workload-option: its bundle had the preset's vocab and was refused in turn."""
    plan = tmp_path / "tt.yaml"
    plan.write_text(yaml.safe_dump({
        "name": "tinytx-pp2", "workload": "gpt-tiny",
        "workload_options": {"hidden": 48, "heads": 4, "num_layers": 3, "vocab": 256, "seq": 16},
        "cluster": {"preset": "local-cpu-2"}, "parallelism": {"pp": 2},
        "schedule": {"name": "1f1b", "micro_batch": 2, "microbatches": 4}}))
    refused = paratwin("simulate", str(plan), "--out", str(tmp_path / "sim"))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    command = re.search(r"profile it on this machine: (paratwin profile .*? --out DIR)", refused.stdout)
    assert command is not None, refused.stdout
    words = shlex.split(command.group(1))
    assert words[:2] == ["paratwin", "profile"] and "vocab=256" in words
    words[words.index("DIR")] = str(tmp_path / "profile")
    profiled = paratwin(*words[1:], "--repeats", "2", "--warmup", "1", "--no-ops")
    assert profiled.returncode == 0, profiled.stdout + profiled.stderr
    assert read_bundle(tmp_path / "profile").meta["workload"]["options"]["vocab"] == 256
    done = paratwin("simulate", str(plan), "--profile", str(tmp_path / "profile"), "--out", str(tmp_path / "sim"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_profile_writes_bundle_and_op_timeline(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    done = paratwin("profile", "--workload", "gpt-tiny", "--micro-batch", "2", "--repeats", "2", "--warmup", "1",
                    "--out", str(out))
    assert done.returncode == 0, done.stderr
    bundle = read_bundle(out)
    assert list(bundle.layers["name"]) == ["embed", "block0", "block1", "block2", "block3", "head"]
    trace = json.loads((out / "ops.trace.json").read_text())
    ops = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(ops) == len(bundle.ops) > 0
    assert {e["args"]["layer"] for e in ops} >= set(range(6))


def test_profile_of_unknown_workload_is_one_line(tmp_path: Path) -> None:
    done = paratwin("profile", "--workload", "gpt-9000", "--out", str(tmp_path / "x"))
    assert done.returncode == 2
    assert "unknown workload 'gpt-9000'" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr


def test_profile_refuses_another_workloads_bundle_and_replaces_its_own(tmp_path: Path,
                                                                       gpt_tiny_profile: Path) -> None:
    """`--workload bert-tiny --out <a gpt-tiny bundle>` replaced that bundle (exit 0); now it is refused
    before profiling, and re-profiling gpt-tiny into its own bundle replaces it as before."""
    from tests.conftest import folder_digest

    out = tmp_path / "bundle"
    shutil.copytree(gpt_tiny_profile, out)
    before = folder_digest(out)
    done = paratwin("profile", "--workload", "bert-tiny", "--out", str(out))
    assert done.returncode == 2, done.stdout + done.stderr
    assert (f"error: --out: {out} holds the profile of gpt-tiny, not a profile of bert-tiny (fix: choose another "
            "folder, or pass --force to replace it (nothing was overwritten))") in done.stdout
    assert "Traceback" not in done.stderr
    assert folder_digest(out) == before
    done = paratwin("profile", "--workload", "gpt-tiny", "--micro-batch", "2", "--repeats", "1", "--warmup", "1",
                    "--no-ops", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert read_bundle(out).meta["settings"]["micro_batch"] == 2  # the fixture's was 1


PROFILE_QUICKLY = ("profile", "--workload", "gpt-tiny", "--micro-batch", "2", "--seq", "16", "--device", "cpu",
                   "--repeats", "1", "--warmup", "0", "--no-ops")


def test_profile_refuses_its_own_bundle_folder_holding_a_users_files(tmp_path: Path, gpt_tiny_profile: Path) -> None:
    """Re-profiling into a bundle folder deleted the notes.txt and the folder a user kept there, exit 0
    (outside-in review B, item 1): refused before profiling, every file kept."""
    from tests.conftest import folder_digest

    out = tmp_path / "bundle"
    shutil.copytree(gpt_tiny_profile, out)
    (out / "notes.txt").write_text("my notes")
    (out / "mine").mkdir()
    (out / "mine" / "data.csv").write_text("x\n")
    before = folder_digest(out)
    done = paratwin(*PROFILE_QUICKLY, "--out", str(out))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.strip() == (f"error: {out}: holds mine/, notes.txt besides its paratwin.profile-bundle files; "
                                   "writing it again would delete them (fix: move them out of the folder or choose "
                                   "another folder (nothing was deleted))")
    assert folder_digest(out) == before


def test_profile_holds_its_folders_lock(tmp_path: Path) -> None:
    """`paratwin profile` took no lock: two into one folder both wrote, the last one winning. Now a folder
    another paratwin process writes is refused, as for every other writer."""
    import os

    from traces.outdir import OutputLock

    out = tmp_path / "bundle"
    with OutputLock(out):
        done = paratwin(*PROFILE_QUICKLY, "--out", str(out))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.startswith(f"error: --out {out}: in use by another paratwin process (pid {os.getpid()})")
    assert not (out / "manifest.json").exists()


def test_simulate_takes_a_profile_from_the_command_line(tmp_path: Path) -> None:
    plan = "examples/plans/gpt-tiny-pp2-1f1b.yaml"
    refused = paratwin("simulate", plan, "--out", str(tmp_path / "refused"))
    assert refused.returncode == 2 and "paratwin profile" in refused.stdout, refused.stdout
    bundle = tmp_path / "bundle"
    assert paratwin("profile", "--workload", "gpt-tiny", "--micro-batch", "2", "--repeats", "2", "--warmup", "1",
                    "--no-ops", "--out", str(bundle)).returncode == 0
    done = paratwin("simulate", plan, "--profile", str(bundle), "--out", str(tmp_path / "sim"))
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert summary["iteration_s"] > 0


@pytest.mark.slow
def test_demo_searches_runs_and_validates(tmp_path: Path) -> None:
    """The demo end to end, and what its files say (tests/demo_output.py): the simulator's and the
    runtime's instruction tables agree, the numbers agree from file to file, memory as predicted."""
    from tests.demo_output import check_demo_output

    done = paratwin("demo", "--out", str(tmp_path / "demo"), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    check_demo_output(tmp_path / "demo")
