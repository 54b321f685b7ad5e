"""The Plan: a small declarative description of how to train a workload on a cluster.

Plans are YAML or JSON files (or dicts) validated into a ``Plan``. Structural checks (types,
ranges, unknown fields) happen on construction; checks that need the workload and the cluster
(degrees vs world size, TP vs heads, partition coverage, schedule preconditions) happen in
``Plan.check`` and raise ``ConfigError`` naming the field and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from traces.errors import ConfigError
from traces.limits import check_document, check_file_size, short_repr

RecomputeMode = Literal["none", "full", "stage-aware"]


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "plan"
    workload: str
    workload_options: dict[str, Any] = Field(default_factory=dict)
    cluster: str | dict[str, Any] = "local-cpu-2"
    profile: str | None = None  # trace bundle directory: measured costs on the same hardware
    dp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    chunks: int = Field(1, ge=1, description="virtual stages per pipeline rank")
    micro_batch: int = Field(1, ge=1)
    microbatches: int = Field(1, ge=1)
    dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    partition: Literal["uniform", "parameters", "time"] | list[list[int]] = "uniform"
    schedule: str = "1f1b"
    recompute: RecomputeMode | list[float] = "none"
    recompute_ratio: float = Field(1.0, ge=0.0, le=1.0, description="first-stage ratio r0 of stage-aware")
    swap: list[float] | None = None  # fraction of each stage's saved activations swapped to host
    tp_overlap: int = Field(0, ge=0, le=3, description="Merak sub-pipelined TP level")
    dp_bucket_mb: float = Field(25.0, gt=0)

    @field_validator("partition")
    @classmethod
    def _ranges_are_pairs(cls, value: object) -> object:
        if isinstance(value, list):
            for i, item in enumerate(value):
                if len(item) != 2 or item[0] >= item[1]:
                    raise ValueError(f"stage {i} range {item} must be [first_layer, end_layer) with first < end")
        return value

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
        return Plan.from_dict({**self.model_dump(), **changes})

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "plan") -> Plan:
        if not isinstance(data, dict):
            raise ConfigError(source, "a plan must be a mapping of fields", "see examples/plans/*.yaml")
        check_document(data, source)
        try:
            return cls(**data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "plan"
            fix = "remove it (known fields: " + ", ".join(cls.model_fields) + ")" \
                if first["type"] == "extra_forbidden" else f"got {short_repr(first.get('input'))}"
            raise ConfigError(f"{source}: {where}", first["msg"], fix) from None

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(str(path), "plan file not found", "pass the path of a .yaml or .json plan")
        check_file_size(path, str(path))
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(str(path), f"not UTF-8 text (byte {exc.start} is 0x{exc.object[exc.start]:02x})",
                              "save the plan as UTF-8 YAML or JSON") from None
        try:
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            raise ConfigError(str(path), f"not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                              f"{str(exc).splitlines()[0]}", "fix the syntax") from None
        return cls.from_dict(data, source=str(path))

    def dump(self, path: str | Path) -> Path:
        path = Path(path)
        data = self.model_dump(exclude_defaults=False)
        path.write_text(json.dumps(data, indent=2) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False))
        return path
