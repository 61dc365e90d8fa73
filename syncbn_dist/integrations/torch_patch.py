"""patch_torch_sync_batchnorm: every ``torch.nn.SyncBatchNorm`` of the process synchronizes through syncbn_dist.

It replaces a few attributes of torch's classes in place, reversibly (docs/frameworks.md, "What the patch changes"). A
patched layer runs :class:`~syncbn_dist.SyncBatchNorm`'s code on its own ``__dict__``, through :class:`_TorchLayerView`.
"""

from __future__ import annotations

import warnings
from types import TracebackType
from typing import Any, Optional

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parallel import DistributedDataParallel

from .. import torch_changes
from ..layer.batchnorm import SyncBatchNorm, SynchronizedBatchNorm1d, SynchronizedBatchNorm2d, SynchronizedBatchNorm3d
from . import convert as _convert
from .families import _NormActForward
from .registry import class_path, find_conversion

__all__ = [
    "SyncBatchNormAct",
    "is_torch_sync_batchnorm_patched",
    "patch_torch_sync_batchnorm",
    "unpatch_torch_sync_batchnorm",
]

# Model zoos' subclasses whose forward calls super().forward, matched by import path (nothing is imported).
_KNOWN_SUBCLASSES = frozenset(
    {"timm.layers.norm_act.SyncBatchNormAct", "timm.models.layers.norm_act.SyncBatchNormAct"}
)
# What convert_model's plain targets become under torch's converter: a torch.nn.SyncBatchNorm (any input rank).
_PLAIN_TARGETS = (SyncBatchNorm, SynchronizedBatchNorm1d, SynchronizedBatchNorm2d, SynchronizedBatchNorm3d)
_VERB = "torch.nn.SyncBatchNorm.convert_sync_batchnorm"

# strict as given to the last patch_torch_sync_batchnorm call (DistributedDataParallel's check reads it).
_strict = True


class SyncBatchNormAct(_NormActForward, nn.SyncBatchNorm):
    """``torch.nn.SyncBatchNorm`` followed by ``drop`` and ``act`` when present: timm's ``SyncBatchNormAct``.

    What the patched ``convert_sync_batchnorm`` builds from timm's ``BatchNormAct2d`` (torch's drops ``act`` and
    ``drop``); normalizes over the global batch (Ioffe & Szegedy 2015, arXiv:1502.03167); state_dict keys unchanged.

    Shape:
        - Input: (N, C, *); Output: what ``act`` returns, (N, C, *) for timm's activations.
    """


class _TorchLayerView(SyncBatchNorm):
    """syncbn_dist's SyncBatchNorm methods on a torch layer's ``__dict__`` (:func:`_view`); the rest is the layer's."""

    __slots__ = ("_layer",)
    # torch's layers normalize by var + eps: set_sbn_eps_mode("clip") is for syncbn_dist's classes only.
    eps_mode = "plus"
    # Set on DataParallel replicas only, by __data_parallel_replicate__ (as SyncBatchNorm.__init__ sets None).
    _replica_exchange = None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_layer"), name)

    def _check_input_dim(self, input: Tensor) -> None:
        self._layer._check_input_dim(input)
        self._layer._check_non_zero_input_channels(input)

    def _describe(self) -> str:
        return f"layer '{self._name()}' ({type(self._layer).__name__})"

    def _module(self) -> nn.Module:
        return self._layer


def _view(layer: nn.SyncBatchNorm) -> _TorchLayerView:
    """A :class:`_TorchLayerView` sharing ``layer.__dict__``, after adding syncbn_dist's per-layer state to it."""
    state = layer.__dict__
    if "_transport_record" not in state:
        # As in SyncBatchNorm.__init__ (replicas share it); agreement_of makes the agreement record: this may be traced.
        state["_transport_record"] = [None]
    view = object.__new__(_TorchLayerView)
    object.__setattr__(view, "__dict__", state)
    object.__setattr__(view, "_layer", layer)
    return view


def _forward(self: nn.SyncBatchNorm, input: Tensor) -> Tensor:
    """The patched ``torch.nn.SyncBatchNorm.forward``: :meth:`syncbn_dist.SyncBatchNorm.forward` on this layer."""
    return _view(self).forward(input)


def _data_parallel_replicate(self: nn.SyncBatchNorm, ctx: Any, copy_id: int) -> None:
    """Replication callback: :meth:`syncbn_dist.SyncBatchNorm.__data_parallel_replicate__` on this replica."""
    _view(self).__data_parallel_replicate__(ctx, copy_id)


def _replicate_for_data_parallel(self: nn.SyncBatchNorm) -> nn.Module:
    """``nn.Module._replicate_for_data_parallel`` after giving the layer its state, so replicas share the original's."""
    _view(self)
    return super(nn.SyncBatchNorm, self)._replicate_for_data_parallel()


def _last_transport(self: nn.SyncBatchNorm) -> Optional[str]:
    """``"local"``, ``"distributed"`` or ``"dataparallel"``: what the last forward used; None before the first."""
    return self.__dict__.get("_transport_record", [None])[0]


def _classify(module: nn.Module) -> tuple[str, Any]:
    """The patched converter's verdict on ``module``: "keep", "sync" (with a target), "unknown" or "other"."""
    if isinstance(module, (nn.SyncBatchNorm, SyncBatchNorm)):
        return "keep", None
    if not isinstance(module, _BatchNorm) or isinstance(module, LazyModuleMixin):
        return "other", None
    entry, owner = find_conversion(type(module))
    if entry is None or (_convert._children(module) and not entry.moves_children):
        return "unknown", _convert._unknown_reason(module, owner)
    if entry.to_sync in _PLAIN_TARGETS:
        return "sync", entry._replace(to_sync=nn.SyncBatchNorm)
    if issubclass(entry.to_sync, _NormActForward):
        return "sync", entry._replace(to_sync=SyncBatchNormAct)
    return "sync", entry  # a class given to register_conversion: its syncbn_dist equivalent


def _convert_sync_batchnorm(
    cls: type, module: nn.Module, process_group: Optional[Any] = None, *, strict: bool = True
) -> nn.Module:
    """The patched ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``: torch's signature and return value (existing
    ``nn.SyncBatchNorm`` layers get ``process_group``, as in torch), with :func:`syncbn_dist.convert_model`'s contract,
    ``strict`` and ``TypeError`` (docs/frameworks.md)."""

    def build(layer: nn.Module, name: str, kind: str, entry: Any) -> nn.Module:
        if kind == "keep":
            if isinstance(layer, nn.SyncBatchNorm) or process_group is not None:
                layer.process_group = process_group
        else:
            layer = _convert._synchronized(layer, entry, process_group)
        layer._qualified_name = name  # names the layer in mismatch errors
        return layer

    return _convert._swap(module, _classify, build, strict, _VERB, _convert.HOW_OUT_OF_CONVERSION)


def _calls_torch_forward(function: Any) -> bool:
    """Whether ``function`` names ``super`` (or ``SyncBatchNorm``) and ``forward``: reads its bytecode's names."""
    code = getattr(function, "__code__", None)
    names = set(code.co_names) if code is not None else set()
    return "forward" in names and bool(names & {"super", "SyncBatchNorm"})


def _unreached_owner(cls: type) -> Optional[type]:
    """The class whose own ``forward`` keeps ``cls`` layers from the patched forward, or None if they reach it."""
    for base in cls.__mro__:
        if base is nn.SyncBatchNorm or class_path(base) in _KNOWN_SUBCLASSES:
            return None
        forward = vars(base).get("forward")
        if forward is not None and not _calls_torch_forward(forward):
            return base
    return None


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_subclasses(sub))
    return found


def _check_reached(classes: list[type], where: str, strict: bool) -> None:
    """Raise (or warn, not strict) for classes among ``classes`` whose layers the patched forward would not reach."""
    unreached = {}
    for cls in classes:
        owner = _unreached_owner(cls)
        if owner is not None:
            unreached[class_path(cls)] = class_path(owner)
    if not unreached:
        return
    listing = "\n".join(f"  {name}: {owner}.forward does not call super().forward" for name, owner in unreached.items())
    if not strict:
        warnings.warn(
            f"{where}: {len(unreached)} torch.nn.SyncBatchNorm subclass(es) keep their own forward, which syncbn_dist "
            f"does not reach (their statistics are whatever that forward computes):\n{listing}",
            stacklevel=3,
        )
        return
    raise TypeError(
        f"{where}: {len(unreached)} torch.nn.SyncBatchNorm subclass(es) define a forward that does not run "
        f"torch.nn.SyncBatchNorm.forward, so syncbn_dist cannot synchronize their layers:\n{listing}\n"
        "Make the forward call super().forward(input) for the normalization; or leave the patch off and convert the "
        "model with syncbn_dist.convert_model after syncbn_dist.register_conversion(TheClass, to_sync=...) (see "
        "docs/api.md#converting-models); or pass strict=False to patch_torch_sync_batchnorm to leave these layers as "
        "they are, with a warning."
    )


def _passing_sync_batchnorm_handle(self: DistributedDataParallel, module: nn.Module) -> None:
    """DDP's SyncBatchNorm check, patched: accepts CPU modules; refuses (warns, not strict) classes the patch misses."""
    classes = {type(m) for m in module.modules() if isinstance(m, nn.SyncBatchNorm)}
    _check_reached(sorted(classes, key=class_path), "DistributedDataParallel", _strict)


# What the patch installs, created once so that every patch installs the same objects.
_REPLACEMENTS: dict[tuple[type, str], Any] = {
    (nn.SyncBatchNorm, "forward"): _forward,
    (nn.SyncBatchNorm, "convert_sync_batchnorm"): classmethod(_convert_sync_batchnorm),
    (nn.SyncBatchNorm, "_replicate_for_data_parallel"): _replicate_for_data_parallel,
    (nn.SyncBatchNorm, "__data_parallel_replicate__"): _data_parallel_replicate,
    (nn.SyncBatchNorm, "last_transport"): property(_last_transport),
    (DistributedDataParallel, "_passing_sync_batchnorm_handle"): _passing_sync_batchnorm_handle,
}


class _Patch:
    """What :func:`patch_torch_sync_batchnorm` returns: leaving it as a context manager restores the earlier state."""

    def __init__(self, was_patched: bool) -> None:
        self._was_patched = was_patched

    def __enter__(self) -> _Patch:
        return self

    def __exit__(
        self, kind: Optional[type[BaseException]], error: Optional[BaseException], trace: Optional[TracebackType]
    ) -> None:
        if not self._was_patched:
            unpatch_torch_sync_batchnorm()


def patch_torch_sync_batchnorm(*, strict: bool = True) -> _Patch:
    """Make every ``torch.nn.SyncBatchNorm`` layer of this process synchronize through syncbn_dist, on CPU and GPU.

    For frameworks that build ``torch.nn.SyncBatchNorm`` themselves ([Frameworks](../frameworks.md));
    ``python -m syncbn_dist.run train.py`` calls it for you, in the processes the script starts too. In place and
    reversibly, torch's forward becomes :class:`~syncbn_dist.SyncBatchNorm`'s (torch's bit for bit in eval mode and
    without peers), ``convert_sync_batchnorm`` keeps what each layer computes as :func:`~syncbn_dist.convert_model`
    does, and DDP accepts CPU modules ([what the patch changes](../frameworks.md#what-the-patch-changes)); layers
    built before the call and subclasses whose forward calls ``super().forward`` are reached too. A second call only
    updates ``strict``. The returned context manager restores the earlier state when its block ends, also on an
    exception::

        syncbn_dist.patch_torch_sync_batchnorm()          # for the rest of the process
        with syncbn_dist.patch_torch_sync_batchnorm():    # for the block only
            trainer.fit(model)

    Args:
        strict: if True (the default), a subclass whose own ``forward`` does not call ``super().forward`` (by its
            bytecode; known model-zoo classes pass) raises ``TypeError``, here if defined now, else in
            ``DistributedDataParallel(...)``; if False, a ``UserWarning`` names it and it keeps its forward.

    Returns:
        A context manager; leaving it unpatches if this call patched.

    Raises:
        TypeError: with ``strict=True``, for subclasses the patch cannot reach, naming each class, the forward that
            stops it and the ways out; nothing is patched.
    """
    global _strict
    was_patched = is_torch_sync_batchnorm_patched()
    _check_reached(_subclasses(nn.SyncBatchNorm), "patch_torch_sync_batchnorm", strict)
    _strict = strict
    if not was_patched:
        for (cls, name), value in _REPLACEMENTS.items():
            torch_changes.replace(cls, name, value)
    torch_changes.apply_first_use_changes()  # torch's layers synchronize now: Join([ddp_model]) must find them
    return _Patch(was_patched)


def unpatch_torch_sync_batchnorm() -> None:
    """Undo :func:`patch_torch_sync_batchnorm`: torch's own attributes again, the same objects; a no-op if not patched.

    Layers keep their tensors and state (and the private attributes the patched forward added, which torch ignores).
    """
    for cls, name in _REPLACEMENTS:
        torch_changes.restore(cls, name)


def is_torch_sync_batchnorm_patched() -> bool:
    """Whether :func:`patch_torch_sync_batchnorm` is in effect."""
    return torch_changes.is_replaced(nn.SyncBatchNorm, "forward")

