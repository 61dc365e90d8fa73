"""The layer's statistics: a summed payload's global statistics as the layer uses them (derived by
:func:`syncbn_dist.kernels.statistics.moments_of_total`), the global count's check, the running-statistics update.
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
    """``(mean, var, unbiased_var, count)`` of a summed tagged payload: the statistics (C,) in ``dtype`` (one stacked
    cast), the (1,) float64 count."""
    mean, var, unbiased_var, count, _ = moments_of_total(total, num_features)
    if dtype != total.dtype:
        mean, var, unbiased_var = torch.stack([mean, var, unbiased_var]).to(dtype).unbind()
    return mean, var, unbiased_var, count


def _checked_count(count: Tensor, input: Tensor) -> None:
    """Raise on every member if the global count per channel is 1, reading it only where it can be below 2 (a shard
    of 0 or 1 values per channel: larger shards never wait on the device). Under ``torch.compile`` it is an in-graph
    assertion, which raises RuntimeError with the same message.

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
    """``running = (1 - momentum) * running + momentum * batch`` for both buffers, in place, as nn.BatchNorm does: the
    one update of a layer's running statistics (a training forward's, a joined rank's). ``momentum`` may be a 0-dim
    tensor (compiled cumulative average); statistics of another dtype than the buffers are cast first.
    """
    if mean.dtype != running_mean.dtype:
        mean, unbiased_var = mean.to(running_mean.dtype), unbiased_var.to(running_var.dtype)
    if isinstance(momentum, Tensor):
        running_mean.lerp_(mean, momentum)
        running_var.lerp_(unbiased_var, momentum)
    else:
        torch._foreach_lerp_([running_mean, running_var], [mean, unbiased_var], momentum)
