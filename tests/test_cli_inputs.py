"""Awkward command-line input gets one line naming the option and the fix, never a traceback (session 17's
input audit): a ``--workload-option`` whose value is not YAML, a ``migrate-plan --out`` that is a folder or
cannot be written; a runs CSV (predict-runs) that is empty, not UTF-8, a header only or ragged."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sim.calibration import read_megatron_csv
from sim.cluster import load_cluster
from sim.hardware import device_from_yaml
from sim.plan import Plan
from traces.errors import BundleError, ConfigError

REPO = Path(__file__).resolve().parents[1]
FLAT_PLAN = "name: f\nworkload: gpt-8.3b\ncluster: a100-64\ndp: 2\ntp: 8\npp: 4\nschedule: 1f1b\n"


def paratwin(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "analysis.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def refused(done: subprocess.CompletedProcess, line: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    assert line in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr


def test_a_workload_option_that_is_not_yaml_is_one_line() -> None:
    """It was a yaml ParserError traceback."""
    done = paratwin("search", "--workload", "gpt2-small", "--cluster", "dgx-a100-8", "--workload-option", "hidden=[")
    refused(done, "error: --workload-option hidden: '[' is not a YAML value (expected the node content, but found "
                  "'<stream end>') (fix: quote it, or write e.g. --workload-option hidden=128)")


def test_migrate_plan_out_that_is_a_folder_or_unwritable_is_one_line(tmp_path: Path) -> None:
    """Both were tracebacks (IsADirectoryError, NotADirectoryError)."""
    plan = tmp_path / "flat.yaml"
    plan.write_text(FLAT_PLAN)
    refused(paratwin("migrate-plan", str(plan), "--out", str(tmp_path)),
            f"error: --out: {tmp_path} is a folder (fix: name the file to write to)")
    done = paratwin("migrate-plan", str(plan), "--out", str(plan / "x.yaml"))  # under a file
    refused(done, f"error: --out: cannot write {plan / 'x.yaml'} (")
    assert done.stdout.rstrip().endswith("(fix: name a file in a place you can write)")
    assert plan.read_text() == FLAT_PLAN
    done = paratwin("migrate-plan", str(plan), "--out", str(tmp_path / "new" / "sectioned.yaml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "parallelism:" in (tmp_path / "new" / "sectioned.yaml").read_text()


def test_migrate_plan_refuses_an_existing_out_file_unless_forced(tmp_path: Path) -> None:
    """It replaced an existing --out file (perhaps the user's) silently."""
    plan = tmp_path / "flat.yaml"
    plan.write_text(FLAT_PLAN)
    keep = tmp_path / "keep.yaml"
    keep.write_text("the user's own")
    refused(paratwin("migrate-plan", str(plan), "--out", str(keep)),
            f"error: --out: {keep} already exists (fix: name a new file, or pass --force to replace it (nothing was "
            "overwritten))")
    assert keep.read_text() == "the user's own"
    done = paratwin("migrate-plan", str(plan), "--out", str(keep), "--force")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "parallelism:" in keep.read_text()


HEADER = ("# GPUs,global batch,micro batch,hidden size,attention heads,# layers,sequence length,tensor parallelism,"
          "data parallelism,pipeline parallelism,iteration time (ms)\n")


@pytest.mark.parametrize(("content", "problem"), [
    (b"", "empty file (fix: a header line naming the columns, then one run per line)"),  # EmptyDataError traceback
    (b"\xff\xfe\x00", "not UTF-8 text (byte 0) (fix: save the CSV as UTF-8)"),  # UnicodeDecodeError traceback
    (HEADER.encode(), "a header and no runs (fix: one run per line under the header)"),  # predicted 0 of 0, exit 0
    # 13 fields under 11 names: pandas made the first two an index and read '# GPUs' = 8 (the micro-batch)
    ((HEADER + "2,16,8,1024,16,24,1024,1,1,2,372.2,7,9\n").encode(),
     "a row has more fields than the header's 11 (the first data line holds the extra ones)"),
    ((HEADER + "2,16,8,1024,16,24,1024,1,1,2,372.2\n2,16,8,1024,16,24,1024,1,1,2,372.2,7\n").encode(),
     "Expected 11 fields in line 3, saw 12 (fix: one value per header column on every line)"),  # ParserError
])
def test_a_runs_csv_that_cannot_be_read_as_runs_is_one_line(tmp_path: Path, content: bytes, problem: str) -> None:
    csv = tmp_path / "runs.csv"
    csv.write_bytes(content)
    with pytest.raises(BundleError) as error:
        read_megatron_csv(csv)
    assert problem in str(error.value)


@pytest.mark.parametrize("timeout", [0, -5, float("nan")])
def test_a_run_timeout_that_is_not_positive_is_refused_before_starting(tmp_path: Path, timeout: float) -> None:
    """0 started the ranks and declared the run hung at once; -5 failed inside gloo on every rank."""
    from exec.launcher import run_plan

    with pytest.raises(ConfigError, match=r"^timeout: must be a positive number of seconds, got .* \(fix: e.g. "
                                          r"--timeout 300\)"):
        run_plan(REPO / "examples" / "plans" / "gpt-tiny-pp2-1f1b.yaml", out_dir=tmp_path / "run", timeout_s=timeout)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("frozen_after", [1.0, float("nan")])
def test_a_frozen_after_below_a_stale_heartbeat_is_refused_before_starting(tmp_path: Path,
                                                                            frozen_after: float) -> None:
    """Below 3 s (the age at which a heartbeat counts as stale) a busy machine's delays would end a healthy run."""
    from exec.launcher import run_plan

    with pytest.raises(ConfigError, match=r"^frozen-after: must be at least 3 s .* \(fix: e.g. --frozen-after 60\)"):
        run_plan(REPO / "examples" / "plans" / "gpt-tiny-pp2-1f1b.yaml", out_dir=tmp_path / "run",
                 frozen_after_s=frozen_after)
    assert not (tmp_path / "run").exists()


def test_simulate_takes_a_plan_or_its_path_and_refuses_other_objects() -> None:
    """A path or a dict was an AttributeError deep inside ('str' object has no attribute 'cluster')."""
    from sim.simulate import simulate

    path = REPO / "examples" / "plans" / "gpt-8.3b-a100-64-merak.yaml"
    assert simulate(str(path)).iteration_s == simulate(Plan.load(path)).iteration_s > 0
    with pytest.raises(ConfigError, match=r"^plan: simulate takes a Plan or a plan file's path, not a dict "
                                          r"\(fix: Plan.load\(path\), or Plan.from_dict\(mapping\)\)"):
        simulate({"workload": "gpt-8.3b"})


def test_a_search_its_own_checks_empty_says_which_and_exits_2(tmp_path: Path) -> None:
    """Every plan pruned by the s2 method's rule (fp32 gradients) said "no plan fits in memory: ... 0 do not fit by
    the estimate" with exit 3 and a fix about memory."""
    done = paratwin("search", "--workload", "gpt-8.3b", "--cluster", "a100-64", "--gradient-sync", "s2",
                    "--out", str(tmp_path / "s"))
    refused(done, "error: --gradient-sync: every one of the 167,552 plans considered was pruned, none for memory: "
                  "120,204 by gradient_sync.method, ")
    assert done.stdout.rstrip().endswith("; gradient_sync.method: s2 needs fp32 gradients, not fp16 (fix: use --dtype "
                                         "fp32, or --gradient-sync allreduce)"), done.stdout
    assert "no plan passes the search's checks: no best.yaml written" in done.stdout
    assert "fits in memory" not in done.stdout


# the bundle's workload (gpt-wordlm as profiled in float32 on a CPU) as search options
WORDLM = ("--workload", "gpt-wordlm", "--workload-option", "hidden=64", "--workload-option", "heads=2",
          "--workload-option", "num_layers=2", "--workload-option", "seq=32")


@pytest.mark.parametrize(("args", "fix"), [
    # was: "then set profile: DIR in the plan", and "set dtype: fp32"; the command profiles in the search's dtype
    # with its workload options (it printed neither, and wrote a bundle the search refused)
    (("--workload", "gpt-tiny"), "(fix: profile it on this machine: paratwin profile --workload gpt-tiny --micro-batch "
                                 "1 --dtype float16 --device cpu --out DIR, then pass --profile DIR)"),
    ((*WORDLM, "--profile", str(REPO / "tests/data/comm/loopback-2d-run7")),
     "(fix: re-profile with paratwin profile --workload gpt-wordlm --micro-batch 4 --workload-option hidden=64 "
     "--workload-option heads=2 --workload-option num_layers=2 --workload-option seq=32 --dtype float16 --device cpu "
     "--out DIR, or pass --dtype fp32)"),
])
def test_a_search_refusal_names_the_search_options_not_plan_fields(tmp_path: Path, args: tuple, fix: str) -> None:
    done = paratwin("search", *args, "--cluster", "local-cpu-2", "--out", str(tmp_path / "s"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith(fix), done.stdout


@pytest.mark.parametrize(("args", "line"), [
    (("search", "--workload", "gpt2-small", "--cluster", "dgx-a100-8", "--top", "-1"),
     "error: --top: Input should be greater than or equal to 0 (fix: write a number >= 0, not '-1')"),
    (("search", "--workload", "gpt2-small", "--cluster", "dgx-a100-8", "--workers", "two"),
     "error: --workers: Input should be a valid integer, unable to parse string as an integer (fix: write a whole "
     "number, not 'two')"),
    (("search", "--cluster", "dgx-a100-8"),
     "error: --workload: Missing option '--workload' (fix: paratwin search --help lists what it takes)"),
    (("simulate", "plan.yaml", "--bogus"),
     "error: --bogus: No such option: --bogus (Possible options: --out) (fix: paratwin simulate --help lists what it "
     "takes)"),
    (("sweep",), "error: SPEC: Missing argument 'spec' (fix: paratwin sweep --help lists what it takes)"),
    (("bogus",), "error: paratwin: No such command 'bogus' (fix: paratwin --help lists "
                 "what it takes)"),
    (("figures", "--out", "x", "--only"),
     "error: --only: Option '--only' requires an argument (fix: paratwin --help lists what it takes)"),
])
def test_a_usage_error_is_one_line_with_a_fix(args: tuple, line: str) -> None:
    """typer drew a box of several lines with no fix (`--top -1`, `--global-batch 0`, ...; an outside-in review)."""
    done = paratwin(*args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert (done.stdout + done.stderr).strip() == line


def test_help_and_no_arguments_still_print_the_help() -> None:
    assert paratwin("simulate", "--help").returncode == 0
    bare = paratwin()
    assert bare.returncode == 2 and "Commands" in bare.stdout + bare.stderr


def test_a_folder_where_a_file_is_expected_is_named_a_folder(tmp_path: Path) -> None:
    """simulate DIR and a sweep base: DIR said "plan file not found", sweep DIR "sweep spec not found"."""
    refused(paratwin("simulate", str(tmp_path)),
            f"error: {tmp_path}: a folder, not a plan file (fix: pass the path of a .yaml or .json plan)")
    refused(paratwin("sweep", str(tmp_path), "--out", str(tmp_path / "out")),
            f"error: {tmp_path}: a folder, not a sweep spec (fix: pass the path of a YAML sweep spec)")
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: s\nbase: {tmp_path}\n")
    refused(paratwin("sweep", str(spec), "--out", str(tmp_path / "out")),
            f"error: {tmp_path}: a folder, not a plan file (fix: pass the path of a .yaml or .json plan)")
    with pytest.raises(ConfigError, match="a folder, not a cluster file"):
        load_cluster(str(tmp_path))
    with pytest.raises(ConfigError, match="a folder, not a device file"):
        device_from_yaml(tmp_path)


def test_yaml_that_does_not_parse_names_its_line_and_column(tmp_path: Path) -> None:
    """It said only "while scanning for the next token" (an outside-in review): every YAML file read through
    traces/strict_yaml.py (plans, sweep specs, cluster and device files) names where."""
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: s\nbase:\n\tdp: 2\n")  # a tab cannot start a token
    where = "found character '\\t' that cannot start any token (line 3, column 1)"
    refused(paratwin("sweep", str(broken), "--out", str(tmp_path / "out")),
            f"error: {broken}: not valid YAML: {where} (fix: fix the syntax)")
    refused(paratwin("simulate", str(broken)), f"error: {broken}: not valid YAML: {where} (fix: fix the syntax)")
    for read in (lambda: load_cluster(str(broken)), lambda: device_from_yaml(broken)):
        with pytest.raises(ConfigError, match=re.escape(f"not valid YAML: {where}")):
            read()
