"""The torch.distributed transport (one coalesced, differentiable ``all_reduce`` per call) and group helpers: the only
module that calls collectives on a process group (:mod:`.agreement` gathers through :func:`all_gather_bytes`).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before init_process_group: troubleshooting.md, "SIGABRT or a hang at exit"
from torch import Tensor
from torch.autograd import Function

from ..settings import launched_world_size

__all__ = [
    "DistributedTransport",
    "all_gather_bytes",
    "all_reduce_mean_",
    "all_reduce_sum",
    "broadcast_from_first_",
    "cached_distributed_transport",
    "distributed_transport",
    "group_needs_sync",
    "new_sync_groups",
    "process_group_missing",
    "resolve_group",
]


def _flatten(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten(flat: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    return [chunk.view_as(t) for chunk, t in zip(flat.split([t.numel() for t in like]), like)]


class _AllReduceCoalesced(Function):
    """Sums tensors with one ``reducer.sum_``; backward, the gradients of the inputs that require grad (the same on
    every rank), through this Function again under ``create_graph`` (docs/design.md, "Higher-order derivatives")."""

    @staticmethod
    def forward(reducer: Any, tags: Optional[tuple[Any, Any, bool]], *tensors: Tensor) -> tuple[Tensor, ...]:
        return tuple(_unflatten(_tagged_sum(reducer, _flatten(tensors), tags), tensors))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        # setup_context rather than ctx in forward: the torch.func transforms can run it
        ctx.reducer, ctx.tags = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Optional[Tensor], ...]:
        needed = [i for i, need in enumerate(ctx.needs_input_grad[2:]) if need]
        result: list[Optional[Tensor]] = [None] * len(grads)
        tags = None if ctx.tags is None else (ctx.tags[1], ctx.tags[0], ctx.tags[2])
        if needed and torch.is_grad_enabled():
            for i, total in zip(needed, _AllReduceCoalesced.apply(ctx.reducer, tags, *(grads[i] for i in needed))):
                result[i] = total
        elif needed:
            flat = _tagged_sum(ctx.reducer, _flatten([grads[i] for i in needed]).contiguous(), tags)
            for i, chunk in zip(needed, _unflatten(flat, [grads[i] for i in needed])):
                result[i] = chunk
        return (None, None, *result)


def _tagged_sum(reducer: Any, flat: Tensor, tags: Optional[tuple[Any, Any, bool]]) -> Tensor:
    """``reducer.sum_`` of ``flat``, verifying (and with ``stamp``, first writing) the tag of ``tags[0]``."""
    if tags is None:
        return reducer.sum_(flat)
    tag, _, stamp = tags
    if stamp:
        tail = tag.tail(flat.device, None)
        flat.narrow(0, flat.numel() - tail.numel(), tail.numel()).copy_(tail)
    return reducer.sum_(flat, tag)


def all_reduce_sum(tensor: Tensor, group_name: Optional[str]) -> Tensor:
    """The sum of ``tensor`` over the group named ``group_name``: torch's functional ``all_reduce`` and ``wait_tensor``,
    C++ ops eagerly and in compiled graphs alike (docs/compile.md, "How the graph stays whole and correct").

    Args:
        tensor: any shape and dtype the backend reduces (the layer sends float64 payloads).
        group_name: ``ProcessGroup.group_name`` of the group; None: a group of one.

    Returns:
        A new tensor of ``tensor``'s shape and dtype holding the members' sum (for None, ``tensor`` itself).
    """
    if group_name is None:
        return tensor
    functional = torch.ops._c10d_functional
    return functional.wait_tensor(functional.all_reduce(tensor, "sum", group_name))


class DistributedTransport:
    """Sums over a ``torch.distributed`` group's members (gloo: CPU tensors, nccl: CUDA), one ``all_reduce`` a call.

    Args:
        process_group: the group to reduce over. Default: ``None`` (the world group)
    """

    name = "distributed"
    differentiable_exchange = False
    exchange_name = "process group"

    def __init__(self, process_group: Optional[Any] = None) -> None:
        self.process_group = process_group

    @property
    def group_name(self) -> str:
        """The group's name, by which functional collectives reach it (:func:`all_reduce_sum`)."""
        return (dist.group.WORLD if self.process_group is None else self.process_group).group_name

    def all_reduce(
        self, tensors: Sequence[Tensor], reducer: Optional[Any] = None, tags: Optional[tuple[Any, Any, bool]] = None
    ) -> list[Tensor]:
        """Sum ``tensors`` over the group with one ``all_reduce``, differentiably (backward sums the gradients).

        Args:
            tensors: tensors of one dtype, any shapes.
            reducer: what sums the flattened tensors, both directions: an object with ``sum_``
                (:class:`~syncbn_dist.comm.join_session.JoinTransport` passes itself). Default: ``None`` (this one)
            tags: ``(forward_tag, backward_tag, stamp)``: the :class:`~syncbn_dist.comm.tags.CollectiveTag` each
                direction verifies and, with ``stamp``, first writes into the tail of what it sends. Default: ``None``
        """
        return list(_AllReduceCoalesced.apply(self if reducer is None else reducer, tags, *tensors))

    def sum_(self, tensor: Tensor, tag: Optional[Any] = None) -> Tensor:
        """Sum ``tensor`` over the group in place with one ``all_reduce`` and return it (not differentiable).

        The group's own ``allreduce``, skipping ``dist.all_reduce``'s per-call checks; traced, :func:`all_reduce_sum`
        (Dynamo cannot trace a process group's methods).

        Args:
            tensor: the flat payload.
            tag: the :class:`~syncbn_dist.comm.tags.CollectiveTag` ending ``tensor``, verified on the sum, or None.

        Raises:
            LayerMismatchError: on every member, if the members sent different tags.
        """
        # torch's process-wide flag, not kernels.tracing's: the functional collective is the same sum, eagerly too.
        if torch.compiler.is_compiling():
            total = all_reduce_sum(tensor, self.group_name)
            if tag is None:
                return total
            # Traced by compiled autograd (the backward of an eager forward): the check as an op of its graph.
            from .tags import checked_in_graph, traced_tag  # (tags imports this module)

            return checked_in_graph(total, traced_tag(tag), self.group_name, backward=True)
        group = self.process_group
        if group is None:
            group = dist.group.WORLD
        group.allreduce([tensor]).wait()
        if tag is not None:
            tag.verify(tensor, self)
        return tensor

    def agreement_group(self) -> Any:
        """The group whose members check that they agree before a collective (:mod:`syncbn_dist.comm.agreement`)."""
        return dist.group.WORLD if self.process_group is None else self.process_group

    def check(self, tag: Any) -> None:
        """Called before the collective of ``tag`` that runs inside a traced region: nothing to do here (a
        :class:`~syncbn_dist.comm.agreement.CheckedTransport` checks the members' agreement)."""


def distributed_transport(process_group: Optional[Any]) -> Optional[DistributedTransport]:
    """The transport for ``process_group`` if synchronization over it is needed, else None.

    Args:
        process_group: a group from ``torch.distributed.new_group`` or None for the world group.

    Returns:
        None when ``torch.distributed`` is unavailable or not initialized, or the group has one member.

    Raises:
        ValueError: if this rank is not a member of ``process_group``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.group.WORLD if process_group is None else process_group
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise ValueError(
            f"rank {dist.get_rank()} is not a member of the process_group given to SyncBatchNorm; build the "
            "layer with a group that contains this rank (e.g. the one syncbn_dist.new_sync_groups returns)"
        )
    if dist.get_world_size(group) <= 1:
        return None
    return DistributedTransport(process_group)


class _WeakGroupTransport(DistributedTransport):
    """Holds its group weakly, so it is freed when destroyed (troubleshooting.md, "SIGABRT or a hang at exit")."""

    def __init__(self, process_group: Any) -> None:  # not super().__init__: process_group is a property here
        self._group_ref = weakref.ref(process_group)

    @property
    def process_group(self) -> Any:  # type: ignore[override]
        group = self._group_ref()
        if group is None:
            raise RuntimeError("the process group of this synchronized layer's transport no longer exists")
        return group


class _TransportCache:
    """What :func:`cached_distributed_transport` keeps, holding no group strongly (design.md, "Host cost per layer")."""

    def __init__(self) -> None:
        self.world: Callable[[], Any] = lambda: None  # a weak reference to the world group (a dead one's gives None)
        self.world_transport: Optional[DistributedTransport] = None
        self.groups: weakref.WeakKeyDictionary[Any, Optional[DistributedTransport]] = weakref.WeakKeyDictionary()


_CACHE = _TransportCache()
_DIST_AVAILABLE = dist.is_available()
_MISSING = object()


def cached_distributed_transport(process_group: Optional[Any]) -> Optional[DistributedTransport]:
    """:func:`distributed_transport`, remembered per group until the default group changes (eager mode only), keeping
    no group alive and nothing for a non-member (docs/design.md, "Host cost per layer").

    Args, Returns, Raises: as :func:`distributed_transport`.
    """
    if not _DIST_AVAILABLE:
        return None
    world = dist.group.WORLD
    if world is None:
        return None
    if _CACHE.world() is not world:  # a new default group: every group of the old one is gone with it
        _CACHE.groups.clear()
        _CACHE.world_transport = distributed_transport(None)
        _CACHE.world = weakref.ref(world)
    if process_group is None:
        return _CACHE.world_transport
    try:
        transport = _CACHE.groups.get(process_group, _MISSING)
    except TypeError:  # no process group (a non-member's NON_GROUP_MEMBER, an int): distributed_transport says so
        return distributed_transport(process_group)
    if transport is _MISSING:
        transport = distributed_transport(process_group)
        if transport is not None:
            transport = _WeakGroupTransport(process_group)
        _CACHE.groups[process_group] = transport
    return transport


def new_sync_groups(group_size: int) -> Any:
    """Split the world into process groups of ``group_size`` consecutive ranks and return this rank's.

    Pass the result to ``convert_model(model, process_group=...)`` to synchronize BatchNorm within each group of k
    ranks (e.g. a node) instead of the whole world. Creating a group is collective: every rank calls this, in the
    same order relative to other group creations. Built on ``torch.distributed.new_subgroups``.

    Args:
        group_size: ranks per group (k); must divide the world size.

    Returns:
        This rank's process group: ranks ``[r - r % k, r - r % k + k)`` for rank r.

    Raises:
        RuntimeError: if ``torch.distributed`` is not initialized.
        ValueError: on every rank, before any group is created, if ``group_size`` is not a positive integer or does
            not divide the world size.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("new_sync_groups needs an initialized default process group (init_process_group)")
    world_size = dist.get_world_size()
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"expected group_size to be a positive integer (got {group_size!r})")
    if world_size % group_size != 0:
        raise ValueError(
            f"world_size {world_size} is not divisible by group_size {group_size}; choose a divisor of "
            f"{world_size}"
        )
    group, _ = dist.new_subgroups(group_size)
    return group


def all_gather_bytes(data: bytes, group: Optional[Any] = None, size: Optional[int] = None) -> list[bytes]:
    """Every member's ``data`` through ``all_gather`` of uint8 tensors (on the current device for nccl): not
    ``all_gather_object``, which needs numpy, absent from torch's CPU wheel.

    Args:
        data: this member's bytes.
        group: the process group. Default: ``None`` (the world group)
        size: a fixed length, each member's bytes cut or zero-padded to it: one collective (trailing zero bytes are
            dropped from what comes back). Default: ``None``: any length, two collectives (lengths, padded bytes)

    Returns:
        One ``bytes`` per member of ``group``, in group rank order.
    """
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    world_size = dist.get_world_size(group)
    lengths: Optional[list[int]] = None
    if size is None:
        mine = torch.tensor([len(data)], dtype=torch.int64, device=device)
        gathered_lengths = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(gathered_lengths, mine, group=group)
        lengths = [int(length.item()) for length in gathered_lengths]
        size = max(lengths)
    data = data[:size]
    padded = torch.zeros(size, dtype=torch.uint8)
    padded[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    gathered = [torch.empty_like(padded, device=device) for _ in range(world_size)]
    dist.all_gather(gathered, padded.to(device), group=group)
    found = [bytes(t.cpu().tolist()) for t in gathered]
    if lengths is None:
        return [item.rstrip(b"\0") for item in found]
    return [item[:length] for item, length in zip(found, lengths)]


def all_reduce_mean_(tensor: Tensor, process_group: Optional[Any] = None) -> Tensor:
    """Replace ``tensor`` in place by its mean over the members of ``process_group`` (one collective)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=process_group)
    return tensor.div_(dist.get_world_size(process_group))


def broadcast_from_first_(tensor: Tensor, process_group: Optional[Any] = None) -> Tensor:
    """Replace ``tensor`` in place by the first member's copy (group rank 0; one collective)."""
    source = 0 if process_group is None else dist.get_global_rank(process_group, 0)
    dist.broadcast(tensor, src=source, group=process_group)
    return tensor


def resolve_group(group_name: str) -> Any:
    """The process group named ``group_name`` (``ProcessGroup.group_name``), through torch's registry of names."""
    return dist.distributed_c10d._resolve_process_group(group_name)


def process_group_missing() -> bool:
    """Whether the launcher started several processes (``WORLD_SIZE`` > 1) but ``torch.distributed`` is not
    initialized: every process would train with its own statistics."""
    return launched_world_size() > 1 and not (_DIST_AVAILABLE and dist.is_initialized())


def group_needs_sync(process_group: Optional[Any] = None) -> bool:
    """True if ``torch.distributed`` is initialized and ``process_group`` has more than one member.

    Raises:
        ValueError: if this rank is not a member of ``process_group``.
    """
    return distributed_transport(process_group) is not None
