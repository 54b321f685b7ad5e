"""The trace data layer on real files: bundles, tables, Kineto import, Chrome export, run records."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from traces.atomic import atomic_path
from traces.bundle import MANIFEST_NAME, ProfileBundle, environment_info, read_bundle, write_bundle
from traces.chrome import instruction_table_to_chrome
from traces.errors import BundleError
from traces.kineto import import_chrome_trace
from traces.runrecord import RunRecord, read_run_record, write_run_record
from traces.schema import (
    COMM_FIT_TABLE,
    COMM_SAMPLE_TABLE,
    INSTRUCTION_TABLE,
    LAYER_TABLE,
    OP_TABLE,
)
from traces.tables import conform, empty_table, read_table, write_table

# --- fixtures ------------------------------------------------------------------------------------


def layer_table(n: int = 3) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rows = {}
    for col, dtype in LAYER_TABLE.columns.items():
        if dtype == "float64":
            rows[col] = rng.random(n) * 1e-3  # awkward floats: the round trip must be exact
        elif dtype == "int64":
            rows[col] = rng.integers(0, 2**40, n)
        elif dtype == "bool":
            rows[col] = [i % 2 == 1 for i in range(n)]
        else:
            rows[col] = [f"{col}-{i}, with comma \"and quote\"" for i in range(n)]
    rows["layer"] = np.arange(n)
    return conform(pd.DataFrame(rows), LAYER_TABLE, "fixture")


def op_table() -> pd.DataFrame:
    return conform(
        pd.DataFrame(
            {
                "layer": [0, 0, 1],
                "phase": ["fwd", "bwd", "unknown"],
                "name": ["aten::addmm", "AddmmBackward0", "aten::relu"],
                "device": ["cpu", "cpu", "cuda"],
                "start_us": [0.0, 12.5, 30.25],
                "dur_us": [10.0, 7.125, 1.0],
                "tid": [1, 1, 7],
                "category": ["cpu_op", "cpu_op", "kernel"],
            }
        ),
        OP_TABLE,
        "fixture",
    )


def comm_tables() -> tuple[pd.DataFrame, pd.DataFrame]:
    samples = pd.DataFrame(
        {
            "primitive": ["all_reduce"] * 2,
            "backend": ["gloo"] * 2,
            "world_size": [2, 2],
            "bytes": [1024, 1 << 20],
            "median_s": [1e-4, 1e-3],
            "min_s": [9e-5, 9e-4],
            "max_s": [2e-4, 2e-3],
            "repeats": [5, 5],
        }
    )
    fits = pd.DataFrame(
        {
            "primitive": ["all_reduce"],
            "backend": ["gloo"],
            "world_size": [2],
            "alpha_s": [1e-4],
            "bandwidth_Bps": [1.1e9],
            "r2": [0.99],
            "note": [""],
        }
    )
    return conform(samples, COMM_SAMPLE_TABLE, "fixture"), conform(fits, COMM_FIT_TABLE, "fixture")


def make_bundle() -> ProfileBundle:
    samples, fits = comm_tables()
    meta = environment_info() | {"workload": {"name": "tiny", "layers": 3}, "settings": {"repeats": 5}}
    return ProfileBundle(meta, layer_table(), op_table(), samples, fits)


def leftovers(parent: Path) -> list[str]:
    """Hidden temporaries that a write could leave beside its target."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def rewrite_member(bundle: Path, name: str, data: bytes) -> None:
    """Replace a bundle file and fix its checksum, as a careless hand edit that keeps it consistent."""
    (bundle / name).write_bytes(data)
    manifest = json.loads((bundle / MANIFEST_NAME).read_text())
    manifest["sha256"][name] = hashlib.sha256(data).hexdigest()
    (bundle / MANIFEST_NAME).write_text(json.dumps(manifest))


def one_line_error(excinfo: pytest.ExceptionInfo, *fragments: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# --- bundles -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_bundle_round_trip(tmp_path: Path, fmt: str) -> None:
    bundle = make_bundle()
    target = write_bundle(bundle, tmp_path / "b", fmt=fmt)
    back = read_bundle(target)

    pd.testing.assert_frame_equal(back.layers, bundle.layers)
    pd.testing.assert_frame_equal(back.ops, bundle.ops)
    pd.testing.assert_frame_equal(back.comm_samples, bundle.comm_samples)
    pd.testing.assert_frame_equal(back.comm_fits, bundle.comm_fits)
    assert back.meta["workload"] == {"name": "tiny", "layers": 3}
    assert back.meta["software"]["torch"] == bundle.meta["software"]["torch"]
    manifest = json.loads((target / MANIFEST_NAME).read_text())
    assert manifest["format"] == "paratwin.profile-bundle" and manifest["version"] == 1
    entry = {"file": f"layers.{fmt}", "schema": "layers", "version": 1, "rows": 3}
    assert manifest["tables"]["layers"] == entry
    assert set(manifest["sha256"]) == {p.name for p in target.iterdir()} - {MANIFEST_NAME}
    assert leftovers(tmp_path) == []


def test_bundle_without_comm_tables_and_with_empty_ops(tmp_path: Path) -> None:
    bundle = ProfileBundle({"workload": {"name": "x"}}, layer_table(2), empty_table(OP_TABLE))
    back = read_bundle(write_bundle(bundle, tmp_path / "b"))
    assert back.comm_samples is None and back.comm_fits is None
    assert len(back.ops) == 0 and list(back.ops.columns) == OP_TABLE.column_names
    assert back.ops["dur_us"].dtype == "float64"
    assert set(back.meta) == {"hardware", "software", "workload", "settings"}


def test_rewriting_a_bundle_replaces_it(tmp_path: Path) -> None:
    write_bundle(make_bundle(), tmp_path / "b", fmt="csv")
    write_bundle(ProfileBundle({}, layer_table(5), empty_table(OP_TABLE)), tmp_path / "b")
    back = read_bundle(tmp_path / "b")
    assert len(back.layers) == 5 and back.comm_fits is None
    assert not list((tmp_path / "b").glob("*.csv"))  # nothing of the old bundle survives
    assert leftovers(tmp_path) == []


def test_rewriting_a_bundle_refuses_and_keeps_a_users_files_in_it(tmp_path: Path) -> None:
    """A second write into a bundle folder deleted every file the bundle writer did not write (a user's
    notes, a subfolder), exit 0 (outside-in review B, item 1): a folder holding any is now refused, whole."""
    from tests.conftest import folder_digest

    target = write_bundle(make_bundle(), tmp_path / "b")
    (target / "notes.txt").write_text("my notes")
    (target / "mine").mkdir()
    (target / "mine" / "data.csv").write_text("x\n")
    before = folder_digest(target)
    with pytest.raises(BundleError) as err:
        write_bundle(ProfileBundle({}, layer_table(5), empty_table(OP_TABLE)), target)
    one_line_error(err, str(target), "holds mine/, notes.txt besides its paratwin.profile-bundle files",
                   "(fix: move them out of the folder or choose another folder (nothing was deleted))")
    assert folder_digest(target) == before and leftovers(tmp_path) == []


def test_a_bundle_folder_keeps_its_lock_across_a_rewrite(tmp_path: Path) -> None:
    """The folder's lock file (every writer's, traces.outdir) is the same file after the folder is swapped
    for the new bundle, so the lock held on it still keeps a second writer out; readers ignore it."""
    import subprocess
    import sys

    from traces.outdir import LOCK_NAME, OutputLock

    target = tmp_path / "b"
    with OutputLock(target):
        inode = (target / LOCK_NAME).stat().st_ino
        write_bundle(make_bundle(), target)
        write_bundle(ProfileBundle({}, layer_table(5), empty_table(OP_TABLE)), target)
        assert (target / LOCK_NAME).stat().st_ino == inode
        other = subprocess.run([sys.executable, "-c", "from traces.outdir import OutputLock; "
                                f"OutputLock({str(target)!r}).acquire()"], capture_output=True, text=True,
                               timeout=60, cwd=Path(__file__).resolve().parents[1])
        assert other.returncode == 1 and "in use by another paratwin process" in other.stderr, other.stderr
    assert len(read_bundle(target).layers) == 5
    write_bundle(make_bundle(), target)  # the lock file alone is no user file
    assert sorted(p.name for p in target.iterdir() if p.name.startswith(".")) == [LOCK_NAME]


def test_write_refuses_to_replace_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.tex").write_text("precious")
    with pytest.raises(BundleError) as err:
        write_bundle(make_bundle(), tmp_path / "home")
    one_line_error(err, "home", "not a paratwin bundle")
    assert (tmp_path / "home" / "thesis.tex").read_text() == "precious"


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(BundleError) as err:
        read_bundle(tmp_path / "nowhere")
    one_line_error(err, "nowhere", "not found")


def test_directory_without_manifest(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    with pytest.raises(BundleError) as err:
        read_bundle(tmp_path / "b")
    one_line_error(err, MANIFEST_NAME, "missing")


def test_manifest_of_wrong_version(tmp_path: Path) -> None:
    target = write_bundle(make_bundle(), tmp_path / "b")
    manifest = json.loads((target / MANIFEST_NAME).read_text())
    manifest["version"] = 99
    (target / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(BundleError) as err:
        read_bundle(target)
    # the fix names the command that writes a readable bundle, with the workload the manifest names
    one_line_error(err, MANIFEST_NAME, "version 99", "(fix: re-profile with this paratwin: paratwin profile "
                   "--workload tiny --micro-batch N --dtype float32 --device cpu|cuda --out DIR)")


def test_a_refused_bundle_is_re_profiled_with_its_workload_options(tmp_path: Path) -> None:
    """A bundle of a workload built with options (a plan's workload_options, which the profiler records) names
    them in its fix: the preset's command wrote a bundle that the plan then refused (review B, section 7)."""
    bundle = make_bundle()
    bundle.meta["workload"]["options"] = {"vocab": 256, "attention": "unfused", "data": "yes", "sizes": [4, 8]}
    bundle.meta["settings"] |= {"micro_batch": 2, "seq": 16, "dtype": "float32", "device": "cpu"}
    target = write_bundle(bundle, tmp_path / "b")
    manifest = json.loads((target / MANIFEST_NAME).read_text())
    manifest["version"] = 99
    (target / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(BundleError) as err:
        read_bundle(target)
    # each value as the command reads it back: a string YAML reads as true is quoted, a list is shell-quoted
    one_line_error(err, MANIFEST_NAME, "(fix: re-profile with this paratwin: paratwin profile --workload tiny "
                   "--micro-batch 2 --seq 16 --workload-option vocab=256 --workload-option attention=unfused "
                   "--workload-option 'data=\"yes\"' --workload-option 'sizes=[4, 8]' --dtype float32 --device cpu "
                   "--out DIR)")


def test_manifest_of_wrong_format_name(tmp_path: Path) -> None:
    target = write_bundle(make_bundle(), tmp_path / "b")
    manifest = json.loads((target / MANIFEST_NAME).read_text())
    manifest["format"] = "someone-elses-format"
    (target / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(BundleError) as err:
        read_bundle(target)
    one_line_error(err, MANIFEST_NAME, "someone-elses-format")


def test_truncated_manifest(tmp_path: Path) -> None:
    target = write_bundle(make_bundle(), tmp_path / "b")
    text = (target / MANIFEST_NAME).read_text()
    (target / MANIFEST_NAME).write_text(text[: len(text) // 2])
    with pytest.raises(BundleError) as err:
        read_bundle(target)
    one_line_error(err, MANIFEST_NAME, "malformed JSON", "(fix: re-profile with this paratwin: paratwin profile "
                   "--workload WORKLOAD")


def test_table_with_missing_column(tmp_path: Path) -> None:
    target = write_bundle(make_bundle(), tmp_path / "b", fmt="csv")
    table = pd.read_csv(target / "layers.csv").drop(columns=["fwd_s"])
    rewrite_member(target, "layers.csv", table.to_csv(index=False).encode())
    with pytest.raises(BundleError) as err:
        read_bundle(target)
    one_line_error(err, "layers.csv", "fwd_s")


def test_csv_table_with_bad_dtype(tmp_path: Path) -> None:
    target = write_bundle(make_bundle(), tmp_path / "b", fmt="csv")
    table = pd.read_csv(target / "ops.csv", dtype=str)
    table.loc[1, "dur_us"] = "fast"
    rewrite_member(target, "ops.csv", table.to_csv(index=False).encode())
    with pytest.raises(BundleError) as err:
        read_bundle(target)
    one_line_error(err, "ops.csv", "dur_us", "row 1", "'fast'")


def test_parquet_table_with_bad_dtype(tmp_path: Path) -> None:
    target = write_bundle(make_bundle(), tmp_path / "b")
    arrow = pq.read_table(target / "layers.parquet")
    bad = arrow.set_column(
        arrow.schema.get_field_index("param_bytes"), "param_bytes", pa.array(["1", "2.5", "3"])
    )
    buffer = pa.BufferOutputStream()
    pq.write_table(bad.replace_schema_metadata(arrow.schema.metadata), buffer)
    rewrite_member(target, "layers.parquet", buffer.getvalue().to_pybytes())
    with pytest.raises(BundleError) as err:
        read_bundle(target)
    one_line_error(err, "layers.parquet", "param_bytes", "non-integer '2.5'")


def test_changed_file_fails_its_checksum(tmp_path: Path) -> None:
    target = write_bundle(make_bundle(), tmp_path / "b")
    data = (target / "ops.parquet").read_bytes()
    (target / "ops.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(BundleError) as err:
        read_bundle(target)
    one_line_error(err, "ops.parquet", "checksum", "(fix: re-profile with this paratwin: paratwin profile "
                   "--workload tiny")


def test_missing_table_file(tmp_path: Path) -> None:
    target = write_bundle(make_bundle(), tmp_path / "b")
    (target / "comm_fits.parquet").unlink()
    with pytest.raises(BundleError) as err:
        read_bundle(target)
    one_line_error(err, "comm_fits.parquet", "missing")


def test_failed_write_keeps_existing_bundle(tmp_path: Path) -> None:
    good = make_bundle()
    write_bundle(good, tmp_path / "b")
    before = {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()}

    # Layers are written first; the op table then fails to serialise (an object column Parquet
    # cannot type), in the middle of the bundle.
    ops = good.ops.copy()
    ops["annotation"] = [object(), 1, "x"]
    with pytest.raises(BundleError) as err:
        write_bundle(ProfileBundle(good.meta, good.layers, ops), tmp_path / "b")
    one_line_error(err, "ops.parquet", "serialise")
    # Every table is written, then the manifest fails: metadata JSON cannot hold.
    with pytest.raises(BundleError) as err:
        write_bundle(ProfileBundle({"settings": {"bad": {1, 2}}}, good.layers, good.ops), tmp_path / "b")
    one_line_error(err, MANIFEST_NAME, "JSON")

    assert {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()} == before
    pd.testing.assert_frame_equal(read_bundle(tmp_path / "b").layers, good.layers)
    assert leftovers(tmp_path) == []


def test_failed_first_write_leaves_nothing(tmp_path: Path) -> None:
    bad_layers = layer_table().drop(columns=["bwd_s"])
    with pytest.raises(BundleError) as err:
        write_bundle(ProfileBundle({}, bad_layers, op_table()), tmp_path / "b", fmt="csv")
    one_line_error(err, "layers.csv", "bwd_s")
    assert list(tmp_path.iterdir()) == []


def test_interrupted_file_write_keeps_old_file(tmp_path: Path) -> None:
    target = tmp_path / "t.bin"
    target.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt), atomic_path(target) as tmp:
        tmp.write_bytes(b"half of the n")
        raise KeyboardInterrupt  # the user pressed Ctrl-C mid-write
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["t.bin"]


# --- single tables -------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_table_round_trip_and_version_check(tmp_path: Path, suffix: str) -> None:
    path = write_table(op_table(), OP_TABLE, tmp_path / f"ops{suffix}")
    pd.testing.assert_frame_equal(read_table(path, OP_TABLE), op_table())
    with pytest.raises(BundleError) as err:
        read_table(path, LAYER_TABLE)
    one_line_error(err, f"ops{suffix}", "'ops'", "'layers'")


def test_csv_sidecar_of_newer_version(tmp_path: Path) -> None:
    path = write_table(op_table(), OP_TABLE, tmp_path / "ops.csv")
    sidecar = tmp_path / "ops.csv.schema.json"
    stamp = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps(stamp | {"version": 2}))
    with pytest.raises(BundleError) as err:
        read_table(path, OP_TABLE)
    one_line_error(err, "ops.csv", "version 2")


def test_table_errors(tmp_path: Path) -> None:
    with pytest.raises(BundleError) as err:
        read_table(tmp_path / "absent.parquet", OP_TABLE)
    one_line_error(err, "absent.parquet", "not found")
    with pytest.raises(BundleError) as err:
        write_table(op_table(), OP_TABLE, tmp_path / "ops.xlsx")
    one_line_error(err, "ops.xlsx", ".parquet or .csv")
    op_table().to_parquet(tmp_path / "foreign.parquet")
    with pytest.raises(BundleError) as err:
        read_table(tmp_path / "foreign.parquet", OP_TABLE)
    one_line_error(err, "foreign.parquet", "schema stamp")
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(BundleError) as err:
        read_table(tmp_path / "junk.parquet", OP_TABLE)
    one_line_error(err, "junk.parquet", "Parquet")


def test_conform_casts_keeps_extras_and_fills_defaults() -> None:
    raw = op_table().drop(columns=["category"]).astype({"tid": "float64", "start_us": "string"})
    raw["source"] = "test"
    table = conform(raw, OP_TABLE, "raw")
    assert list(table.columns) == OP_TABLE.column_names + ["source"]
    assert table["tid"].dtype == "int64" and table["start_us"].dtype == "float64"
    assert (table["category"] == "").all()
    with pytest.raises(BundleError) as err:
        conform(raw.assign(layer=[0, 1.5, 2]), OP_TABLE, "raw")
    one_line_error(err, "raw", "'layer'", "1.5")
    with pytest.raises(BundleError) as err:
        conform(raw.assign(tid=[1, None, 2]), OP_TABLE, "raw")
    one_line_error(err, "'tid'", "row 1", "empty")


# --- Kineto import -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kineto_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 32), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(32, 4))]
    x = torch.randn(8, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("forward"):
            for i, layer in enumerate(layers):
                with record_function(f"layer{i}"):
                    x = layer(x)
        x.sum().backward()
    path = tmp_path_factory.mktemp("kineto") / "tiny.pt.trace.json"
    prof.export_chrome_trace(str(path))
    return path


def test_import_profiler_trace(kineto_trace: Path) -> None:
    ops = import_chrome_trace(kineto_trace)
    assert list(ops.columns) == OP_TABLE.column_names
    cpu_ops = ops[ops["category"] == "cpu_op"]
    assert len(cpu_ops) > 10 and (cpu_ops["device"] == "cpu").all()
    assert (ops["dur_us"] >= 0).all() and (ops["start_us"] >= 0).all()
    addmm = ops[ops["name"] == "aten::addmm"]
    assert len(addmm) == 2 and (addmm["dur_us"] > 0).all()
    assert sorted(addmm["layer"]) == [0, 1] and (addmm["phase"] == "fwd").all()
    backward = ops[ops["name"].str.startswith("autograd::engine::evaluate_function")]
    assert len(backward) >= 2 and (backward["phase"] == "bwd").all()
    assert set(ops["phase"]) >= {"fwd", "bwd"}
    assert ops["start_us"].is_monotonic_increasing


def test_import_gzipped_and_bare_list(kineto_trace: Path, tmp_path: Path) -> None:
    reference = import_chrome_trace(kineto_trace)
    gz = tmp_path / "trace.json.gz"
    gz.write_bytes(gzip.compress(kineto_trace.read_bytes()))
    pd.testing.assert_frame_equal(import_chrome_trace(gz), reference)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(json.loads(kineto_trace.read_text())["traceEvents"]))
    pd.testing.assert_frame_equal(import_chrome_trace(bare), reference)


def test_import_gpu_shaped_trace(tmp_path: Path) -> None:
    # No GPU here: the event layout below is the one torch.profiler writes for CUDA runs (cpu_op
    # -> cuda_runtime launch -> kernel linked by "correlation"; memcpy on a stream; B/E spans).
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: AddmmBackward0",
         "pid": 10, "tid": 11, "ts": 1000.0, "dur": 50.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 10, "tid": 11,
         "ts": 1010.0, "dur": 5.0, "args": {"correlation": 77}},
        {"ph": "X", "cat": "kernel", "name": "ampere_sgemm_64x32", "pid": 0, "tid": 7,
         "ts": 1020.0, "dur": 12.5, "args": {"correlation": 77, "stream": 7, "device": 0}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "pid": 0,
         "tid": "stream 8", "ts": 1040.0, "dur": 3.0, "args": {"correlation": 78}},
        {"ph": "B", "cat": "user_annotation", "name": "encoder.layer.3 forward", "pid": 10, "tid": 11,
         "ts": 900.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 10, "tid": 11, "ts": 910.0, "dur": 20.0},
        {"ph": "E", "pid": 10, "tid": 11, "ts": 990.0},
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "x", "ts": 0,
         "dur": 9e9},
        {"ph": "s", "cat": "ac2g", "id": 77, "pid": 10, "tid": 11, "ts": 1010.0},
    ]
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"traceEvents": events}))
    ops = import_chrome_trace(path).set_index("name")
    assert len(ops) == 6
    kernel = ops.loc["ampere_sgemm_64x32"]
    assert (kernel["device"], kernel["phase"], kernel["tid"], kernel["dur_us"]) == ("cuda", "bwd", 7, 12.5)
    assert ops.loc["Memcpy HtoD (Pinned -> Device)", "tid"] == 8
    assert ops.loc["cudaLaunchKernel", "device"] == "cpu"
    assert tuple(ops.loc["aten::mm", ["phase", "layer"]]) == ("fwd", 3)
    assert ops.loc["encoder.layer.3 forward", "dur_us"] == 90.0
    assert ops["start_us"].min() == 0.0


def test_import_bad_traces(tmp_path: Path, kineto_trace: Path) -> None:
    with pytest.raises(BundleError) as err:
        import_chrome_trace(tmp_path / "absent.json")
    one_line_error(err, "absent.json", "not found")
    text = kineto_trace.read_text()
    (tmp_path / "cut.json").write_text(text[: len(text) // 2])
    with pytest.raises(BundleError) as err:
        import_chrome_trace(tmp_path / "cut.json")
    one_line_error(err, "cut.json", "malformed JSON")
    data = gzip.compress(text.encode())
    (tmp_path / "cut.json.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(BundleError) as err:
        import_chrome_trace(tmp_path / "cut.json.gz")
    one_line_error(err, "cut.json.gz", "gzip")
    (tmp_path / "other.json").write_text(json.dumps({"events": []}))
    with pytest.raises(BundleError) as err:
        import_chrome_trace(tmp_path / "other.json")
    one_line_error(err, "other.json", "traceEvents")


# --- Chrome export and run records ---------------------------------------------------------------


def instruction_table() -> pd.DataFrame:
    def row(rank, index, kind, stream, start, end, parent=-1, layer=-1, nbytes=0, name=""):
        return {
            "rank": rank, "index": index, "kind": kind, "stage": rank, "microbatch": 0, "stream": stream,
            "start_s": start, "end_s": end, "bytes": nbytes, "mem_after": 1000 * (index + 1),
            "parent": parent, "layer": layer, "name": name,
        }

    rows = [
        row(0, 0, "FWD", "compute", 0.000, 0.010),
        row(0, 100, "FWD", "compute", 0.000, 0.004, parent=0, layer=0),
        row(0, 101, "FWD", "compute", 0.004, 0.010, parent=0, layer=1),
        row(0, 102, "ALLREDUCE", "collective", 0.006, 0.008, parent=0, layer=1, nbytes=512, name="tp ar"),
        row(0, 1, "SEND_ACT", "p2p_send", 0.010, 0.011, nbytes=4096),
        row(1, 0, "RECV_ACT", "p2p_recv", 0.000, 0.011, nbytes=4096),
        row(1, 1, "FWD", "compute", 0.011, 0.020),
    ]
    return conform(pd.DataFrame(rows), INSTRUCTION_TABLE, "fixture")


@pytest.mark.parametrize("name", ["timeline.json", "timeline.json.gz"])
def test_chrome_export(tmp_path: Path, name: str) -> None:
    path = instruction_table_to_chrome(instruction_table(), tmp_path / name, time_offset_s=1.0)
    raw = path.read_bytes()
    trace = json.loads(gzip.decompress(raw) if name.endswith(".gz") else raw)
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}

    assert processes == {0: "rank 0", 1: "rank 1"}
    assert {(e["pid"], e["tid"]) for e in spans} == set(threads)
    assert set(threads.values()) == {"compute", "collective", "p2p_send", "p2p_recv"}
    assert len(spans) == len(instruction_table())
    forward = next(e for e in spans if e["pid"] == 0 and e["name"] == "FWD s0 mb0")
    assert (forward["ts"], forward["dur"]) == (1_000_000.0, 10_000.0)  # seconds -> us, offset applied
    children = [e for e in spans if e["args"]["parent"] == 0 and e["pid"] == 0]
    for child in children:  # each child lies inside its parent; same-stream children share its track
        assert forward["ts"] <= child["ts"] and child["ts"] + child["dur"] <= forward["ts"] + forward["dur"]
    assert {threads[(0, c["tid"])] for c in children} == {"compute", "collective"}
    counters = [e for e in events if e["ph"] == "C"]
    assert len(counters) == 4 and all(e["args"]["mem_after"] > 0 for e in counters)


def test_chrome_export_rejects_bad_tables(tmp_path: Path) -> None:
    bad = instruction_table()
    bad.loc[0, "end_s"] = -1.0
    with pytest.raises(BundleError) as err:
        instruction_table_to_chrome(bad, tmp_path / "t.json")
    one_line_error(err, "t.json", "row 0")
    with pytest.raises(BundleError) as err:
        instruction_table_to_chrome(instruction_table().drop(columns=["stream"]), tmp_path / "t.json")
    one_line_error(err, "t.json", "stream")
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_run_record_round_trip(tmp_path: Path, fmt: str) -> None:
    record = RunRecord(instruction_table(), {"iteration_s": 0.02, "plan": {"pp": 2}})
    target = write_run_record(record, tmp_path / "run", fmt=fmt)
    back = read_run_record(target)
    pd.testing.assert_frame_equal(back.instructions, record.instructions)
    assert back.summary == record.summary
    assert json.loads((target / "trace.json").read_text())["traceEvents"]
    assert "trace.json" in json.loads((target / MANIFEST_NAME).read_text())["sha256"]
    with pytest.raises(BundleError) as err:
        read_bundle(target)  # a run record is not a profile bundle, and the error says so
    one_line_error(err, MANIFEST_NAME, "paratwin.run-record")


def test_a_bundle_is_read_from_a_string_path(gpt_tiny_profile: Path) -> None:
    """read_bundle("...") as docs/traces.md calls it was a TypeError (str / str) in its layer-row check."""
    from traces.bundle import read_bundle

    assert read_bundle(str(gpt_tiny_profile)).layers.equals(read_bundle(gpt_tiny_profile).layers)
