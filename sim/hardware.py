"""Hardware catalog: devices (peak FLOP/s per dtype, memory) and links (bandwidth, latency).

The numbers live in ``sim/data/hardware.yaml``, each with its source; this module turns them into
typed, immutable specs. ``local-cpu`` is the one device whose numbers come from measurement:
``device_from_profile_meta`` and ``link_from_comm_fits`` build specs from what the profiler and the
communication benchmark measured on the machine at hand.

Units inside the code are SI: FLOP/s, bytes/s (per direction), bytes, seconds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

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


@dataclass(frozen=True)
class _Unit:
    """The unit a spec field is in, the range of values real hardware spans in it, and the catalog's unit for
    the same quantity (``sim/data/hardware.yaml``), which a value off by the usual factor was most likely
    written in: ``bandwidth_Bps: 200`` is a link of 200 B/s, meant as 200 GB/s."""

    words: str  # "bytes per second"
    symbol: str  # "B/s"
    low: float  # the least value accepted
    high: float  # the largest value accepted
    bounds: str  # the two in words, for the refusal
    catalog_key: str  # the catalog's field for the quantity ...
    catalog_unit: str  # ... its unit ...
    factor: float  # ... and that unit in the field's


# Bounds far from any real hardware on both sides, so that only a value in the wrong unit falls outside.
# Links: the slowest the project prices is a tc tbf veth at 100 Mbit/s (12.5 MB/s, scripts/netns_*.sh;
# analysis.compression_validate takes kbit rates too: 1mbit is 125 kB/s); 10 kB/s is 12x below that, and a
# bandwidth written in GB/s or Gbit/s (at most ~1,800, NVLink 5) is 5x below the bound. No upper bound:
# an ideal link (bandwidth_Bps: 1e30) is a deliberate what-if (tests/test_engine.py). Latency: the
# largest in the catalog is 90 us (loopback-gloo), a geostationary satellite hop takes 0.25 s one way;
# a latency written in microseconds (NVLink 3.4, InfiniBand 14, TCP 30) is 1 s or more. One below 1 us
# (0.5 meaning 0.5 us) still passes: no bound separates it from a real 0.5 s.
_BANDWIDTH = _Unit("bytes per second", "B/s", 1e4, math.inf, "at least 1e4 B/s, 10 kB/s",
                   "bandwidth_GBps", "GB/s", GB)
_LATENCY = _Unit("seconds", "s", 0.0, 1.0, "at most 1 s", "latency_us", "us", 1e-6)
# Devices: local-cpu, the slowest, runs a matmul at 9e10 FLOP/s, copies at 34.6 GB/s and has 23 GiB; the
# fastest parts reach ~1e16 FLOP/s (fp4), 8 TB/s (HBM3e; a wafer-scale part's SRAM ~2e16 B/s) and 1 TiB.
# The lower bounds (0.1 GFLOP/s, 100 MB/s, 256 MiB) sit 90x or more below local-cpu and refuse a figure written
# in TFLOP/s or GFLOP/s, GB/s or MB/s, GiB or MiB; the upper ones (1 EFLOP/s, 100 PB/s, 1 EiB) refuse an
# SI value written under the catalog's key (peak_tflops: 4e14 is 4e26 FLOP/s).
_PEAK = _Unit("FLOP/s", "FLOP/s", 1e8, 1e18, "1e8 to 1e18 FLOP/s", "peak_tflops", "TFLOP/s", 1e12)
_MEMORY_BANDWIDTH = _Unit("bytes per second", "B/s", 1e8, 1e17, "1e8 to 1e17 B/s", "memory_bandwidth_GBps",
                          "GB/s", GB)
_MEMORY = _Unit("bytes", "bytes", 2**28, 2**60, "256 MiB to 1 EiB", "memory_GiB", "GiB", GiB)


def _written(value: float, factor: float) -> str:
    """``value`` times ``factor`` as one writes it in YAML: 200e9, 4e-6, or the whole number of bytes."""
    exponent = math.log10(factor)
    return f"{value:g}e{exponent:.0f}" if exponent == round(exponent) else f"{round(value * factor)}"


def _check_unit(field: str, value: float, unit: _Unit, dtype: str = "") -> None:
    """Refuse a value no real hardware has, naming its unit and the value it was likely meant as."""
    if unit.low <= value <= unit.high:
        return
    label, shown = f"{field}.{dtype}" if dtype else field, f"{value:g}"

    def form(key: str, number: str) -> str:
        return f"{key}: {{{dtype}: {number}}}" if dtype else f"{key}: {number}"

    if (value < unit.low) == (unit.factor > 1):  # a number in the catalog's unit (GB/s) under the SI field
        fix = f"for {shown} {unit.catalog_unit} write {form(field, _written(value, unit.factor))} or " \
              f"{form(unit.catalog_key, shown)}"
    else:  # an SI number under the catalog's field (memory_GiB: 51539607552)
        meant = value / unit.factor
        fix = f"for {meant:.12g} {unit.symbol} write {form(field, f'{meant:.12g}')} or " \
              f"{form(unit.catalog_key, f'{meant / unit.factor:g}')}"
    raise PydanticCustomError("unit", "{problem}", {
        "problem": f"{label} is in {unit.words}: {shown} is {shown} {unit.symbol}, "
                   f"{'below' if value < unit.low else 'above'} any real hardware ({unit.bounds})",
        "fix": fix})


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

    @field_validator("bandwidth_Bps", "latency_s")
    @classmethod
    def _plausible(cls, value: float, info: ValidationInfo) -> float:
        _check_unit(str(info.field_name), value, _BANDWIDTH if info.field_name == "bandwidth_Bps" else _LATENCY)
        return value

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
        overrides = _in_si(overrides, _LINK_UNITS, field, required=False)
        unknown = set(overrides) - set(type(self).model_fields)
        if unknown:
            raise ConfigError(f"{field}.{sorted(unknown)[0]}", "unknown override",
                              "use bandwidth_Bps (or bandwidth_GBps), latency_s (or latency_us), efficiency, "
                              "p2p_efficiency")
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

    @field_validator("peak_flops")
    @classmethod
    def _plausible_peaks(cls, peaks: dict[str, float]) -> dict[str, float]:
        for dtype, value in peaks.items():
            _check_unit("peak_flops", value, _PEAK, dtype)
        return peaks

    @field_validator("memory_bandwidth_Bps", "memory_bytes")
    @classmethod
    def _plausible(cls, value: float, info: ValidationInfo) -> float:
        _check_unit(str(info.field_name), value, _MEMORY if info.field_name == "memory_bytes" else _MEMORY_BANDWIDTH)
        return value

    def peak(self, dtype: str) -> float:
        key = normalize_dtype(dtype)
        if key not in self.peak_flops:
            raise ConfigError("dtype", f"{self.name} has no {key} peak in the catalog",
                              f"use one of {', '.join(sorted(self.peak_flops))}")
        return self.peak_flops[key]

    def with_overrides(self, field: str = "", **overrides: Any) -> DeviceSpec:
        field = field or f"device {self.name}"
        overrides = _in_si(overrides, _DEVICE_UNITS, field, required=False)
        unknown = set(overrides) - set(type(self).model_fields)
        if unknown:
            raise ConfigError(f"{field}.{sorted(unknown)[0]}", "unknown override",
                              f"use {', '.join(type(self).model_fields)} (or peak_tflops, memory_bandwidth_GBps, "
                              "memory_GiB)")
        return _validated(type(self), {**self.model_dump(), **overrides}, field=field)


def _validated(model: type[BaseModel], data: Mapping[str, Any], field: str) -> Any:
    """Build a pydantic model, turning its ValidationError into a one-line ConfigError."""
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        fix = err.get("ctx", {}).get("fix") or "correct the value (see sim/data/hardware.yaml for examples)"
        raise ConfigError(f"{field}.{where}" if where else field, err["msg"], fix) from None


# --- one reader for the catalog's entries, device files and a cluster's inline specs ---------------------

# The catalog writes each quantity in the unit its datasheets print (TFLOP/s, GB/s, GiB, us); a spec holds
# SI. An entry may give either key of a pair: spec field -> its unit, which names the catalog's key.
_DEVICE_UNITS = {"peak_flops": _PEAK, "memory_bandwidth_Bps": _MEMORY_BANDWIDTH, "memory_bytes": _MEMORY}
_LINK_UNITS = {"bandwidth_Bps": _BANDWIDTH, "latency_s": _LATENCY}
DEVICE_FORM = "{name: MyAccel, peak_tflops: {bf16: 400}, memory_bandwidth_GBps: 3000, memory_GiB: 48}"


def _in_si(entry: Mapping[str, Any], units: Mapping[str, _Unit], field: str, required: bool = True) -> dict[str, Any]:
    """``entry`` with every quantity under its spec field in SI (``peak_tflops: {bf16: 400}`` becomes
    ``peak_flops: {bf16: 4e14}``), dtype names made canonical; ``required``: each quantity must be there."""
    data = {k: v for k, v in entry.items() if k != "aliases"}  # the catalog's other names for a device
    for si, unit in units.items():
        key = unit.catalog_key
        if key in data and si in data:
            raise ConfigError(f"{field}.{key}", f"given together with {si}", f"keep one of {key} and {si}")
        if key in data:
            data[si] = _scaled(data.pop(key), unit, f"{field}.{key}")
        if isinstance(data.get(si), Mapping):  # peak_flops per dtype
            data[si] = {normalize_dtype(k): v for k, v in data[si].items()}
        if required and si not in data:
            raise ConfigError(f"{field}.{key}", "missing", f"give {key} (in {unit.catalog_unit}) or {si} (in "
                              f"{unit.symbol}), as in sim/data/hardware.yaml")
    return data


def _scaled(value: Any, unit: _Unit, field: str) -> Any:
    """A value given in the catalog's unit, in the spec's."""
    if isinstance(value, Mapping):
        return {k: _scaled(v, unit, f"{field}.{k}") for k, v in value.items()}
    try:  # a string too, as pydantic reads the SI fields: YAML 1.1 reads 1e9 (no dot, no sign) as one
        number = float(value) if isinstance(value, int | float | str) and not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None:
        raise ConfigError(field, f"must be a number, got {value!r}", f"write a number in {unit.catalog_unit}")
    return round(number * unit.factor) if unit is _MEMORY else number * unit.factor  # bytes are whole


def device_from_entry(entry: Mapping[str, Any], field: str, name: str | None = None) -> DeviceSpec:
    """A device from a mapping in the catalog's units or in SI (``peak_tflops`` or ``peak_flops``, ...)."""
    data = _in_si(entry, _DEVICE_UNITS, field)
    if name is not None:
        data.setdefault("name", name)
    return _validated(DeviceSpec, data, field=field)


def link_from_entry(entry: Mapping[str, Any], field: str, name: str | None = None) -> LinkSpec:
    """A link from a mapping in the catalog's units or in SI (``bandwidth_GBps`` or ``bandwidth_Bps``, ...)."""
    data = _in_si(entry, _LINK_UNITS, field)
    if name is not None:
        data.setdefault("name", name)
    return _validated(LinkSpec, data, field=field)


# --- catalog ----------------------------------------------------------------------------------------


@lru_cache(maxsize=4)
def _load_catalog(path: str) -> tuple[dict[str, DeviceSpec], dict[str, LinkSpec], dict[str, str]]:
    with open(path) as fh:
        raw = yaml.safe_load(fh)
    devices = {name: device_from_entry(e, f"devices.{name}", name) for name, e in raw["devices"].items()}
    links = {name: link_from_entry(e, f"links.{name}", name) for name, e in raw["links"].items()}
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


def device_from_yaml(path: str | Path, field: str = "device file") -> DeviceSpec:
    """A user device in the catalog's YAML format (one entry, keyed by its name, or a flat mapping; SI
    fields such as ``peak_flops`` are read too)."""
    p = Path(path)
    raw = read_document(p, "device file", "give the path of a YAML device entry")
    if not isinstance(raw, Mapping):
        raise ConfigError(str(p), "must hold a device entry (a mapping)", f"e.g. {DEVICE_FORM}")
    if len(raw) == 1 and isinstance(next(iter(raw.values())), Mapping):
        name, entry = next(iter(raw.items()))
    else:
        name, entry = p.stem, raw
    return device_from_entry(entry, str(p), str(name))
