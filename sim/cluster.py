"""Cluster specs: nodes x devices per node, the device, and the links inside and between nodes.

A cluster is loaded from a preset name, a YAML file or a dict. Devices and links are catalog names
(``sim/data/hardware.yaml``) or inline specs; ``overrides`` adjusts catalog numbers without copying
them, e.g. ``overrides: {inter_node_link: {efficiency: 0.8}}``. Every mistake is reported as a
``ConfigError`` naming the field and the fix.

Ranks are placed node-major: rank r lives on node r // devices_per_node (torchrun's order).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, model_validator

from sim.hardware import (
    DEVICE_FORM,
    DeviceSpec,
    LinkSpec,
    device_from_entry,
    device_from_yaml,
    get_device,
    get_link,
    link_from_entry,
    list_links,
)
from traces.errors import ConfigError
from traces.strict_yaml import read_document

_LINK_FIELDS = ("intra_node_link", "inter_node_link")
_KNOWN_KEYS = {"name", "nodes", "devices_per_node", "device", *_LINK_FIELDS, "nics_per_node", "p2p_channels",
               "host_cores", "overrides", "source"}


class ClusterSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "custom"
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node_link: LinkSpec | None = None  # None only for one device per node
    inter_node_link: LinkSpec | None = None  # None only for a single node
    # Network adapters per node; inter_node_link is one adapter, so the node's network bandwidth is
    # nics_per_node x inter_node_link.bandwidth (e.g. 4 x HDR = 800 Gbit/s per DGX A100 node).
    nics_per_node: int = 1
    # Peers one rank's all-to-all exchanges with at once. NCCL runs the grouped sends and receives
    # of an all-to-all in one kernel, one channel per peer operation over its p2p channels
    # (NVIDIA/nccl src/enqueue.cc scheduleP2pTasksToPlan: "Try to use all channels, but one channel
    # per operation"; p2pnChannels = pow2Up(min(nChannels, NCCL_MAX_P2P_NCHANNELS)),
    # src/graph/paths.cc ncclTopoComputeP2pChannels), so n - 1 peers cost ceil((n - 1) / p2p_channels)
    # latencies, not n - 1 (sim.collectives). 1: one peer at a time (a pairwise exchange).
    p2p_channels: int = 1
    # Cores per node that its ranks' compute threads share with their communication (CPU ranks on
    # gloo: the backend's threads and the kernel's socket copies run on the same cores); None: each
    # rank's compute has a processor of its own (a GPU). With a benchmark that measured the CPU
    # cost of communicating (exec.commbench cpu_s), the engine slows compute that overlaps data
    # moving when the node's threads want more cores than it has (sim.host_cpu).
    host_cores: int | None = None
    source: str = ""

    @model_validator(mode="before")
    @classmethod
    def _resolve(cls, data: Any, info: ValidationInfo) -> Any:
        """Resolve catalog names, apply overrides and check the shape, before pydantic's own checks. A device
        file's relative path is read from ``info.context["folder"]``: the cluster file's (``load_cluster``)."""
        if not isinstance(data, Mapping):
            raise ConfigError("cluster", f"expected a mapping, got {type(data).__name__}",
                              "give nodes, devices_per_node, device, intra_node_link, inter_node_link")
        data = dict(data)
        unknown = set(data) - _KNOWN_KEYS
        if unknown:
            raise ConfigError(f"cluster.{sorted(unknown)[0]}", "unknown field",
                              f"use {', '.join(sorted(_KNOWN_KEYS))}")
        for key in ("nodes", "devices_per_node"):
            if key not in data:
                raise ConfigError(f"cluster.{key}", "missing", f"set {key} to a positive integer")
            _positive_int(data, key)
        _positive_int(data, "nics_per_node", default=1)
        _positive_int(data, "p2p_channels", default=1)
        if data.get("host_cores") is not None:
            _positive_int(data, "host_cores")
        if "device" not in data:
            raise ConfigError("cluster.device", "missing", "name a catalog device, e.g. A100-80GB")

        overrides = data.pop("overrides", None) or {}
        if not isinstance(overrides, Mapping):
            raise ConfigError("cluster.overrides", "must be a mapping",
                              "e.g. {inter_node_link: {efficiency: 0.8}}")
        bad = set(overrides) - {"device", *_LINK_FIELDS}
        if bad:
            raise ConfigError(f"cluster.overrides.{sorted(bad)[0]}", "cannot be overridden",
                              "override device, intra_node_link or inter_node_link")

        device = _resolve_device(data["device"], (info.context or {}).get("folder"))
        if "device" in overrides:
            device = device.with_overrides("cluster.overrides.device",
                                            **_mapping(overrides["device"], "cluster.overrides.device"))
        data["device"] = device

        # A multi-device node without a named intra-node link uses the link its vendor pairs the
        # device with (NVLink for SXM parts, PCIe for the RTX 3090).
        if data.get("intra_node_link") is None and data["devices_per_node"] > 1:
            if device.intra_link is None:
                raise ConfigError("cluster.intra_node_link", "missing (devices_per_node > 1)",
                                  f"name one of {', '.join(list_links())}")
            data["intra_node_link"] = device.intra_link
        if data.get("inter_node_link") is None and data["nodes"] > 1:
            raise ConfigError("cluster.inter_node_link", "missing (nodes > 1)",
                              f"name one of {', '.join(list_links())}, e.g. ib-hdr")
        for key in _LINK_FIELDS:
            if data.get(key) is not None:
                link = _resolve_link(data[key], f"cluster.{key}")
                if key in overrides:
                    field = f"cluster.overrides.{key}"
                    link = link.with_overrides(field, **_mapping(overrides[key], field))
                data[key] = link
        return data

    # --- placement -----------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def check_rank(self, rank: int, field: str = "rank") -> int:
        if not 0 <= int(rank) < self.world_size:
            raise ConfigError(field, f"rank {rank} outside the cluster",
                              f"use 0..{self.world_size - 1} ({self.nodes} x {self.devices_per_node})")
        return int(rank)

    def node_of(self, rank: int) -> int:
        return self.check_rank(rank) // self.devices_per_node

    def local_rank(self, rank: int) -> int:
        return self.check_rank(rank) % self.devices_per_node

    def link_between(self, a: int, b: int) -> LinkSpec:
        """The link class a message from rank a to rank b crosses (intra- or inter-node)."""
        if self.check_rank(a) == self.check_rank(b):
            raise ConfigError("ranks", f"rank {a} to itself crosses no link", "pass two different ranks")
        link = self.intra_node_link if self.node_of(a) == self.node_of(b) else self.inter_node_link
        assert link is not None  # guaranteed by _resolve for any pair of distinct ranks
        return link

    @property
    def memory_per_rank_bytes(self) -> int:
        """Memory one rank may use. A GPU's memory is its own; a CPU device's memory is the host's,
        shared by every rank placed on that host, so each gets an even share (the catalog's
        ``memory_GiB`` of a CPU device is the whole host's). An even share is exact for ranks that
        use equal memory and conservative for a pipeline whose stages differ."""
        if self.device.kind == "cpu":
            return int(self.device.memory_bytes) // self.devices_per_node
        return int(self.device.memory_bytes)

    @property
    def node_network_Bps(self) -> float:
        """Effective network bandwidth of a whole node (all its adapters, one direction)."""
        if self.inter_node_link is None:
            return 0.0
        return self.nics_per_node * self.inter_node_link.effective_bandwidth_Bps

    @property
    def host_link(self) -> LinkSpec | None:
        """Host <-> device copy link (swap traffic), from the device's catalog entry."""
        return get_link(self.device.host_link) if self.device.host_link else None

    def describe(self) -> str:
        inter = (f", {self.nics_per_node} x {self.inter_node_link.name} between nodes"
                 if self.inter_node_link else "")
        intra = f" over {self.intra_node_link.name}" if self.intra_node_link else ""
        return f"{self.name}: {self.nodes} x {self.devices_per_node} {self.device.name}{intra}{inter}"


def _positive_int(data: dict[str, Any], key: str, default: int | None = None) -> None:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value or value < 1:
        raise ConfigError(f"cluster.{key}", f"must be a positive integer, got {value!r}",
                          f"set {key} to 1 or more")
    data[key] = int(value)


def _mapping(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(field, f"must be a mapping, got {value!r}", "e.g. {bandwidth_Bps: 2.0e10}")
    return dict(value)


def _resolve_device(value: Any, folder: Path | None = None) -> DeviceSpec:
    """A catalog name, a device YAML file (``*.yaml``; a relative path is read from ``folder``, else the
    current directory), or an inline device in the catalog's units or SI."""
    if isinstance(value, DeviceSpec):
        return value
    if isinstance(value, str) and value.endswith((".yaml", ".yml")):
        path = Path(folder or ".") / value
        if not path.is_file():
            base = "the cluster file's folder" if folder else "the current directory"
            where = "" if Path(value).is_absolute() else \
                f" (a relative path is read from {base}, {Path(folder or '.').resolve()})"
            raise ConfigError("cluster.device", f"no device file {value!r}{where}", "give the path of a YAML "
                              "device entry in sim/data/hardware.yaml's format, or a catalog name")
        return device_from_yaml(path)
    if isinstance(value, str):
        try:
            return get_device(value, field="cluster.device")
        except ConfigError as exc:
            raise ConfigError(exc.field, exc.problem, f"{exc.fix}; or the path of a device YAML file "
                              f"(sim/data/hardware.yaml's format), or an inline device {DEVICE_FORM}") from None
    spec = _mapping(value, "cluster.device")
    if "base" in spec:  # a catalog device with some numbers replaced
        base = get_device(spec.pop("base"), field="cluster.device.base")
        return base.with_overrides("cluster.device", **spec)
    return device_from_entry(spec, "cluster.device")


def _resolve_link(value: Any, field: str) -> LinkSpec:
    if isinstance(value, LinkSpec):
        return value
    if isinstance(value, str):
        return get_link(value, field=field)
    spec = _mapping(value, field)
    if "base" in spec:
        return get_link(spec.pop("base"), field=f"{field}.base").with_overrides(field, **spec)
    return link_from_entry(spec, field, name=field.rsplit(".", 1)[-1])


# --- presets and loading ----------------------------------------------------------------------------------

PRESETS: dict[str, dict[str, Any]] = {
    "dgx-a100-8": dict(nodes=1, devices_per_node=8, device="A100-80GB", intra_node_link="nvlink3",
                       source="NVIDIA DGX A100 datasheet (2020): 8 x A100 80GB, NVSwitch, 600 GB/s NVLink"),
    # 8 nodes of 8 A100s as vTrain's configurations describe them (github VIA-Research/vTrain, the
    # files behind sim/data/a100_single_node_megatron.csv): inter-node "800" (read as Gbit/s per node
    # = 4 x HDR 200 Gbit/s, which the nodes have) and intra-node "150" (units not stated). For NVLink
    # the link catalog's nvlink3 is kept: its all-reduce bus bandwidth is the ~200 GB/s nccl-tests
    # measure on 8 x A100 (sim/data/hardware.yaml), a measurement, where vTrain's 150 is a simulator
    # input. Ranks of a node share its 4 adapters (sim.comm.concurrent_groups).
    "a100-64": dict(nodes=8, devices_per_node=8, device="A100-80GB", intra_node_link="nvlink3",
                    inter_node_link="ib-hdr", nics_per_node=4, p2p_channels=8,
                    source="vTrain configurations (Bang et al., MICRO 2024): 8-GPU A100 nodes, 800 Gbit/s per "
                           "node (4 x HDR); NVLink at the nccl-tests all-reduce bus bandwidth (~200 GB/s); "
                           "p2p_channels: NCCL 2.9.9 on 8 x A100 nodes (EC2 p4d) logs '6 coll channels, 8 p2p "
                           "channels, 2 p2p channels per peer' (github NVIDIA/nccl issue 527)"),
    # 128 DGX H100 nodes with 8 x ConnectX-7 NDR 400 Gbit/s adapters each.
    "h100-1024": dict(nodes=128, devices_per_node=8, device="H100-SXM", intra_node_link="nvlink4",
                      inter_node_link="ib-ndr", nics_per_node=8,
                      source="NVIDIA DGX H100 datasheet (2023): 8 x H100, 8 x ConnectX-7 400 Gb/s"),
    "h200-1": dict(nodes=1, devices_per_node=1, device="H200",
                   source="the single H200 the project can borrow for device checks"),
    "local-cpu-2": dict(nodes=1, devices_per_node=2, device="local-cpu", intra_node_link="loopback-gloo",
                        host_cores=2,
                        source="two gloo ranks on the development machine; host_cores: lscpu there, "
                               "2 vCPUs (AMD EPYC, 1 thread per core, KVM)"),
}


def list_presets() -> list[str]:
    return sorted(PRESETS)


def cluster_from_dict(data: Mapping[str, Any], field: str = "cluster", folder: Path | None = None) -> ClusterSpec:
    """A ClusterSpec from a mapping; ``preset: NAME`` starts from a preset and the other keys override it.
    ``folder``: where a relative device file path is read from (default: the current directory)."""
    data = dict(data)
    if "preset" in data:
        name = data.pop("preset")
        if name not in PRESETS:
            raise ConfigError(f"{field}.preset", f"unknown preset {name!r}",
                              f"use one of {', '.join(PRESETS)}")
        data = {"name": name, **PRESETS[name], **data}
    try:
        return ClusterSpec.model_validate(data, context={"folder": folder})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"{field}.{where}", err["msg"], "see examples/clusters/*.yaml") from None


def load_cluster(source: str | Path | Mapping[str, Any] | ClusterSpec) -> ClusterSpec:
    """A cluster from a preset name, a YAML file path, a mapping, or an existing spec."""
    if isinstance(source, ClusterSpec):
        return source
    if isinstance(source, Mapping):
        return cluster_from_dict(source)
    text = str(source)
    if text in PRESETS:
        return cluster_from_dict({"preset": text})
    path = Path(text)
    fix = f"use one of {', '.join(PRESETS)} or a path like examples/clusters/a100-2x8-hdr.yaml"
    if not path.exists():
        where = "" if path.is_absolute() else f" (a relative path is read from the current directory, {Path.cwd()})"
        raise ConfigError("cluster", f"{text!r} is neither a preset nor a YAML file{where}", fix)
    raw = read_document(path, "cluster file", fix)
    if not isinstance(raw, Mapping):
        raise ConfigError(str(path), "top level must be a mapping", "see examples/clusters/*.yaml")
    raw = dict(raw.get("cluster", raw))
    raw.setdefault("name", path.stem)
    return cluster_from_dict(raw, field=f"{path.name}", folder=path.parent)
