"""Sweeps: many simulated points, written one by one, resumable, on local processes or on Dask.

A sweep is a set of **points**, each a plan (plus, optionally, a cost model that replaces the
plan's, for schedule studies) built from a spec:

```yaml
name: merak-ablation
base: {workload: gpt-8.3b, cluster: a100-64, dtype: fp16,    # a plan mapping, or a plan file
       parallelism: {dp: 2, tp: 8, pp: 4}, schedule: {name: 1f1b, micro_batch: 4, microbatches: 16}}
grid:                               # every combination of these values (a product)
  workload: [gpt-2.5b, gpt-8.3b]    # a top-level field: its values
  schedule.microbatches: [8, 16]    # one field of a section
  memory: [{policy: full}, {policy: stage-aware, ratio: 0.5}]   # a section: partial mappings
axes:                               # named override sets, crossed with the grid and each other
  technique:
    megatron: {memory: {policy: full}}
    merak: {schedule: {name: merak-shifted}, parallelism: {tp_overlap: 3}}
points:                             # explicit overrides of the base, added as they are (not crossed)
  - {name: one-more, parallelism: {dp: 8, tp: 8, pp: 1}}
costs: {uniform: {num_layers: 32, fwd_s: 1.0, bwd_input_s: 1.0, bwd_weight_s: 1.0}}  # optional
full: false                         # simulate every rank (default: one per symmetric group)
```

Overrides merge like ``Plan.replace``: a section given as a mapping is merged into the current one,
unless it names another memory policy or gradient-sync method. An override may also carry
``costs:`` (per point). Each point has an **id**, a hash of what is simulated (the plan without its
name, the costs, ``full``), so the same point in two sweeps, or in a sweep whose spec grew, is the
same file.

``run_sweep(spec, out_dir)`` writes

- ``points/<id>.json``: one record per completed point, written atomically the moment it completes
  (status ``ok``, ``does-not-fit`` or ``error`` with its one-line reason; ``exception`` for an
  unexpected failure, with its type and message);
- ``results.parquet`` and ``results.csv``: every point of the spec, merged, at the end;
- ``spec.json`` (the points, with their ids and labels) and ``events.jsonl`` (one line per run and
  per submitted point: what a run was doing when it stopped).

Run it again with the same spec and ``out_dir`` and it computes only the points without a record:
a sweep killed at any moment (``kill -9`` included) loses at most the points in flight, never a
completed one, and never computes a completed point again. Delete ``points/<id>.json`` to compute a
point again.

Where the points run (the same interface for all, `analysis.executors`, shared with the HAP runner):

- ``workers=1``: in this process, one after the other;
- default: a ``concurrent.futures.ProcessPoolExecutor`` of ``workers`` processes (default: the
  usable cores);
- ``scheduler="local-dask"``: an embedded Dask ``LocalCluster`` of ``workers`` workers;
- ``scheduler="tcp://host:8786"``: an existing Dask cluster (``dask scheduler`` and ``dask worker``
  on the machines; each worker needs paratwin installed). Results travel back to this process,
  which writes them, so the workers need no shared file system.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import socket
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.executors import LOCAL_DASK, BrokenProcessPool, backend, check_workers, one_line, usable_cores
from traces.atomic import atomic_path, atomic_write_text
from traces.errors import ConfigError, NoPlanFits, ParatwinError
from traces.outdir import OutputLock, prepare_out_folder
from traces.strict_yaml import read_document

STATUSES = ("ok", "does-not-fit", "error", "exception")
# The plan's shape, as columns of the merged table (read from the plan of each point).
PLAN_COLUMNS = ["workload", "cluster", "dtype", "dp", "tp", "pp", "chunks", "partition", "tp_overlap", "schedule",
                "micro_batch", "microbatches", "global_batch", "memory_policy", "gradient_sync"]
METRIC_COLUMNS = ["iteration_s", "samples_per_s", "tokens_per_s", "model_tflops_per_device", "mfu",
                  "bubble_mean", "bubble_max", "peak_memory_gib", "capacity_gib", "oom"]


# What a sweep writes in its folder (a folder of the user's holding one of these is refused).
SWEEP_OUTPUTS = ("points", "spec.json", "events.jsonl", "results.parquet", "results.csv")


class SweepInterrupted(ParatwinError):
    """A sweep stopped before its end; what it completed is recorded and a rerun resumes. ``exit_code``:
    the CLI's status (2; 130 for Ctrl-C, as a shell reports SIGINT)."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# ---------------------------------------------------------------------------------------------
# Points


@dataclass(frozen=True)
class Point:
    """One simulation of a sweep: a plan (a mapping, checked when evaluated), optional costs."""

    id: str
    labels: dict[str, Any]
    plan: dict[str, Any]
    costs: dict[str, Any] | None = None
    full: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "labels": self.labels, "plan": self.plan, "costs": self.costs, "full": self.full}


@dataclass
class SweepSpec:
    name: str
    points: list[Point]
    source: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> SweepSpec:
        path = Path(path)
        data = read_document(path, "sweep spec", "pass the path of a YAML sweep spec")
        return cls.from_dict(data, source=str(path), root=path.parent)

    @classmethod
    def from_dict(cls, data: Any, source: str = "sweep", root: Path | None = None) -> SweepSpec:
        if not isinstance(data, dict):
            raise ConfigError(source, "a sweep spec must be a mapping", "give name, base, grid, axes or points")
        known = {"name", "base", "grid", "axes", "points", "costs", "full"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: {unknown[0]}", "unknown field", f"use {', '.join(sorted(known))}")
        name = str(data.get("name", "sweep"))
        base = data.get("base") or {}
        if isinstance(base, str):
            base = _base_plan(base, root, source)
        if not isinstance(base, dict):
            raise ConfigError(f"{source}: base", "must be a plan mapping or a plan file", "see examples/plans")
        check_overrides(base, f"{source}: base")
        axes = _grid_axes(data.get("grid") or {}, source) + _named_axes(data.get("axes") or {}, source)
        extra = data.get("points") or []
        if not isinstance(extra, list):
            raise ConfigError(f"{source}: points", "must be a list of plan overrides", "write points: [{...}, ...]")
        if not axes and not extra:
            axes = [("point", [("base", {})])]
        costs, full = data.get("costs"), data.get("full", False)
        if not isinstance(full, bool):  # bool('maybe') simulated every rank
            raise ConfigError(f"{source}: full", f"must be true or false, not {full!r}",
                              "write full: true to simulate every rank")
        points: list[Point] = []
        if axes:
            for combo in itertools.product(*(values for _, values in axes)):
                labels = {axis: label for (axis, _), (label, _) in zip(axes, combo, strict=True)}
                overrides = [changes for _, changes in combo]
                points.append(make_point(base, overrides, labels, costs, full, name))
        for i, changes in enumerate(extra):
            if not isinstance(changes, dict):
                raise ConfigError(f"{source}: points[{i}]", "must be a mapping of plan overrides", "write {...}")
            check_overrides(changes, f"{source}: points[{i}]")
            label = changes.get("name", str(i))
            points.append(make_point(base, [changes], {"point": label}, costs, full, name))
        seen: dict[str, Point] = {}
        for point in points:
            seen.setdefault(point.id, point)  # the same simulation twice is one point
        return cls(name, list(seen.values()), data)


def _base_plan(base: str, root: Path | None, source: str) -> dict[str, Any]:
    """The plan file a spec's ``base:`` names. A relative path is read from the spec's folder (``root``), as
    an include is, so a spec means the same plan wherever the command runs; a miss says where it looked."""
    from sim.plan import Plan

    path = Path(base)
    if root is not None and not path.is_absolute():
        path = root / path
        if not path.exists():
            here = Path(base).resolve()  # a file of that name from the current directory: likely the one meant
            fix = (f"write base: {os.path.relpath(here, root)}, the file of that name in the current directory"
                   if here.is_file() else "write the plan's path from the spec's folder, or an absolute path")
            raise ConfigError(f"{source}: base", f"no plan file {base} in {root}, the spec's folder (a relative base "
                              "is read from there)", fix)
    return Plan.load(path).model_dump()


def check_overrides(changes: Mapping[str, Any], where: str) -> None:
    """Refuse, before any point runs, an override that names no plan field (``schedule.bogus``), or a field
    inside one that is not a section: each of its points could only be an error (the sweep ran them all and
    exited 0). The fields are the plan's own (``sim.plan.section_fields``); a field that some memory policy
    or gradient-sync method takes passes (an override may switch the choice), and what a field holds is
    each point's check: a bad value is a recorded result."""
    from sim.plan import Plan, section_fields

    plan_fields = list(Plan.model_fields)
    for key, value in changes.items():
        if key == "costs":  # a point's own cost model (make_point)
            continue
        if key not in plan_fields:
            raise ConfigError(where, f"{key!r} is not a plan field", f"use {', '.join(plan_fields)}; a section's "
                              "field as section.field in a grid (schedule.microbatches)")
        fields = section_fields(key)
        if not isinstance(value, dict) or fields is None:
            continue
        if not fields:
            sections = [f for f in plan_fields if section_fields(f) != []]
            raise ConfigError(where, f"{key} is not a section", f"give {key} a value; the sections are "
                              f"{', '.join(sections)}")
        unknown = [k for k in value if k not in fields]
        if unknown:
            raise ConfigError(where, f"{unknown[0]!r} is not a field of {key}", f"use {', '.join(fields)}")


def _label(value: Any) -> Any:
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return value


def _grid_axes(grid: Any, source: str) -> list[tuple[str, list[tuple[Any, dict[str, Any]]]]]:
    if not isinstance(grid, dict):
        raise ConfigError(f"{source}: grid", "must map a field to a list of values", "write grid: {field: [..]}")
    axes = []
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{source}: grid.{key}", "must be a non-empty list of values", f"write {key}: [a, b]")
        section, _, name = str(key).partition(".")
        changes = [{section: {name: v}} if name else {section: v} for v in values]
        for change in changes:
            check_overrides(change, f"{source}: grid.{key}")
        axes.append((str(key), [(_label(v), c) for v, c in zip(values, changes, strict=True)]))
    return axes


def _named_axes(axes: Any, source: str) -> list[tuple[str, list[tuple[Any, dict[str, Any]]]]]:
    if not isinstance(axes, dict):
        raise ConfigError(f"{source}: axes", "must map an axis name to named overrides",
                          "write axes: {technique: {name: {...}}}")
    out = []
    for axis, named in axes.items():
        if not isinstance(named, dict) or not named or not all(isinstance(v, dict) for v in named.values()):
            raise ConfigError(f"{source}: axes.{axis}", "must map names to override mappings",
                              "write {name: {schedule: {...}}, ...}")
        for name, changes in named.items():
            check_overrides(changes, f"{source}: axes.{axis}.{name}")
        out.append((str(axis), [(name, changes) for name, changes in named.items()]))
    return out


def merge_plan(data: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``changes`` over a plan mapping, as ``Plan.replace`` merges them: a section mapping merges into
    the current section unless it switches the memory policy or gradient-sync method."""
    merged = dict(data)
    for key, value in changes.items():
        current = merged.get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            switches = any(k in value and value[k] != current.get(k) for k in ("policy", "method"))
            merged[key] = dict(value) if switches else {**current, **value}
        else:
            merged[key] = value
    return merged


def make_point(base: Mapping[str, Any], overrides: Iterable[Mapping[str, Any]], labels: dict[str, Any],
               costs: dict[str, Any] | None = None, full: bool = False, sweep_name: str = "sweep") -> Point:
    plan: dict[str, Any] = dict(base)
    for changes in overrides:
        changes = dict(changes)
        costs = changes.pop("costs", costs)
        plan = merge_plan(plan, changes)
    if "name" not in plan or plan["name"] == base.get("name"):
        plan["name"] = "-".join([sweep_name, *(str(v) for v in labels.values())])[:200]
    plan = _canonical(plan)
    return Point(point_id(plan, costs, full), labels, plan, costs, full)


def _canonical(plan: dict[str, Any]) -> dict[str, Any]:
    """A valid plan spelled with every default, so that two spellings of one plan share an id; an
    invalid one is kept as written (its evaluation records why it is invalid)."""
    from sim.plan import Plan

    try:
        return Plan.from_dict(plan).model_dump(mode="json")
    except (ParatwinError, TypeError, ValueError):
        return plan


def point_id(plan: Mapping[str, Any], costs: Mapping[str, Any] | None, full: bool) -> str:
    """A stable hash of what a point simulates (its plan without the name, its costs, ``full``)."""
    what = {"plan": {k: v for k, v in plan.items() if k != "name"}, "costs": costs, "full": full}
    text = json.dumps(what, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Evaluating one point (runs in a worker: imports sim, never torch)


def build_costs(costs: Mapping[str, Any] | None):  # noqa: ANN201 - a sim.costs.CostModel or None
    if not costs:
        return None
    if set(costs) != {"uniform"} or not isinstance(costs["uniform"], dict):
        raise ConfigError("costs", f"unknown cost model {sorted(costs)}", "write costs: {uniform: {num_layers: N}}")
    from sim.costs import UniformCosts

    try:
        return UniformCosts(**costs["uniform"])
    except TypeError as exc:
        raise ConfigError("costs.uniform", str(exc), "give num_layers and optionally fwd_s, bwd_input_s, "
                          "bwd_weight_s, recompute_s, saved_bytes, output_bytes, param_bytes") from None


def evaluate_point(point: Point | dict[str, Any]) -> dict[str, Any]:
    """Simulate one point; never raises: a bad plan or one that does not fit is a record too."""
    if isinstance(point, dict):
        point = Point(**point)
    started = time.perf_counter()
    record: dict[str, Any] = {"id": point.id, "labels": point.labels, "name": point.plan.get("name"),
                              "status": "ok", "reason": "", "plan": point.plan, "costs": point.costs}
    try:
        from sim.plan import Plan
        from sim.simulate import simulate

        plan = Plan.from_dict(point.plan, source="plan")
        record.update(_plan_shape(plan))
        result = simulate(plan, full=point.full, costs=build_costs(point.costs))
        bubbles = list(result.bubble_fraction.values())
        worst = max(result.memory.values(), key=lambda m: m.peak_bytes / max(m.capacity_bytes, 1))
        record.update({
            "iteration_s": result.iteration_s, "samples_per_s": result.samples_per_s,
            "tokens_per_s": result.tokens_per_s, "model_tflops_per_device": result.model_flops_per_device / 1e12,
            "mfu": result.mfu, "bubble_mean": sum(bubbles) / len(bubbles), "bubble_max": max(bubbles),
            "bubble_by_stage": {str(k): v for k, v in sorted(result.bubble_fraction.items())},
            "peak_memory_gib": result.peak_memory_bytes / 2**30, "capacity_gib": worst.capacity_bytes / 2**30,
            "peak_memory_gib_by_rank": {str(r): m.peak_bytes / 2**30 for r, m in sorted(result.memory.items())},
            "oom": result.oom, "simulator_wall_s": result.wall_s,
        })
        does_not_fit = result.does_not_fit()
        if does_not_fit is not None:
            record.update(status="does-not-fit", reason=one_line(does_not_fit))
    except ParatwinError as exc:
        record.update(status="error", reason=one_line(exc))
    except Exception as exc:  # a bug, not a bad plan: recorded (with where it happened), never lost
        where = traceback.extract_tb(exc.__traceback__)[-1]
        record.update(status="exception", reason=one_line(f"{type(exc).__name__}: {exc} "
                                                           f"({Path(where.filename).name}:{where.lineno})"))
    record.update({"eval_s": time.perf_counter() - started, "host": socket.gethostname(), "pid": os.getpid(),
                   "computed_at": datetime.now(timezone.utc).isoformat()})
    return record


def _plan_shape(plan: Any) -> dict[str, Any]:
    partition = plan.parallelism.partition
    return {"workload": plan.workload, "cluster": plan.cluster if isinstance(plan.cluster, str) else
            str(plan.cluster.get("name", "inline")), "dtype": plan.dtype, "dp": plan.dp, "tp": plan.tp,
            "pp": plan.pp, "chunks": plan.chunks,
            "partition": partition if isinstance(partition, str) else json.dumps(partition),
            "tp_overlap": plan.parallelism.tp_overlap, "schedule": plan.schedule.name,
            "micro_batch": plan.micro_batch, "microbatches": plan.microbatches, "global_batch": plan.global_batch,
            "memory_policy": plan.memory.policy, "gradient_sync": plan.gradient_sync.method}


# ---------------------------------------------------------------------------------------------
# Running a sweep


@dataclass
class SweepRun:
    """What ``run_sweep`` returns: the merged table and what this run did."""

    table: pd.DataFrame
    out_dir: Path
    run_id: str
    total: int
    computed: list[str]  # ids this run computed
    reused: int  # points already recorded before this run
    backend: str
    wall_s: float

    @property
    def counts(self) -> dict[str, int]:
        return {s: int(n) for s, n in self.table["status"].value_counts().items()} if len(self.table) else {}


def no_point_ok(run: SweepRun, name: str) -> ParatwinError | None:
    """Why a sweep none of whose points is ok fails (None when one is ok; the results are written either
    way). Every point not fitting in memory: ``NoPlanFits``, exit 3, as simulate and search exit for plans
    that do not fit; any other mix (a point its checks refused, an exception): a ``ConfigError``, exit 2.
    It exited 0, the spec's mistake said only point by point."""
    counts = run.counts
    if not counts or counts.get("ok"):
        return None
    told = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    where = f"every reason is in {run.out_dir / 'results.csv'}"
    if set(counts) == {"does-not-fit"}:
        return NoPlanFits(f"sweep {name}: no point fits in memory ({told}); {where} (fix: more devices or devices "
                          "with more memory, recompute, or fewer or smaller micro-batches)")
    return ConfigError(f"sweep {name}", f"no point is ok ({told}); {where}",
                       "correct the spec or its base plan: the reasons above say what each point lacks")


def point_path(out_dir: Path, point_id: str) -> Path:
    return Path(out_dir) / "points" / f"{point_id}.json"


def recorded_ids(out_dir: Path) -> set[str]:
    """Ids with a complete record (a record is renamed into place whole, so a file is complete)."""
    folder = Path(out_dir) / "points"
    return {p.stem for p in folder.glob("*.json")} if folder.is_dir() else set()


def _log(out_dir: Path, event: dict[str, Any]) -> None:
    # One line per write, appended (O_APPEND): a killed run leaves at most a torn last line.
    with open(Path(out_dir) / "events.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps(event, default=str) + "\n")
        handle.flush()


def read_events(out_dir: Path) -> list[dict[str, Any]]:
    path = Path(out_dir) / "events.jsonl"
    events = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # the torn last line of a killed run
    return events


def run_sweep(spec: SweepSpec | dict[str, Any] | str | Path, out_dir: str | Path, workers: int | None = None,
              scheduler: str | None = None, progress: Callable[[int, int, dict[str, Any]], None] | None = None,
              dask_processes: bool = True, evaluate: Callable[[Point], dict[str, Any]] = evaluate_point) -> SweepRun:
    """Compute every point of ``spec`` that ``out_dir`` has no record of, write each record the
    moment it completes, then merge all of the spec's records into ``results.parquet``/``.csv``.

    ``workers``: processes (or Dask workers for ``local-dask``); default the usable cores; 1 runs in
    this process. ``scheduler``: None (local processes), ``"local-dask"`` or a Dask scheduler address.
    ``progress(done, total, record)`` is called after every point this run completes."""
    started = time.perf_counter()
    if not isinstance(spec, SweepSpec):
        spec = SweepSpec.load(spec) if isinstance(spec, (str, Path)) else SweepSpec.from_dict(spec)
    out = Path(out_dir)
    workers = usable_cores() if workers is None else workers  # 0 is refused, not read as the default
    check_workers(workers)
    prepare_out_folder(out, SWEEP_OUTPUTS)
    with OutputLock(out):  # one sweep at a time per folder: two would compute the same points
        return _run_locked(spec, out, workers, scheduler, progress, dask_processes, evaluate, started)


def _run_locked(spec: SweepSpec, out: Path, workers: int, scheduler: str | None,
                progress: Callable[[int, int, dict[str, Any]], None] | None, dask_processes: bool,
                evaluate: Callable[[Point], dict[str, Any]], started: float) -> SweepRun:
    (out / "points").mkdir(parents=True, exist_ok=True)
    for stale in (out / "points").glob(".*.tmp"):  # a record being written when a run was killed
        stale.unlink(missing_ok=True)
    atomic_write_text(out / "spec.json", json.dumps({"name": spec.name, "source": spec.source,
                                                     "points": [p.to_dict() for p in spec.points]},
                                                    indent=1, default=str))
    done_before = recorded_ids(out)
    todo = [p for p in spec.points if p.id not in done_before]
    run_id = f"{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    reused = len(spec.points) - len(todo)
    computed: list[str] = []
    backend_name = "nothing to compute"
    _log(out, {"run": run_id, "event": "start", "points": len(spec.points), "todo": len(todo), "pid": os.getpid()})
    if todo:
        where = backend(min(workers, len(todo)) if not scheduler else workers, scheduler, dask_processes)
        backend_name = where.name
        interrupted = False
        try:
            futures = []
            for point in todo:
                _log(out, {"run": run_id, "event": "submit", "id": point.id})
                futures.append(where.submit(evaluate, point, f"point-{point.id}"))
            for future in where.as_completed(futures):
                try:
                    record = future.result()
                except BrokenProcessPool as exc:  # a worker was killed (OOM killer, signal) or failed to start
                    raise SweepInterrupted(
                        f"sweep {spec.name}: a worker process died ({exc}); {reused + len(computed)} of "
                        f"{len(spec.points)} points are recorded in {out} (fix: run the sweep again to resume; a "
                        "script that calls run_sweep needs `if __name__ == \"__main__\":`)") from None
                record["run"] = run_id
                atomic_write_text(point_path(out, record["id"]), json.dumps(record, indent=1, default=str))
                computed.append(record["id"])
                if progress is not None:
                    progress(reused + len(computed), len(spec.points), record)
        except KeyboardInterrupt:  # Ctrl-C: it stopped with no word of what was kept
            interrupted = True
            raise SweepInterrupted(
                f"sweep {spec.name}: interrupted; {reused + len(computed)} of {len(spec.points)} points are "
                f"recorded in {out} (fix: run the same command again to resume)", exit_code=130) from None
        finally:
            where.close(abort=interrupted)
    table = merge_results(out, spec)
    _log(out, {"run": run_id, "event": "end", "computed": len(computed)})
    return SweepRun(table, out, run_id, len(spec.points), computed, reused, backend_name,
                    time.perf_counter() - started)


def load_records(out_dir: Path, ids: Iterable[str]) -> list[dict[str, Any]]:
    records = []
    for point_id in ids:
        path = point_path(out_dir, point_id)
        if path.is_file():
            records.append(json.loads(path.read_text(encoding="utf-8")))
    return records


def records_table(records: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per record: id, the point's labels as columns, status, reason, the plan's shape,
    the metrics; nested values (per-stage bubbles, per-rank memory, the plan) as JSON text."""
    rows = []
    for record in records:
        row: dict[str, Any] = {"id": record["id"]}
        for key, value in record.get("labels", {}).items():
            row[key if key not in record else f"label:{key}"] = value
        for key, value in record.items():
            if key in ("id", "labels"):
                continue
            row[key] = json.dumps(value, sort_keys=True, default=str) if isinstance(value, (dict, list)) else value
        rows.append(row)
    table = pd.DataFrame(rows)
    for column in ["status", "reason", *PLAN_COLUMNS, *METRIC_COLUMNS]:
        if column not in table:
            table[column] = None
    return table


def merge_results(out_dir: Path, spec: SweepSpec) -> pd.DataFrame:
    """The spec's records in one table, written atomically as ``results.parquet`` and ``results.csv``
    (records of points no longer in the spec stay in ``points/`` but are not merged)."""
    out = Path(out_dir)
    table = records_table(load_records(out, [p.id for p in spec.points]))
    with atomic_path(out / "results.parquet") as tmp:
        table.to_parquet(tmp, index=False)
    with atomic_path(out / "results.csv") as tmp:
        table.to_csv(tmp, index=False)
    return table


def read_results(out_dir: str | Path) -> pd.DataFrame:
    return pd.read_parquet(Path(out_dir) / "results.parquet")


__all__ = ["LOCAL_DASK", "Point", "SweepRun", "SweepSpec", "check_overrides", "evaluate_point", "make_point",
           "merge_plan", "merge_results", "no_point_ok", "point_id", "read_events", "read_results", "recorded_ids",
           "run_sweep"]
