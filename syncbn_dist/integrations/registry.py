"""Which BatchNorm classes convert_model may synchronize, and into what: the registry behind docs/api/conversion.md.

Classes are registered by object, or by import path (``module.QualName``) so that model zoos match without an import.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..layer.batchnorm import SyncBatchNorm, SynchronizedBatchNorm1d, SynchronizedBatchNorm2d, SynchronizedBatchNorm3d

__all__ = ["register_conversion"]


class Conversion(NamedTuple):
    """A registry entry: the synchronized class a layer becomes, and whether the layer may own child modules (not for
    torch's own classes, whose forward uses none: a subclass with children does more than BatchNorm)."""

    to_sync: type[SyncBatchNorm]
    moves_children: bool


_BY_CLASS: dict[type, Conversion] = {
    # torch's own classes, found along the MRO, so a subclass without a forward of its own converts as before.
    nn.SyncBatchNorm: Conversion(SyncBatchNorm, moves_children=False),
    nn.BatchNorm1d: Conversion(SynchronizedBatchNorm1d, moves_children=False),
    nn.BatchNorm2d: Conversion(SynchronizedBatchNorm2d, moves_children=False),
    nn.BatchNorm3d: Conversion(SynchronizedBatchNorm3d, moves_children=False),
}
_BY_PATH: dict[str, Conversion] = {}

# The plain class a layer with no record of its original class (built synchronized) reverts to; most specific first.
PLAIN_OF: tuple[tuple[type[SyncBatchNorm], type[_BatchNorm]], ...] = (
    (SynchronizedBatchNorm1d, nn.BatchNorm1d),
    (SynchronizedBatchNorm2d, nn.BatchNorm2d),
    (SynchronizedBatchNorm3d, nn.BatchNorm3d),
    (SyncBatchNorm, nn.SyncBatchNorm),
)


def class_path(cls: type) -> str:
    """``cls.__module__ + "." + cls.__qualname__``, e.g. ``"timm.layers.norm_act.BatchNormAct2d"``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def register_conversion(cls: Union[type[nn.Module], str], to_sync: type[SyncBatchNorm]) -> None:
    """Teach :func:`~syncbn_dist.convert_model` to synchronize ``cls`` layers as ``to_sync`` layers.

    For a BatchNorm subclass with its own ``forward`` or child modules, which convert_model otherwise refuses.
    ``to_sync.forward`` computes what ``cls.forward`` does with the synchronized normalization in place of the local
    one, usually ``super().forward(x)`` and the extra steps. The layer is built through ``SyncBatchNorm.__init__``, then
    given the original's tensors, children and every instance attribute ``to_sync`` does not set (usable by name in
    ``to_sync.forward``; ``state_dict()`` keys unchanged); :func:`~syncbn_dist.revert_model` restores the original
    class. Subclasses of ``cls`` without their own ``forward`` convert alike; registering a class again replaces its
    entry. Example: [the conversion contract](../api/conversion.md#the-conversion-contract).

    Args:
        cls: a subclass of ``torch.nn.modules.batchnorm._BatchNorm``, or its import path ``"package.module.QualName"``
            (``__module__ + "." + __qualname__``), matched without importing the package.
        to_sync: the synchronized equivalent, a subclass of :class:`~syncbn_dist.SyncBatchNorm` whose ``__init__``
            takes SyncBatchNorm's arguments.

    Raises:
        TypeError: ``cls`` is neither a ``_BatchNorm`` subclass nor a dotted path, or already synchronized (a
            syncbn_dist SyncBatchNorm subclass), or ``to_sync`` is not a SyncBatchNorm subclass.
    """
    if not (isinstance(to_sync, type) and issubclass(to_sync, SyncBatchNorm)):
        raise TypeError(f"expected to_sync to be a subclass of syncbn_dist.SyncBatchNorm (got {to_sync!r})")
    if isinstance(cls, str):
        if "." not in cls.strip("."):
            raise TypeError(f"expected cls as 'package.module.QualName' (got {cls!r})")
        _BY_PATH[cls] = Conversion(to_sync, moves_children=True)
        return
    if not (isinstance(cls, type) and issubclass(cls, _BatchNorm)):
        raise TypeError(f"expected cls to be a subclass of torch.nn.modules.batchnorm._BatchNorm (got {cls!r})")
    if issubclass(cls, SyncBatchNorm):
        raise TypeError(f"{class_path(cls)} is already a syncbn_dist synchronized class; register its plain original")
    _BY_CLASS[cls] = Conversion(to_sync, moves_children=True)


def find_conversion(cls: type) -> tuple[Optional[Conversion], Optional[type]]:
    """``(entry, None)`` for the first registered class along ``cls.__mro__``, or ``(None, owner)`` where ``owner``,
    the first class with a ``forward`` of its own, comes before any registered one."""
    for base in cls.__mro__:
        entry = _BY_CLASS.get(base) or _BY_PATH.get(class_path(base))
        if entry is not None:
            return entry, None
        if "forward" in vars(base):
            return None, base
    return None, cls
