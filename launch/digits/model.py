"""The digits CNN, and how it is wrapped: DDP with synchronized BatchNorm, or DataParallelWithCallback."""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import syncbn_dist
from launch.digits.config import DigitsConfig, ModelConfig
from launch.digits.runtime import Runtime
from syncbn_dist import SyncBatchNorm


def _conv_bn(in_channels: int, out_channels: int, bn_momentum: float) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),  # BatchNorm's shift makes a bias redundant
        nn.BatchNorm2d(out_channels, momentum=bn_momentum),
        nn.ReLU(inplace=True),
    )


class DigitsNet(nn.Module):
    """A CNN for 1x8x8 digits: conv-BN-ReLU x2, pool, conv-BN-ReLU, pool, then Linear-BatchNorm1d-ReLU-Linear
    (Linear-ReLU-Linear with ``cfg.head_bn`` false).

    Shape:
        - Input: (N, 1, 8, 8)
        - Output: (N, num_classes) logits
    """

    def __init__(self, cfg: ModelConfig, num_classes: int = 10) -> None:
        super().__init__()
        w, m = cfg.width, cfg.bn_momentum
        self.features = nn.Sequential(
            _conv_bn(1, w, m),
            _conv_bn(w, w, m),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            _conv_bn(w, 2 * w, m),
            nn.MaxPool2d(2),  # 4x4 -> 2x2
        )
        head_bn = [nn.BatchNorm1d(4 * w, momentum=m)] if cfg.head_bn else []
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * w * 4, 4 * w, bias=not cfg.head_bn),
            *head_bn,
            nn.ReLU(inplace=True),
            nn.Dropout(cfg.dropout),
            nn.Linear(4 * w, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def build_model(cfg: DigitsConfig, runtime: Runtime) -> tuple[nn.Module, nn.Module, int]:
    """The model to train, the bare model (for eval and checkpoints), and the number of replicas per step.

    DDP (world_size > 1): BatchNorm layers are converted, then wrapped in DistributedDataParallel.
    DataParallel: converted, then wrapped in DataParallelWithCallback over every CUDA device, or over
    ``cpu_replicas`` CPU thread replicas. One process without torchrun keeps plain BatchNorm.
    """
    net = DigitsNet(cfg.model)
    if cfg.parallel == "dataparallel":
        net = syncbn_dist.convert_model(net).to(runtime.device)
        if runtime.device.type == "cuda":
            device_ids = list(range(torch.cuda.device_count()))
            return syncbn_dist.DataParallelWithCallback(net, device_ids=device_ids), net, len(device_ids)
        return syncbn_dist.DataParallelWithCallback(net, cpu_replicas=cfg.cpu_replicas), net, cfg.cpu_replicas
    net = net.to(runtime.device)
    if runtime.world_size == 1:
        return net, net, 1
    if cfg.model.sync_bn:
        net = syncbn_dist.convert_model(net)
    # No buffer sync in forward: DDP would otherwise copy rank 0's running statistics to every rank at each
    # step and hide any divergence; synchronized BatchNorm keeps them equal, and check_same_on_all_ranks
    # verifies that at the end. (torch >= 2.13 spells it forward_sync_buffers, older ones broadcast_buffers.)
    no_buffer_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        else {"broadcast_buffers": False}
    )
    device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
    return DistributedDataParallel(net, device_ids=device_ids, **no_buffer_sync), net, 1


def bn_transports(module: nn.Module) -> list[str]:
    """The ``last_transport`` of every synchronized BatchNorm layer (empty for plain BatchNorm)."""
    return sorted({m.last_transport or "unused" for m in module.modules() if isinstance(m, SyncBatchNorm)})
