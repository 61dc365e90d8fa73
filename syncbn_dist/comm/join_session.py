"""Collectives for ranks that have run out of inputs: the protocol behind :func:`syncbn_dist.join_layers`.

Under ``Join``, a joined rank's *listener* thread answers the active ranks' collectives with an empty shard; while a
peer has joined, a *control* all-reduce before each says what to answer (docs/design.md, "Uneven inputs under Join").
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from .distributed import DistributedTransport
from .tags import FORWARD, FORWARD_WITHOUT_BACKWARD, TAG_SIZE, TANGENT, LayerMismatchError, summed_tags_agree
from .transport import UNREACHABLE

__all__ = [
    "NOTIFICATIONS",
    "OPEN_JOINS",
    "HeaderSchedule",
    "JoinBinding",
    "JoinSession",
    "JoinTransport",
    "NotCoveredByJoinError",
]

#: How many enabled torch ``Join`` contexts are open in this process (counted by syncbn_dist.integrations.torch_join):
#: a synchronized layer that trains over a process group then needs a joinable of its own.
OPEN_JOINS = [0]
#: How many per-step notifications (``Join.notify_join_context`` by a ``Join``'s first joinable: DDP's forward, or
#: another joinable's) this process has sent (counted by syncbn_dist.integrations.torch_join).
NOTIFICATIONS = [0]

# Control kinds: a forward's start, a collective, and a forward whose total updates the running statistics.
_HEADER, _COLLECTIVE, _TRACKED_FORWARD = 1.0, 2.0, 3.0
# The dtypes a payload can have, by code (the index + 1): the synchronized layers send float64.
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_CONTROL_SIZE = 9
_FORWARD_DIRECTIONS = (FORWARD, FORWARD_WITHOUT_BACKWARD, TANGENT)  # (a tangent: forward-mode AD, in the forward)


def _control(active: float, kind: float, layer: int, numel: int, dtype_code: int, device: torch.device) -> Tensor:
    values = [active]
    for value in (kind, layer, numel, dtype_code):
        values += [value * active, value * value * active]
    return torch.tensor(values, dtype=torch.float64, device=device)


class _Announcement:
    """What the active ranks of one control sent, or why they disagree (the summed control, read on the host)."""

    def __init__(self, total: Tensor) -> None:
        values = total.tolist()
        self.active = round(values[0])
        self.fields: list[int] = []
        self.agree = True
        for i in range(1, _CONTROL_SIZE, 2):
            total_value, total_square = values[i], values[i + 1]
            if self.active and self.active * total_square != total_value * total_value:
                self.agree = False
            self.fields.append(round(total_value / self.active) if self.active else 0)

    @property
    def kind(self) -> int:
        return self.fields[0]

    @property
    def layer(self) -> int:
        return self.fields[1]

    @property
    def numel(self) -> int:
        return self.fields[2]

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.fields[3] - 1]


class JoinSession:
    """One group's synchronized layers inside ``Join`` contexts, on this rank: one group copy and one listener thread,
    shared by every joinable whose layers use the group.

    Args:
        process_group: a copy of the layers' own group, used by nothing else.
        device: where controls and empty shards live: CPU for gloo, the current CUDA device for nccl.
    """

    def __init__(self, process_group: Any, device: torch.device) -> None:
        self.transport = DistributedTransport(process_group)
        self.size = torch.distributed.get_world_size(process_group)
        self.device = device
        self.peers_joined = False
        self._listener: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._codes: dict[int, int] = {}  # id(layer) -> code
        self._layers: list[Callable[[], Any]] = []  # by code - 1: weak references to the layers
        self._forward_totals: list[tuple[Any, Tensor]] = []
        self._lock = threading.Lock()

    def code_of(self, layer: Any) -> int:
        """The number of ``layer`` in this session, from 1 (the same layer, bound by several joinables, gets one)."""
        code = self._codes.get(id(layer))
        if code is None or self._layers[code - 1]() is not layer:
            self._layers.append(weakref.ref(layer))
            code = self._codes[id(layer)] = len(self._layers)
        return code

    def take_forward_totals(self) -> list[tuple[Any, Tensor]]:
        """The ``(layer, summed forward payload)`` the listener answered since the last call, in order, for the main
        thread to update the running statistics from (the listener writes no buffer)."""
        with self._lock:
            totals, self._forward_totals = self._forward_totals, []
        return totals

    @property
    def process_group(self) -> Any:
        return self.transport.process_group

    def reset(self) -> None:
        """Forget the previous ``Join`` context's state (called when a new one is built, on every rank)."""
        self.peers_joined = False
        self._listener = None
        self._error = None

    def header(self) -> None:
        """The header that starts a step's synchronized calls (:class:`HeaderSchedule`), on an active rank: counts the
        active ranks (one small collective).

        Raises:
            LayerMismatchError: if the active ranks are not all at a header.
        """
        announcement = self._exchange(_control(1.0, _HEADER, 0, 0, 0, self.device))
        if not announcement.agree or announcement.kind != _HEADER:
            raise LayerMismatchError(self._mismatch("at the start of a step (a header)"))
        self.peers_joined = announcement.active < self.size

    def announce(self, layer: int, payload: Tensor, tracked_forward: bool = False, what: str = "") -> None:
        """On an active rank, before ``payload`` is summed: tell the joined ranks, if any, what to answer (``what``:
        this rank's layer and direction, for the error).

        Raises:
            LayerMismatchError: on every rank, if the active ranks' layers, payload sizes or dtypes differ.
        """
        if not self.peers_joined:
            return
        dtype_code = _DTYPES.index(payload.dtype) + 1
        kind = _TRACKED_FORWARD if tracked_forward else _COLLECTIVE
        announcement = self._exchange(_control(1.0, kind, layer, payload.numel(), dtype_code, self.device))
        if not announcement.agree:
            where = what or f"layer {layer}"
            raise LayerMismatchError(self._mismatch(f"(this rank was at {where}, {payload.numel()} values)"))

    def start_listener(self) -> None:
        """On a rank that has joined: answer the active ranks' collectives in a thread until every rank has joined."""
        if self._listener is None:
            self._listener = threading.Thread(target=self._listen, name="syncbn_dist-join-listener", daemon=True)
            self._listener.start()

    def finish(self) -> None:
        """After every rank has joined: wait for the listener to stop and raise what it found, if anything.

        Raises:
            LayerMismatchError: if the active ranks disagreed while this rank listened.
            RuntimeError: the process group's error if a collective of the listener failed or timed out.
        """
        if self._listener is not None:
            self._listener.join()
        self.raise_listener_error()

    def raise_listener_error(self) -> None:
        """Raise the error the listener met, if any (its traceback is the listener thread's)."""
        if self._error is not None:
            raise self._error

    def _listen(self) -> None:
        try:
            while True:
                announcement = self._exchange(_control(0.0, 0.0, 0, 0, 0, self.device))
                if announcement.active == 0:
                    return  # every rank has joined: the last control was all listeners
                if not announcement.agree:
                    raise LayerMismatchError(self._mismatch("while this rank had joined"))
                if announcement.kind == _HEADER:
                    continue
                total = self.transport.sum_(
                    torch.zeros(announcement.numel, dtype=announcement.dtype, device=self.device)
                )
                if not summed_tags_agree(total[-TAG_SIZE:].tolist()):  # (the active ranks raise at this collective)
                    raise LayerMismatchError(self._mismatch("while this rank had joined (their collectives' tags)"))
                if announcement.kind == _TRACKED_FORWARD:
                    layer = self._layers[announcement.layer - 1]()
                    if layer is not None:
                        with self._lock:
                            self._forward_totals.append((layer, total))
        except BaseException as error:  # noqa: B036 - handed to the main thread by finish()
            self._error = error

    def _exchange(self, control: Tensor) -> _Announcement:
        return _Announcement(self.transport.sum_(control))

    def _mismatch(self, where: str) -> str:
        return (
            f"under Join, the ranks that still have inputs reached different synchronized layers {where}: every "
            "active rank must run the same layers in the same order in each step (the joined ranks answer them)"
        )


class HeaderSchedule:
    """When the layers of one joinable send the next header, on an active rank: at a synchronized training call.

    A rank joins between two steps of the loop, so the header (:meth:`JoinSession.header`) must come before the first
    synchronized collective of every step; one more costs a small all-reduce. The layers see every call, whichever
    module runs them (the model, a wrapper of it, its DataParallel replicas, its children called one by one), and
    every active rank makes the same calls, so every active rank finds a header due at the same calls, from:

    - the first call in the ``Join``;
    - ``Join``'s per-step notification since the last header (:data:`NOTIFICATIONS`), which DDP sends in its forward;
    - a forward of the model the joinable was built from (itself, not a replica) started since the last header;
    - where no other joinable notifies (``by_layers``: ours are the first of the ``Join``), outside a forward of the
      model (its replicas or children run): a layer whose forward already ran since the last header (the next step's
      first forward), or a backward collective since the last header (the end of a step). Inside the model's forward
      its start alone counts, so ranks that run different layers there meet at the same headers, and the layers'
      collectives find it out (their checks and tags).
    """

    def __init__(self) -> None:
        self.by_layers = True
        self._started = False
        self._notifications = 0  # NOTIFICATIONS at the last header
        self._model_started = False  # a forward of the model started since the last header
        self._in_model = 0  # forwards of the model running now
        self._ran: set[int] = set()  # the layers whose forward ran since the last header (their transports' ids)
        self._backward = False

    def reset(self, by_layers: bool) -> None:
        """A new ``Join``: its first call starts with a header."""
        self.by_layers, self._started = by_layers, False

    def due(self, transport: JoinTransport) -> bool:
        """Whether the training call of ``transport``'s layer starts with a header (then :meth:`sent` follows)."""
        key = id(transport)
        if not self._started or self._model_started or self._notifications != NOTIFICATIONS[0]:
            return True
        if self.by_layers and not self._in_model and (self._backward or key in self._ran):
            return True
        self._ran.add(key)
        return False

    def sent(self, transport: JoinTransport) -> None:
        """The header before ``transport``'s call is sent (after this joinable's own notification, if it sends it)."""
        self._started, self._notifications, self._model_started, self._backward = True, NOTIFICATIONS[0], False, False
        self._ran = {id(transport)}

    def model_forward(self, end: bool) -> None:
        """A forward of the model starts (or ends: ``end``)."""
        if end:
            self._in_model = max(0, self._in_model - 1)
            return
        self._in_model += 1
        self._model_started = True

    def backward_ran(self) -> None:
        self._backward = True


class JoinTransport:
    """The transport of one synchronized layer inside a ``Join`` context: announces, then sums on the session's group.

    Args:
        session: this layer's :class:`JoinSession`.
        layer: the layer's code in the session, the same on every rank (:meth:`JoinSession.code_of`).
        schedule: the :class:`HeaderSchedule` of the layer's joinable, told of each backward collective.
    """

    name = "distributed"
    differentiable_exchange = False
    exchange_name = "Join session"
    # The controls that announce each collective to the joined ranks run in Python: no traced region can send them.
    group_name = UNREACHABLE

    def __init__(self, session: JoinSession, layer: int, schedule: HeaderSchedule) -> None:
        self.session = session
        self.layer = layer
        self.schedule = schedule
        self.process_group = session.process_group
        self._tracked_forward = False

    def expect_tracked_forward(self, tracked: bool) -> None:
        """Whether the layer's next collective (its forward payload) updates its running statistics; set by every
        training forward, so that no earlier call's answer outlives it."""
        self._tracked_forward = tracked

    def sum_(self, tensor: Tensor, tag: Optional[Any] = None) -> Tensor:
        """:meth:`DistributedTransport.sum_` on the session's group, announced to the joined ranks (who add zeros, so
        their tag counts nothing), then ``tag`` verified."""
        tracked_forward, self._tracked_forward = self._tracked_forward, False
        what = "" if tag is None else f"{tag.description}: {tag.where}"
        if tag is not None and tag.direction not in _FORWARD_DIRECTIONS:
            self.schedule.backward_ran()
        self.session.announce(self.layer, tensor, tracked_forward, what)
        total = self.session.transport.sum_(tensor)
        if tag is not None:
            tag.verify(total, self)
        return total

    def all_reduce(self, tensors: Sequence[Tensor], tags: Optional[tuple[Any, Any, bool]] = None) -> list[Tensor]:
        """:meth:`DistributedTransport.all_reduce` (differentiable, one collective), announced in both directions."""
        return self.session.transport.all_reduce(tensors, reducer=self, tags=tags)

    def agreement_group(self) -> Any:
        """The session's group while every rank is active; None once a peer has joined (the controls and tags then
        check each collective, and a joined rank cannot take part in a gather)."""
        return None if self.session.peers_joined else self.session.process_group


class NotCoveredByJoinError(RuntimeError):
    """A layer (its description) trains over a process group under a ``Join`` that covers it not: raised on every rank
    at its first such forward, before any collective, since every rank runs the same ``Join``; Join's exit then joins
    as a rank out of inputs does, and lets it through."""

    def __init__(self, layer: str) -> None:
        super().__init__(
            f"{layer} trains over a process group inside torch's Join, but no joinable of the Join covers it: once a "
            "rank runs out of inputs, nobody would answer its collectives. List the joinable of the model that holds "
            "it, e.g. Join([ddp, syncbn_dist.join_layers(teacher)]) for a second model (docs: the Join guide)"
        )


class JoinBinding:
    """A synchronized layer's link to its joinable (``layer._join_binding``).

    Copies of the layer (deepcopy, pickling) drop it: a copy is not in the ``Join``. DataParallel replicas share it
    (a shallow ``__dict__`` copy), so the master replica's collective over processes is announced like any other.

    Args:
        owner: the joinable (``active`` while a ``Join`` is open), held weakly: a cycle through the model would hold
            its process groups past ``destroy_process_group``, until a gc pass.
        transport: the layer's :class:`JoinTransport`.
    """

    def __init__(self, owner: Any, transport: JoinTransport) -> None:
        self._owner = weakref.ref(owner)
        self.transport = transport

    @property
    def owner(self) -> Any:
        """The joinable, or None once it is gone."""
        return self._owner()

    @property
    def active(self) -> bool:
        owner = self._owner()
        return owner is not None and owner.active

    def start_of_call(self) -> None:
        """Before the layer's training call while :attr:`active`, on the call that crosses processes (not a DataParallel
        slave's, not a checkpoint recomputation's): the joinable's header, where due (:class:`HeaderSchedule`).

        Raises:
            LayerMismatchError: as :meth:`JoinSession.header`.
            RuntimeError: ``Join``'s, under ``throw_on_early_termination=True`` once a rank has run out of inputs.
        """
        owner = self._owner()
        if owner is not None:
            owner._start_of_call(self.transport)

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_unbound, ())


def _unbound() -> None:
    return None
