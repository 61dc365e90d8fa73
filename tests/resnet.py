"""A small ResNet (He et al. 2016, arXiv:1512.03385) for tests: torchvision's block structure at toy width.

BasicBlock and Bottleneck as in torchvision.models.resnet: BatchNorm after every convolution, a 1x1 convolution
plus BatchNorm in the downsampling shortcut, and the last BatchNorm of each block zero-initialised
(``zero_init_residual=True``, Goyal et al. 2017), so each block starts as its shortcut. torchvision itself is not
used: its wheel on the registry is a CUDA build whose ops do not load with the CPU torch the tests install.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn


def _downsample(in_planes: int, out_planes: int, stride: int) -> Optional[nn.Sequential]:
    if stride == 1 and in_planes == out_planes:
        return None
    return nn.Sequential(nn.Conv2d(in_planes, out_planes, 1, stride, bias=False), nn.BatchNorm2d(out_planes))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions; output ``planes`` channels."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        nn.init.zeros_(self.bn2.weight)
        self.downsample = _downsample(in_planes, planes, stride)
        self.relu = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu(out + shortcut)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand; output ``planes * 4`` channels."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out_planes = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_planes)
        nn.init.zeros_(self.bn3.weight)
        self.downsample = _downsample(in_planes, out_planes, stride)
        self.relu = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu(out + shortcut)


class ResNet(nn.Module):
    """Stem, then ``blocks`` (a BasicBlock, a strided BasicBlock and a strided Bottleneck, each with its
    shortcut), global average pooling and a linear classifier.

    Input: (N, 3, H, W) float, H and W multiples of 4 (16x16 in the tests). Output: (N, num_classes) logits.
    Every BatchNorm is a plain ``nn.BatchNorm2d``; convert it with ``syncbn_dist.convert_model``.
    """

    def __init__(self, width: int = 4, num_classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(
            BasicBlock(width, width),
            BasicBlock(width, 2 * width, stride=2),
            Bottleneck(2 * width, width, stride=2),  # 2w -> 4w channels: a projection shortcut
        )
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.stem(x)))


def resnet(seed: int = 0, width: int = 4, num_classes: int = 5) -> ResNet:
    """A :class:`ResNet` with deterministic float32 initial weights."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return ResNet(width, num_classes)
