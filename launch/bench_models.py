"""The benchmark's CNN, the naive reference SyncBN, and the model of every benchmarked variant.

Variants (the keys used throughout the benchmark's JSON):

- ``bn``: plain ``nn.BatchNorm2d``, unsynchronized, the lower bound (a);
- ``syncbn_dist``: :func:`syncbn_dist.convert_model` on DDP's process group (b);
- ``syncbn_dist_dedicated``: the same on a dedicated group created once and shared by every layer (b', P5);
- ``naive``: :class:`NaiveSyncBatchNorm2d`, detectron2-style (c);
- ``torch_syncbn``: ``torch.nn.SyncBatchNorm`` (d), CUDA only: it refuses CPU tensors.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd import Function

import syncbn_dist

VARIANTS = ("bn", "syncbn_dist", "syncbn_dist_dedicated", "naive", "torch_syncbn")
LABELS = {
    "bn": "(a) nn.BatchNorm2d",
    "syncbn_dist": "(b) syncbn_dist",
    "syncbn_dist_dedicated": "(b') syncbn_dist, dedicated group",
    "naive": "(c) naive SyncBN",
    "torch_syncbn": "(d) torch.nn.SyncBatchNorm",
}


class BenchNet(nn.Module):
    """``num_layers`` blocks of conv3x3 -> BatchNorm2d -> ReLU at constant ``width``, global pool, linear head.

    Every BatchNorm layer has ``width`` channels, so every synchronized layer sends the same payload.
    """

    def __init__(self, in_channels: int, width: int, num_layers: int, num_classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for _ in range(num_layers):
            layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(True)]
            channels = width
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).mean((2, 3)))


class _AllReduceSum(Function):
    """Differentiable sum over a group: all_reduce in forward, all_reduce of the gradient in backward."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, group: Optional[Any]) -> Tensor:
        ctx.group = group
        output = input.clone()
        dist.all_reduce(output, group=group)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None]:
        grad = grad_output.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class NaiveSyncBatchNorm2d(nn.BatchNorm2d):
    """The reference SyncBN many codebases copy (detectron2's ``NaiveSyncBatchNorm``, stats_mode "").

    Each rank computes the per-channel ``[mean, mean of squares]`` in the input dtype, all-reduces them
    through autograd, and normalizes with elementwise autograd ops (``input * scale + shift``), so autograd
    keeps every intermediate and derives the backward. Like detectron2 it assumes equal batch sizes on every
    rank and puts the biased variance into ``running_var``. Kept here only as the benchmark's baseline (c).
    """

    def __init__(self, *args: Any, process_group: Optional[Any] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.process_group = process_group

    def forward(self, input: Tensor) -> Tensor:
        world_size = dist.get_world_size(self.process_group) if dist.is_initialized() else 1
        if not self.training or world_size == 1:
            return super().forward(input)
        num_features = input.size(1)
        mean = input.mean(dim=[0, 2, 3])
        meansqr = (input * input).mean(dim=[0, 2, 3])
        stats = _AllReduceSum.apply(torch.cat([mean, meansqr]), self.process_group) * (1.0 / world_size)
        mean, meansqr = stats.split(num_features)
        var = meansqr - mean * mean
        invstd = torch.rsqrt(var + self.eps)
        scale = self.weight * invstd
        shift = self.bias - mean * scale
        with torch.no_grad():
            self.running_mean += self.momentum * (mean.detach() - self.running_mean)
            self.running_var += self.momentum * (var.detach() - self.running_var)
            self.num_batches_tracked.add_(1)
        return input * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)


def _replace_batchnorm(module: nn.Module, build: Callable[[nn.BatchNorm2d], nn.Module]) -> nn.Module:
    """Replace every plain ``nn.BatchNorm2d`` below ``module`` (recursively) with ``build(old)``."""
    for name, child in module.named_children():
        if type(child) is nn.BatchNorm2d:
            setattr(module, name, build(child))
        else:
            _replace_batchnorm(child, build)
    return module


def _naive_from(process_group: Optional[Any]) -> Callable[[nn.BatchNorm2d], nn.Module]:
    def build(old: nn.BatchNorm2d) -> nn.Module:
        new = NaiveSyncBatchNorm2d(old.num_features, old.eps, old.momentum, process_group=process_group)
        new.load_state_dict(old.state_dict())
        return new.to(old.weight.device)

    return build


def build_variant(variant: str, base: nn.Module, dedicated_group: Optional[Any] = None) -> nn.Module:
    """A deep copy of ``base`` (same weights) with its BatchNorm layers made into ``variant``'s kind.

    Args:
        variant: one of :data:`VARIANTS`.
        base: a model with plain ``nn.BatchNorm2d`` layers; it is not modified.
        dedicated_group: the group of ``syncbn_dist_dedicated``, created once by the caller.

    Raises:
        ValueError: for an unknown variant, or ``syncbn_dist_dedicated`` without a group.
    """
    model = copy.deepcopy(base)
    if variant == "bn":
        return model
    if variant == "syncbn_dist":
        return syncbn_dist.convert_model(model)
    if variant == "syncbn_dist_dedicated":
        if dedicated_group is None:
            raise ValueError("expected a dedicated_group for variant 'syncbn_dist_dedicated' (got None)")
        return syncbn_dist.convert_model(model, process_group=dedicated_group)
    if variant == "naive":
        return _replace_batchnorm(model, _naive_from(None))
    if variant == "torch_syncbn":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    raise ValueError(f"expected a variant in {VARIANTS} (got {variant!r})")
