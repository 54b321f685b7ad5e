"""Typed tables on disk: check a DataFrame against a TableSchema, write it, read it back.

Parquet files carry their schema name and version in the file's key-value metadata; a CSV file
carries them in a sidecar ``<file>.csv.schema.json``. Every problem is a one-line BundleError that
names the file (or the table's source) and what is wrong with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from traces.atomic import atomic_path, atomic_write_text
from traces.errors import BundleError
from traces.schema import TableSchema

SCHEMA_METADATA_KEY = b"paratwin.schema"
TABLE_SUFFIXES = (".parquet", ".csv")
_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}


def empty_table(schema: TableSchema) -> pd.DataFrame:
    return pd.DataFrame({col: pd.Series(dtype=dtype) for col, dtype in schema.columns.items()})


def conform(df: pd.DataFrame, schema: TableSchema, source: object) -> pd.DataFrame:
    """Return ``df`` with the schema's columns first, in order and cast to their dtypes.

    Columns the schema does not know are kept after them, unchanged. Columns the schema gives a
    default for may be absent and are then filled in. The index is kept.
    """
    if not isinstance(df, pd.DataFrame):
        raise BundleError(source, f"table {schema.name!r} must be a DataFrame, not {type(df).__name__}")
    duplicated = sorted({str(c) for c in df.columns[df.columns.duplicated()]})
    if duplicated:
        raise BundleError(source, f"table {schema.name!r} has duplicate column(s) {', '.join(duplicated)}")
    missing = [c for c in schema.columns if c not in df.columns and c not in schema.defaults]
    if missing:
        raise BundleError(
            source, f"table {schema.name!r} v{schema.version} lacks column(s) {', '.join(missing)}"
        )
    columns: dict[object, pd.Series] = {}
    for col, dtype in schema.columns.items():
        if col in df.columns:
            columns[col] = _cast(df[col], dtype, col, schema, source)
        else:
            columns[col] = pd.Series([schema.defaults[col]] * len(df), index=df.index, dtype=dtype)
    for col in df.columns:
        if col not in schema.columns:
            columns[col] = df[col]
    _check_ranges(columns, schema, source)
    return pd.DataFrame(columns, index=df.index)


def _check_ranges(columns: dict[object, pd.Series], schema: TableSchema, source: object) -> None:
    """Refuse negative (and, where the schema asks, NaN or infinite) values: a negative time in a
    profile would otherwise surface much later as a simulator traceback, or as a wrong prediction."""
    rules = [(col, True) for col in schema.finite_nonnegative] + [(col, False) for col in schema.nonnegative]
    for col, finite in rules:
        values = columns[col].to_numpy(dtype="float64")
        bad = values < 0
        if finite:
            bad |= ~np.isfinite(values)
        if bad.any():
            row = int(np.argmax(bad))
            need = "finite and >= 0" if finite else ">= 0 (or NaN)"
            raise BundleError(source, f"table {schema.name!r} row {row} column {col!r} holds {float(values[row])!r}; "
                                      f"it must be {need} (re-measure, or correct the value)")


def write_table(df: pd.DataFrame, schema: TableSchema, path: Path) -> Path:
    """Check ``df`` and write it atomically as Parquet or CSV, chosen by the suffix of ``path``."""
    path = Path(path)
    fmt = _format_of(path)
    table = conform(df, schema, path).reset_index(drop=True)
    stamp = _schema_stamp(schema)
    if fmt == ".parquet":
        _write_parquet(table, stamp, path)
    else:
        # The sidecar goes first: a CSV never exists without the schema that describes it.
        atomic_write_text(csv_sidecar(path), json.dumps(stamp, indent=1) + "\n")
        with atomic_path(path) as tmp:
            table.to_csv(tmp, index=False)
    return path


def read_table(path: Path, schema: TableSchema) -> pd.DataFrame:
    """Read a table written by ``write_table``; check its schema name, version, columns, dtypes."""
    path = Path(path)
    fmt = _format_of(path)
    if not path.is_file():
        raise BundleError(path, "file not found" if not path.exists() else "not a regular file")
    if fmt == ".parquet":
        df, stamp = _read_parquet(path)
    else:
        stamp = _read_csv_stamp(path)
        try:
            # Everything as text first: conform() does the typed conversion and names bad cells.
            df = pd.read_csv(path, dtype=str, keep_default_na=False, na_filter=False)
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError) as exc:
            raise BundleError(path, f"malformed CSV: {_one_line(exc)}") from None
    check_stamp(stamp, schema, path)
    return conform(df, schema, path).reset_index(drop=True)


def check_stamp(stamp: object, schema: TableSchema, source: object) -> None:
    """Check a recorded {"schema": name, "version": n} against the schema this code reads."""
    if not isinstance(stamp, dict) or "schema" not in stamp or "version" not in stamp:
        raise BundleError(source, "no paratwin schema stamp (write tables with traces.tables.write_table)")
    if stamp["schema"] != schema.name:
        raise BundleError(source, f"holds table {stamp['schema']!r}, expected {schema.name!r}")
    if stamp["version"] != schema.version:
        raise BundleError(
            source,
            f"table {schema.name!r} has version {stamp['version']!r}; this paratwin reads version "
            f"{schema.version} (re-create it with this version)",
        )


def csv_sidecar(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + ".schema.json")


# --- formats -------------------------------------------------------------------------------------


def _format_of(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in TABLE_SUFFIXES:
        raise BundleError(path, f"unknown table format {suffix or '(no suffix)'!r}; use .parquet or .csv")
    return suffix


def _schema_stamp(schema: TableSchema) -> dict:
    return {"schema": schema.name, "version": schema.version, "columns": dict(schema.columns)}


def _write_parquet(table: pd.DataFrame, stamp: dict, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        arrow = pa.Table.from_pandas(table, preserve_index=False)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise BundleError(path, f"cannot serialise table to Parquet: {_one_line(exc)}") from None
    metadata = dict(arrow.schema.metadata or {})
    metadata[SCHEMA_METADATA_KEY] = json.dumps(stamp).encode()
    arrow = arrow.replace_schema_metadata(metadata)
    with atomic_path(path) as tmp:
        pq.write_table(arrow, tmp)


def _read_parquet(path: Path) -> tuple[pd.DataFrame, object]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        arrow = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise BundleError(path, f"not a readable Parquet file: {_one_line(exc)}") from None
    raw = (arrow.schema.metadata or {}).get(SCHEMA_METADATA_KEY)
    try:
        stamp = json.loads(raw) if raw is not None else None
    except json.JSONDecodeError:
        raise BundleError(path, "schema metadata is not valid JSON") from None
    return arrow.to_pandas(), stamp


def _read_csv_stamp(path: Path) -> object:
    sidecar = csv_sidecar(path)
    if not sidecar.is_file():
        raise BundleError(path, f"schema sidecar {sidecar.name} is missing (write tables with write_table)")
    try:
        return json.loads(sidecar.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(sidecar, f"malformed JSON: {_one_line(exc)}") from None


# --- casting -------------------------------------------------------------------------------------


def _cast(series: pd.Series, dtype: str, col: str, schema: TableSchema, source: object) -> pd.Series:
    def fail(position: int, what: str) -> BundleError:
        # ``what`` may show the offending cell as {value}; numpy scalars are shown as plain Python.
        value = series.iloc[position]
        value = value.item() if isinstance(value, np.generic) else value
        return BundleError(
            source, f"column {col!r} of table {schema.name!r} must be {dtype}: row {position} "
            + what.format(value=repr(value)[:80])
        )

    if dtype == "string":
        return _cast_string(series, fail)
    if dtype in ("int64", "float64"):
        return _cast_number(series, dtype, fail)
    if dtype == "bool":
        return _cast_bool(series, fail)
    raise BundleError(source, f"schema {schema.name!r} declares unsupported dtype {dtype!r} for {col!r}")


def _cast_string(series: pd.Series, fail) -> pd.Series:
    if series.dtype == object:
        ok = series.map(lambda v: v is None or v is pd.NA or isinstance(v, (str, int, float, np.number)))
        if not ok.all():
            raise fail(_first(~ok), "holds {value}")
    return series.astype("string")


def _cast_number(series: pd.Series, dtype: str, fail) -> pd.Series:
    if pd.api.types.is_bool_dtype(series.dtype) and len(series):
        raise fail(0, "holds a boolean {value}")
    if not pd.api.types.is_numeric_dtype(series.dtype):
        text_missing = series.isna() | (series.astype("string").str.strip() == "")
        numbers = pd.to_numeric(series.where(~text_missing, None), errors="coerce")
        bad = numbers.isna() & ~text_missing
        if bad.any():
            raise fail(_first(bad), "holds {value}")
        series = numbers
    values = series.astype("float64") if dtype == "float64" else series
    if dtype == "float64":
        return values
    missing = values.isna()
    if missing.any():
        raise fail(_first(missing), "is empty")
    as_float = values.astype("float64")
    fractional = ~np.isfinite(as_float) | (as_float != np.round(as_float))
    if fractional.any():
        raise fail(_first(fractional), "holds the non-integer {value}")
    return values.astype("int64")


def _cast_bool(series: pd.Series, fail) -> pd.Series:
    if pd.api.types.is_bool_dtype(series.dtype) and not series.isna().any():
        return series.astype("bool")

    def parse(value: object) -> object:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        if isinstance(value, (int, np.integer)) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        return None

    parsed = series.map(parse)
    bad = parsed.isna()
    if bad.any():
        raise fail(_first(bad), "holds {value}, not true/false")
    return parsed.astype("bool")


def _first(mask: pd.Series) -> int:
    return int(np.flatnonzero(np.asarray(mask, dtype=bool))[0])


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
