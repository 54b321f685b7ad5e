"""The Plan: a small declarative description of how to train a workload on a cluster.

Plans are YAML or JSON files (or dicts) validated into a ``Plan``. A plan has a few top-level
fields (workload, cluster, profile, dtype) and one section per plan dimension, each with defaults:

- ``parallelism``: dp, tp, pp, chunks, partition, tp_overlap;
- ``schedule``: a registered pipeline schedule (``sim.schedules``) and its micro-batching;
- ``memory``: a registered memory policy (``sim.memory``), chosen by ``policy:``;
- ``gradient_sync``: a registered gradient-sync method (``sim.gradient_sync``), chosen by ``method:``;
- ``embedding``: a registered embedding-communication method (``sim.embedding``), chosen by ``method:``.

Structural checks (types, ranges, unknown fields, registered names) happen on construction; checks
that need the workload and the cluster (degrees vs world size, TP vs heads, partition coverage,
schedule preconditions) happen when the plan is compiled (``sim.compile``). Both raise
``ConfigError`` naming the field and the fix. A plan in the old flat form (``dp: 2`` at the top)
is refused with the same plan spelled in sections.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from sim.cluster import PRESETS as CLUSTER_PRESETS
from sim.embedding import EMBEDDING_METHODS, DenseEmbedding, EmbeddingConfig
from sim.gradient_sync import GRADIENT_SYNC, DenseAllReduce, GradientSyncConfig
from sim.implementations import expand_implementation
from sim.memory import MEMORY_POLICIES, MemoryConfig, NoRecompute
from sim.schedules import SCHEDULES
from sim.workloads import workload_family
from traces.errors import ConfigError
from traces.limits import MAX_DOCUMENT_BYTES, check_document, short_repr
from traces.strict_yaml import read_document


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _count_is_not_a_switch(cls, value: object, info: ValidationInfo) -> object:
        """A whole-number field given true/false is refused: pydantic's lax mode read ``dp: true`` as 1."""
        if isinstance(value, bool) and info.field_name and cls.model_fields[info.field_name].annotation is int:
            raise PydanticCustomError("int_type", "Input should be a valid integer, not true or false")
        return value


class Parallelism(Section):
    """How the model and the batch are split over the devices (dp x tp x pp = the cluster's devices)."""

    dp: int = Field(1, ge=1, description="data-parallel replicas")
    tp: int = Field(1, ge=1, description="tensor-parallel degree (Megatron); divides the heads and hidden size")
    pp: int = Field(1, ge=1, description="pipeline ranks")
    chunks: int = Field(1, ge=1, description="virtual stages per pipeline rank (interleaved, V schedules)")
    partition: Literal["uniform", "parameters", "time"] | list[list[int]] = Field(
        "uniform", description="layers per virtual stage: balanced by count, parameters or time, or "
        "[first, end) per stage")
    tp_overlap: int = Field(0, ge=0, le=3, description="Merak's sub-pipelined TP level (simulated only)")

    @field_validator("partition")
    @classmethod
    def _ranges_are_pairs(cls, value: object) -> object:
        if isinstance(value, list):
            for i, item in enumerate(value):
                if len(item) != 2 or item[0] >= item[1]:
                    raise ValueError(f"stage {i} range {item} must be [first_layer, end_layer) with first < end")
        return value


class Schedule(Section):
    """The pipeline schedule (``paratwin options`` lists them) and the micro-batches it runs."""

    name: str = Field("1f1b", description="a registered schedule")
    micro_batch: int = Field(1, ge=1, description="samples per micro-batch")
    microbatches: int = Field(1, ge=1, description="micro-batches per iteration and data-parallel replica")
    # How pipeline stages exchange activations and gradients (docs/accuracy.md, section 3). "async":
    # a send runs beside the compute that follows it. "blocking": as Megatron-LM 2021 ran its
    # schedules (megatron/p2p_communication.py, _communicate at tag v2.5: batch_isend_irecv, wait on
    # every request, torch.cuda.synchronize()): a rank computes on only once its transfers are done.
    p2p: Literal["async", "blocking"] = Field(
        "async", description="pipeline sends: async (beside compute) or blocking (Megatron-LM 2021)")
    p2p_scatter_gather: bool = Field(
        False, description="each TP rank sends 1/tp of an activation or gradient and the receivers all-gather "
        "it over their TP group (Megatron-LM's scatter/gather; the runtime does the same, exec/interpreter.py)")

    @field_validator("name")
    @classmethod
    def _registered(cls, value: str) -> str:
        if value not in SCHEDULES:
            raise ValueError(f"unknown schedule {value!r}; registered: {', '.join(SCHEDULES)}")
        return value


# The sections chosen by a key, each with the key that names its choice, and the choices' registries.
_SECTION_CHOICE = {"memory": "policy", "gradient_sync": "method", "embedding": "method"}
_REGISTRIES = {"memory": MEMORY_POLICIES, "gradient_sync": GRADIENT_SYNC, "embedding": EMBEDDING_METHODS}


def _registered_config(registry: dict[str, Any], key: str, what: str, value: object) -> object:
    """A section chosen by ``key`` (policy:, method:): the registered choice's own settings model."""
    if not isinstance(value, dict):
        return value  # already a settings model
    choice = value.get(key)
    if choice is None:  # it read "policy None is not a registered memory policy"
        raise ValueError(f"no {key} named (the section's {what}); registered: {', '.join(registry)}")
    if choice not in registry:
        raise ValueError(f"{key} {choice!r} is not a registered {what}; registered: {', '.join(registry)}")
    return registry[choice].config.model_validate(value)


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "plan"
    workload: str
    workload_options: dict[str, Any] = Field(default_factory=dict)
    cluster: str | dict[str, Any] = "local-cpu-2"
    profile: str | None = None  # trace bundle directory: measured costs on the same hardware
    dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    parallelism: Parallelism = Parallelism()
    schedule: Schedule = Schedule()
    memory: SerializeAsAny[MemoryConfig] = NoRecompute()
    gradient_sync: SerializeAsAny[GradientSyncConfig] = DenseAllReduce()
    embedding: SerializeAsAny[EmbeddingConfig] = DenseEmbedding()

    @model_validator(mode="before")
    @classmethod
    def _implementation(cls, data: object) -> object:
        """``workload_options: {implementation: megatron-lm}`` replaced by the options it stands for, the
        plan's own explicit options winning (sim.implementations), so every reader of the plan sees them."""
        if not isinstance(data, dict) or not isinstance(data.get("workload_options"), dict):
            return data
        family = workload_family(data.get("workload"))
        return {**data, "workload_options": expand_implementation(data["workload_options"], family)}

    @field_validator("memory", mode="before")
    @classmethod
    def _memory_policy(cls, value: object) -> object:
        return _registered_config(MEMORY_POLICIES, _SECTION_CHOICE["memory"], "memory policy", value)

    @field_validator("gradient_sync", mode="before")
    @classmethod
    def _gradient_sync_method(cls, value: object) -> object:
        return _registered_config(GRADIENT_SYNC, _SECTION_CHOICE["gradient_sync"], "gradient-sync method", value)

    @field_validator("embedding", mode="before")
    @classmethod
    def _embedding_method(cls, value: object) -> object:
        return _registered_config(EMBEDDING_METHODS, _SECTION_CHOICE["embedding"], "embedding method", value)

    # Shorthands for the shape of the job, read everywhere.
    @property
    def dp(self) -> int:
        return self.parallelism.dp

    @property
    def tp(self) -> int:
        return self.parallelism.tp

    @property
    def pp(self) -> int:
        return self.parallelism.pp

    @property
    def chunks(self) -> int:
        return self.parallelism.chunks

    @property
    def micro_batch(self) -> int:
        return self.schedule.micro_batch

    @property
    def microbatches(self) -> int:
        return self.schedule.microbatches

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.microbatches

    def replace(self, **changes: Any) -> Plan:
        """A copy with top-level fields replaced; a section given as a mapping is merged into the
        current one (``plan.replace(schedule={"microbatches": 8})``), unless it names another
        policy or method, which starts from that choice's defaults."""
        data = self.model_dump()
        for key, value in changes.items():
            current = data.get(key)
            if isinstance(value, dict) and isinstance(current, dict):
                switches = any(k in value and value[k] != current.get(k) for k in ("policy", "method"))
                data[key] = value if switches else {**current, **value}
            else:
                data[key] = value
        return Plan.from_dict(data)

    def with_absolute_paths(self) -> Plan:
        """A copy naming its cluster file and profile folder by absolute paths: a relative one is read from
        the current directory, so a plan written for later (search's best.yaml) would work only from the
        directory it was written in."""
        cluster = self.cluster if not isinstance(self.cluster, str) or self.cluster in CLUSTER_PRESETS \
            else str(Path(self.cluster).resolve())
        return self.replace(cluster=cluster, profile=str(Path(self.profile).resolve()) if self.profile else None)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "plan") -> Plan:
        if not isinstance(data, dict):
            raise ConfigError(source, "a plan must be a mapping of fields", "see examples/plans/*.yaml")
        check_document(data, source)
        _refuse_flat_form(data, source)
        try:
            return cls(**data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"] if not _is_pydantic_tag(p)) or "plan"
            problem = first["msg"].removeprefix("Value error, ")
            if first["type"] == "extra_forbidden":
                fix = "remove it (known fields: " + ", ".join(_known_fields(data, first["loc"])) + ")"
            elif "registered:" in problem:
                fix = "choose a registered one (paratwin options lists them)"
            elif "expected" in first.get("ctx", {}):  # one of fixed values (schedule.p2p): name them in the fix
                fix = f"write {first['ctx']['expected']}, not {short_repr(first.get('input'))}"
            elif first["type"] in ("model_type", "dict_type") and where in _SECTION_CHOICE \
                    and isinstance(first.get("input"), str):  # memory: full, the choice without its section
                fix = f"write {where}: {{{_SECTION_CHOICE[where]}: {first['input']}}}"
            elif first["type"] in ("bool_parsing", "bool_type"):  # a switch (schedule.p2p_scatter_gather)
                fix = f"write true or false, not {short_repr(first.get('input'))}"
            elif (wanted := number_fix(first)) is not None:  # a count (parallelism.dp)
                fix = wanted
            elif first["type"] == "list_type":  # a per-stage list given one value (memory.swap: 0.5)
                fix = _list_wanted(data, first)
            else:
                fix = f"got {short_repr(first.get('input'))}"
            raise ConfigError(f"{source}: {where}", problem, fix) from None

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_dict(read_plan_document(path), source=str(path))

    def dump(self, path: str | Path) -> Path:
        path = Path(path)
        data = self.model_dump(exclude_defaults=False)
        path.write_text(json.dumps(data, indent=2) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False))
        return path


def _is_pydantic_tag(part: object) -> bool:
    """A part of a pydantic error location that names no field: a validator (``function-after[...]``) or
    the member of a union that failed (``str``, ``literal['uniform',...]``, ``list[list[int]]``); the field
    read "cluster.str" or "parallelism.partition.literal['uniform','parameters','time']"."""
    text = str(part)
    return text.startswith("function-") or "[" in text or text in ("str", "int", "float", "bool")


# pydantic's error types for a number out of its range: the bound's key in the error's ctx and its sign.
_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"), "less_than_equal": ("le", "<="),
           "less_than": ("lt", "<")}


def number_fix(error: Mapping[str, Any]) -> str | None:
    """The fix for a pydantic error of a number field, "write a number >= 1, not 0" or "write a whole number,
    not 'two'" (a plan's counts and ratios; the command line's, which typer checks with pydantic); None for
    another error."""
    if error["type"] in _BOUNDS:
        key, sign = _BOUNDS[error["type"]]
        wanted = f"a number {sign} {error['ctx'][key]}"
    elif error["type"].startswith("int_"):
        wanted = "a whole number"
    else:
        return None
    return f"write {wanted}, not {short_repr(error.get('input'))}"


def _list_wanted(data: dict[str, Any], error: Mapping[str, Any]) -> str:
    """What a list field wants, from its description: ``memory.swap: 0.5`` is told to write one fraction per
    virtual stage, ``swap: [0.5, 0.5]`` at pp x chunks = 2."""
    loc = tuple(p for p in error["loc"] if not _is_pydantic_tag(p))
    info = _section_model(data, loc).model_fields.get(str(loc[-1]))
    what = (info.description or "") if info is not None else ""
    value = error.get("input")
    if not what.startswith("per virtual stage"):
        return f"write a list{f' ({what})' if what else ''}, not {short_repr(value)}"
    parallelism = data.get("parallelism") if isinstance(data.get("parallelism"), dict) else {}
    degrees = (parallelism.get("pp", 1), parallelism.get("chunks", 1))
    known = all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in degrees)
    stages = degrees[0] * degrees[1] if known else 2  # 2: an example where the plan's count is not known yet
    wanted = f"write a list, one value per virtual stage (pp x chunks{f' = {stages} here' if known else ''}), " \
             f"each the {what.removeprefix('per virtual stage').lstrip(': ')}"
    if isinstance(value, int | float) and not isinstance(value, bool):  # the one value meant for every stage
        shown = ", ".join([f"{value:g}"] * stages) if stages <= 8 else f"{value:g}, ... ({stages} values)"
        return f"{wanted}: {loc[-1]}: [{shown}]"
    return f"{wanted}; not {short_repr(value)}"


def _section_model(data: dict[str, Any], loc: tuple[Any, ...]) -> type[BaseModel]:
    """The model whose field is at ``loc``: the plan, or its section (a memory policy's own settings)."""
    if len(loc) < 2:
        return Plan
    section = loc[0]
    if section in _REGISTRIES:  # the fields of the chosen policy or method
        model: type[BaseModel] = _REGISTRIES[section][data[section][_SECTION_CHOICE[section]]].config
    else:
        model = Plan.model_fields[section].annotation  # type: ignore[assignment]
    return model


def _known_fields(data: dict[str, Any], loc: tuple[Any, ...]) -> list[str]:
    """The fields allowed where an unknown one was found: the plan's, or its section's."""
    return list(_section_model(data, loc).model_fields)


def section_fields(field: str) -> list[str] | None:
    """What plan field ``field`` may hold as a mapping, from the plan's own models: a section's fields (for
    memory, gradient_sync and embedding those of any registered choice: which are valid depends on the
    choice); None for a mapping whose keys the plan does not fix (workload_options, an inline cluster);
    [] for a field that holds no mapping (workload, dtype). ``KeyError`` for a name that is no plan field."""
    if field in _REGISTRIES:
        return sorted({name for choice in _REGISTRIES[field].values() for name in choice.config.model_fields})
    annotation = Plan.model_fields[field].annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return list(annotation.model_fields)
    members = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    return None if any(get_origin(member) is dict for member in members) else []


# The flat form (before plan sections): field -> (section, name in that section).
FLAT_FIELDS: dict[str, tuple[str, str]] = {
    "dp": ("parallelism", "dp"), "tp": ("parallelism", "tp"), "pp": ("parallelism", "pp"),
    "chunks": ("parallelism", "chunks"), "partition": ("parallelism", "partition"),
    "tp_overlap": ("parallelism", "tp_overlap"), "micro_batch": ("schedule", "micro_batch"),
    "microbatches": ("schedule", "microbatches"), "dp_bucket_mb": ("gradient_sync", "bucket_mb"),
}


def _refuse_flat_form(data: dict[str, Any], source: str) -> None:
    flat = [key for key in (*FLAT_FIELDS, "recompute", "recompute_ratio", "swap") if key in data]
    if isinstance(data.get("schedule"), str):
        flat.append("schedule")
    if not flat:
        return
    sections = {k: v for k, v in migrate_flat(data).items() if k in _SECTIONS}
    spelled = yaml.safe_dump(sections, default_flow_style=True, sort_keys=False, width=10**6).strip()
    raise ConfigError(f"{source}: {flat[0]}", "plans are written in sections, not flat fields (flat here: "
                      f"{', '.join(flat)}; `paratwin migrate-plan FILE` rewrites a file)", f"write {spelled[:400]}")


_SECTIONS = ("parallelism", "schedule", "memory", "gradient_sync")


def migrate_flat(data: dict[str, Any]) -> dict[str, Any]:
    """A plan written in the flat form, spelled in sections (``paratwin migrate-plan`` prints it)."""
    sections: dict[str, dict[str, Any]] = {}
    if isinstance(data.get("schedule"), str):
        sections["schedule"] = {"name": data["schedule"]}
    for key, (section, name) in FLAT_FIELDS.items():
        if key in data:
            sections.setdefault(section, {})[name] = data[key]
    recompute, swap = data.get("recompute", "none"), data.get("swap")
    if isinstance(recompute, list):
        memory: dict[str, Any] = {"policy": "per-stage", "recompute": recompute}
    else:
        memory = {"policy": recompute}
        if recompute == "stage-aware" and "recompute_ratio" in data:
            memory["ratio"] = data["recompute_ratio"]
    if swap is not None:
        memory["swap"] = swap
    if memory != {"policy": "none"}:
        sections["memory"] = memory
    if "gradient_sync" in sections:
        sections["gradient_sync"] = {"method": "allreduce", **sections["gradient_sync"]}
    flat = {*FLAT_FIELDS, "recompute", "recompute_ratio", "swap", "schedule"}
    kept = {k: v for k, v in data.items() if k not in flat}
    return {**kept, **{name: sections[name] for name in _SECTIONS if name in sections}}


def read_plan_document(path: str | Path) -> Any:
    """The parsed YAML or JSON of a plan file, refused in one line when it is missing, a folder, too large,
    not UTF-8 or not valid syntax (``Plan.from_dict`` then checks what it says)."""
    return read_document(path, "plan file", "pass the path of a .yaml or .json plan", MAX_DOCUMENT_BYTES)
