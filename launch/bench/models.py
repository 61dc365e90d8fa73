"""The benchmark's networks, the naive reference SyncBN, the floor variant, and the model of every variant.

Networks: :class:`BenchNet` (conv3x3 -> BN -> ReLU layers at constant width), :class:`ResNetBench`
(ResNet-18 topology at reduced width for 32x32 inputs) and :class:`ResNet50` (torchvision's ResNet-50 topology,
53 BatchNorm2d layers, at any width and input size).

Variants (the keys used throughout the benchmark's JSON):

- ``bn``: plain ``nn.BatchNorm2d``, unsynchronized, the lower bound (a);
- ``syncbn_dist``: :func:`syncbn_dist.convert_model` on DDP's process group (b);
- ``syncbn_dist_dedicated``: the same on a dedicated group created once and shared by every layer (b', P5);
- ``syncbn_dist_debug``: ``syncbn_dist`` with debug mode on during its steps (b''): every collective checked, the
  cost of catching a rank that runs other layers at any step;
- ``floor``: plain ``nn.BatchNorm2d`` plus the collectives syncbn_dist sends, with dummy payloads (f): the
  in-step synchronization floor (:class:`FloorBatchNorm2d`);
- ``naive``: :class:`NaiveSyncBatchNorm2d`, detectron2-style (c);
- ``torch_syncbn``: ``torch.nn.SyncBatchNorm`` (d), CUDA only: it refuses CPU tensors;
- ``<variant>_compiled``: the same model, ``torch.compile`` of its DDP wrapper (inductor).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd import Function

import syncbn_dist
from launch.bench.resnet_blocks import BasicBlock, Bottleneck

EAGER_VARIANTS = ("bn", "syncbn_dist", "syncbn_dist_dedicated", "syncbn_dist_debug", "floor", "naive", "torch_syncbn")
# Variants whose steps run in syncbn_dist's debug mode (launch.bench.step).
DEBUG_VARIANTS = ("syncbn_dist_debug",)
COMPILED_SUFFIX = "_compiled"
VARIANTS = EAGER_VARIANTS + tuple(v + COMPILED_SUFFIX for v in ("bn", "syncbn_dist", "floor", "naive"))
_EAGER_LABELS = {
    "bn": "(a) nn.BatchNorm2d",
    "syncbn_dist": "(b) syncbn_dist",
    "syncbn_dist_dedicated": "(b') syncbn_dist, dedicated group",
    "syncbn_dist_debug": "(b'') syncbn_dist, debug mode",
    "floor": "(f) BN + same collectives",
    "naive": "(c) naive SyncBN",
    "torch_syncbn": "(d) torch.nn.SyncBatchNorm",
}
LABELS = {
    **_EAGER_LABELS,
    **{v + COMPILED_SUFFIX: _EAGER_LABELS[v] + ", compiled" for v in ("bn", "syncbn_dist", "floor", "naive")},
}
MODELS = ("convbn", "resnet18")


def eager_variant(variant: str) -> str:
    """The eager variant a (possibly ``_compiled``) variant builds its model from."""
    return variant[: -len(COMPILED_SUFFIX)] if variant.endswith(COMPILED_SUFFIX) else variant


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


class ResNetBench(nn.Module):
    """ResNet-18 topology (2-2-2-2 BasicBlocks) at base ``width`` for 32x32 inputs: 20 BatchNorm2d layers.

    CIFAR-style stem (one conv3x3 -> BN -> ReLU, no max-pool), stages of ``width``, 2, 4 and 8 x ``width``
    channels at strides 1, 2, 2, 2, a BN in each downsampling shortcut, global average pool, linear head.
    """

    def __init__(self, in_channels: int, width: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(True)
        )
        blocks: list[nn.Module] = []
        channels = width
        for stage, stride in enumerate((1, 2, 2, 2)):
            out_channels = width * 2**stage
            blocks += [BasicBlock(channels, out_channels, stride), BasicBlock(out_channels, out_channels, 1)]
            channels = out_channels
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class ResNet50(nn.Module):
    """torchvision's ``resnet50`` topology (He et al. 2016, arXiv:1512.03385): a 7x7 stride-2 stem with BatchNorm
    and max-pool, stages of 3, 4, 6 and 3 Bottlenecks of ``width``, 2, 4 and 8 x ``width`` planes (4x that out) at
    strides 1, 2, 2, 2, a BatchNorm in each stage's projection shortcut: 53 BatchNorm2d layers. ``width=64`` is
    torchvision's model (25.6 M parameters); smaller widths keep the layer count and shapes' structure for the CPU.

    Input: (N, in_channels, H, W), 224x224 for ImageNet (any size of at least 32). Output: (N, num_classes).
    """

    def __init__(self, in_channels: int = 3, width: int = 64, num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(True),
            nn.MaxPool2d(3, 2, 1),
        )
        blocks: list[nn.Module] = []
        channels = width
        for stage, (depth, stride) in enumerate(zip((3, 4, 6, 3), (1, 2, 2, 2))):
            planes = width * 2**stage
            for index in range(depth):
                blocks.append(Bottleneck(channels, planes, stride if index == 0 else 1))
                channels = planes * Bottleneck.expansion
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def build_model(model: str, in_channels: int, width: int, num_layers: int, num_classes: int) -> nn.Module:
    """The scenario's network with plain ``nn.BatchNorm2d`` layers: ``"convbn"`` or ``"resnet18"``.

    Raises:
        ValueError: for a model name not in :data:`MODELS`.
    """
    if model == "convbn":
        return BenchNet(in_channels, width, num_layers, num_classes)
    if model == "resnet18":
        return ResNetBench(in_channels, width, num_classes)
    raise ValueError(f"expected a model in {MODELS} (got {model!r})")


class _SyncPoint(Function):
    """Identity on ``input``; forward all-reduces ``forward_payload``, backward a fresh ``backward_numel`` buffer.

    The collectives carry dummy values (zeros) but have syncbn_dist's sizes, dtype and group, one per layer and
    direction: forward before the layer's own work, backward after it (a synchronized layer's collective sits
    between its two passes over the activations, either way inside the layer).
    """

    @staticmethod
    def forward(ctx: Any, input: Tensor, forward_payload: Tensor, backward_numel: int, group: Optional[Any]) -> Tensor:
        ctx.backward_numel, ctx.group = backward_numel, group
        dist.all_reduce(forward_payload, group=group)
        return input.view_as(input)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None, None, None]:
        payload = torch.zeros(ctx.backward_numel, dtype=torch.float64, device=grad_output.device)
        dist.all_reduce(payload, group=ctx.group)
        return grad_output, None, None, None


class FloorBatchNorm2d(nn.BatchNorm2d):
    """Plain ``nn.BatchNorm2d`` plus the two collectives a syncbn_dist layer sends: the in-step floor (f).

    In training, forward and backward each all-reduce 2C + 6 float64 values on ``process_group`` through autograd,
    as syncbn_dist does (``[sum, sumsq, count]`` and ``[sum_dy, sum_dy_xhat, 0]``, each followed by the collective's
    five-value tag: syncbn_dist.comm.tags), with dummy payloads. Its step time minus plain BN's is what the
    synchronization points cost inside a training step (waiting for the slowest rank, waking the transport's thread
    while the cores are busy), which no synchronized BatchNorm can avoid.
    """

    def __init__(self, *args: Any, process_group: Optional[Any] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.process_group = process_group

    def forward(self, input: Tensor) -> Tensor:
        if self.training:
            # On the input, not the output: the output of a custom Function that returns a view may not be
            # modified in place (the inplace ReLU after it), and a clone would add a pass over the activations.
            numel = 2 * self.num_features + 6
            payload = torch.zeros(numel, dtype=torch.float64, device=input.device)
            input = _SyncPoint.apply(input, payload, numel, self.process_group)
        return super().forward(input)


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

    In a one-member group it is plain ``nn.BatchNorm2d``, as detectron2's is, unless ``sync_alone`` is set (an
    attribute): then it runs its synchronized path there too (launch.bench.resnet50_step forces it so).
    """

    sync_alone = False

    def __init__(self, *args: Any, process_group: Optional[Any] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.process_group = process_group

    def forward(self, input: Tensor) -> Tensor:
        world_size = dist.get_world_size(self.process_group) if dist.is_initialized() else 1
        if not self.training or (world_size == 1 and not self.sync_alone):
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


def _floor_from(process_group: Optional[Any]) -> Callable[[nn.BatchNorm2d], nn.Module]:
    def build(old: nn.BatchNorm2d) -> nn.Module:
        new = FloorBatchNorm2d(old.num_features, old.eps, old.momentum, process_group=process_group)
        new.load_state_dict(old.state_dict())
        return new.to(old.weight.device)

    return build


def build_variant(variant: str, base: nn.Module, dedicated_group: Optional[Any] = None) -> nn.Module:
    """A deep copy of ``base`` (same weights) with its BatchNorm layers made into ``variant``'s kind.

    A ``_compiled`` variant gets its eager variant's model here; the caller compiles it.

    Args:
        variant: one of :data:`VARIANTS`.
        base: a model with plain ``nn.BatchNorm2d`` layers; it is not modified.
        dedicated_group: the group of ``syncbn_dist_dedicated``, created once by the caller.

    Raises:
        ValueError: for an unknown variant, or ``syncbn_dist_dedicated`` without a group.
    """
    model = copy.deepcopy(base)
    variant = eager_variant(variant)
    if variant == "bn":
        return model
    if variant in ("syncbn_dist", "syncbn_dist_debug"):
        return syncbn_dist.convert_model(model)
    if variant == "syncbn_dist_dedicated":
        if dedicated_group is None:
            raise ValueError("expected a dedicated_group for variant 'syncbn_dist_dedicated' (got None)")
        return syncbn_dist.convert_model(model, process_group=dedicated_group)
    if variant == "naive":
        return _replace_batchnorm(model, _naive_from(None))
    if variant == "floor":
        return _replace_batchnorm(model, _floor_from(None))
    if variant == "torch_syncbn":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    raise ValueError(f"expected a variant in {VARIANTS} (got {variant!r})")
