"""Synchronized equivalents of model zoos' BatchNorm subclasses, registered by import path (no zoo is imported).

==========================================================  =============================================
original class (matched by ``__module__.__qualname__``)      becomes
==========================================================  =============================================
``timm.layers.norm_act.BatchNormAct2d`` (timm >= 0.9)        :class:`SynchronizedBatchNormAct2d`
``timm.models.layers.norm_act.BatchNormAct2d`` (timm 0.6)    :class:`SynchronizedBatchNormAct2d`
``timm.layers.norm_act.SyncBatchNormAct`` (and 0.6 path)     :class:`SynchronizedBatchNormAct`
``mmengine.model.utils._BatchNormXd``                        :class:`~syncbn_dist.SyncBatchNorm` (any rank)
``mmcv.cnn.utils.sync_bn._BatchNormXd`` (mmcv 1.x)           :class:`~syncbn_dist.SyncBatchNorm` (any rank)
``detectron2.layers.batch_norm.NaiveSyncBatchNorm``          :class:`~syncbn_dist.SynchronizedBatchNorm2d`
==========================================================  =============================================

timm's norm+act layers run ``act(drop(batch_norm(x)))``; every constructor option of timm 1.0 that changes the
forward (``apply_act``, ``act_layer``, ``act_kwargs``, ``inplace``, ``drop_layer``) lives in the ``act`` and ``drop``
child modules, which move to the synchronized layer as they are. ``_BatchNormXd`` is ``_BatchNorm`` without the
input rank check. detectron2's ``NaiveSyncBatchNorm`` is ``nn.BatchNorm2d`` in one process and an approximate
synchronized BatchNorm (E[x²]−E[x]², ``stats_mode``) across processes; its synchronized equivalent here is the exact
one, and ``stats_mode`` is kept for :func:`~syncbn_dist.revert_model`. ``FrozenBatchNormAct2d`` (timm) and
``FrozenBatchNorm2d`` (torchvision, detectron2) are not ``_BatchNorm`` subclasses and are left alone: frozen
statistics need no synchronization.
"""

from __future__ import annotations

from torch import Tensor

from ..layer.batchnorm import SyncBatchNorm, SynchronizedBatchNorm2d
from .registry import register_conversion

__all__ = ["SynchronizedBatchNormAct", "SynchronizedBatchNormAct2d"]


class _NormActForward:
    """``act(drop(normalized))`` after the synchronized normalization, as timm's norm+act layers compute it.

    Each step runs only if the layer has that child, as in timm's ``SyncBatchNormAct`` (``BatchNormAct2d`` always
    has both, ``nn.Identity`` when unused).
    """

    def forward(self, input: Tensor) -> Tensor:
        output = super().forward(input)  # type: ignore[misc]
        if hasattr(self, "drop"):
            output = self.drop(output)
        if hasattr(self, "act"):
            output = self.act(output)
        return output


class SynchronizedBatchNormAct2d(_NormActForward, SynchronizedBatchNorm2d):
    """:class:`~syncbn_dist.SynchronizedBatchNorm2d` followed by ``drop`` and ``act``: timm's ``BatchNormAct2d``.

    ``act(drop(y))`` where ``y`` is the synchronized normalization of (N, C, H, W) input (Ioffe & Szegedy 2015,
    arXiv:1502.03167) over the global batch. Built by :func:`~syncbn_dist.convert_model` from a
    ``timm.layers.norm_act.BatchNormAct2d``, whose ``act`` and ``drop`` children (and so ``apply_act``,
    ``act_layer``, ``act_kwargs``, ``inplace`` and ``drop_layer``) it takes over unchanged; state_dict keys are the
    original's. In one process its output is ``BatchNormAct2d``'s bit for bit.

    Shape:
        - Input: (N, C, H, W); Output: what ``act`` returns, (N, C, H, W) for timm's activations.
    """


class SynchronizedBatchNormAct(_NormActForward, SyncBatchNorm):
    """:class:`~syncbn_dist.SyncBatchNorm` (any input rank) followed by ``drop`` and ``act`` when present.

    The synchronized equivalent of timm's ``SyncBatchNormAct`` (the ``nn.SyncBatchNorm`` subclass that
    ``timm.layers.convert_sync_batchnorm`` builds, CUDA only), which runs ``drop`` and ``act`` if the layer has them.

    Shape:
        - Input: (N, C, *); Output: what ``act`` returns.
    """


for _module in ("timm.layers.norm_act", "timm.models.layers.norm_act"):
    register_conversion(f"{_module}.BatchNormAct2d", SynchronizedBatchNormAct2d)
    register_conversion(f"{_module}.SyncBatchNormAct", SynchronizedBatchNormAct)
for _path in ("mmengine.model.utils._BatchNormXd", "mmcv.cnn.utils.sync_bn._BatchNormXd"):
    register_conversion(_path, SyncBatchNorm)
register_conversion("detectron2.layers.batch_norm.NaiveSyncBatchNorm", SynchronizedBatchNorm2d)
