"""Collective tags: every synchronized collective says which layer and direction sent it, and checks that on arrival.

Each member appends ``[1, f, f**2, g, g**2]`` (float64; ``(f, g)`` two 16-bit hashes of the layer's identity and the
direction) to its payload; from the sums every member tests ``sum_i (f_i - f)**2 == 0`` (and for ``g``), so all pass
or all raise :class:`LayerMismatchError`. Read on the host after a CPU collective, by a custom op in a compiled graph
(:func:`checked_in_graph`), on CUDA at a later call (:class:`_DeviceMonitor`). docs/design.md, "Every collective
checks itself".
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .distributed import all_gather_bytes, resolve_group

__all__ = [
    "BACKWARD",
    "EXCHANGES",
    "JOIN_SESSION",
    "PROCESS_GROUP",
    "REPLICA_EXCHANGE",
    "FORWARD",
    "FORWARD_WITHOUT_BACKWARD",
    "NO_TAG",
    "RECORDED_ADJOINT",
    "RECORDED_BACKWARD",
    "TANGENT",
    "TAG_SIZE",
    "CollectiveTag",
    "LayerMismatchError",
    "TracedTag",
    "checked_in_graph",
    "layer_tags",
    "describe_disagreement",
    "exchange_advice",
    "raise_pending_mismatch",
    "summed_tags_agree",
    "tag_for",
    "traced_constants",
    "traced_tag",
    "traced_tags",
]

#: Values a tag adds to a payload: ``[1, f, f**2, g, g**2]``.
TAG_SIZE = 5
# The directions of a layer's collectives. A training forward says whether autograd will run its backward (and so the
# backward's collective): a forward under no_grad on one rank beside a training forward on another is a mismatch.
FORWARD, FORWARD_WITHOUT_BACKWARD, BACKWARD = "forward", "forward without backward", "backward"
TANGENT = "forward-mode tangent"
RECORDED_BACKWARD, RECORDED_ADJOINT = "recorded backward (create_graph)", "adjoint of the recorded backward"
# The exchanges a collective can belong to: a process group's own sums; the DataParallel replica exchange's
# cross-process sum, whose backward sums the gradients of the totals rather than the layer's backward payload; the
# copy of a group that torch's Join runs the layers on.
PROCESS_GROUP, REPLICA_EXCHANGE, JOIN_SESSION = "process group", "replica exchange", "Join session"
EXCHANGES = (PROCESS_GROUP, REPLICA_EXCHANGE, JOIN_SESSION)
_F64 = torch.float64
# Bytes per rank of the record gathered to name every member's collective, once a mismatch is found.
_RECORD_BYTES = 256


class LayerMismatchError(ValueError):
    """Members of a synchronization group reached different synchronized collectives: another layer, or the other
    direction (raised on every member at that collective).

    Raised by the collective tags, the first-step and debug-mode gather checks and the controls under ``Join``
    ([Troubleshooting](../troubleshooting.md#what-is-caught-and-when)); inside a compiled graph on CUDA a mismatch is a
    device-side assertion instead.
    """


def describe_disagreement(records: list[list[str]], group: Any) -> str:
    """One line per member from ``[compared, display]`` records, then which ranks differ from the first."""
    ranks = [dist.get_global_rank(group, i) for i in range(len(records))]
    lines = [f"  rank {rank}: {record[-1]}" for rank, record in zip(ranks, records)]
    differing = [rank for rank, record in zip(ranks, records) if record[0] != records[0][0]]
    return "\n".join(lines) + f"\nranks {differing} differ from rank {ranks[0]}"


def exchange_advice(records: list[str]) -> str:
    """Advice for a disagreement whose ``records`` (each member's collective as text) mix the replica exchange with
    another, else empty."""
    through_replicas = {f"through the {REPLICA_EXCHANGE}" in record for record in records}
    if len(through_replicas) == 2:
        return (
            "\nSome processes run this layer in DataParallel replicas and others run it directly: the replica "
            "exchange and the process group sum different gradients. Run replicas on every process or on none "
            "(nn.DataParallel on one CUDA device runs the module itself; syncbn_dist.DataParallelWithCallback with "
            "cpu_replicas=1 makes a replica)"
        )
    return ""


class CollectiveTag:
    """The identity of one synchronized collective: a layer and a direction, hashed into two 16-bit integers.

    Args:
        identity: what names the layer on every member alike (:func:`syncbn_dist.layer.identity.layer_identity`).
        direction: the collective's direction (``"forward"``, ``"backward"``, ...).
        description: how errors name the layer (its name and class).
        index: the tag's number in this process (:func:`tag_for`).
        exchange: which exchange the collective belongs to, one of :data:`EXCHANGES`. Default: ``"process group"``
    """

    __slots__ = ("identity", "direction", "description", "index", "exchange", "values", "_discrepancy", "_tails")

    def __init__(
        self, identity: str, direction: str, description: str, index: int, exchange: str = PROCESS_GROUP
    ) -> None:
        digest = hashlib.blake2b(f"{identity}\x1f{direction}\x1f{exchange}".encode(), digest_size=4).digest()
        f, g = int.from_bytes(digest[:2], "little"), int.from_bytes(digest[2:], "little")
        self.identity, self.direction, self.description, self.index = identity, direction, description, index
        self.exchange = exchange
        self.values = (1.0, float(f), float(f * f), float(g), float(g * g))
        # [f**2 + g**2, -2 f, 1, -2 g, 1]: its dot product with the summed tag is sum_i (f_i - f)**2 + (g_i - g)**2.
        self._discrepancy = (float(f * f + g * g), -2.0 * f, 1.0, -2.0 * g, 1.0)
        self._tails: dict[tuple[torch.device, Optional[float]], Tensor] = {}

    def sibling(self, direction: str) -> CollectiveTag:
        """The tag of the same layer's collective in ``direction``, through the same exchange."""
        return tag_for(self.identity, direction, self.description, self.exchange)

    @property
    def where(self) -> str:
        """The direction, and the exchange unless it is the process group's own (how records and errors show it)."""
        return self.direction if self.exchange == PROCESS_GROUP else f"{self.direction} through the {self.exchange}"

    def tail(self, device: torch.device, lead: Optional[float]) -> Tensor:
        """``[lead, 1, f, f**2, g, g**2]`` float64 on ``device`` (made once), ``lead`` the payload's count slot
        (None: the tag's five values)."""
        key = (device, lead)
        tail = self._tails.get(key)
        if tail is None:
            values = self.values if lead is None else (lead, *self.values)
            tail = self._tails[key] = torch.tensor(values, dtype=_F64, device=device)
        return tail

    def discrepancy_weights(self, device: torch.device) -> Tensor:
        """(5,) float64 on ``device``: the summed tag's dot product with it is 0 exactly when every member agrees."""
        key = (device, -1.0)  # (no count slot is -1)
        weights = self._tails.get(key)
        if weights is None:
            weights = self._tails[key] = torch.tensor(self._discrepancy, dtype=_F64, device=device)
        return weights

    def verify(self, total: Tensor, transport: Optional[Any] = None) -> None:
        """Check the summed tags at the end of ``total``.

        Args:
            total: the summed payload, its last :data:`TAG_SIZE` values the summed tags (or those values alone).
            transport: what summed it: on a mismatch its ``agreement_group()`` gathers a record per member to name
                each one's collective (no group: the error names this member's alone).

        Raises:
            LayerMismatchError: on every member, if they did not all send this tag (on CUDA at a later synchronized
                call, see :class:`_DeviceMonitor`).
        """
        summed = total[-TAG_SIZE:]
        if summed.is_cuda:
            _monitor(summed.device).add(self, summed)
            return
        # sum_i (f_i - f)**2 == 0 as the sums allow it (the same for g), in exact float64 integers.
        n, f_sum, f_squares, g_sum, g_squares = summed.tolist()
        _, f, f_square, g, g_square = self.values
        if not (f_sum == n * f and f_squares == n * f_square and g_sum == n * g and g_squares == n * g_square):
            group = getattr(transport, "agreement_group", lambda: None)()
            raise self.mismatch(int(n), group)

    def mismatch(self, members: int, group: Optional[Any]) -> LayerMismatchError:
        """The error every member raises when a collective's tags disagree, naming each member's collective when
        ``group`` is given (one ``all_gather``, which every member of ``group`` runs here)."""
        mine = f"{self.description}: {self.where}"
        if group is not None:
            records = [r.decode("utf-8", "replace") for r in all_gather_bytes(mine.encode(), group, _RECORD_BYTES)]
            return LayerMismatchError(
                "synchronized BatchNorm layers disagree across the members of the process group: they were at "
                "different synchronized collectives (a layer or direction that not every member runs at this point):\n"
                + describe_disagreement([[record, record] for record in records], group)
                + exchange_advice(records)
            )
        return LayerMismatchError(
            f"synchronized BatchNorm layers disagree across the {members} members of this collective: this member was "
            f"at {mine}, some other member at another synchronized collective (a layer or direction that not every "
            "member runs at this point). Set SYNCBN_DEBUG=1 to name every member's layer"
        )


class TracedTag(NamedTuple):
    """A :class:`CollectiveTag` as constants of a traced graph: its number, its five values, and what it names."""

    index: int
    values: tuple[float, ...]
    name: str


#: The tag of a collective with no peer (a group of one): its sums are its own, nothing is checked.
NO_TAG = TracedTag(-1, (1.0, 0.0, 0.0, 0.0, 0.0), "")


def traced_constants(tag: CollectiveTag) -> tuple[Any, ...]:
    """``tag`` as the constants a trace-time function returns: ``(index, *values, name)``."""
    return (tag.index, *tag.values, f"{tag.description}: {tag.where}")


def traced_tag(tag: CollectiveTag) -> TracedTag:
    """``tag`` as a :class:`TracedTag`."""
    index, *values, name = traced_constants(tag)
    return TracedTag(index, tuple(values), name)


def traced_tags(constants: tuple[Any, ...]) -> tuple[TracedTag, TracedTag]:
    """The forward and backward :class:`TracedTag` from the flat tuple of both :func:`traced_constants` (what
    :func:`syncbn_dist.comm.agreement.verify_while_tracing` returns)."""
    size = 2 + TAG_SIZE
    forward, backward = constants[:size], constants[size:]
    return (
        TracedTag(forward[0], tuple(forward[1:-1]), forward[-1]),
        TracedTag(backward[0], tuple(backward[1:-1]), backward[-1]),
    )


_TAGS: dict[tuple[str, str, str], CollectiveTag] = {}
_TAGS_BY_INDEX: list[CollectiveTag] = []
_TAGS_LOCK = threading.Lock()


def layer_tags(
    identity: str, description: str, forward: str = FORWARD, exchange: str = PROCESS_GROUP
) -> tuple[CollectiveTag, CollectiveTag]:
    """The tags of a layer's forward (direction ``forward``) and backward collectives through ``exchange``."""
    return tag_for(identity, forward, description, exchange), tag_for(identity, BACKWARD, description, exchange)


def summed_tags_agree(summed: list[float]) -> bool:
    """Whether the members that sent the summed tag ``summed`` all sent the same one, for a member that sent none (a
    joined rank's listener): ``n sum f**2 == (sum f)**2`` for both halves, in exact integers."""
    n, f_sum, f_squares, g_sum, g_squares = (round(value) for value in summed)
    return n * f_squares == f_sum * f_sum and n * g_squares == g_sum * g_sum


def tag_for(identity: str, direction: str, description: str, exchange: str = PROCESS_GROUP) -> CollectiveTag:
    """The tag of ``identity``'s collectives in ``direction`` through ``exchange``, made once per process (the
    description of its first request names it in errors)."""
    key = (identity, direction, exchange)
    tag = _TAGS.get(key)
    if tag is None:
        with _TAGS_LOCK:  # DataParallel replica threads may ask together
            tag = _TAGS.get(key)
            if tag is None:
                tag = _TAGS[key] = CollectiveTag(identity, direction, description, len(_TAGS_BY_INDEX), exchange)
                _TAGS_BY_INDEX.append(tag)
    return tag


# CUDA: the discrepancy accumulated on the device, read back later.

# Slots of a device's accumulator, by tag index modulo this: fixed, so that CUDA graphs that captured the accumulation
# keep writing where the monitor reads.
_SLOTS = 4096


class _DeviceMonitor:
    """One CUDA device's summed discrepancies, a slot per tag, copied to pinned host memory: :meth:`add` accumulates
    with one kernel and no host read, then polls."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums = torch.zeros(_SLOTS, dtype=_F64, device=device)
        self.host = torch.zeros(_SLOTS, dtype=_F64, pin_memory=True)
        self.event: Optional[torch.cuda.Event] = None

    def add(self, tag: CollectiveTag, summed: Tensor) -> None:
        slot = self.sums.narrow(0, tag.index % _SLOTS, 1)
        slot.addmv_(summed.view(1, TAG_SIZE), tag.discrepancy_weights(summed.device))
        self.poll()

    def poll(self, wait: bool = False) -> None:
        """Raise for a discrepancy the device has reported back; enqueue the next copy (``wait``: wait for it). Nothing
        while a CUDA graph is captured (its replays accumulate into the same slots)."""
        if torch.cuda.is_current_stream_capturing():
            return
        if self.event is not None and (wait or self.event.query()):
            if wait:
                self.event.synchronize()
            self.event = None
            bad = self.host.nonzero().flatten().tolist()
            if bad:
                self.sums.zero_()
                names = sorted({f"{t.description}: {t.where}" for t in _TAGS_BY_INDEX if t.index % _SLOTS in bad})
                raise LayerMismatchError(
                    f"synchronized BatchNorm layers disagreed across the members of a collective on {self.device}: "
                    f"this member was at {'; '.join(names)}, some other member at another synchronized collective. "
                    "Found on the device after the collective ran. Set SYNCBN_DEBUG=1 to name every member's layer"
                )
        if self.event is None:
            self.host.copy_(self.sums, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()


_MONITORS: dict[torch.device, _DeviceMonitor] = {}


def _monitor(device: torch.device) -> _DeviceMonitor:
    monitor = _MONITORS.get(device)
    if monitor is None:
        monitor = _MONITORS[device] = _DeviceMonitor(device)
    return monitor


def raise_pending_mismatch() -> None:
    """Wait for every CUDA device this process checked collectives on, and raise a mismatch found there.

    Raises:
        LayerMismatchError: if a synchronized collective on a CUDA device mixed different layers or directions.
    """
    for monitor in list(_MONITORS.values()):
        monitor.poll(wait=True)
        monitor.poll(wait=True)  # the copy enqueued by the first poll holds every collective so far


# Inside a user's torch.compile graph.


class _NamedGroup(NamedTuple):
    """The group named ``name``, as :meth:`CollectiveTag.verify` asks for it: only on a mismatch."""

    name: str

    def agreement_group(self) -> Any:
        return resolve_group(self.name)


def _check_op(name: str) -> Any:
    """The custom op ``syncbn_dist::<name>(total, tag_index, group_name) -> total``: :meth:`CollectiveTag.verify` as
    one op of a compiled graph. On a mismatch ``group_name``'s members gather their records as eager mode does, so an
    eager member (Dynamo's fallback) and a compiled one run the same collectives."""

    @torch.library.custom_op(f"syncbn_dist::{name}", mutates_args=())
    def check(total: Tensor, tag_index: int, group_name: str) -> Tensor:
        _TAGS_BY_INDEX[tag_index].verify(total, _NamedGroup(group_name))
        return total.clone()

    check.register_fake(lambda total, tag_index, group_name: torch.empty_like(total))
    check.register_autograd(lambda ctx, grad: (grad, None, None))
    return getattr(torch.ops.syncbn_dist, name).default


# The forward's check, whose output the graph reads (the normalization and the running statistics), and the
# backward's, which the compiler must keep where nothing reads it (an empty shard's grad_input): a side effect. (Not
# the forward's: the partitioner would then move the forward's collectives into the backward graph.)
_FORWARD_CHECK = _check_op("tag_checked")
_BACKWARD_CHECK = _check_op("tag_checked_backward")
torch.fx.node.has_side_effect(_BACKWARD_CHECK)


def checked_in_graph(total: Tensor, tag: TracedTag, group_name: str, backward: bool = False) -> Tensor:
    """:meth:`CollectiveTag.verify` of ``total`` inside a traced graph, returning the checked total for the caller to
    use: on the CPU the custom op (``backward``: the one with a side effect), on CUDA ``torch._assert_async`` with no
    host code (docs/compile.md, "How the graph stays whole and correct")."""
    if not total.is_cuda:
        return (_BACKWARD_CHECK if backward else _FORWARD_CHECK)(total, tag.index, group_name)
    _, f, f_square, g, g_square = tag.values
    weights = total.new_tensor([f_square + g_square, -2.0 * f, 1.0, -2.0 * g, 1.0])
    discrepancy = (total[-TAG_SIZE:] * weights).sum()
    torch._assert_async(
        discrepancy == 0.0,
        f"syncbn_dist LayerMismatchError: members of a process group ran different synchronized collectives; this "
        f"member was at {tag.name}",
    )
    return total
