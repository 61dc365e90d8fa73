"""The small conv-BatchNorm network and global batch that the script-level tests train (a plain torchrun script,
Lightning's Trainer), written once: the scripts import it from their own directory, the tests through them."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def build() -> nn.Sequential:
    """conv - BatchNorm2d - ReLU - Linear - BatchNorm1d in float64, the same weights every call."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(16, 5), nn.BatchNorm1d(5)
    ).double()


def batch(rows: int) -> tuple[Tensor, Tensor]:
    """The global batch: inputs (rows, 3, 2, 2) with mean 1, std 2, and targets or weights (rows, 5), float64."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, 3, 2, 2, generator=gen, dtype=torch.float64) * 2 + 1
    return x, torch.randn(rows, 5, generator=gen, dtype=torch.float64)
