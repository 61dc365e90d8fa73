"""The gather check: before a collective of a group's first step (every one in debug mode), one ``all_gather`` of a
short record per member (layer, num_features, dtype, direction, traced or eager, an input error) catches what a tag
cannot: payloads of other sizes (which abort gloo), a compiled rank beside an eager one, a bad input on one rank.
Which collectives are gathered depends only on the group's history (:class:`_Window`), so ranks decide alike.
docs/design.md, "Every collective checks itself".
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .. import settings
from ..compiler_marks import when_dynamo_loads
from .distributed import _AllReduceCoalesced, all_gather_bytes, resolve_group
from .tags import BACKWARD, LayerMismatchError, describe_disagreement, exchange_advice, layer_tags, traced_constants

__all__ = [
    "CheckedTransport",
    "LayerAgreement",
    "LayerMismatchError",
    "agreement_of",
    "check_due",
    "verify",
    "verify_while_tracing",
]

# Debug-mode call numbers: this process's checked collectives on each process group (forgotten with the group).
_DEBUG_CALLS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
# Bytes per rank of the gathered record, and its field separator.
_RECORD_BYTES = 256
_SEPARATOR = "\x1f"


def _world_if_none(group: Optional[Any]) -> Any:
    return dist.group.WORLD if group is None else group


class _Window:
    """Which collectives of one process group the gather checks: every eager one while ``state`` is "open" (the
    group's first step), none once "closed"; ``seen``: those checked, eager or traced; ``first_traces``: by Dynamo
    frame, the compilation that first traced a synchronized training call of the group (the one whose layers the
    trace-time check gathers)."""

    __slots__ = ("state", "seen", "first_layer", "first_traces")

    def __init__(self) -> None:
        self.state = "open"
        self.seen: set[tuple[str, str]] = set()  # (layer identity, direction) of every collective checked
        self.first_layer: Optional[str] = None
        self.first_traces: dict[int, int] = {}  # frame id -> that frame's compilation that first traced the group

    def passed(self, identity: str, direction: str) -> None:
        """Record an eager collective that passed the check, closing the window where the first step ends."""
        key = (identity, direction)
        if key in self.seen or (direction == BACKWARD and identity == self.first_layer):
            self.state = "closed"
        if self.first_layer is None:
            self.first_layer = identity
        self.seen.add(key)


# Each process group's window (forgotten with the group: a new group has a first step of its own).
_WINDOWS: weakref.WeakKeyDictionary[Any, _Window] = weakref.WeakKeyDictionary()


def _window(group: Any) -> _Window:
    window = _WINDOWS.get(group)
    if window is None:
        window = _WINDOWS[group] = _Window()
    return window


def check_due(group: Optional[Any]) -> bool:
    """Whether an eager collective on ``group`` (None: the world) is gathered and checked before it runs: in debug mode,
    and during the group's first step."""
    return settings._DEBUG or _window(_world_if_none(group)).state == "open"


class LayerAgreement:
    """A synchronized layer's memory of its agreement checks (shared by its DataParallel replicas; a copy starts
    empty): ``settled``, the transport and dtype of its last call that needed no gather (the steady state's test, two
    identity comparisons), and its tags by direction."""

    def __init__(self) -> None:
        self.settled: Optional[tuple[Any, torch.dtype]] = None
        self.tags: dict[tuple[str, str], Any] = {}  # (forward direction, exchange) -> the layer's tags

    def __reduce__(self) -> tuple[type[LayerAgreement], tuple[()]]:
        return (LayerAgreement, ())


def verify(
    group: Optional[Any],
    tag: Any,
    key: str,
    description: str,
    *,
    traced: bool = False,
    error: Optional[str] = None,
) -> None:
    """Gather one record per member of ``group`` and compare them: every member reaches the same verdict.

    Args:
        group: the process group; None means the world group.
        tag: the collective's :class:`~syncbn_dist.comm.tags.CollectiveTag` (its layer identity and direction).
        key: what else must agree, short text (num_features and dtype).
        description: names the layer in the error (its qualified name and class).
        traced: whether ``torch.compile`` traces this call.
        error: why this member's input is bad (its own error is raised by the caller after the check), or None.

    Raises:
        LayerMismatchError: on every member, naming each rank's record, if the records differ.
    """
    group = _world_if_none(group)
    how = "traced by torch.compile" if traced else "eager"
    shown = f"{key}, {tag.where}, {how}"
    compared = f"{tag.identity}{_SEPARATOR}{shown}" if error is None else f"bad input: {error}"
    display = f"{description}: {shown if error is None else compared}"
    if settings._DEBUG:
        # The call number catches a member that skipped or added a collective; the name, one that reordered.
        call = _DEBUG_CALLS.get(group, 0) + 1
        _DEBUG_CALLS[group] = call
        display = f"call #{call} at {display}"
        compared = f"call #{call}{_SEPARATOR}{compared}"
    record = f"{compared}{_SEPARATOR * 2}{display}".encode()
    gathered = all_gather_bytes(record, group, size=_RECORD_BYTES)
    records = [item.decode("utf-8", "replace").split(_SEPARATOR * 2, 1) for item in gathered]
    if any(record[0] != records[0][0] for record in records):
        hint = "" if settings._DEBUG else " (set SYNCBN_DEBUG=1 to check every call)"
        raise LayerMismatchError(
            "synchronized BatchNorm layers disagree across the members of the process group" + hint + ":\n"
            + describe_disagreement(records, group) + _advice(records)
        )
    if not traced and not settings._DEBUG:
        _window(group).passed(tag.identity, tag.direction)


def _advice(records: list[list[str]]) -> str:
    compared = {record[0].rsplit(", ", 1)[-1] for record in records}
    if {"traced by torch.compile", "eager"} <= compared:
        return (
            "\nSome ranks trace this layer under torch.compile while others run it eagerly: compile the model on "
            "every rank or on none (a rank may fall back to eager once every layer has run: Dynamo's recompile limit)"
        )
    return exchange_advice([record[0] for record in records])


class CheckedTransport:
    """A layer's transport over a process group that runs the gather check before each collective while
    :func:`check_due` says so; a region traced into a user's graph, whose collective runs inside it, calls
    :meth:`check` first.

    Args:
        transport: the layer's :class:`~syncbn_dist.comm.DistributedTransport` or ``JoinTransport``.
        key: the layer's num_features and dtype, as records show them.
        description: names the layer in the error.
    """

    def __init__(self, transport: Any, key: str, description: str) -> None:
        self.name = transport.name
        self.differentiable_exchange = False
        self.exchange_name = transport.exchange_name
        self.transport = transport
        self._key, self._description = key, description

    @property
    def process_group(self) -> Any:
        return self.transport.process_group

    @property
    def group_name(self) -> Any:
        """The traced regions' name of the transport's group (see ``SummingTransport.group_name``)."""
        return self.transport.group_name

    def agreement_group(self) -> Any:
        return self.transport.agreement_group()

    def check(self, tag: Any) -> None:
        """The gather check before the collective of ``tag``, where it is due.

        Raises:
            LayerMismatchError: on every member, if they are at different collectives.
        """
        group = self.transport.agreement_group()
        if group is not None and check_due(group):  # (None: under Join with a peer joined: the controls check)
            verify(group, tag, self._key, self._description)

    def sum_(self, tensor: Tensor, tag: Any = None) -> Tensor:
        """:meth:`check`, then the transport's ``sum_``."""
        if tag is not None:
            self.check(tag)
        return self.transport.sum_(tensor, tag)

    def all_reduce(self, tensors: Sequence[Tensor], tags: Any = None) -> list[Tensor]:
        """:meth:`DistributedTransport.all_reduce` (differentiable), each direction's collective checked."""
        return list(_AllReduceCoalesced.apply(self, tags, *tensors))


def agreement_of(layer: Any) -> LayerAgreement:
    """The :class:`LayerAgreement` in ``layer.__dict__`` (so DataParallel replicas share it), made on first use,
    eagerly."""
    state = layer.__dict__
    agreement = state.get("_agreement")
    if agreement is None:
        agreement = state["_agreement"] = LayerAgreement()
    return agreement


def verify_while_tracing(group_name: str, identity: str, forward: str, key: str, description: str) -> Any:
    """The gather check of a layer that ``torch.compile`` traces, run eagerly while Dynamo traces it (marked
    ``assume_constant_result``: Dynamo keeps only the result). Only the compilation of a frame that first traces the
    group's synchronized training calls checks, and only layers the group has not checked: every member traces that
    before its graph runs a collective, whatever it compiled of the frame before (an evaluation on one rank first),
    and a recompilation on one rank gathers nothing. Tracing ends the group's eager first step on this rank.

    Args:
        group_name: the process group's name (Dynamo hands groups themselves over as fake objects, names as text).
        identity: names the layer on every member alike (in its collective tags:
            :func:`~syncbn_dist.comm.tags.layer_tags`).
        forward: the direction of its forward collective (whether autograd will run its backward).
        key, description: as :func:`verify` takes them.

    Returns:
        The tags as constants of the graph: :func:`~syncbn_dist.comm.tags.traced_constants` of the forward's, then of
        the backward's (:func:`syncbn_dist.comm.tags.traced_tags` reads them).

    Raises:
        LayerMismatchError: as :func:`verify`, at compile time, on every member.
    """
    forward_tag, backward_tag = layer_tags(identity, description, forward)
    group = resolve_group(group_name)
    window = _window(group)
    from torch._guards import CompileContext  # (Dynamo is tracing: loaded)

    compile_id = CompileContext.current_compile_id()
    if compile_id is None:
        first_compilation = True
    else:  # (no frame under compiled autograd: never a first compilation there)
        frame, number = compile_id.frame_id, compile_id.frame_compile_id
        first_compilation = frame is not None and window.first_traces.setdefault(frame, number) == number
    if first_compilation and (forward_tag.identity, forward_tag.direction) not in window.seen:
        verify(group, forward_tag, key, description, traced=True)
        window.seen.update({(t.identity, t.direction) for t in (forward_tag, backward_tag)})
    window.state = "closed"  # this rank compiles: its eager calls, if it falls back to eager, gather nothing
    return (*traced_constants(forward_tag), *traced_constants(backward_tag))


when_dynamo_loads(lambda: torch.compiler.assume_constant_result(verify_while_tracing))
