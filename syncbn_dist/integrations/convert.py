"""convert_model and revert_model: swap BatchNorm layers for synchronized ones and back, keeping tensors."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.utils import parametrize

from ..layer.batchnorm import SyncBatchNorm
from ..layer.identity import record_parents
from . import families  # noqa: F401 - registers the model zoos' classes
from .data_parallel import DataParallelWithCallback
from .registry import PLAIN_OF, class_path, find_conversion

__all__ = ["convert_model", "revert_model"]

# nn.Module's per-instance hook state, read from torch (every version's): hooks are part of what a layer computes.
_HOOK_STATE = tuple(name for name in vars(nn.Module()) if "hook" in name)

# (original class, names of its instance attributes), set by convert_model: revert_model rebuilds that class with them.
_SOURCE = "_syncbn_source"

HOW_OUT_OF_CONVERSION = (
    "Either register a synchronized equivalent that computes the same forward, "
    "syncbn_dist.register_conversion(TheClass, to_sync=TheSyncClass) with TheSyncClass a subclass of "
    "syncbn_dist.SyncBatchNorm (see docs/api.md#converting-models), or pass strict=False to leave these layers "
    "unsynchronized (their statistics stay per process), with a warning that lists them."
)
_HOW_OUT_OF_REVERSION = (
    "Revert only layers that convert_model built, or pass strict=False to keep these layers as they are, with a "
    "warning that lists them."
)


def _rebuild(old: nn.Module, new_cls: type[nn.Module], **kwargs: Any) -> nn.Module:
    """A ``new_cls`` layer owning ``old``'s very tensors, settings and hook dictionaries (so its hook handles work)."""
    new = new_cls(
        old.num_features, old.eps, old.momentum, old.affine, old.track_running_stats, device="meta", **kwargs
    )
    for name in _HOOK_STATE:
        if name in old.__dict__:
            new.__dict__[name] = old.__dict__[name]
    new._parameters = dict(old._parameters)
    new._buffers = dict(old._buffers)
    new._non_persistent_buffers_set = set(old._non_persistent_buffers_set)
    new.train(old.training)
    if hasattr(old, "qconfig"):
        new.qconfig = old.qconfig
    if parametrize.is_parametrized(old):
        # The same ParametrizationLists (the state), with their properties injected as register_parametrization does.
        new._modules["parametrizations"] = old._modules["parametrizations"]
        parametrize._inject_new_class(new)
        for tensor_name in old._modules["parametrizations"]:
            parametrize._inject_property(new, tensor_name)
    return new


def _children(module: nn.Module) -> list[str]:
    """The layer's child modules, but for the ParametrizationLists of torch.nn.utils.parametrize."""
    parametrized = parametrize.is_parametrized(module)
    return [name for name in module._modules if not (parametrized and name == "parametrizations")]


def _unknown_reason(module: nn.Module, owner: Optional[type]) -> str:
    if owner is not None:
        return f"{class_path(owner)} defines its own forward"
    return f"owns child modules {sorted(_children(module))} that nn.BatchNorm's forward does not use"


def _classify(module: nn.Module) -> tuple[str, Any]:
    """What convert_model does with ``module``: "sync" (with the registry entry), "synced", "unknown" or "other"."""
    if isinstance(module, SyncBatchNorm):
        return "synced", None
    if not isinstance(module, _BatchNorm) or isinstance(module, LazyModuleMixin):
        return "other", None  # LazyBatchNorm becomes nn.BatchNorm*d at its first forward: convert after that
    entry, owner = find_conversion(type(module))
    if entry is None or (_children(module) and not entry.moves_children):
        return "unknown", _unknown_reason(module, owner)
    return "sync", entry


def _synchronized(old: nn.Module, entry: Any, process_group: Optional[Any]) -> SyncBatchNorm:
    group = process_group if process_group is not None else getattr(old, "process_group", None)
    new = _rebuild(old, entry.to_sync, process_group=group)
    for key, value in old.__dict__.items():
        new.__dict__.setdefault(key, value)  # attributes of the original class (detectron2's _stats_mode, ...)
    if entry.moves_children:
        new._modules = dict(old._modules)  # timm's act and drop: the same modules, so the same state_dict keys
    new.__dict__[_SOURCE] = (type(old), frozenset(old.__dict__))
    return new


def _restored(layer: SyncBatchNorm) -> nn.Module:
    """The layer as an instance of its original class again: same tensors, children and attributes, no __init__."""
    cls, keys = layer.__dict__[_SOURCE]
    plain = cls.__new__(cls)
    plain.__dict__.update({key: value for key, value in layer.__dict__.items() if key in keys})
    plain._parameters = dict(layer._parameters)
    plain._buffers = dict(layer._buffers)
    plain._modules = dict(layer._modules)
    plain._non_persistent_buffers_set = set(layer._non_persistent_buffers_set)
    return plain


def _classify_synced(module: nn.Module) -> tuple[str, Any]:
    """What revert_model does with ``module``: "restore", "plain" (with the class), "unknown" or "other"."""
    if not isinstance(module, SyncBatchNorm):
        return "other", None
    if _SOURCE in module.__dict__:
        return "restore", None
    for base in type(module).__mro__:
        plain = dict(PLAIN_OF).get(base)
        if plain is not None:
            if _children(module):
                return "unknown", _unknown_reason(module, None)
            return "plain", plain
        if "forward" in vars(base):
            return "unknown", f"{class_path(base)} defines its own forward and the layer has no record of the " \
                "class it was converted from"
    raise AssertionError("unreachable: every SyncBatchNorm has SyncBatchNorm in its MRO")


def _swap(
    module: nn.Module, classify: Callable[[nn.Module], tuple[str, Any]], build: Callable[..., Optional[nn.Module]],
    strict: bool, verb: str, how_out: str,
) -> nn.Module:
    """Classify every layer first (so a refusal leaves the model untouched), then swap in every slot a module is
    registered in (``named_children`` would skip a second slot holding the same layer); returns the new root."""
    unknown: list[str] = []
    _visit(module, "", classify, set(), unknown)
    if unknown:
        listing = "\n".join(unknown)
        if strict:
            raise TypeError(
                f"{verb} cannot swap {len(unknown)} BatchNorm layer(s) without changing what they compute, so it "
                f"swapped none:\n"
                f"{listing}\n{how_out}"
            )
        warnings.warn(f"{verb}(strict=False) leaves {len(unknown)} layer(s) as they are:\n{listing}", stacklevel=3)
    root = _swapped(module, "", classify, build, {})
    record_parents(root)  # (a model built before syncbn_dist was imported: its layers' identities need its structure)
    return root


# Module-level walks: a recursive closure is a cycle, holding a process group until gc (docs/troubleshooting.md).


def _visit(
    node: nn.Module, name: str, classify: Callable[[nn.Module], tuple[str, Any]], visited: set[int], unknown: list[str]
) -> None:
    """Classify ``node`` and its descendants, each once, listing the layers that cannot be swapped in ``unknown``."""
    if id(node) in visited:
        return
    visited.add(id(node))
    kind, detail = classify(node)
    if kind == "unknown":
        unknown.append(f"  '{name or '<root>'}' ({class_path(type(node))}): {detail}")
    elif kind == "other":
        for child_name, child in node._modules.items():
            if child is not None:
                _visit(child, f"{name}.{child_name}" if name else child_name, classify, visited, unknown)


def _swapped(
    node: nn.Module,
    name: str,
    classify: Callable[[nn.Module], tuple[str, Any]],
    build: Callable[..., Optional[nn.Module]],
    swapped: dict[int, nn.Module],
) -> nn.Module:
    """``node`` swapped (its descendants in place), each module once; ``swapped`` maps visited ids to replacements."""
    if id(node) in swapped:
        return swapped[id(node)]
    kind, detail = classify(node)
    swapped[id(node)] = node  # a module that contains itself is walked once
    if kind == "other":
        for child_name, child in list(node._modules.items()):
            if child is not None:
                new_child = _swapped(child, f"{name}.{child_name}" if name else child_name, classify, build, swapped)
                if new_child is not child:
                    node._modules[child_name] = new_child
    elif kind != "unknown":
        swapped[id(node)] = build(node, name, kind, detail)
    return swapped[id(node)]


def convert_model(module: nn.Module, process_group: Optional[Any] = None, *, strict: bool = True) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` with a synchronized layer that computes the same function, in place.

    In one process the converted model's outputs, gradients and running statistics are the original's, bit for bit.
    ``nn.BatchNorm1d/2d/3d`` becomes :class:`SynchronizedBatchNorm1d/2d/3d`, ``nn.SyncBatchNorm``
    :class:`SyncBatchNorm`, other classes as registered
    ([the conversion contract](../api/conversion.md#the-conversion-contract)); synchronized layers are kept, so
    converting twice is a no-op. The new layers own the same tensors (an optimizer's references survive), settings,
    instance attributes, parametrizations and, unlike with torch's ``convert_sync_batchnorm``, hooks (their handles
    still work) and a norm+act family's children (``state_dict()`` keys unchanged). A layer registered in several
    places becomes one layer, shared alike.

    Args:
        module: a model, a single BatchNorm layer, or an ``nn.DataParallel``.
        process_group: the group to synchronize over; None means the world group (or an ``nn.SyncBatchNorm``'s own).
            Already synchronized layers get it if it is not None.
        strict: if True (the default), an unknown BatchNorm subclass raises ``TypeError``; if False, such layers
            (and their children) are left unsynchronized and a warning names them.

    Returns:
        ``module`` with layers swapped; a new layer if ``module`` is a single BatchNorm layer; for an
        ``nn.DataParallel``, a :class:`DataParallelWithCallback` of the converted module with its device_ids,
        output_device and dim.

    Warns:
        UserWarning: for uninitialized LazyBatchNorm layers, left unsynchronized (convert after their first forward);
            for an ``nn.DataParallel`` that found no GPU (one replica, no peer), pointing to ``cpu_replicas=N``.

    Raises:
        TypeError: if ``module`` is wrapped in DistributedDataParallel (convert before wrapping); with ``strict=True``,
            for unknown BatchNorm subclasses, naming every such layer's path and class and the two ways out
            (:func:`~syncbn_dist.register_conversion`, ``strict=False``); nothing is converted.
    """
    if isinstance(module, nn.parallel.DistributedDataParallel):
        raise TypeError(
            "convert_model got a DistributedDataParallel; convert the model first, then wrap it in "
            "DistributedDataParallel so that DDP sees the final parameters"
        )
    if isinstance(module, nn.DataParallel):
        cpu_replicas = getattr(module, "cpu_replicas", None)
        if not module.device_ids and cpu_replicas is None:
            # nn.DataParallel drops its device_ids where it finds no GPU, and runs one replica.
            warnings.warn(
                "convert_model: this nn.DataParallel found no GPU, so it runs its module as one replica and the "
                "synchronized layers have no peer (last_transport 'local'). To run replicas on the CPU, wrap the "
                "converted module in syncbn_dist.DataParallelWithCallback(module, cpu_replicas=N)",
                UserWarning,
                stacklevel=2,
            )
        inner = convert_model(module.module, process_group, strict=strict)
        return DataParallelWithCallback(
            inner,
            device_ids=module.device_ids or None,
            output_device=getattr(module, "output_device", None) if module.device_ids else None,
            dim=getattr(module, "dim", 0),
            cpu_replicas=cpu_replicas,
        )

    lazy = [
        name or "<root>"
        for name, m in module.named_modules()
        if isinstance(m, _BatchNorm) and isinstance(m, LazyModuleMixin)
    ]
    if lazy:
        warnings.warn(
            f"convert_model leaves {len(lazy)} uninitialized LazyBatchNorm layer(s) unsynchronized: {lazy}; run one "
            "forward pass (which makes them nn.BatchNorm*d), then convert",
            stacklevel=2,
        )

    def build(layer: nn.Module, name: str, kind: str, entry: Any) -> nn.Module:
        if kind == "synced":
            if process_group is not None:
                layer.process_group = process_group
        else:
            layer = _synchronized(layer, entry, process_group)
        layer._qualified_name = name  # names the layer in mismatch errors (see syncbn_dist.set_debug)
        return layer

    return _swap(module, _classify, build, strict, "convert_model", HOW_OUT_OF_CONVERSION)


def revert_model(module: nn.Module, *, strict: bool = True) -> nn.Module:
    """Replace every synchronized layer of ``module`` with a plain one, in place, for single-device inference or export.

    A layer :func:`convert_model` built becomes its original class again (no ``__init__`` call) with the same tensors,
    children and instance attributes, so ``state_dict()`` survives a round trip; one built synchronized (e.g. by
    :func:`patch_sync_batchnorm`) becomes ``nn.BatchNorm1d/2d/3d``, or ``nn.SyncBatchNorm`` for :class:`SyncBatchNorm`.

    Args:
        module: a model, a single synchronized layer, or a DataParallel wrapper (returned, its module reverted).
        strict: if True (the default), a synchronized subclass with its own ``forward`` or children and no record of an
            original class raises ``TypeError``; if False it is kept, and a warning names it.

    Returns:
        ``module`` with layers swapped, or a new layer if ``module`` is a single synchronized layer.

    Raises:
        TypeError: with ``strict=True``, for a layer with no plain counterpart (see ``strict``), naming every such
            layer; nothing is reverted.
    """
    if isinstance(module, nn.DataParallel):
        module.module = revert_model(module.module, strict=strict)
        return module

    def build(layer: nn.Module, name: str, kind: str, plain: Optional[type[nn.Module]]) -> nn.Module:
        if kind == "restore":
            return _restored(layer)
        assert plain is not None
        kwargs = {"process_group": layer.process_group} if plain is nn.SyncBatchNorm else {}
        return _rebuild(layer, plain, **kwargs)

    return _swap(module, _classify_synced, build, strict, "revert_model", _HOW_OUT_OF_REVERSION)
