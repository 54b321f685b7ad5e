"""Hardware catalog: devices (peak FLOP/s per dtype, memory) and links (bandwidth, latency).

The numbers live in ``sim/data/hardware.yaml``, each with its source; this module turns them into
typed, immutable specs. ``local-cpu`` is the one device whose numbers come from measurement:
``device_from_profile_meta`` and ``link_from_comm_fits`` build specs from what the profiler and the
communication benchmark measured on the machine at hand.

Units inside the code are SI: FLOP/s, bytes/s (per direction), bytes, seconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from traces.errors import ConfigError
from traces.strict_yaml import read_document

CATALOG_PATH = Path(__file__).parent / "data" / "hardware.yaml"

# Canonical dtype names and the spellings users (and torch) use for them.
DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8")
_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "float8": "fp8", "e4m3": "fp8", "float8_e4m3fn": "fp8",
}
# Bytes of one element of a plan's parameters and gradients (plans train in fp32, fp16 or bf16).
ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
GB = 1e9
GiB = 2**30


def normalize_dtype(dtype: str) -> str:
    key = str(dtype).strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise ConfigError("dtype", f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPES)}")
    return key


class LinkSpec(BaseModel):
    """One link class: time to move S bytes once = latency_s + S / (bandwidth_Bps * efficiency)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    kind: str = "custom"  # nvlink / pcie / infiniband / ethernet / measured / custom
    bandwidth_Bps: float = Field(gt=0)  # per direction
    latency_s: float = Field(ge=0)
    efficiency: float = Field(default=1.0, gt=0, le=1.0)  # achievable fraction of bandwidth_Bps
    # The share of that rate one point-to-point send/recv between two ranks reaches. NCCL's send/recv
    # "are mostly optimized for alltoall ... individual send/recv might not achieve peak bandwidth"
    # (NVIDIA, github NVIDIA/nccl issue 464, 2021-02-09), so a pipeline's activation exchange may run
    # below the rate the collectives (and an all-to-all's grouped sends) reach. sim/data/hardware.yaml
    # says where each link's figure comes from.
    p2p_efficiency: float = Field(default=1.0, gt=0, le=1.0)
    source: str = ""

    @property
    def effective_bandwidth_Bps(self) -> float:
        return self.bandwidth_Bps * self.efficiency

    def transfer_time(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.effective_bandwidth_Bps

    @property
    def p2p_bandwidth_Bps(self) -> float:
        """What one send/recv between two ranks reaches over this link alone."""
        return self.effective_bandwidth_Bps * self.p2p_efficiency

    @classmethod
    def from_fit(cls, alpha_s: float, bandwidth_Bps: float, name: str = "measured",
                 source: str = "alpha-beta fit of exec/commbench samples") -> LinkSpec:
        """A link from an alpha-beta fit (``exec.commbench.fit_alpha_beta_from_samples``)."""
        return _validated(cls, {"name": name, "kind": "measured", "bandwidth_Bps": bandwidth_Bps,
                                "latency_s": max(float(alpha_s), 0.0), "source": source}, field=name)

    def with_overrides(self, field: str = "", **overrides: Any) -> LinkSpec:
        field = field or f"link {self.name}"
        unknown = set(overrides) - set(type(self).model_fields)
        if unknown:
            raise ConfigError(f"{field}.{sorted(unknown)[0]}", "unknown override",
                              "use bandwidth_Bps, latency_s, efficiency, p2p_efficiency")
        return _validated(type(self), {**self.model_dump(), **overrides}, field=field)


class DeviceSpec(BaseModel):
    """An accelerator (or a CPU rank): peak dense FLOP/s per dtype, memory bandwidth and size."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    kind: Literal["gpu", "cpu"] = "gpu"
    peak_flops: dict[str, float]  # canonical dtype -> dense FLOP/s
    memory_bandwidth_Bps: float = Field(gt=0)
    memory_bytes: int = Field(gt=0)
    host_link: str | None = None  # catalog link name of the host <-> device copy path
    intra_link: str | None = None  # the link its vendor pairs it with inside a node
    # Streaming multiprocessors: a GEMM's output tiles run in waves of sm_count (wave quantisation,
    # sim.analytic.gemm_time). None: no wave model (CPU, or a device the catalog does not describe).
    sm_count: int | None = Field(None, gt=0)
    source: str = ""

    def peak(self, dtype: str) -> float:
        key = normalize_dtype(dtype)
        if key not in self.peak_flops:
            raise ConfigError("dtype", f"{self.name} has no {key} peak in the catalog",
                              f"use one of {', '.join(sorted(self.peak_flops))}")
        return self.peak_flops[key]

    def with_overrides(self, field: str = "", **overrides: Any) -> DeviceSpec:
        field = field or f"device {self.name}"
        unknown = set(overrides) - set(type(self).model_fields)
        if unknown:
            raise ConfigError(f"{field}.{sorted(unknown)[0]}", "unknown override",
                              f"use {', '.join(type(self).model_fields)}")
        return _validated(type(self), {**self.model_dump(), **overrides}, field=field)


def _validated(model: type[BaseModel], data: Mapping[str, Any], field: str) -> Any:
    """Build a pydantic model, turning its ValidationError into a one-line ConfigError."""
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"{field}.{where}" if where else field, err["msg"],
                          "correct the value (see sim/data/hardware.yaml for examples)") from None


# --- catalog ----------------------------------------------------------------------------------------

def _device_from_entry(name: str, entry: Mapping[str, Any]) -> DeviceSpec:
    data = {
        "name": name,
        "kind": entry.get("kind", "gpu"),
        "peak_flops": {normalize_dtype(k): float(v) * 1e12 for k, v in entry["peak_tflops"].items()},
        "memory_bandwidth_Bps": float(entry["memory_bandwidth_GBps"]) * GB,
        "memory_bytes": int(float(entry["memory_GiB"]) * GiB),
        "host_link": entry.get("host_link"),
        "intra_link": entry.get("intra_link"),
        "sm_count": entry.get("sm_count"),
        "source": entry.get("source", ""),
    }
    return _validated(DeviceSpec, data, field=f"devices.{name}")


def _link_from_entry(name: str, entry: Mapping[str, Any]) -> LinkSpec:
    data = {
        "name": name,
        "kind": entry.get("kind", "custom"),
        "bandwidth_Bps": float(entry["bandwidth_GBps"]) * GB,
        "latency_s": float(entry["latency_us"]) * 1e-6,
        "efficiency": float(entry.get("efficiency", 1.0)),
        "p2p_efficiency": float(entry.get("p2p_efficiency", 1.0)),
        "source": entry.get("source", ""),
    }
    return _validated(LinkSpec, data, field=f"links.{name}")


@lru_cache(maxsize=4)
def _load_catalog(path: str) -> tuple[dict[str, DeviceSpec], dict[str, LinkSpec], dict[str, str]]:
    with open(path) as fh:
        raw = yaml.safe_load(fh)
    devices = {name: _device_from_entry(name, e) for name, e in raw["devices"].items()}
    links = {name: _link_from_entry(name, e) for name, e in raw["links"].items()}
    aliases: dict[str, str] = {}
    for name, entry in raw["devices"].items():
        for alias in [name, *entry.get("aliases", [])]:
            aliases[str(alias).lower()] = name
    return devices, links, aliases


def _catalog() -> tuple[dict[str, DeviceSpec], dict[str, LinkSpec], dict[str, str]]:
    return _load_catalog(str(CATALOG_PATH))


def list_devices() -> list[str]:
    return sorted(_catalog()[0])


def list_links() -> list[str]:
    return sorted(_catalog()[1])


def get_device(name: str, field: str = "device") -> DeviceSpec:
    devices, _, aliases = _catalog()
    canonical = aliases.get(str(name).lower())
    if canonical is None:
        raise ConfigError(field, f"unknown device {name!r}", f"use one of {', '.join(sorted(devices))}")
    return devices[canonical]


# Substrings of the name CUDA reports (torch.cuda.get_device_name) -> the catalog's device. The PCIe and
# NVL boards of the H100 have other memory and clocks than the SXM part the catalog holds: not matched.
_CUDA_NAMES = (("H200", "H200"), ("H100 80GB HBM3", "H100-SXM"), ("V100", "V100-32GB"), ("3090", "RTX3090"))


def catalog_device_for_gpu(cuda_name: str, memory_bytes: int) -> str | None:
    """The catalog's device for a GPU as CUDA names it (the A100s told apart by their memory), or None
    where the catalog has no such part: a device check then asks for the name instead of guessing."""
    if "A100" in cuda_name:
        return "A100-80GB" if memory_bytes > 50 * 2**30 else "A100-40GB"
    return next((device for key, device in _CUDA_NAMES if key in cuda_name), None)


def gpu_at_hand(device_name: str | None = None) -> tuple[str, str]:
    """CUDA's name for GPU 0 and the catalog's device it is priced as (``device_name`` where given), for
    the scripts that measure a GPU. ConfigError where there is no CUDA GPU or the catalog has no such part."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("device", "no CUDA device here", "run it on a GPU machine, or --smoke for the CPU path")
    props = torch.cuda.get_device_properties(0)
    name = device_name or catalog_device_for_gpu(props.name, props.total_memory)
    if name is None:
        raise ConfigError("--device-name", f"{props.name!r} is not in sim/data/hardware.yaml's catalog",
                          "pass --device-name NAME, or add the device there with its datasheet")
    get_device(name, field="--device-name")  # a name the catalog does not hold is refused here
    return props.name, name


def get_link(name: str, field: str = "link") -> LinkSpec:
    links = _catalog()[1]
    spec = links.get(str(name).lower())
    if spec is None:
        raise ConfigError(field, f"unknown link {name!r}", f"use one of {', '.join(sorted(links))}")
    return spec


# --- specs from measurement ---------------------------------------------------------------------------

def device_from_profile_meta(meta: Mapping[str, Any], name: str = "local-cpu") -> DeviceSpec:
    """A DeviceSpec from what a profile bundle measured on the machine at hand.

    Keys are read from ``meta["hardware"]`` (where ``traces.bundle.environment_info`` puts the
    machine's facts) or from the top level: ``peak_flops`` (dtype -> achieved FLOP/s of a large
    matmul), ``memory_bandwidth_Bps`` (copy bandwidth, read + write), ``memory_bytes``; optional
    ``kind`` and ``source``. Missing keys fall back to the catalog's ``local-cpu`` numbers, so a
    partial measurement (today's bundles record memory_bytes only) still yields a spec.
    """
    base = get_device("local-cpu")
    hw = meta.get("hardware", {})
    facts = {**meta, **hw} if isinstance(hw, Mapping) else dict(meta)
    peaks = facts.get("peak_flops") or base.peak_flops
    if not isinstance(peaks, Mapping):
        raise ConfigError("meta.peak_flops", "must map dtype -> FLOP/s", "e.g. {fp32: 9.0e10}")
    data = {
        "name": name,
        "kind": facts.get("kind", base.kind),
        "peak_flops": {normalize_dtype(k): float(v) for k, v in peaks.items()},
        "memory_bandwidth_Bps": float(facts.get("memory_bandwidth_Bps") or base.memory_bandwidth_Bps),
        "memory_bytes": int(facts.get("memory_bytes") or base.memory_bytes),
        "host_link": facts.get("host_link", base.host_link),
        "intra_link": facts.get("intra_link", base.intra_link),
        "source": str(facts.get("source", "measured (profile bundle meta)")),
    }
    return _validated(DeviceSpec, data, field="meta")


def link_from_comm_fits(fits: Any, primitive: str = "send_recv", name: str = "measured") -> LinkSpec:
    """A LinkSpec from a comm_fits table (traces.schema.COMM_FIT_TABLE) row of ``primitive``.

    ``fits`` is a pandas DataFrame or a list of row dicts. Point-to-point fits give the link
    directly (exec/commbench calls it ``send_recv``); for other primitives the caller must undo
    the algorithm's factor itself.
    """
    rows = fits.to_dict("records") if hasattr(fits, "to_dict") else list(fits)
    match = [r for r in rows if str(r.get("primitive")) == primitive]
    if not match:
        have = sorted({str(r.get("primitive")) for r in rows})
        raise ConfigError("comm_fits.primitive", f"no fit for {primitive!r}", f"use one of {have}")
    # Largest world size first: its fit has seen the most contention, the conservative choice.
    row = max(match, key=lambda r: int(r.get("world_size", 0)))
    return LinkSpec.from_fit(float(row["alpha_s"]), float(row["bandwidth_Bps"]), name=name,
                             source=f"exec/commbench fit of {primitive} ({row.get('backend', '?')})")


def device_from_yaml(path: str | Path) -> DeviceSpec:
    """A user device in the catalog's YAML format (one entry, keyed by its name, or a flat mapping)."""
    p = Path(path)
    raw = read_document(p, "device file", "give the path of a YAML device entry")
    if isinstance(raw, Mapping) and len(raw) == 1 and isinstance(next(iter(raw.values())), Mapping):
        name, entry = next(iter(raw.items()))
    else:
        name, entry = str(raw.get("name", p.stem)), raw
    missing = {"peak_tflops", "memory_bandwidth_GBps", "memory_GiB"} - set(entry)
    if missing:
        raise ConfigError(f"{p}", f"missing key(s) {sorted(missing)}", "see sim/data/hardware.yaml")
    return _device_from_entry(str(name), entry)
