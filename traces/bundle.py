"""Profile bundles: a directory of typed tables plus a ``manifest.json`` that describes them.

    my-bundle/
      manifest.json          format, version, meta (hardware, software, workload, settings),
                             the table list (file, schema, version, rows) and a SHA-256 per file
      layers.parquet         LAYER_TABLE            (or .csv + .csv.schema.json with fmt="csv")
      ops.parquet            OP_TABLE               (may have no rows)
      comm_samples.parquet   COMM_SAMPLE_TABLE      (optional)
      comm_fits.parquet      COMM_FIT_TABLE         (optional)
      process_layers.parquet PROCESS_LAYER_TABLE    (optional: each co-located profiling process's medians)

A bundle is written to a temporary directory and renamed into place, so a failed write leaves
no partial bundle and keeps the bundle that was there. Only an empty folder or an earlier table
directory that holds nothing but its own files (and the folder's ``.paratwin.lock``, which is kept) is
replaced: a user's file in it is refused, never deleted. Reading checks format, version, checksums,
columns and dtypes and reports the first problem as a one-line BundleError naming the file.

``write_table_dir`` / ``read_table_dir`` are the format-independent machinery, shared with run
records and comm benchmark results.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import shlex
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from traces.atomic import atomic_directory, atomic_write_text
from traces.errors import BundleError, ConfigError
from traces.outdir import LOCK_NAME
from traces.schema import (
    COMM_BENCH_FORMAT,
    COMM_FIT_TABLE,
    COMM_SAMPLE_TABLE,
    LAYER_TABLE,
    OP_TABLE,
    PROCESS_LAYER_TABLE,
    PROFILE_BUNDLE_FORMAT,
    PROFILE_BUNDLE_VERSION,
    RUN_RECORD_FORMAT,
    TableSchema,
)
from traces.tables import check_stamp, conform, csv_sidecar, empty_table, read_table, write_table

MANIFEST_NAME = "manifest.json"
TABLE_FORMATS = ("parquet", "csv")
META_SECTIONS = ("hardware", "software", "workload", "settings")


@dataclass
class ProfileBundle:
    meta: dict  # {"hardware": {...}, "software": {...}, "workload": {...}, "settings": {...}}
    layers: pd.DataFrame  # LAYER_TABLE
    ops: pd.DataFrame = field(default_factory=lambda: _empty(OP_TABLE))  # OP_TABLE, may be empty
    comm_samples: pd.DataFrame | None = None  # COMM_SAMPLE_TABLE
    comm_fits: pd.DataFrame | None = None  # COMM_FIT_TABLE
    process_layers: pd.DataFrame | None = None  # PROCESS_LAYER_TABLE (None: one process, or an older bundle)


def write_bundle(bundle: ProfileBundle, directory: Path, fmt: str = "parquet") -> Path:
    """Write ``bundle`` atomically to ``directory`` (replacing a bundle already there)."""
    if not isinstance(bundle.meta, dict):
        raise BundleError(Path(directory) / MANIFEST_NAME, "meta must be a dict")
    meta = {section: {} for section in META_SECTIONS} | bundle.meta
    for section in META_SECTIONS:
        if not isinstance(meta[section], dict):
            raise BundleError(Path(directory) / MANIFEST_NAME, f"meta[{section!r}] must be a dict")
    tables = {
        "layers": (bundle.layers, LAYER_TABLE),
        "ops": (_empty(OP_TABLE) if bundle.ops is None else bundle.ops, OP_TABLE),
        "comm_samples": (bundle.comm_samples, COMM_SAMPLE_TABLE),
        "comm_fits": (bundle.comm_fits, COMM_FIT_TABLE),
        "process_layers": (bundle.process_layers, PROCESS_LAYER_TABLE),
    }
    extra = {"meta": meta}
    return write_table_dir(directory, PROFILE_BUNDLE_FORMAT, PROFILE_BUNDLE_VERSION, tables, extra, fmt,
                           extra_files=lambda tmp: _write_op_timeline(bundle.ops, tmp))


OP_TIMELINE_NAME = "ops.trace.json"


def _write_op_timeline(ops: pd.DataFrame | None, directory: Path) -> list[str]:
    """The per-op table as a Chrome trace, for Perfetto (nothing when there are no ops)."""
    from traces.chrome import op_table_events, write_chrome_trace

    if ops is None or not len(ops):
        return []
    write_chrome_trace(op_table_events(conform(ops, OP_TABLE, directory / OP_TIMELINE_NAME)),
                       directory / OP_TIMELINE_NAME)
    return [OP_TIMELINE_NAME]


def read_bundle(directory: str | Path) -> ProfileBundle:
    directory = Path(directory)  # a string path was a TypeError in the checks below (docs/traces.md passes one)
    schemas = {
        "layers": LAYER_TABLE,
        "ops": OP_TABLE,
        "comm_samples": COMM_SAMPLE_TABLE,
        "comm_fits": COMM_FIT_TABLE,
        "process_layers": PROCESS_LAYER_TABLE,
    }
    manifest, tables = read_table_dir(
        directory, PROFILE_BUNDLE_FORMAT, PROFILE_BUNDLE_VERSION, schemas, required=("layers", "ops")
    )
    meta = manifest.get("meta")
    manifest_path = Path(directory) / MANIFEST_NAME
    if not isinstance(meta, dict) or any(not isinstance(meta.get(s), dict) for s in META_SECTIONS):
        sections = ", ".join(META_SECTIONS)
        raise BundleError(manifest_path, f"'meta' needs object sections {sections}")
    if "meta" not in manifest["extra_sha256"]:
        raise BundleError(manifest_path, "'meta' is not covered by 'extra_sha256' (re-create the bundle)")
    _check_layer_rows(tables["layers"], meta["settings"], directory / manifest["tables"]["layers"]["file"])
    return ProfileBundle(
        meta, tables["layers"], tables["ops"], tables.get("comm_samples"), tables.get("comm_fits"),
        tables.get("process_layers"),
    )


def _check_layer_rows(layers: pd.DataFrame, settings: dict, path: Path) -> None:
    """One row per layer, no duplicates and no gaps, over the span the settings say was profiled."""
    found = sorted(int(v) for v in layers["layer"])
    span = settings.get("layers")
    first = int(span[0]) if isinstance(span, list) and len(span) == 2 else (found[0] if found else 0)
    expected = list(range(first, int(span[1]))) if isinstance(span, list) and len(span) == 2 \
        else list(range(first, first + len(found)))
    if found != expected:
        missing = sorted(set(expected) - set(found))
        extra = sorted({v for v in found if found.count(v) > 1} | (set(found) - set(expected)))
        problem = (f"layer(s) {missing[:8]} missing" if missing else f"layer(s) {extra[:8]} duplicated or "
                   "outside the profiled span")
        raise BundleError(path, f"{problem}; the table must hold one row per layer "
                                f"{expected[0] if expected else 0}..{expected[-1] if expected else 0} "
                                "(re-profile)")


# --- the generic table directory -----------------------------------------------------------------


def write_table_dir(
    directory: Path,
    format_name: str,
    version: int,
    tables: dict[str, tuple[pd.DataFrame | None, TableSchema]],
    extra: dict,
    fmt: str = "parquet",
    extra_files: Callable[[Path], list[str]] | None = None,
) -> Path:
    """Write tables (None ones skipped) and a manifest into ``directory``, atomically.

    ``extra`` is merged into the manifest (it must be JSON); ``extra_files`` may write more files
    into the temporary directory and returns their names, which then get checksums too.
    """
    directory = Path(directory)
    if fmt not in TABLE_FORMATS:
        raise ConfigError("fmt", f"unknown table format {fmt!r}", f"use one of {', '.join(TABLE_FORMATS)}")
    check_replaceable(directory)
    with atomic_directory(directory, keep=(LOCK_NAME,)) as tmp:
        entries: dict[str, dict] = {}
        files: list[str] = []
        for key, (df, schema) in tables.items():
            if df is None:
                continue
            name = f"{key}.{fmt}"
            table = conform(df, schema, directory / name)  # errors name the final path, not tmp
            try:
                write_table(table, schema, tmp / name)
            except BundleError as exc:
                raise BundleError(directory / name, exc.problem) from None
            entries[key] = {
                "file": name, "schema": schema.name, "version": schema.version, "rows": len(table)
            }
            files += [name, csv_sidecar(Path(name)).name] if fmt == "csv" else [name]
        if extra_files is not None:
            files += extra_files(tmp)
        manifest = {
            "format": format_name,
            "version": version,
            "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "table_format": fmt,
            **extra,
            "tables": entries,
            "sha256": {name: _sha256(tmp / name) for name in files},
        }
        try:
            text = json.dumps(manifest, indent=1, allow_nan=False, default=_json_default)
            # The metadata steers predictions (a bundle's micro-batch scales every time), so it is
            # checksummed like the tables: a hand edit of it is refused on reading.
            manifest["extra_sha256"] = {key: _json_sha256(json.loads(text)[key]) for key in extra}
            text = json.dumps(manifest, indent=1, allow_nan=False, default=_json_default)
        except (TypeError, ValueError) as exc:
            problem = f"metadata cannot be stored as JSON: {exc}"
            raise BundleError(directory / MANIFEST_NAME, problem) from None
        atomic_write_text(tmp / MANIFEST_NAME, text + "\n")
        check_replaceable(directory)  # again, just before the swap: a file put there while the tables were written
    return directory


def read_table_dir(
    directory: Path,
    format_name: str,
    version: int,
    schemas: dict[str, TableSchema],
    required: tuple[str, ...] = (),
) -> tuple[dict, dict[str, pd.DataFrame]]:
    """Read and check a directory written by ``write_table_dir``: (manifest, tables by key)."""
    directory = Path(directory)
    manifest = read_manifest(directory, format_name, version)
    manifest_path = directory / MANIFEST_NAME
    entries = manifest.get("tables")
    sums = manifest.get("sha256")
    if not isinstance(entries, dict) or not isinstance(sums, dict):
        raise BundleError(manifest_path, "'tables' and 'sha256' must be JSON objects")
    for key in required:
        if key not in entries:
            raise BundleError(manifest_path, f"lists no {key!r} table")
    _check_extra_sums(manifest, manifest_path)
    for key, entry in entries.items():
        # Every table file must be covered by a checksum: a deleted sha256 entry would otherwise
        # let a changed table through unchecked.
        file = entry.get("file") if isinstance(entry, dict) else None
        if isinstance(file, str) and file not in sums:
            raise BundleError(manifest_path, f"has no sha256 entry for table {key!r} ({file}); the bundle was "
                                             "edited after writing (re-create it)")
    for name, digest in sums.items():
        path = _member(directory, name, manifest_path)
        if not path.is_file():
            raise BundleError(path, f"listed in {MANIFEST_NAME} but missing")
        if _sha256(path) != digest:
            problem = f"checksum differs from {MANIFEST_NAME} (file changed or truncated after writing)"
            raise BundleError(path, problem, remake_hint(format_name, manifest))
    tables: dict[str, pd.DataFrame] = {}
    for key, schema in schemas.items():
        entry = entries.get(key)
        if entry is None:
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
            raise BundleError(manifest_path, f"table entry {key!r} must be an object with a 'file'")
        path = _member(directory, entry["file"], manifest_path)
        check_stamp(entry, schema, path)
        table = read_table(path, schema)
        if entry.get("rows") is not None and entry["rows"] != len(table):
            raise BundleError(path, f"holds {len(table)} rows, {MANIFEST_NAME} says {entry['rows']}")
        tables[key] = table
    return manifest, tables


def read_manifest(directory: Path, format_name: str, version: int) -> dict:
    directory = Path(directory)
    if not directory.exists():
        raise BundleError(directory, "directory not found")
    if not directory.is_dir():
        raise BundleError(directory, f"not a directory (a {format_name} is a directory with {MANIFEST_NAME})")
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise BundleError(path, f"missing; {directory} is not a {format_name}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        problem = f"malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        raise BundleError(path, problem, remake_hint(format_name)) from None
    except UnicodeDecodeError:
        raise BundleError(path, "not UTF-8 text") from None
    if not isinstance(manifest, dict):
        raise BundleError(path, "must hold a JSON object")
    if manifest.get("format") != format_name:
        raise BundleError(path, f"format is {manifest.get('format')!r}, expected {format_name!r}")
    if manifest.get("version") != version:
        found = manifest.get("version")
        raise BundleError(path, f"version {found!r} is not supported; this paratwin reads version {version}",
                          remake_hint(format_name, manifest))
    return manifest


def remake_hint(format_name: str, manifest: dict | None = None) -> str:
    """How to write a table directory of ``format_name`` again with this paratwin: no migration exists for
    one (``migrate-plan`` is for plans), so a refused one is measured again. The profile command takes its
    options from the manifest's metadata where that can be read (not from malformed JSON)."""
    if format_name == PROFILE_BUNDLE_FORMAT:
        meta = _section(manifest, "meta")
        workload, settings = _section(meta, "workload"), _section(meta, "settings")
        device = str(settings.get("device", "cpu|cuda"))
        return "re-profile with this paratwin: " + profile_command(
            str(workload.get("name", "WORKLOAD")), settings.get("micro_batch", "N"), _section(workload, "options"),
            str(settings.get("dtype", "float32")), "cuda" if device.startswith("cuda") else device, settings.get("seq"))
    if format_name == RUN_RECORD_FORMAT:
        return "run the plan again with this paratwin: paratwin run PLAN --out DIR"
    if format_name == COMM_BENCH_FORMAT:
        return "measure again with this paratwin: paratwin commbench --out DIR"
    return "write it again with this paratwin"


def profile_command(workload: str, micro_batch: object, options: Mapping[str, object] | None = None,
                    dtype: str = "float32", device: str = "cpu", seq: object = None) -> str:
    """The ``paratwin profile`` command that measures ``workload`` built with ``options`` (a plan's
    ``workload_options``), for a refusal to print: each option is a ``--workload-option`` written so that the
    command reads back the same value, so the printed command writes the bundle the plan asks for."""
    options = dict(options or {})
    words = ["paratwin profile --workload", workload, "--micro-batch", str(micro_batch)]
    if seq is not None and "seq" not in options:
        words += ["--seq", str(seq)]
    for key, value in options.items():
        words += ["--workload-option", shlex.quote(f"{key}={_as_yaml(value)}")]
    return " ".join([*words, "--dtype", dtype, "--device", device, "--out DIR"])


def _as_yaml(value: object) -> str:
    """``value`` as text the CLI reads back (as YAML) as the same value: JSON, except a string YAML reads
    as itself (unfused, wikitext-2); one it would read as something else ("yes", "128") stays quoted."""
    try:
        plain = isinstance(value, str) and yaml.safe_load(value) == value
    except yaml.YAMLError:
        plain = False
    return str(value) if plain else json.dumps(value)


def _section(mapping: object, key: str) -> dict:
    """``mapping[key]`` where both are JSON objects, else {}: a manifest is read as its writer (or a user's
    editor) left it."""
    value = mapping.get(key) if isinstance(mapping, dict) else None
    return value if isinstance(value, dict) else {}


def check_replaceable(directory: Path) -> dict | None:
    """Refuse to overwrite anything but an empty directory or an earlier paratwin table directory that holds
    only its own files: replacing a directory deletes its old contents, and neither a mistyped path nor a
    user's notes kept beside a bundle may be lost (they were, with exit 0). Its own files are those its
    manifest lists, the manifest, and the folder's lock file (``traces.outdir``, carried into the new one).
    Returns the manifest of the table directory that would be replaced (None: nothing is replaced)."""
    if not directory.exists():
        return None
    if not directory.is_dir():
        raise BundleError(directory, "exists and is not a directory; choose another path")
    entries = {path.name: path for path in directory.iterdir() if path.name != LOCK_NAME}
    if not entries:
        return None
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        manifest = None
    if not (isinstance(manifest, dict) and str(manifest.get("format", "")).startswith("paratwin.")):
        raise BundleError(
            directory, "exists and is not a paratwin bundle; refusing to replace it (choose a new path)"
        )
    sums = manifest.get("sha256")
    own = {MANIFEST_NAME, *(sums if isinstance(sums, dict) else ())}
    foreign = sorted(name + "/" * entries[name].is_dir() for name in entries if name not in own)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise BundleError(directory, f"holds {shown} besides its {manifest['format']} files; writing it again "
                                     "would delete them",
                          "move them out of the folder or choose another folder (nothing was deleted)")
    return manifest


def check_profile_target(directory: Path, workload: str, force: bool = False) -> None:
    """Before profiling, refuse what writing ``workload``'s bundle to ``directory`` would lose: what
    ``check_replaceable`` refuses (it was found only after the profile), and, unless ``force``, a paratwin
    folder that is not a profile of ``workload`` (another workload's bundle, a run record), which was replaced
    silently. Re-profiling a workload into its own bundle replaces it, as before."""
    directory = Path(directory)
    manifest = check_replaceable(directory)
    if manifest is None or force:
        return
    meta = _section(manifest, "meta") if manifest.get("format") == PROFILE_BUNDLE_FORMAT else {}
    held = _section(meta, "workload").get("name")
    if held == workload:
        return
    what = f"the profile of {held}" if held else f"a {manifest.get('format')} folder"
    raise ConfigError("--out", f"{directory} holds {what}, not a profile of {workload}",
                      "choose another folder, or pass --force to replace it (nothing was overwritten)")


def _member(directory: Path, name: object, manifest_path: Path) -> Path:
    # Manifest entries are plain file names: a manifest must not point outside its directory.
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise BundleError(manifest_path, f"file entry {name!r} is not a plain file name")
    return directory / name


def _check_extra_sums(manifest: dict, manifest_path: Path) -> None:
    sums = manifest.get("extra_sha256")
    if not isinstance(sums, dict) or not sums:
        raise BundleError(manifest_path, "has no 'extra_sha256' (written by an older paratwin, or edited); "
                                         "re-create it with this paratwin")
    for key, digest in sums.items():
        if key not in manifest or _json_sha256(manifest[key]) != digest:
            raise BundleError(manifest_path, f"{key!r} differs from its checksum (edited after writing; "
                                             "re-create it rather than editing it)")


def _json_sha256(value: object) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _json_default(value: object) -> object:
    # numpy scalars and paths are common in metadata; anything else is a caller's mistake.
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} value {value!r:.60} is not JSON")


def _empty(schema: TableSchema) -> pd.DataFrame:
    return empty_table(schema)


# --- environment facts ---------------------------------------------------------------------------


def environment_info() -> dict:
    """{"hardware": {...}, "software": {...}} of this machine, ready to merge into bundle meta."""
    hardware: dict = {
        "hostname": socket.gethostname(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "cuda_devices": [],
        "cuda_device_name": None,
    }
    software: dict = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "pandas": pd.__version__,
        "paratwin": _package_version("paratwin"),
    }
    try:
        import torch
        import torch.distributed as dist
    except ImportError:  # the data layer works without torch; the facts then say so
        software["torch"] = None
        return {"hardware": hardware, "software": software}
    software["torch"] = torch.__version__
    software["torch_cuda"] = torch.version.cuda
    software["gloo_available"] = bool(dist.is_available() and dist.is_gloo_available())
    software["nccl_available"] = bool(dist.is_available() and dist.is_nccl_available())
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            hardware["cuda_devices"].append(
                {
                    "index": index,
                    "name": props.name,
                    "total_memory_bytes": int(props.total_memory),
                    "capability": f"{props.major}.{props.minor}",
                    "multiprocessors": int(props.multi_processor_count),
                }
            )
        if hardware["cuda_devices"]:
            hardware["cuda_device_name"] = hardware["cuda_devices"][0]["name"]
    return {"hardware": hardware, "software": software}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None
