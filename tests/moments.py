"""The tests' view of one shard's statistics and of their combination: the payload's count and moments, and the global
mean and variance of summed ones, through the package's own derivation (``local_payload``, ``moments_of_total``)."""

from __future__ import annotations

import torch
from torch import Tensor

from syncbn_dist.kernels.native import local_payload
from syncbn_dist.kernels.statistics import moments_of_total


def local_moments(input: Tensor) -> tuple[Tensor, Tensor]:
    """``count`` (1,) and ``moments`` (2C,) = [sum(C), sumsq(C)] of one (N, C, *) shard, float64 (zeros if empty)."""
    payload = local_payload(input)
    return payload[-1:], payload[:-1]


def combine_moments(count: Tensor, moments: Tensor) -> tuple[Tensor, Tensor]:
    """Global mean and biased variance (C,) float64 from summed counts and moments (zeros for a zero count)."""
    mean, var, _, _, _ = moments_of_total(torch.cat([moments, count.clamp(min=1.0)]))
    return mean, var.clamp(min=0.0)
