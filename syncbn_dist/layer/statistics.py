"""The layer's statistics: the global statistics of a summed payload as the layer uses them, the check every member
makes of the global count, and the running-statistics update.

The derivation itself, from the summed payload ``[sum(x) (C), sum(x**2) (C), count]`` to the mean and variances, is
:func:`syncbn_dist.kernels.statistics.moments_of_total`, which every path shares; one shard's payload comes from the
kernels (:func:`syncbn_dist.kernels.native.local_payload`, or the compiled source's ``shard_payload``).
"""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

from ..kernels.statistics import moments_of_total
from ..kernels.tracing import is_compiling

__all__ = ["update_running_stats"]


def _global_statistics_as(
    total: Tensor, dtype: torch.dtype, num_features: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`~syncbn_dist.kernels.statistics.moments_of_total` of a summed tagged payload as the layer uses them:
    ``(mean, var, unbiased_var, count)``, the three statistics (C,) in ``dtype`` and the (1,) float64 count.

    Five ops for float64 statistics, eight otherwise (one stacked cast and its unbind).
    """
    mean, var, unbiased_var, count, _ = moments_of_total(total, num_features)
    if dtype != total.dtype:
        mean, var, unbiased_var = torch.stack([mean, var, unbiased_var]).to(dtype).unbind()
    return mean, var, unbiased_var, count


def _checked_count(count: Tensor, input: Tensor) -> None:
    """Raise on every member if the global count per channel is 1; look only where it can be below 2.

    Only shards of 0 or 1 values per channel can be part of a global count below 2, so every member that could
    see such a count reads it, and all of them agree; larger shards never wait on the device. Under
    ``torch.compile`` the check is an in-graph assertion (``torch._assert_async``), which raises RuntimeError
    with the same message instead of ValueError: the count cannot be read on the host inside a graph.

    Args:
        count: the (1,) float64 global count.
        input: this member's (N, C, *) shard.

    Raises:
        ValueError: if the global count per channel is 1 (raised on every member, which all see that count).
    """
    if input.numel() > input.size(1):  # more than one value per channel (numel is a multiple of C)
        return
    message = (
        "Expected more than 1 value per channel when training, got a global batch of 1 value per channel "
        f"(local input size {list(input.shape)})"
    )
    if is_compiling():
        torch._assert_async(count[0] != 1.0, message)
    elif int(count.item()) == 1:
        raise ValueError(message)


def update_running_stats(
    running_mean: Tensor, running_var: Tensor, mean: Tensor, unbiased_var: Tensor, momentum: Union[float, Tensor]
) -> None:
    """``running = (1 - momentum) * running + momentum * batch`` for both buffers, as nn.BatchNorm does, in place.

    The one update of a layer's running statistics: its training forward's, and a joined rank's from the total it
    answered (:mod:`syncbn_dist.integrations.torch_join`). ``momentum`` is a 0-dim tensor for a cumulative average
    under ``torch.compile`` (see ``SyncBatchNorm``); statistics of another dtype than the buffers (float32 statistics
    of a float16 model) are cast first.
    """
    if mean.dtype != running_mean.dtype:
        mean, unbiased_var = mean.to(running_mean.dtype), unbiased_var.to(running_var.dtype)
    if isinstance(momentum, Tensor):
        running_mean.lerp_(mean, momentum)
        running_var.lerp_(unbiased_var, momentum)
    else:
        torch._foreach_lerp_([running_mean, running_var], [mean, unbiased_var], momentum)
