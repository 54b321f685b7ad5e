"""Bottleneck ResNets (He et al. 2016) as cuttable layers: stem, every bottleneck block, head.

ResNet-50/101 use torchvision's ``Bottleneck`` where torchvision imports; otherwise paratwin's own
definition below, which is the same architecture (torchvision's "v1.5": stride on the 3x3
convolution, projection shortcut = 1x1 convolution + BatchNorm, ReLU in place) with the same
initialisation, so parameter counts and saved activations agree. ``describe()`` records which
one was used. ``resnet-tiny`` is a small CIFAR-size network for tests: a 3x3 stem without
max-pool and one bottleneck per stage.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sim.workloads import RESNET_PRESETS, ResNetConfig, preset_with_overrides
from traces.errors import ConfigError

from .base import Batch, Workload
from .data import check_data_source, synthetic_images

try:  # torchvision does not import beside the torch 2.13.0 CPU build used here.
    import torchvision
    from torchvision.models.resnet import Bottleneck as _TorchvisionBottleneck
except Exception:  # noqa: BLE001 - any import-time failure means "not available"
    torchvision = None
    _TorchvisionBottleneck = None

EXPANSION = 4
# Blocks per stage: He et al. 2016, Table 1.
STAGES = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 0: (1, 1, 1)}
WIDTHS = {50: (64, 128, 256, 512), 101: (64, 128, 256, 512), 0: (8, 16, 32)}
STEM_WIDTH = {50: 64, 101: 64, 0: 16}


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carries the stride), 1x1 expand by 4, each with BatchNorm; residual add."""

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * EXPANSION, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * EXPANSION)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class Stem(nn.Module):
    def __init__(self, width: int, imagenet: bool) -> None:
        super().__init__()
        if imagenet:  # 7x7 stride-2 convolution, then 3x3 stride-2 max-pool
            self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
            self.maxpool: nn.Module = nn.MaxPool2d(3, stride=2, padding=1)
        else:  # CIFAR-size: one 3x3 convolution, no pooling
            self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
            self.maxpool = nn.Identity()
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.maxpool(self.relu(self.bn1(self.conv1(x))))


class Head(nn.Module):
    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.avgpool(x), 1))


@dataclass(frozen=True)
class BlockSpec:
    name: str
    inplanes: int
    planes: int
    stride: int
    downsample: bool


def block_specs(depth: int) -> list[BlockSpec]:
    specs, inplanes = [], STEM_WIDTH[depth]
    for stage, (count, planes) in enumerate(zip(STAGES[depth], WIDTHS[depth], strict=True)):
        for j in range(count):
            stride = 2 if stage > 0 and j == 0 else 1
            specs.append(BlockSpec(f"layer{stage + 1}.{j}", inplanes, planes, stride,
                                   stride != 1 or inplanes != planes * EXPANSION))
            inplanes = planes * EXPANSION
    return specs


def _init_like_torchvision(module: nn.Module) -> None:
    # torchvision.models.ResNet.__init__: Kaiming-normal (fan_out) convolutions, BatchNorm 1 / 0.
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)


class ResNetWorkload(Workload):
    def __init__(self, name: str, cfg: ResNetConfig, definition: str = "auto") -> None:
        if cfg.depth not in STAGES:
            raise ConfigError("depth", f"ResNet depth {cfg.depth} is not built here",
                              "use 50, 101 or 0 (tiny)")
        if definition not in ("auto", "torchvision", "paratwin"):
            raise ConfigError("definition", f"unknown definition {definition!r}",
                              "use auto, torchvision or paratwin")
        if definition == "torchvision" and _TorchvisionBottleneck is None:
            raise ConfigError("definition", "torchvision does not import here",
                              "use definition='paratwin' or 'auto'")
        self.name = name
        self.cfg = cfg
        self.blocks = block_specs(cfg.depth)
        # The tiny test network is always ours; the real ones prefer torchvision's blocks.
        use_tv = cfg.depth != 0 and definition != "paratwin" and _TorchvisionBottleneck is not None
        self.definition = f"torchvision {torchvision.__version__} Bottleneck" if use_tv else \
            "paratwin exec.workloads.resnet.Bottleneck (same architecture as torchvision v1.5)"
        self._bottleneck = _TorchvisionBottleneck if use_tv else Bottleneck

    def layer_names(self) -> list[str]:
        return ["stem", *(b.name for b in self.blocks), "head"]

    def layer_kind(self, index: int) -> str:
        return "stem" if index == 0 else "head" if index == self.num_layers - 1 else "bottleneck"

    def build_layer(self, index: int) -> nn.Module:
        depth = self.cfg.depth
        if index == 0:
            layer: nn.Module = Stem(STEM_WIDTH[depth], imagenet=depth != 0)
        elif index == self.num_layers - 1:
            layer = Head(WIDTHS[depth][-1] * EXPANSION, self.cfg.classes)
        else:
            b = self.blocks[index - 1]
            down = nn.Sequential(
                nn.Conv2d(b.inplanes, b.planes * EXPANSION, 1, stride=b.stride, bias=False),
                nn.BatchNorm2d(b.planes * EXPANSION),
            ) if b.downsample else None
            layer = self._bottleneck(b.inplanes, b.planes, b.stride, down)
        _init_like_torchvision(layer)
        return layer

    def make_batch(self, micro_batch: int, seed: int = 0, device: str | torch.device = "cpu") -> Batch:
        images, labels = synthetic_images(micro_batch, self.cfg.image, self.cfg.classes, seed)
        return Batch(images.to(device), labels.to(device))

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, targets)

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "family": "resnet", "config": asdict(self.cfg),
                "definition": self.definition, "data": "synthetic"}


def from_preset(name: str, **overrides: object) -> ResNetWorkload:
    """``resnet-tiny``, ``resnet50``, ``resnet101``; overrides: ``image``, ``classes``, ``definition``."""
    definition = str(overrides.pop("definition", "auto"))
    if check_data_source(overrides.pop("data", "synthetic")) != "synthetic":
        raise ConfigError("data", f"{name} reads images; only synthetic images are available",
                          "use data='synthetic'")
    cfg = preset_with_overrides("ResNet", RESNET_PRESETS, name, overrides, allowed=("image", "classes"),
                                extra=("definition", "data"))
    return ResNetWorkload(name, cfg, definition=definition)
