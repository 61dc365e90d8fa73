"""The digits job's optimizer and learning-rate schedule: SGD with Nesterov momentum, a per-epoch cosine."""

from __future__ import annotations

import math

import torch
from torch import nn

from launch.digits.config import TrainConfig


def build_optimizer(net: nn.Module, cfg: TrainConfig) -> torch.optim.SGD:
    """SGD over ``net``'s parameters at ``cfg.lr``, ``cfg.momentum`` (Nesterov when > 0), ``cfg.weight_decay``."""
    return torch.optim.SGD(
        net.parameters(), lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0, weight_decay=cfg.weight_decay
    )


def cosine_schedule(
    optimizer: torch.optim.Optimizer, epochs: int, completed: int = 0
) -> torch.optim.lr_scheduler.LambdaLR:
    """The per-epoch cosine schedule (Loshchilov & Hutter 2017, arXiv:1608.03983, without restarts), in closed
    form: epoch ``e`` (0-based) runs at ``lr * (1 + cos(pi * e / epochs)) / 2``.

    The learning rate is a function of the position alone, so a resumed run (``completed`` epochs done, and the
    optimizer's state loaded, which holds each group's ``initial_lr``) continues on the cosine of the current
    ``epochs``, also when ``train.epochs`` changed.
    """
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda epoch: (1 + math.cos(math.pi * epoch / epochs)) / 2, last_epoch=completed - 1
    )
