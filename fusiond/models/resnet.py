"""ResNet-18/50/101, written in the project with torchvision's parameter names.

torchvision does not import beside torch 2.13 here, so the zoo has its own: the same layer
names (`conv1`, `bn1`, `layer1.0.conv1`, ..., `fc`), so a torchvision state dict loads as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual (ResNet-18/34)."""

    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = _conv3x3(cin, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != planes:
            self.downsample = nn.Sequential(_conv1x1(cin, planes, stride), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 - 3x3 - 1x1 bottleneck with a residual (ResNet-50/101), stride on the 3x3."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = _conv1x1(cin, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, cout)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(_conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + identity)


class ResNet(nn.Module):
    """ResNet for images (B, 3, H, W) -> logits (B, num_classes)."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: tuple[int, int, int, int],
        num_classes: int = 1000,
        width: int = 64,
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        cin = width
        stages = []
        for i, n in enumerate(layers):
            planes = width * (2**i)
            blocks: list[nn.Module] = []
            for j in range(n):
                blocks.append(block(cin, planes, stride=2 if (i > 0 and j == 0) else 1))
                cin = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        out: torch.Tensor = self.fc(x)
        return out


def resnet18(num_classes: int = 1000, width: int = 64) -> ResNet:
    """ResNet-18 (11.7M parameters at width 64, 1000 classes)."""
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes, width)


def resnet50(num_classes: int = 1000, width: int = 64) -> ResNet:
    """ResNet-50 (25.6M parameters)."""
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes, width)


def resnet101(num_classes: int = 1000, width: int = 64) -> ResNet:
    """ResNet-101 (44.5M parameters), the FusionLLM paper's vision model."""
    return ResNet(Bottleneck, (3, 4, 23, 3), num_classes, width)


def classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy: logits (B, C), integer targets (B,)."""
    return F.cross_entropy(logits, targets)
