"""ResNet building blocks (He et al. 2016, arXiv:1512.03385), as in torchvision.models.resnet.

BasicBlock and Bottleneck: BatchNorm after every convolution, a 1x1 convolution plus BatchNorm in the
downsampling shortcut, and the last BatchNorm of each block zero-initialised (``zero_init_residual=True``, Goyal
et al. 2017), so each block starts as its shortcut. Shared by the bench's ResNet-18-style network (:mod:`.models`)
and the tests' small ResNet (``tests/resnet.py``). torchvision itself is not used: its wheel on the registry is a
CUDA build whose ops do not load with the CPU torch this project installs.
"""

from __future__ import annotations

from typing import Optional

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
