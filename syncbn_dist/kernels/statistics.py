"""The statistics of a summed payload: the one derivation of the global mean and variances, for every path.

:func:`moments_of_total` forms the global mean and variances from the members' summed float64 payloads
``[sum(x) (C), sum(x**2) (C), count]`` (Chan, Golub & LeVeque 1979, as sums of exact per-shard moments) for both kernel
sets, a user's ``torch.compile`` graph, the DataParallel Functions, the recorded double backward and a joined rank's
running statistics; :func:`invstd_and_scale` turns a variance into the normalization's per-channel factors.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["COMBINE_DTYPE", "invstd_and_scale", "moments_of_total", "payload_of"]

# Statistics are combined in float64: in float32, E[x^2] - E[x]^2 cancels (docs/design.md, "The statistics").
COMBINE_DTYPE = torch.float64


def moments_of_total(
    total: Tensor, num_features: Optional[int] = None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The global statistics of a summed payload, in float64.

    ``M2 = sum(x**2) - sum(x) * mean`` combines the members' exact sums about the global mean (Chan et al. 1979).

    Args:
        total: float64, the payloads ``[sum (C), sum of squares (C), count]`` summed over the members, followed by
            their summed collective tags (:mod:`syncbn_dist.comm.tags`) when ``num_features`` is given (or any such
            triple: the double backward's sums about a shift).
        num_features: C, where ``total`` carries a tag after the count; None: ``total`` is (2C + 1,), untagged.

    Returns:
        ``(mean, var, unbiased_var, count, tag)``: the mean and the biased and unbiased variances, (C,); the (1,)
        count (a view of ``total``); and the view of the summed tag (empty for an untagged total). A count of 0
        gives NaNs, of 1 an infinite unbiased variance: the callers check the count.
    """
    if num_features is None:
        num_features = total.numel() // 2
    sizes = [num_features, num_features, 1, total.numel() - 2 * num_features - 1]
    sums, squares, count, tag = total.split_with_sizes(sizes)
    mean = sums / count
    m2 = torch.addcmul(squares, sums, mean, value=-1.0)
    var, unbiased_var = torch._foreach_div([m2, m2], [count, count - 1.0])
    return mean, var, unbiased_var, count, tag


def invstd_and_scale(var: Tensor, eps: float, weight: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``invstd = rsqrt(var + eps)`` and ``scale = weight * invstd`` (``invstd`` itself without a weight), per channel,
    in ``var``'s dtype: what the normalization multiplies ``x - mean`` by."""
    invstd = torch.rsqrt(var + eps)
    return invstd, invstd if weight is None else invstd * weight.to(var.dtype)


def payload_of(mean: Tensor, var: Tensor, count: int) -> Tensor:
    """``count * [mean, var + mean**2, 1]`` from a shard's float64 mean and biased variance, in four ops: the 1 is
    padded in as a value, not a constant tensor of its own (``count`` may be symbolic in a graph)."""
    moments = torch.cat([mean, torch.addcmul(var, mean, mean)])
    return torch.constant_pad_nd(moments, (0, 1), 1.0).mul_(count)
