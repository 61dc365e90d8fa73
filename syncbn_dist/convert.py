"""convert_model and revert_model: swap BatchNorm layers for synchronized ones and back, keeping tensors."""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from .batchnorm import SyncBatchNorm, SynchronizedBatchNorm1d, SynchronizedBatchNorm2d, SynchronizedBatchNorm3d
from .replicate import DataParallelWithCallback

__all__ = ["convert_model", "revert_model"]

# Most specific first: nn.SyncBatchNorm and the Synchronized* classes are checked before their bases.
_TO_SYNC: tuple[tuple[type[nn.Module], type[SyncBatchNorm]], ...] = (
    (nn.SyncBatchNorm, SyncBatchNorm),
    (nn.BatchNorm1d, SynchronizedBatchNorm1d),
    (nn.BatchNorm2d, SynchronizedBatchNorm2d),
    (nn.BatchNorm3d, SynchronizedBatchNorm3d),
)
_TO_PLAIN: tuple[tuple[type[SyncBatchNorm], type[nn.Module]], ...] = (
    (SynchronizedBatchNorm1d, nn.BatchNorm1d),
    (SynchronizedBatchNorm2d, nn.BatchNorm2d),
    (SynchronizedBatchNorm3d, nn.BatchNorm3d),
    (SyncBatchNorm, nn.SyncBatchNorm),
)


def _rebuild(old: nn.Module, new_cls: type[nn.Module], **kwargs: Any) -> nn.Module:
    """A ``new_cls`` layer that owns the very same parameter and buffer tensors and settings as ``old``."""
    new = new_cls(
        old.num_features, old.eps, old.momentum, old.affine, old.track_running_stats, device="meta", **kwargs
    )
    new._parameters = dict(old._parameters)
    new._buffers = dict(old._buffers)
    new._non_persistent_buffers_set = set(old._non_persistent_buffers_set)
    new.train(old.training)
    if hasattr(old, "qconfig"):
        new.qconfig = old.qconfig
    return new


def _convert_layer(module: nn.Module, name: str, process_group: Optional[Any]) -> Optional[nn.Module]:
    if isinstance(module, SyncBatchNorm):
        if process_group is not None:
            module.process_group = process_group
        module._qualified_name = name
        return None
    for source, target in _TO_SYNC:
        if isinstance(module, source):
            group = process_group if process_group is not None else getattr(module, "process_group", None)
            layer = _rebuild(module, target, process_group=group)
            layer._qualified_name = name  # names the layer in mismatch errors (see syncbn_dist.set_debug)
            return layer
    return None


def _revert_layer(module: nn.Module, name: str) -> Optional[nn.Module]:
    for source, target in _TO_PLAIN:
        if isinstance(module, source):
            kwargs = {"process_group": module.process_group} if target is nn.SyncBatchNorm else {}
            return _rebuild(module, target, **kwargs)
    return None


def _swap_layers(module: nn.Module, swap: Any, name: str = "") -> nn.Module:
    replacement = swap(module, name)
    if replacement is not None:
        return replacement
    for child_name, child in module.named_children():
        new_child = _swap_layers(child, swap, f"{name}.{child_name}" if name else child_name)
        if new_child is not child:
            module._modules[child_name] = new_child
    return module


def convert_model(module: nn.Module, process_group: Optional[Any] = None) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` with its synchronized counterpart, in place.

    ``nn.BatchNorm1d/2d/3d`` (and subclasses) become :class:`SynchronizedBatchNorm1d/2d/3d`;
    ``nn.SyncBatchNorm`` becomes :class:`SyncBatchNorm` (any input rank), keeping its process group unless
    one is given. Layers at any depth are found (Sequential, ModuleList, ModuleDict, attributes). The new
    layers own the same parameter and buffer tensors (values, requires_grad, device, dtype, and the
    optimizer's references survive) and the same eps, momentum (None included), affine,
    track_running_stats, training flag and qconfig. InstanceNorm, LazyBatchNorm and other relatives are
    left alone. Mirrors ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``.

    Args:
        module: a model, a single BatchNorm layer, or an ``nn.DataParallel``.
        process_group: the group the layers synchronize over; None means the world group (or, for
            ``nn.SyncBatchNorm``, the group it already had). Layers that are already synchronized get
            this group if it is not None.

    Returns:
        ``module`` itself with layers swapped; a new layer if ``module`` is a single BatchNorm layer; and
        for an ``nn.DataParallel``, a :class:`DataParallelWithCallback` around the converted module with
        the same device_ids, output_device and dim.

    Raises:
        TypeError: if ``module`` is already wrapped in DistributedDataParallel (convert before wrapping).
    """
    if isinstance(module, nn.parallel.DistributedDataParallel):
        raise TypeError(
            "convert_model got a DistributedDataParallel; convert the model first, then wrap it in "
            "DistributedDataParallel so that DDP sees the final parameters"
        )
    if isinstance(module, nn.DataParallel):
        inner = convert_model(module.module, process_group)
        return DataParallelWithCallback(
            inner,
            device_ids=module.device_ids or None,
            output_device=getattr(module, "output_device", None) if module.device_ids else None,
            dim=getattr(module, "dim", 0),
            cpu_replicas=getattr(module, "cpu_replicas", None),
        )
    return _swap_layers(module, lambda m, name: _convert_layer(m, name, process_group))


def revert_model(module: nn.Module) -> nn.Module:
    """Replace every synchronized layer of ``module`` with a plain one, in place: the inverse of convert.

    :class:`SynchronizedBatchNorm1d/2d/3d` become ``nn.BatchNorm1d/2d/3d``; the rank-agnostic
    :class:`SyncBatchNorm` becomes ``nn.SyncBatchNorm`` (which, like any BatchNorm, never communicates in
    eval mode). The same tensors and settings are kept, so ``state_dict()`` is identical before and after
    a convert/revert round trip. Use it for single-device inference or export.

    Args:
        module: a model, a single synchronized layer, or a DataParallel wrapper (its module is reverted and
            the wrapper returned).

    Returns:
        ``module`` itself with layers swapped, or a new layer if ``module`` is a single synchronized layer.
    """
    if isinstance(module, nn.DataParallel):
        module.module = revert_model(module.module)
        return module
    return _swap_layers(module, _revert_layer)


def _convert_sync_batchnorm(cls: type, module: nn.Module, process_group: Optional[Any] = None) -> nn.Module:
    """Alias of :func:`syncbn_dist.convert_model`, spelled like ``torch.nn.SyncBatchNorm``'s classmethod.

    Args:
        module: a model, a single BatchNorm layer, or an ``nn.DataParallel``.
        process_group: the group the converted layers synchronize over; None means the world group.

    Returns:
        What :func:`syncbn_dist.convert_model` returns.
    """
    return convert_model(module, process_group)


# Attached here rather than defined in batchnorm.py, which would then import this module (an import cycle).
SyncBatchNorm.convert_sync_batchnorm = classmethod(_convert_sync_batchnorm)  # type: ignore[attr-defined]
