"""The agreement check: the members of a group are at the same synchronized collective, or all of them raise.

Before a synchronized layer's collective, its members can gather one short record each (one fixed-size
``all_gather``) and compare them: the layer, its num_features and dtype, the collective (forward or backward), whether
``torch.compile`` traces the call, and any error this member's input has. When they differ, every member raises
:class:`LayerMismatchError` naming each rank's record; a collective between members at different layers would hang,
abort gloo (payloads of different sizes) or mix statistics (payloads of the same size).

When a layer checks (:class:`LayerAgreement`):

- by default, the first forward and the first backward of each layer on each process group: a rank that runs another
  layer than its peers is caught where the ranks first part, if that is at such a first call (the usual case: a
  layer only some ranks run is new to them);
- in debug mode (:func:`syncbn_dist.set_debug`, ``SYNCBN_DEBUG=1``), before every collective, forward, backward and
  checkpoint recomputation, with the group's call number, so that a rank that skips, adds or reorders a layer later is
  caught too.

Under ``torch.compile`` the first forward's check runs while Dynamo traces the layer, before the graph runs any
collective; a compiled graph cannot check its backward, so tracing a layer counts for both directions. A rank that
traces the layer while a peer runs it eagerly sends its records in another order than the peer's (all of a graph's
checks before its collectives), so the record says which: such ranks disagree at their first check, and every one
raises, instead of hanging at the second.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .. import settings
from .distributed import _AllReduceCoalesced, all_gather_bytes

__all__ = [
    "CheckedTransport",
    "LayerAgreement",
    "LayerMismatchError",
    "agreement_of",
    "collective_key",
    "verify_while_tracing",
]

# Debug-mode call numbers: this process's checked collectives on each process group (forgotten with the group).
_DEBUG_CALLS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
# Bytes per rank of the gathered record, and its field separator.
_RECORD_BYTES = 256
_SEPARATOR = "\x1f"


class LayerMismatchError(ValueError):
    """Members of a synchronization group reached different synchronized layers (raised on every member)."""


def _world_if_none(group: Optional[Any]) -> Any:
    return dist.group.WORLD if group is None else group


class LayerAgreement:
    """What one synchronized layer has checked with the members of each process group (see the module docstring).

    Keyed by the process group (weakly: a destroyed group's record goes with it, and a new group is checked anew) and
    by the collective's key (num_features, dtype, direction). A layer's DataParallel replicas share its agreement (and
    only the master replica checks); a copy of the layer (``copy.deepcopy``, pickling) gets a new one. Debug mode
    keeps nothing: it checks every collective.
    """

    def __init__(self) -> None:
        self._verified: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
        # (transport, dtype) of the layer's last call that needed no check: the steady state's test, two identity
        # comparisons (the transport is the cached one of its group, replaced when the groups change).
        self.settled: Optional[tuple[Any, torch.dtype]] = None

    def __reduce__(self) -> tuple[type[LayerAgreement], tuple[()]]:
        # A copy of the layer (copy.deepcopy, pickling, torch.save) checks anew: it may run on other groups.
        return (LayerAgreement, ())

    def is_verified(self, group: Optional[Any], key: str) -> bool:
        """Whether a collective with ``key`` on ``group`` needs no check (never in debug mode)."""
        return not settings._DEBUG and key in self._verified.get(_world_if_none(group), ())

    def verify(
        self, group: Optional[Any], key: str, description: str, *, traced: bool = False, error: Optional[str] = None
    ) -> None:
        """Check that every member of ``group`` is at a collective with ``key``, unless :meth:`is_verified`.

        Every member compares the same gathered records (one fixed-size ``all_gather`` on ``group``), so all reach
        the same verdict.

        Args:
            group: the process group; None means the world group.
            key: what must agree: num_features, dtype and the collective's direction, short text.
            description: names the layer in the error (its qualified name and class).
            traced: whether ``torch.compile`` traces this call (see the module docstring).
            error: why this member's input is bad (its own error is raised by the caller after the check), or None.

        Raises:
            LayerMismatchError: on every member, naming each rank's record, if the records differ.
        """
        group = _world_if_none(group)
        if self.is_verified(group, key):
            return
        how = "traced by torch.compile" if traced else "eager"
        compared = f"{key}, {how}" if error is None else f"bad input: {error}"
        display = f"{description}: {compared}"
        if settings._DEBUG:
            # The call number catches a member that skipped or added a collective; the name, one that reordered.
            call = _DEBUG_CALLS.get(group, 0) + 1
            _DEBUG_CALLS[group] = call
            display = f"call #{call} at {display}"
            compared = display
        gathered = all_gather_bytes(f"{compared}{_SEPARATOR}{display}".encode(), group, size=_RECORD_BYTES)
        records = [record.decode("utf-8", "replace").split(_SEPARATOR, 1) for record in gathered]
        if any(record[0] != records[0][0] for record in records):
            hint = "" if settings._DEBUG else " (set SYNCBN_DEBUG=1 to check every call)"
            raise LayerMismatchError(
                "synchronized BatchNorm layers disagree across the members of the process group" + hint + ":\n"
                + _describe_disagreement(records, group) + _advice(records)
            )
        self._verified.setdefault(group, set()).add(key)

    def mark_verified(self, group: Optional[Any], key: str) -> None:
        """Count a collective with ``key`` on ``group`` as checked (a traced layer's backward: see the module)."""
        self._verified.setdefault(_world_if_none(group), set()).add(key)


def collective_key(num_features: int, dtype: torch.dtype, numel: int) -> str:
    """What the members of a group compare before a layer's collective of ``numel`` values: the layer's num_features
    and dtype, and the direction the size tells (forward ``2C + 1`` values, backward ``2C``)."""
    direction = {2 * num_features + 1: "forward", 2 * num_features: "backward"}.get(numel, f"{numel} values")
    return f"num_features={num_features} dtype={dtype}, {direction}"


class CheckedTransport:
    """A layer's transport over a process group that runs the agreement check before each of its collectives.

    A synchronized layer uses one while a check is due (its first forward and backward on the group, or every call in
    debug mode) and the plain transport afterwards, so the steady state costs nothing. Its ``sum_`` checks, then sums;
    a compiled region, whose collective runs inside it, calls :meth:`check` first.

    Args:
        transport: the layer's :class:`~syncbn_dist.comm.DistributedTransport` or ``JoinTransport``.
        agreement: the layer's :class:`LayerAgreement`.
        num_features, dtype: the layer's, for :func:`collective_key`.
        description: names the layer in the error.
    """

    def __init__(
        self, transport: Any, agreement: LayerAgreement, num_features: int, dtype: torch.dtype, description: str
    ) -> None:
        self.name = transport.name
        self.differentiable_exchange = False
        self.transport = transport
        self._agreement = agreement
        self._num_features, self._dtype, self._description = num_features, dtype, description

    @property
    def process_group(self) -> Any:
        return self.transport.process_group

    @property
    def group_name(self) -> Any:
        """The compiled kernels' name of the transport's group (see ``SummingTransport.group_name``)."""
        return self.transport.group_name

    def agreement_group(self) -> Any:
        return self.transport.agreement_group()

    def check(self, numel: int) -> None:
        """The check before a collective of ``numel`` values, unless already verified.

        Raises:
            LayerMismatchError: on every member, if they are at different collectives.
        """
        group = self.transport.agreement_group()
        if group is not None:  # (None: under Join with a peer joined, whose controls check every collective)
            key = collective_key(self._num_features, self._dtype, numel)
            self._agreement.verify(group, key, self._description)

    def sum_(self, tensor: Tensor) -> Tensor:
        """:meth:`check`, then the transport's ``sum_``."""
        self.check(tensor.numel())
        return self.transport.sum_(tensor)

    def all_reduce(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """:meth:`DistributedTransport.all_reduce` (differentiable), each direction's collective checked."""
        return list(_AllReduceCoalesced.apply(self, *tensors))


def agreement_of(layer: Any) -> LayerAgreement:
    """The :class:`LayerAgreement` of ``layer`` (a module, kept in its ``__dict__`` so that DataParallel replicas share
    it), made on first use: always eagerly, never in code ``torch.compile`` traces."""
    state = layer.__dict__
    agreement = state.get("_agreement")
    if agreement is None:
        agreement = state["_agreement"] = LayerAgreement()
    return agreement


def _describe_disagreement(records: list[list[str]], group: Any) -> str:
    """One line per member from ``[compared, display]`` records, then which ranks differ from the first."""
    ranks = [dist.get_global_rank(group, i) for i in range(len(records))]
    lines = [f"  rank {rank}: {record[-1]}" for rank, record in zip(ranks, records)]
    differing = [rank for rank, record in zip(ranks, records) if record[0] != records[0][0]]
    return "\n".join(lines) + f"\nranks {differing} differ from rank {ranks[0]}"


def _advice(records: list[list[str]]) -> str:
    compared = {record[0].rsplit(", ", 1)[-1] for record in records}
    if {"traced by torch.compile", "eager"} <= compared:
        return (
            "\nSome ranks trace this layer under torch.compile while others run it eagerly: compile the model on "
            "every rank or on none (a rank may fall back to eager once every layer has run: Dynamo's recompile limit)"
        )
    return ""


def verify_while_tracing(
    group: Optional[Any], forward_key: str, backward_key: str, description: str, layer: Any
) -> None:
    """:meth:`LayerAgreement.verify` of a forward that ``torch.compile`` traces, run once, eagerly, while Dynamo traces.

    Left out of the graph: every member traces its first call of a layer before its graph runs a collective, so all
    of them take part in the gather, and a recompilation (a new batch shape on one rank only) finds the layer verified
    and gathers nothing. The backward (inside the compiled graph, where nothing can be checked) counts as verified too,
    and so does the layer's eager path, which a rank takes when Dynamo falls back to eager. Debug mode's per-call
    check cannot be traced; debug mode runs the layer eagerly.

    Args:
        group: the process group, or None for the world group.
        forward_key, backward_key: the keys of the layer's forward and backward collectives.
        description: names the layer in the error.
        layer: the module that holds the layer's agreement (:func:`agreement_of`).

    Raises:
        LayerMismatchError: as :meth:`LayerAgreement.verify`, at compile time, on every member.
    """
    _verify_once(group, forward_key, backward_key, description, layer)


@torch._dynamo.assume_constant_result
def _verify_once(group: Any, forward_key: str, backward_key: str, description: str, layer: Any) -> bool:
    # assume_constant_result: dynamo calls this while tracing, with the real arguments, and keeps only the result; the
    # agreement is plain Python state, which the traced code never sees.
    agreement = agreement_of(layer)
    agreement.verify(group, forward_key, description, traced=True)
    agreement.mark_verified(group, backward_key)
    return True
