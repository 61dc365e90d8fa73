"""What a transport is: the two protocols the layer's Functions take, and which one a transport follows.

A transport sums tensors over the members of a group (processes, replicas, or both), with one collective per call,
and knows nothing about batch norm. The synchronized layer has two autograd shapes, one per kind of transport:

- :class:`SummingTransport` (a process group: :class:`~syncbn_dist.comm.DistributedTransport`, the Join session's
  transport, the agreement-checking wrapper, a group of one): its plain ``sum_`` runs inside one autograd Function,
  forward and backward (:mod:`syncbn_dist.layer.functions`);
- :class:`ExchangeTransport` (the DataParallel exchange, :class:`~syncbn_dist.comm.DataParallelTransport`): its sum
  is itself an autograd edge, since every replica's backward runs in one autograd thread where no exchange could
  happen, so the layer is two Functions around it (:mod:`syncbn_dist.layer.exchange_functions`).

Each transport says which it is with ``differentiable_exchange``, a class attribute: the layer reads that one flag
to choose its autograd shape, once per call. A transport that does not set it is an exchange: ``name`` and a
differentiable ``all_reduce`` are all :func:`syncbn_dist.layer.functions.sync_batch_norm` needs of one.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

from torch import Tensor

__all__ = ["UNREACHABLE", "ExchangeTransport", "SummingTransport", "Transport"]


class _Unreachable:
    def __repr__(self) -> str:
        return "UNREACHABLE"


#: The ``group_name`` of a transport whose group the compiled kernels cannot reach (their collective would skip the
#: Join session's announcements): its calls take the native kernels.
UNREACHABLE: Any = _Unreachable()


class Transport(Protocol):
    """What every transport offers."""

    #: ``"distributed"``, ``"dataparallel"`` or ``"local"``: what the layer reports as ``last_transport``.
    name: str
    #: False for a :class:`SummingTransport`, True for an :class:`ExchangeTransport`.
    differentiable_exchange: bool

    def all_reduce(self, tensors: Sequence[Tensor], tags: Optional[tuple[Any, Any, bool]] = None) -> list[Tensor]:
        """The sums over the members of ``tensors``, as new tensors, with one collective, differentiably: the gradients
        of the outputs are summed over the members into those of the inputs that require grad (one collective).

        ``tags`` (``(forward_tag, backward_tag, stamp)`` or None): the :class:`~syncbn_dist.comm.tags.CollectiveTag`
        whose summed values end the flattened tensors in each direction, for a transport that verifies them where it
        sums (:mod:`syncbn_dist.comm.tags`); a transport may ignore them (the layer verifies every total it gets)."""

    def agreement_group(self) -> Any:
        """The process group whose members check, before a collective, that they are at the same one; None when
        nobody is to be checked (:mod:`syncbn_dist.comm.agreement`)."""


class SummingTransport(Transport, Protocol):
    """A transport over a process group, whose sum can run inside an autograd Function."""

    #: The group's name for the compiled kernels' functional collective (None: a group of one, no collective), or
    #: :data:`UNREACHABLE` where the compiled kernels cannot reach the group (the Join session's announcements run in
    #: Python).
    group_name: Optional[str]

    def sum_(self, tensor: Tensor, tag: Optional[Any] = None) -> Tensor:
        """The sum of ``tensor`` over the members, in place where the backend can (not differentiable), ``tag`` (its
        :class:`~syncbn_dist.comm.tags.CollectiveTag`, whose values end ``tensor``) verified on the sum.

        Raises:
            LayerMismatchError: if the members sent different tags (on every member)."""

    def check(self, tag: Any) -> None:
        """Called before the collective of ``tag`` that runs inside a compiled region (not through ``sum_``)."""


class ExchangeTransport(Transport, Protocol):
    """A transport whose ``all_reduce`` is an autograd edge between the members (DataParallel replicas)."""
