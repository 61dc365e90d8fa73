"""patch_torch_sync_batchnorm: every ``torch.nn.SyncBatchNorm`` of the process synchronizes through syncbn_dist.

The one place where syncbn_dist reaches into torch's classes. It replaces a few attributes of ``torch.nn.SyncBatchNorm``
(``forward``, ``convert_sync_batchnorm``, and the DataParallel seams ``_replicate_for_data_parallel`` and
``__data_parallel_replicate__``, plus a read-only ``last_transport``) and DistributedDataParallel's
``_passing_sync_batchnorm_handle`` (which refuses CPU modules holding a SyncBatchNorm), in place, so that layers built
before the patch, and subclasses defined before it (timm's ``SyncBatchNormAct``, whose forward calls
``super().forward``), are reached too. :func:`unpatch_torch_sync_batchnorm` puts torch's own attributes back, the very
same objects.

The statistics are syncbn_dist's: a patched layer's forward runs :class:`~syncbn_dist.SyncBatchNorm`'s forward on the
layer's own state (``__dict__``), through a view object that shares that dictionary, so transport selection,
agreement checks, DataParallel replicas and activation-checkpoint recomputation are the same code as for syncbn_dist's
own layers. What the layer needs beyond torch's attributes (the transport record, the verified process groups) is
added to its ``__dict__`` on first use, and replicas share it as they share a syncbn_dist layer's.
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

# Subclasses of torch.nn.SyncBatchNorm from model zoos whose forward runs torch's forward (super().forward) and then
# more steps: matched by import path, as syncbn_dist.families does, without importing the package.
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

    What ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` builds from a timm ``BatchNormAct2d`` while
    :func:`patch_torch_sync_batchnorm` is on, instead of torch's plain ``nn.SyncBatchNorm`` (which keeps ``act`` and
    ``drop`` as children but never calls them). The normalization is the patched ``nn.SyncBatchNorm.forward`` (Ioffe &
    Szegedy 2015, arXiv:1502.03167, over the global batch); ``isinstance(layer, torch.nn.SyncBatchNorm)`` holds, and
    the state_dict keys are the original layer's.

    Shape:
        - Input: (N, C, *); Output: what ``act`` returns, (N, C, *) for timm's activations.
    """


class _TorchLayerView(SyncBatchNorm):
    """syncbn_dist's SyncBatchNorm methods on a ``torch.nn.SyncBatchNorm`` layer's own ``__dict__`` (see the module).

    Built per call by :func:`_view`, never with ``__init__``: its attributes, tensors and the buffers it updates are
    the layer's. Input checks are the layer class's own (``_check_input_dim``, torch's non-zero channel check), and an
    attribute that only the layer's class provides (a parametrized ``weight``, a property) is read from the layer.
    """

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
        name = self.__dict__.get("_qualified_name") or "<unnamed>"
        return f"layer '{name}' ({type(self._layer).__name__})"

    def _agreement_owner(self) -> nn.Module:
        return self._layer


def _view(layer: nn.SyncBatchNorm) -> _TorchLayerView:
    """A :class:`_TorchLayerView` sharing ``layer.__dict__``, after adding syncbn_dist's per-layer state to it."""
    state = layer.__dict__
    if "_transport_record" not in state:
        # A one-element list, shared by DataParallel replicas (shallow copies of __dict__), as SyncBatchNorm.__init__
        # creates it. The agreement record is made eagerly when first needed (comm.agreement.agreement_of): this may
        # run in code torch.compile traces.
        state["_transport_record"] = [None]
    view = object.__new__(_TorchLayerView)
    object.__setattr__(view, "__dict__", state)
    object.__setattr__(view, "_layer", layer)
    return view


def _forward(self: nn.SyncBatchNorm, input: Tensor) -> Tensor:
    """Normalize ``input`` (N, C, *) with local, process-group or replica-wide statistics: syncbn_dist's forward.

    The patched ``torch.nn.SyncBatchNorm.forward``. In eval mode, or with no peers, it is torch's forward bit for bit
    (``F.batch_norm``); in training over a process group of more than one member it is
    :func:`syncbn_dist.layer.functions.sync_batch_norm` on any device gloo or nccl serves (torch's own raises on CPU).

    Returns:
        Tensor of the input's shape, dtype and memory format.

    Raises:
        ValueError: input of fewer than 2 dimensions, 0 channels, ``C != num_features``, a global count of 1 value
            per channel in training, or a ``process_group`` this rank is not a member of.
        TypeError: a non-floating input.
        LayerMismatchError: members of the group are at different layers or collectives (see SyncBatchNorm.forward).
        ReplicaSyncError: a DataParallel peer replica failed or did not arrive in time.
    """
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
    """What the patched convert_sync_batchnorm does with ``module``: "keep", "sync" (with a target), "unknown", "other".

    torch's converter makes every ``_BatchNorm`` a plain ``nn.SyncBatchNorm``; this one keeps what the layer computes,
    as :func:`syncbn_dist.convert_model` does, and builds ``torch.nn.SyncBatchNorm`` instances where it can.
    """
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
    """Convert every BatchNorm layer of ``module`` to ``torch.nn.SyncBatchNorm``, keeping what each layer computes.

    The patched ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``: torch's signature and return value, the conversion
    contract of :func:`syncbn_dist.convert_model`. Plain layers (``nn.BatchNorm1d/2d/3d``, mmengine's
    ``_BatchNormXd``, detectron2's ``NaiveSyncBatchNorm``, subclasses without a forward of their own) become
    ``torch.nn.SyncBatchNorm``; timm's ``BatchNormAct2d`` becomes :class:`SyncBatchNormAct` (its ``act`` and ``drop``
    kept and applied); a class given to :func:`~syncbn_dist.register_conversion` becomes its registered equivalent.
    Each new layer owns the original's parameter and buffer tensors, attributes, hooks and parametrizations. Layers
    that are already ``torch.nn.SyncBatchNorm`` (any subclass) are kept and get ``process_group``, as torch's
    converter gives them; syncbn_dist's own layers are kept. An uninitialized LazyBatchNorm is left alone.

    Args:
        module: a model or a single BatchNorm layer.
        process_group: the group the layers synchronize over; None means the world group.
        strict: see :func:`syncbn_dist.convert_model`.

    Returns:
        ``module`` itself with layers swapped, or the new layer if ``module`` is a single BatchNorm layer.

    Raises:
        TypeError: with ``strict=True``, for BatchNorm subclasses whose forward a synchronized layer would not compute
            (the message names each layer and class); nothing is converted.
    """

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
    """DDP's check of SyncBatchNorm layers, patched: CPU modules are accepted (syncbn_dist synchronizes on gloo).

    Layers whose class keeps them from the patched forward (a subclass defined after the patch) are refused here,
    where torch refused CPU modules, or named in a warning if the patch was made with ``strict=False``.
    """
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

    For frameworks that build ``torch.nn.SyncBatchNorm`` themselves (mmengine/mmdet/mmseg ``norm_cfg=dict(type=
    'SyncBN')``, timm's ``convert_sync_batchnorm``, Lightning's ``Trainer(sync_batchnorm=True)``, detectron2's
    ``get_norm("SyncBN")``, ``nn.SyncBatchNorm(...)`` in model code). Call it once at the top of a training script;
    ``python -m syncbn_dist.run train.py`` calls it for you (and for the processes the script starts). It changes, in
    place and reversibly:

    - ``torch.nn.SyncBatchNorm.forward``: syncbn_dist's (see :class:`~syncbn_dist.SyncBatchNorm`): exact float64
      ``[count, sum, sumsq]`` statistics in one all_reduce per direction, on gloo (CPU) and nccl (GPU), over
      ``process_group`` (None: the world), uneven and empty shards, DataParallel replicas of
      :class:`~syncbn_dist.DataParallelWithCallback`. In eval mode and without peers it computes what torch's
      forward computes, bit for bit (torch's raises on CPU inputs whenever a process group is initialized).
      Layers built before the call, and subclasses defined before it whose forward calls ``super().forward`` (timm's
      ``SyncBatchNormAct``), synchronize too; a layer's tensors and state are untouched.
    - ``torch.nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group=None)``: returns ``torch.nn.SyncBatchNorm``
      layers as torch's does, but keeps what each layer computes, as :func:`~syncbn_dist.convert_model` does (hooks,
      parametrizations, timm's norm+act layers; unknown subclasses refused with ``TypeError``).
    - ``DistributedDataParallel`` accepts CPU modules holding ``torch.nn.SyncBatchNorm`` (torch raises "SyncBatchNorm
      layers only work with GPU modules").
    - ``torch.nn.SyncBatchNorm`` gains ``last_transport`` and the DataParallel replication callback.

    ``isinstance(layer, torch.nn.SyncBatchNorm)``, the state_dict keys and the constructor are torch's. Calling it
    again is a no-op (``strict`` is updated); :func:`unpatch_torch_sync_batchnorm` restores torch's exact attributes.
    The return value is a context manager that restores the state from before the call when its block ends, also on
    an exception::

        syncbn_dist.patch_torch_sync_batchnorm()          # for the rest of the process
        with syncbn_dist.patch_torch_sync_batchnorm():    # for the block only
            trainer.fit(model)

    Args:
        strict: if True (the default), a subclass of ``torch.nn.SyncBatchNorm`` whose own ``forward`` does not call
            ``super().forward`` (so the patch cannot reach it; read from the function's bytecode names), other than
            the known model-zoo classes, raises ``TypeError`` here, for the subclasses defined now, and in
            ``DistributedDataParallel(...)`` for classes defined later; if False, a ``UserWarning`` names them and
            they keep their own forward.

    Returns:
        A context manager; leaving it unpatches if this call patched.

    Raises:
        TypeError: with ``strict=True``, for subclasses the patch cannot reach (the message names each class, the
            forward that stops it and what to do); nothing is patched then.
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

    Layers keep their tensors and state (and the few private attributes the patched forward added, which torch's
    forward ignores).
    """
    for cls, name in _REPLACEMENTS:
        torch_changes.restore(cls, name)


def is_torch_sync_batchnorm_patched() -> bool:
    """Whether :func:`patch_torch_sync_batchnorm` is in effect."""
    return torch_changes.is_replaced(nn.SyncBatchNorm, "forward")

