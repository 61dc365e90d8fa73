"""sync_running_stats: align the running statistics of every BatchNorm layer across ranks."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..comm import all_reduce_mean_, broadcast_from_first_, group_needs_sync

__all__ = ["sync_running_stats"]

_MODES = ("mean", "broadcast")


def sync_running_stats(module: nn.Module, process_group: Optional[Any] = None, mode: str = "mean") -> nn.Module:
    """Make running_mean and running_var of every BatchNorm-like layer identical on all ranks, in place.

    For models trained with plain BatchNorm, whose running statistics drift apart across ranks: call it before
    evaluation or checkpointing, as timm's ``distribute_bn`` is called. One collective, on a float64 tensor packing
    every layer's buffers, however many layers; ``num_batches_tracked`` is left alone.

    Args:
        module: the model; every ``_BatchNorm`` layer with running statistics (nn.BatchNorm*, nn.SyncBatchNorm,
            syncbn_dist's layers).
        process_group: the group to align over; None means the world group.
        mode: ``"mean"`` averages the buffers over the group (running_var: the mean of the per-rank estimates, as
            timm); ``"broadcast"`` copies the first member's buffers to all. Default: ``"mean"``

    Returns:
        ``module``; unchanged without an initialized process group of more than one member.

    Raises:
        ValueError: for an unknown ``mode``, or if this rank is not a member of ``process_group``.
    """
    if mode not in _MODES:
        raise ValueError(f"expected mode to be one of {_MODES} (got {mode!r})")
    layers = [m for m in module.modules() if isinstance(m, _BatchNorm) and m.running_mean is not None]
    if not group_needs_sync(process_group) or not layers:
        return module
    buffers = [b for layer in layers for b in (layer.running_mean, layer.running_var)]
    flat = torch.cat([b.detach().reshape(-1).to(device=buffers[0].device, dtype=torch.float64) for b in buffers])
    if mode == "mean":
        all_reduce_mean_(flat, process_group)
    else:
        broadcast_from_first_(flat, process_group)
    with torch.no_grad():
        for buffer, chunk in zip(buffers, flat.split([b.numel() for b in buffers])):
            buffer.copy_(chunk.view_as(buffer))
    return module
