"""Synchronized BatchNorm modules that pick their transport at every forward."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .. import settings, torch_changes
from ..comm import (
    DataParallelTransport,
    LayerMismatchError,
    SlavePipe,
    SyncMaster,
    distributed_transport,
    new_sync_master,
)
from ..comm.agreement import CheckedTransport, LayerAgreement, agreement_of, check_due, verify, verify_while_tracing
from ..comm.distributed import cached_distributed_transport, process_group_missing
from ..comm.join_session import OPEN_JOINS, JoinBinding, JoinTransport, NotCoveredByJoinError
from ..comm.tags import FORWARD, FORWARD_WITHOUT_BACKWARD, NO_TAG, CollectiveTag, layer_tags, traced_tags
from ..compiler_marks import never_traced
from ..kernels.tracing import eager_replica_thread, is_compiling, is_recomputing
from .functions import Transport, sync_batch_norm
from .identity import identity_while_tracing, layer_identity
from .replay import RecordingTransport, ReplayTransport

__all__ = [
    "SyncBatchNorm",
    "SynchronizedBatchNorm1d",
    "SynchronizedBatchNorm2d",
    "SynchronizedBatchNorm3d",
    "patch_sync_batchnorm",
]


class _SoloTransport:
    """A group of one: the sum over the members is the tensor itself."""

    name = "local"
    differentiable_exchange = False
    exchange_name = "local"
    group_name = None  # the traced regions' name for a group of one: no collective

    def sum_(self, tensor: Tensor, tag: Optional[CollectiveTag] = None) -> Tensor:
        return tensor

    def all_reduce(self, tensors: Sequence[Tensor], tags: Optional[tuple[Any, Any, bool]] = None) -> list[Tensor]:
        return list(tensors)

    def agreement_group(self) -> None:
        return None

    def check(self, tag: Any) -> None:
        return None


_SOLO = _SoloTransport()


class SyncBatchNorm(_BatchNorm):
    r"""Batch Normalization with statistics over the global batch of every process and replica.

    Ioffe & Szegedy 2015, "Batch Normalization: Accelerating Deep Network Training by Reducing Internal
    Covariate Shift", arXiv:1502.03167:

    .. math::

        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta

    where the mean and biased variance are taken per channel over the concatenation of the batches of
    every member of the synchronization group, so the result equals ``nn.BatchNorm`` on that global batch:
    outputs, input gradients and running statistics (``running_var`` gets the unbiased global variance).
    Each member sends one float64 payload ``[sum(C), sumsq(C), count]`` in forward and ``[sum(dy), sum(dy *
    x_hat)]`` in backward, each ending in the collective's tag, so uneven and empty shards are exact and members at
    different layers raise. ``weight`` and ``bias`` receive the local gradient sums, which DistributedDataParallel
    averages, as with ``torch.nn.SyncBatchNorm``.

    Args:
        num_features: :math:`C` from an expected input of size :math:`(N, C, *)`.
        eps: a value added to the denominator for numerical stability. Default: 1e-5
        momentum: the value used for the running_mean and running_var computation; None for a cumulative
            moving average over ``num_batches_tracked``. Default: 0.1
        affine: whether the module has learnable affine parameters. Default: ``True``
        track_running_stats: whether the module tracks running_mean and running_var; if ``False`` it uses
            batch statistics in eval mode too. Default: ``True``
        process_group: the ``torch.distributed`` group to synchronize over; None means the world group.
            Default: ``None``
        device: the device of the parameters and buffers (a factory argument). Default: ``None``
        dtype: the dtype of the parameters and buffers (a factory argument). Default: ``None``

    Shape:
        - Input: :math:`(N, C, *)` with at least 2 dimensions; N may be 0 and may differ across members.
        - Output: :math:`(N, C, *)` (same shape, dtype and memory format as input)

    .. note::
        The transport is chosen in every forward and reported by :attr:`last_transport`:

        - ``"local"``: eval mode, or no peers. No communication; exactly ``nn.BatchNorm``. In eval mode
          with ``track_running_stats=False`` the local batch statistics are used, as
          ``torch.nn.SyncBatchNorm`` does, so evaluation never communicates (safe on one rank only).
        - ``"dataparallel"``: this module is a replica of a ``DataParallelWithCallback`` (or a patched
          ``nn.DataParallel``) with more than one replica. If ``torch.distributed`` is also initialized
          with more than one process, the master replica also all-reduces over ``process_group``, so the
          statistics cover every replica of every process.
        - ``"distributed"``: training mode, ``torch.distributed`` initialized, and ``process_group`` has more
          than one member. Works with gloo on CPU tensors and nccl on CUDA tensors.

        Every member of the group must run the layer the same number of times in training mode.

    Examples::

        >>> model = syncbn_dist.convert_model(model)              # under torchrun
        >>> model = nn.parallel.DistributedDataParallel(model)
        >>> bn = syncbn_dist.SynchronizedBatchNorm2d(64)
        >>> out = bn(torch.randn(8, 64, 14, 14))
        >>> bn.last_transport
        'local'
    """

    # The layer's transport inside a Join context (syncbn_dist.join_layers); class defaults reach unpickled layers too.
    _join_binding: Optional[JoinBinding] = None
    # Seconds a DataParallel replica waits for its peers at this layer before raising ReplicaSyncError.
    replica_timeout: Optional[float] = settings.DEFAULT_REPLICA_TIMEOUT
    # "plus", "clip" ("clamp"), or None for the process-wide default of set_sbn_eps_mode.
    eps_mode: Optional[str] = None
    # What each process group's members agreed on (comm.agreement; agreement_of makes it where a layer has none).
    _agreement: Optional[LayerAgreement] = None

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Optional[Any] = None,
        device: Optional[Union[torch.device, str]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        torch_changes.apply_first_use_changes()  # (the first synchronized layer of the process: torch_changes.py)
        self.process_group = process_group
        # A one-element list, so DataParallel replicas (shallow copies of __dict__) report to the original.
        self._transport_record: list[Optional[str]] = [None]
        # Set on DataParallel replicas only, by __data_parallel_replicate__.
        self._replica_exchange: Optional[Union[SyncMaster, SlavePipe]] = None
        self._agreement = LayerAgreement()  # shared by replicas, like _transport_record

    @classmethod
    def convert_sync_batchnorm(
        cls, module: nn.Module, process_group: Optional[Any] = None, *, strict: bool = True
    ) -> nn.Module:
        """:func:`syncbn_dist.convert_model`, spelled like ``torch.nn.SyncBatchNorm``'s classmethod.

        Args:
            module: a model, a single BatchNorm layer, or an ``nn.DataParallel``.
            process_group: the group the converted layers synchronize over; None means the world group.
            strict: see :func:`syncbn_dist.convert_model`.

        Returns:
            What :func:`syncbn_dist.convert_model` returns.

        Raises:
            TypeError: as :func:`syncbn_dist.convert_model`.
        """
        # Deferred: the converter is built on this module (docs/design.md, "The package").
        from ..integrations.convert import convert_model

        return convert_model(module, process_group, strict=strict)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # An unpickled layer (torch.load of a model) is a first synchronized layer too.
        super().__setstate__(state)
        torch_changes.apply_first_use_changes()

    def __getstate__(self) -> dict[str, Any]:
        """The pickled state (``torch.save`` of a model): a process group cannot be saved, so a loaded layer
        synchronizes over the default group unless it is given one (``process_group`` None)."""
        state = self.__dict__.copy()
        state["process_group"] = None
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> SyncBatchNorm:
        """A deep copy (an EMA model, a teacher) that synchronizes over the same ``process_group`` object: a process
        group is shared, never copied (everything else is copied as ``copy.deepcopy`` copies a module)."""
        group = self.__dict__.get("process_group")
        if group is not None:
            memo[id(group)] = group
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__dict__, memo))
        return copied

    def __copy__(self) -> SyncBatchNorm:
        """A shallow copy, its process group included (pickling drops it: :meth:`__getstate__`)."""
        copied = type(self).__new__(type(self))
        copied.__setstate__(self.__dict__.copy())
        return copied

    @property
    def last_transport(self) -> Optional[str]:
        """``"local"``, ``"distributed"`` or ``"dataparallel"``: what the last forward (of any replica) used.

        None before the first forward. Read-only.
        """
        return self._transport_record[0]

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _input_error(self, input: Tensor) -> Optional[Exception]:
        """What is wrong with ``input`` (the error to raise), or None."""
        try:
            self._check_input_dim(input)
        except (ValueError, TypeError) as error:
            return error
        if not input.is_floating_point():
            return TypeError(f"expected a floating point input (got {input.dtype} input)")
        if input.size(1) != self.num_features:
            return ValueError(
                f"expected input with {self.num_features} channels in dim 1 (got input of shape "
                f"{tuple(input.shape)}, with {input.size(1)} channels)"
            )
        return None

    def __data_parallel_replicate__(self, ctx: Any, copy_id: int) -> None:
        """Replication callback (:func:`syncbn_dist.execute_replication_callbacks`): replica 0 becomes the master of a
        fresh :class:`SyncMaster` shared through ``ctx``; the others register with it as slaves."""
        if copy_id == 0:
            # (other callbacks may share no Replication: a failure then wakes this layer's peers only)
            ctx.sync_master = new_sync_master(self.replica_timeout, getattr(ctx, "replication", None))
            self._replica_exchange = ctx.sync_master
        else:
            self._replica_exchange = ctx.sync_master.register_slave(copy_id)
        # This replica's payloads and totals, replayed if activation checkpointing recomputes a forward (replay.py).
        self._replay_records: list[Any] = []

    def _select_transport(self, input: Tensor, compiling: bool, recomputing: bool = False) -> Optional[Transport]:
        """What this training call sums over, built once, innermost first: the process group (or the Join session's
        copy), the first-step gather check while due, the DataParallel exchange, a replica's record of it (or its replay
        in a recomputation). None: local (eval, or nothing to synchronize with)."""
        if not self.training:
            return None
        # Dynamo traces torch.distributed's own queries (constants in the graph), not a cache of their answers.
        inner = distributed_transport(self.process_group) if compiling else cached_distributed_transport(
            self.process_group
        )
        binding = self._join_binding
        if inner is not None and binding is not None and binding.active:  # inside Join (syncbn_dist.join_layers)
            inner = binding.transport
            if not (compiling or recomputing or isinstance(self._replica_exchange, SlavePipe)):
                binding.start_of_call()  # Join's header first, where due (the master replica's: it crosses processes)
        elif not compiling and inner is not None and OPEN_JOINS[0]:  # (not read while tracing: no guard on it)
            raise NotCoveredByJoinError(self._describe())
        if inner is not None and not compiling:
            agreement = self._agreement  # (None on a torch.nn.SyncBatchNorm before its first check: agreement_of)
            settled = None if agreement is None else agreement.settled
            if settled is None or settled[0] is not inner or settled[1] is not input.dtype or settings._DEBUG:
                inner = self._checked(inner, input.dtype)
        elif inner is None and not compiling and process_group_missing():
            _warn_missing_process_group(self._describe())
        exchange = self._replica_exchange
        if exchange is None:
            return inner
        if isinstance(exchange, SlavePipe) or exchange.nr_slaves > 0:
            inner = DataParallelTransport(exchange, inner)
        if inner is None:
            return None
        # A replica's collective, even alone in its process, takes the exchange's autograd shape, as its peer
        # processes' replicas do; its backward runs in one thread with theirs, so a checkpoint recomputation replays
        # what the forward exchanged (replay.py).
        if recomputing:
            return ReplayTransport(inner.name, self._replay_records, self._describe_replica())
        return RecordingTransport(inner, self._replay_records)

    def _checked(self, transport: Any, dtype: torch.dtype) -> Any:
        """``transport``, in a CheckedTransport while its group's collectives are gathered and checked before they run
        (the group's first step, or debug mode: :func:`~syncbn_dist.comm.agreement.check_due`)."""
        group = transport.agreement_group()
        if group is None:
            return transport
        if check_due(group):
            return CheckedTransport(transport, self._agreement_key(dtype), self._describe())
        agreement_of(self).settled = (transport, dtype)
        return transport

    def _agreement_key(self, dtype: torch.dtype) -> str:
        return f"num_features={self.num_features} dtype={dtype}"

    def _identity(self, compiling: bool = False) -> str:
        """What names this layer alike on every rank (its collective tags): its place in the model's structure
        (:func:`~syncbn_dist.layer.identity.layer_identity`), never the process's history (docs/design.md, "Every
        collective checks itself"). A layer no name was given (built directly) takes its path as its name in errors."""
        if compiling:
            return identity_while_tracing(self._module())
        return layer_identity(self)

    def _module(self) -> nn.Module:
        """The module this layer's state belongs to (itself; a patched torch layer's view: the torch layer)."""
        return self

    def forward(self, input: Tensor) -> Tensor:
        """Normalize ``input`` (N, C, *) with local, process-group or replica-wide statistics.

        Returns:
            Tensor of the input's shape, dtype and memory format.

        Raises:
            ValueError: wrong input rank, ``C != num_features``, a global count of 1 value per channel in
                training, or a ``process_group`` this rank is not a member of.
            TypeError: a non-floating input.
            LayerMismatchError: at the layer's first forward or backward on the group (every call in debug mode),
                on every member, if the members are at different layers or collectives, or a peer's input is bad
                (this rank's own bad input raises its ValueError or TypeError); see syncbn_dist.comm.agreement.
            ReplicaSyncError: a DataParallel peer replica failed or did not arrive in ``replica_timeout``.
        """
        if self._replica_exchange is not None:
            return self._replica_forward(input)
        return self._forward(input)

    def _replica_forward(self, input: Tensor) -> Tensor:
        """A DataParallel replica's forward (always eager): its failure wakes the peers blocked at this or a later layer
        with ReplicaSyncError, whatever runs the replicas."""
        exchange = self._replica_exchange
        assert exchange is not None
        try:
            with eager_replica_thread():  # a peer compiling a kernel must not look like tracing here
                return self._forward(input)
        except BaseException as error:
            exchange.report_failure(error, self._describe())
            raise

    def _forward(self, input: Tensor) -> Tensor:
        """What this call is, decided once: its transport (``_select_transport``), then one call, into the layer's
        Function or, with nothing to synchronize with, into ``F.batch_norm``."""
        compiling = is_compiling()
        # A forward re-run by activation checkpointing inside backward (dynamo cannot trace the query: never then).
        recomputing = not compiling and is_recomputing()
        transport = self._select_transport(input, compiling, recomputing)
        error = self._input_error(input)
        if error is not None:
            try:
                self._share_input_error(transport, input, error, compiling)
            except LayerMismatchError as mismatch:  # the peers raise it; this rank, its own error
                raise error from mismatch
            raise error
        self._transport_record[0] = "local" if transport is None else transport.name
        if transport is None and self.training and self._eps_mode() == "clip":
            transport = _SOLO  # F.batch_norm knows only var + eps: the same math, with no communication
        if transport is None:
            return self._local_forward(input, recomputing)
        eager_only = self._replica_exchange is not None or settings._DEBUG or isinstance(transport, JoinTransport)
        if compiling and eager_only:
            return self._eager_sync_forward(input, transport)
        return self._sync_forward(input, transport, compiling, recomputing)

    def _local_forward(self, input: Tensor, recomputing: bool) -> Tensor:
        """``nn.BatchNorm``'s forward; a checkpoint recomputation normalizes with throw-away copies of the running
        statistics, saving what the original forward saved."""
        if not (recomputing and self.training and self.track_running_stats and self.running_mean is not None):
            return super().forward(input)
        running_mean, running_var = self.running_mean.clone(), self.running_var.clone()
        return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, True, 0.0, self.eps)

    def _share_input_error(
        self, transport: Optional[Transport], input: Tensor, error: Exception, compiling: bool
    ) -> None:
        """Where this collective would be gather-checked, send this rank's input error instead: every member raises."""
        group = None if transport is None or compiling else transport.agreement_group()
        if group is not None and check_due(group):
            tag = self._tags_of_call(input, self.weight, self.bias, transport, False)[0]
            verify(group, tag, self._agreement_key(input.dtype), self._describe(), error=str(error))

    def _eps_mode(self) -> str:
        return settings._EPS_MODE if self.eps_mode is None else settings._resolve_eps_mode(self.eps_mode)

    def _sync_forward(self, input: Tensor, transport: Transport, compiling: bool, recomputing: bool = False) -> Tensor:
        """The synchronized training forward, traced whole by ``torch.compile`` over a process group; a checkpoint
        recomputation (``recomputing``) leaves the running statistics alone."""
        weight, bias = self.weight, self.bias
        tags = self._tags_of_call(input, weight, bias, transport, compiling)
        # DataParallel slaves leave the buffers to the master, whose buffers are the original module's.
        owns_buffers = not isinstance(self._replica_exchange, SlavePipe)
        track = self.track_running_stats and self.running_mean is not None and owns_buffers and not recomputing
        momentum = 0.0
        if track:
            self.num_batches_tracked.add_(1)
            momentum = self._momentum_factor(compiling)
        binding = self._join_binding
        if owns_buffers and binding is not None and binding.active and transport is not _SOLO:
            # Set at every call: the joined ranks update their buffers from this call's total only if this one does.
            binding.transport.expect_tracked_forward(track)
        args = (
            input,
            weight,
            bias,
            self.running_mean if track else None,
            self.running_var if track else None,
            momentum,
            self.eps,
            transport,
            self._eps_mode(),
            tags,
            compiling,
        )
        if compiling:  # traced: the graph stays as it was (tests/test_compiled_graph.py)
            return sync_batch_norm(*args)
        try:
            return sync_batch_norm(*args)
        except BaseException:
            # A failed call (ranks at different collectives, a peer's bad input, a timeout) leaves every buffer as it
            # was, on every rank, whichever check raised: the running statistics are written after the collective and
            # its checks, num_batches_tracked before them (the cumulative average's factor reads it).
            if track:
                self.num_batches_tracked.sub_(1)
            raise

    def _tags_of_call(
        self, input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], transport: Any, compiling: bool
    ) -> tuple[Any, Any]:
        """The tags of this call's forward and backward collectives (:mod:`syncbn_dist.comm.tags`), cached; traced, the
        graph's constants from the trace-time check. The forward's direction says whether a backward will follow."""
        with_backward = torch.is_grad_enabled() and (
            input.requires_grad
            or (weight is not None and weight.requires_grad)
            or (bias is not None and bias.requires_grad)
        )
        forward = FORWARD if with_backward else FORWARD_WITHOUT_BACKWARD
        if not compiling:
            cache = (self._agreement or agreement_of(self)).tags
            key = (forward, transport.exchange_name)
            tags = cache.get(key)
            if tags is None:
                identity = self._identity()
                tags = cache[key] = layer_tags(identity, self._describe(), forward, transport.exchange_name)
            return tags
        if transport is _SOLO:  # a group of one ("clip" with no peers): no collective to tag
            return NO_TAG, NO_TAG
        constants = verify_while_tracing(
            transport.group_name,  # (by name: Dynamo hands the group itself over as a fake object)
            self._identity(compiling),
            forward,
            self._agreement_key(input.dtype),
            self._describe(),
        )
        return traced_tags(constants)

    def _momentum_factor(self, compiling: bool) -> Union[float, Tensor]:
        """``momentum``, or ``1 / num_batches_tracked`` for a cumulative average: a 0-dim tensor under
        ``torch.compile`` (a host read would end the graph)."""
        if self.momentum is not None:
            return self.momentum
        if compiling:
            # In the precision eager mode's float reaches the update with: float64 buffers take it whole, the others
            # in float32 (lerp's opmath), not the int64 count's default float dtype.
            return 1.0 / self.num_batches_tracked.to(torch.promote_types(self.running_mean.dtype, torch.float32))
        return 1.0 / float(self.num_batches_tracked)

    def _eager_sync_forward(self, input: Tensor, transport: Transport) -> Tensor:
        binding = self._join_binding
        if binding is not None and transport is binding.transport and not is_recomputing():
            binding.start_of_call()  # (traced up to here: the header _select_transport sends in eager calls)
        if not isinstance(transport, CheckedTransport):
            # (traced up to here, nor the gather chosen): an eager peer gathers in debug mode, this rank too
            transport = self._checked(transport, input.dtype)
        return self._sync_forward(input, transport, False)

    def _describe(self) -> str:
        return f"layer '{self._name()}' ({type(self).__name__})"

    def _name(self) -> str:
        """How errors name the layer: its qualified name from convert_model, else its path in the model."""
        name = self.__dict__.get("_qualified_name")
        if name is None and not is_compiling():
            self._identity()  # (names it by its path)
            name = self.__dict__.get("_qualified_name")
        return name or "<unnamed>"

    def _describe_replica(self) -> str:
        exchange = self._replica_exchange
        copy_id = exchange.identifier if isinstance(exchange, SlavePipe) else 0
        return f"{self._describe()} on DataParallel replica {copy_id}"


# Always eager, under a user's torch.compile too: a replica's forward and the synchronized forward of replicas, debug
# mode and Join (one graph break per layer).
never_traced(SyncBatchNorm, "_replica_forward", "_eager_sync_forward")

_WARNED_NO_GROUP: list[bool] = [False]


def _warn_missing_process_group(description: str) -> None:
    """Warn once per process: torchrun says this is one process of several, but torch.distributed is not initialized."""
    if _WARNED_NO_GROUP[0]:
        return
    _WARNED_NO_GROUP[0] = True
    warnings.warn(
        f"syncbn_dist: {description} trains with local statistics: the environment says this is one of "
        f"{settings.launched_world_size()} processes (WORLD_SIZE), but torch.distributed is not initialized. Call "
        "torch.distributed.init_process_group before the first training forward to synchronize BatchNorm",
        RuntimeWarning,
        stacklevel=4,
    )


class SynchronizedBatchNorm1d(SyncBatchNorm):
    """:class:`SyncBatchNorm` for (N, C) or (N, C, L) input, checked as ``nn.BatchNorm1d`` does."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() not in (2, 3):
            raise ValueError(f"expected 2D or 3D input (got {input.dim()}D input)")


class SynchronizedBatchNorm2d(SyncBatchNorm):
    """:class:`SyncBatchNorm` for (N, C, H, W) input, checked as ``nn.BatchNorm2d`` does."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() != 4:
            raise ValueError(f"expected 4D input (got {input.dim()}D input)")


class SynchronizedBatchNorm3d(SyncBatchNorm):
    """:class:`SyncBatchNorm` for (N, C, D, H, W) input, checked as ``nn.BatchNorm3d`` does."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() != 5:
            raise ValueError(f"expected 5D input (got {input.dim()}D input)")


@contextlib.contextmanager
def patch_sync_batchnorm() -> Iterator[None]:
    """Inside the block, ``nn.BatchNorm1d/2d/3d`` construct ``SynchronizedBatchNorm1d/2d/3d``.

    The classic Synchronized-BatchNorm-PyTorch API, for model code you cannot edit::

        with syncbn_dist.patch_sync_batchnorm():
            model = build_model()   # every nn.BatchNorm2d(...) it makes is a SynchronizedBatchNorm2d

    It replaces the three attributes of ``torch.nn`` process-wide (other threads constructing layers in the block
    are affected too; a name imported before it, e.g. ``from torch.nn import BatchNorm2d``, is not) and restores them
    on exit, also when the block raises. Blocks nest. The synchronized classes take ``nn.BatchNorm``'s arguments.

    Subclasses defined before the block are not reached (a class statement binds its base when it runs): timm's
    norm+act layers (``timm.layers.BatchNormAct2d``, in EfficientNet, MobileNetV3, RegNet, ...) stay unsynchronized.
    Call :func:`~syncbn_dist.convert_model` on the built model instead, which converts them keeping their activation.

    Yields:
        None.
    """
    backup = nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d = (  # type: ignore[misc]
        SynchronizedBatchNorm1d,
        SynchronizedBatchNorm2d,
        SynchronizedBatchNorm3d,
    )
    try:
        yield
    finally:
        nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d = backup  # type: ignore[misc]
