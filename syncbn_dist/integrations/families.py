"""Synchronized equivalents of model zoos' BatchNorm subclasses, registered by import path (no zoo is imported).

timm's norm+act layers, mmengine's and mmcv's ``_BatchNormXd`` (``_BatchNorm`` without the rank check: any rank),
detectron2's ``NaiveSyncBatchNorm``: what each becomes, and why it keeps its function, in docs/api/conversion.md, "The
conversion contract".
"""

from __future__ import annotations

from torch import Tensor

from ..layer.batchnorm import SyncBatchNorm, SynchronizedBatchNorm2d
from .registry import register_conversion

__all__ = ["SynchronizedBatchNormAct", "SynchronizedBatchNormAct2d"]


class _NormActForward:
    """``act(drop(normalized))``, each step only if the layer has that child, as timm's norm+act layers compute it."""

    def forward(self, input: Tensor) -> Tensor:
        output = super().forward(input)  # type: ignore[misc]
        if hasattr(self, "drop"):
            output = self.drop(output)
        if hasattr(self, "act"):
            output = self.act(output)
        return output


class SynchronizedBatchNormAct2d(_NormActForward, SynchronizedBatchNorm2d):
    """:class:`~syncbn_dist.SynchronizedBatchNorm2d` followed by ``drop`` and ``act``: timm's ``BatchNormAct2d``.

    ``act(drop(y))``, ``y`` the synchronized normalization of (N, C, H, W) input over the global batch (Ioffe & Szegedy
    2015, arXiv:1502.03167). :func:`~syncbn_dist.convert_model` builds it from timm's ``BatchNormAct2d``, taking over
    its ``act`` and ``drop`` (every timm option) and state_dict keys; it computes the same in one process, bit for bit.

    Shape:
        - Input: (N, C, H, W); Output: what ``act`` returns, (N, C, H, W) for timm's activations.
    """


class SynchronizedBatchNormAct(_NormActForward, SyncBatchNorm):
    """:class:`~syncbn_dist.SyncBatchNorm` (any input rank) followed by ``drop`` and ``act`` when present.

    The synchronized equivalent of timm's ``SyncBatchNormAct``, what ``timm.layers.convert_sync_batchnorm`` builds.

    Shape:
        - Input: (N, C, *); Output: what ``act`` returns.
    """


for _module in ("timm.layers.norm_act", "timm.models.layers.norm_act"):
    register_conversion(f"{_module}.BatchNormAct2d", SynchronizedBatchNormAct2d)
    register_conversion(f"{_module}.SyncBatchNormAct", SynchronizedBatchNormAct)
for _path in ("mmengine.model.utils._BatchNormXd", "mmcv.cnn.utils.sync_bn._BatchNormXd"):
    register_conversion(_path, SyncBatchNorm)
register_conversion("detectron2.layers.batch_norm.NaiveSyncBatchNorm", SynchronizedBatchNorm2d)
