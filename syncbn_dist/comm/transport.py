"""What a transport is: the two protocols the layer's Functions take, and which one a transport follows.

A transport sums tensors over a group's members (processes, replicas, or both), one collective per call, knowing
nothing of batch norm. A :class:`SummingTransport` (a process group) sums inside one autograd Function; an
:class:`ExchangeTransport` (DataParallel replicas) is itself an autograd edge, with the layer's two Functions around
it (docs/design.md, "Transports"). The layer reads ``differentiable_exchange`` once per call to tell which; a
transport without it is an exchange, needing only ``name`` and ``all_reduce``.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

from torch import Tensor

__all__ = ["UNREACHABLE", "ExchangeTransport", "SummingTransport", "Transport"]


class _Unreachable:
    def __repr__(self) -> str:
        return "UNREACHABLE"


#: The ``group_name`` of a transport whose group a traced region cannot reach (its collective would skip the Join
#: session's announcements): its calls take the native kernels, also under a user's ``torch.compile``.
UNREACHABLE: Any = _Unreachable()


class Transport(Protocol):
    """What every transport offers."""

    #: ``"distributed"``, ``"dataparallel"`` or ``"local"``: what the layer reports as ``last_transport``.
    name: str
    #: False for a :class:`SummingTransport`, True for an :class:`ExchangeTransport`.
    differentiable_exchange: bool
    #: Which exchange its collectives belong to, named in their tags (:data:`~syncbn_dist.comm.tags.EXCHANGES`): two
    #: exchanges sum different things, so their collectives must never pass for each other.
    exchange_name: str

    def all_reduce(self, tensors: Sequence[Tensor], tags: Optional[tuple[Any, Any, bool]] = None) -> list[Tensor]:
        """The sums over the members of ``tensors``, as new tensors, with one collective; backward sums the gradients
        into the inputs that require grad likewise.

        ``tags``: ``(forward_tag, backward_tag, stamp)`` or None, the tags ending the flattened tensors in each
        direction (:mod:`syncbn_dist.comm.tags`), for a transport to verify; the layer verifies every total anyway."""

    def agreement_group(self) -> Any:
        """The process group whose members check, before a collective, that they are at the same one; None when
        nobody is to be checked (:mod:`syncbn_dist.comm.agreement`)."""


class SummingTransport(Transport, Protocol):
    """A transport over a process group, whose sum can run inside an autograd Function."""

    #: The group's name for the traced regions' functional collective (None: a group of one) or :data:`UNREACHABLE`.
    group_name: Optional[str]

    def sum_(self, tensor: Tensor, tag: Optional[Any] = None) -> Tensor:
        """The sum of ``tensor`` over the members, in place where the backend can (not differentiable), ``tag`` (its
        :class:`~syncbn_dist.comm.tags.CollectiveTag`, whose values end ``tensor``) verified on the sum.

        Raises:
            LayerMismatchError: if the members sent different tags (on every member)."""

    def check(self, tag: Any) -> None:
        """Called before the collective of ``tag`` that runs inside a traced region (not through ``sum_``)."""


class ExchangeTransport(Transport, Protocol):
    """A transport whose ``all_reduce`` is an autograd edge between the members (DataParallel replicas)."""
