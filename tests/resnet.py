"""A small ResNet (He et al. 2016, arXiv:1512.03385) for tests, built from launch/bench/resnet_blocks.py's BasicBlock
and Bottleneck (torchvision's block structure at toy width, the bench's blocks too).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from launch.bench.resnet_blocks import BasicBlock, Bottleneck


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
