"""Transports: the only place that touches ``torch.distributed`` or threads.

A transport sums a list of tensors over the members of a group with one collective, differentiably (see
:class:`syncbn_dist.functions.Transport`). Two exist:

- :class:`DistributedTransport`: one ``all_reduce`` over a process group (gloo, nccl, ...).
- :class:`DataParallelTransport`: the in-process master/slave exchange between DataParallel replicas
  (:class:`SyncMaster`, :class:`SlavePipe`, :class:`FutureResult`), optionally followed on the master by a
  :class:`DistributedTransport` over processes, so that replicas of all processes are synchronized.

Neither knows anything about batch norm.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Function

__all__ = [
    "DataParallelTransport",
    "DistributedTransport",
    "FutureResult",
    "LayerMismatchError",
    "ReplicaSyncError",
    "SlavePipe",
    "SyncMaster",
    "distributed_transport",
    "all_reduce_mean_",
    "broadcast_from_first_",
    "group_needs_sync",
    "is_debug_enabled",
    "new_sync_groups",
    "run_replicas_in_threads",
    "set_debug",
]

# How long a replica waits for the others at one synchronized layer before giving up (seconds).
DEFAULT_REPLICA_TIMEOUT = float(os.environ.get("SYNCBN_REPLICA_TIMEOUT", "300"))


def _flatten(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten(flat: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    return [chunk.view_as(t) for chunk, t in zip(flat.split([t.numel() for t in like]), like)]


class _AllReduceCoalesced(Function):
    """Sum tensors over a process group with one ``all_reduce``; backward does the same for the gradients.

    The adjoint of a sum-all_reduce is a sum-all_reduce of the gradients. Only the gradients of inputs that
    require grad are sent, so the backward payload is as small as it can be (every rank agrees on which
    inputs those are, since they run the same model).
    """

    @staticmethod
    def forward(ctx: Any, group: Any, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.group = group
        flat = _flatten(tensors)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        return tuple(_unflatten(flat, tensors))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Optional[Tensor], ...]:
        needed = [i for i, need in enumerate(ctx.needs_input_grad[1:]) if need]
        result: list[Optional[Tensor]] = [None] * len(grads)
        if needed:
            flat = _flatten([grads[i] for i in needed]).contiguous()
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=ctx.group)
            for i, chunk in zip(needed, _unflatten(flat, [grads[i] for i in needed])):
                result[i] = chunk
        return (None, *result)


# Debug-mode call numbers per process group (this process's count of synchronized collectives on it).
_DEBUG_CALLS: dict[Any, int] = {}
_DEBUG = os.environ.get("SYNCBN_DEBUG", "0").strip().lower() not in ("", "0", "false", "no", "off")
# Bytes per rank in the debug/handshake record gathered from every member, and its field separator.
_RECORD_BYTES = 256
_SEPARATOR = "\x1f"


def set_debug(enabled: bool) -> None:
    """Turn debug mode on or off for this process (also on with the environment variable ``SYNCBN_DEBUG=1``).

    In debug mode every synchronized collective is preceded by one small ``all_gather`` that checks that
    all members are at the same layer (call number, layer name, num_features, dtype); on a mismatch every
    member raises :class:`LayerMismatchError` naming each rank's layer, instead of hanging or mixing
    statistics. Off by default; when off it costs nothing.
    """
    global _DEBUG
    _DEBUG = bool(enabled)


def is_debug_enabled() -> bool:
    """Whether debug mode is on (see :func:`set_debug`)."""
    return _DEBUG


class LayerMismatchError(ValueError):
    """Members of a synchronization group reached different synchronized layers (raised on every member)."""


def _gather_records(record: str, group: Any) -> list[str]:
    """All-gather one short string per member as a fixed-size byte tensor (one collective)."""
    data = record.encode("utf-8")[:_RECORD_BYTES]
    mine = torch.zeros(_RECORD_BYTES, dtype=torch.uint8)
    mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = mine.to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace") for t in gathered]


def _describe_disagreement(records: list[list[str]], group: Any) -> str:
    """One line per member from ``[compared, display]`` records, then which ranks differ from the first."""
    ranks = [dist.get_global_rank(group, i) if group is not None else i for i in range(len(records))]
    lines = [f"  rank {rank}: {record[-1]}" for rank, record in zip(ranks, records)]
    differing = [rank for rank, record in zip(ranks, records) if record[0] != records[0][0]]
    return "\n".join(lines) + f"\nranks {differing} differ from rank {ranks[0]}"


class DistributedTransport:
    """Sums over the members of a ``torch.distributed`` process group with one ``all_reduce`` per call.

    Args:
        process_group: the group to reduce over; None means the default (world) group.

    The backend follows the tensors: gloo for CPU tensors, nccl for CUDA tensors.
    """

    name = "distributed"

    def __init__(self, process_group: Optional[Any] = None) -> None:
        self.process_group = process_group

    def all_reduce(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        return list(_AllReduceCoalesced.apply(self.process_group, *tensors))

    def verify_agreement(self, key: str, description: str, verified: set[Any]) -> None:
        """Raise :class:`LayerMismatchError` on every member unless all members present the same ``key``.

        Without debug mode the check runs once per (process group, caller): ``verified`` remembers the
        groups already checked, so the steady state costs nothing. In debug mode it runs at every call,
        prefixed with this group's call number, so a member that skipped or reordered a layer is caught
        at the next call. Every member compares the same gathered records, so all reach the same verdict.

        Args:
            key: what must agree (e.g. num_features and dtype), short text.
            description: names the caller in the error (e.g. the layer's qualified name).
            verified: the caller's record of groups already checked.
        """
        group = self.process_group
        group_key = "world" if group is None else id(group)
        if not _DEBUG and group_key in verified:
            return
        display = f"{description}: {key}"
        compared = key
        if _DEBUG:
            # The call number catches a member that skipped or added a layer; the name, one that reordered.
            call = _DEBUG_CALLS.get(group_key, 0) + 1
            _DEBUG_CALLS[group_key] = call
            display = f"call #{call} at {display}"
            compared = display
        records = [r.split(_SEPARATOR, 1) for r in _gather_records(f"{compared}{_SEPARATOR}{display}", group)]
        if any(record[0] != records[0][0] for record in records):
            hint = "" if _DEBUG else " (set SYNCBN_DEBUG=1 to check every call)"
            raise LayerMismatchError(
                "synchronized BatchNorm layers disagree across the members of the process group" + hint + ":\n"
                + _describe_disagreement(records, group)
            )
        verified.add(group_key)


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


def new_sync_groups(group_size: int) -> Any:
    """Split the world into process groups of ``group_size`` consecutive ranks and return this rank's.

    Pass the result to ``convert_model(model, process_group=...)`` to synchronize BatchNorm within each
    group of k ranks (e.g. within a node) instead of over the whole world. Every rank must call this, in
    the same order relative to other group creations, since creating a group is collective. Built on
    ``torch.distributed.new_subgroups``.

    Args:
        group_size: ranks per group; must divide the world size.

    Returns:
        The process group (ranks ``[r - r % k, r - r % k + k)`` for rank r) this rank belongs to.

    Raises:
        RuntimeError: if ``torch.distributed`` is not initialized.
        ValueError: if ``group_size`` is not a positive integer or does not divide the world size (raised
            on every rank before any group is created, since all ranks see the same world size).
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


def all_reduce_mean_(tensor: Tensor, process_group: Optional[Any] = None) -> Tensor:
    """Replace ``tensor`` in place by its mean over the members of ``process_group`` (one collective)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=process_group)
    return tensor.div_(dist.get_world_size(process_group))


def broadcast_from_first_(tensor: Tensor, process_group: Optional[Any] = None) -> Tensor:
    """Replace ``tensor`` in place by the first member's copy (group rank 0; one collective)."""
    source = 0 if process_group is None else dist.get_global_rank(process_group, 0)
    dist.broadcast(tensor, src=source, group=process_group)
    return tensor


def group_needs_sync(process_group: Optional[Any] = None) -> bool:
    """True if ``torch.distributed`` is initialized and ``process_group`` has more than one member.

    Raises:
        ValueError: if this rank is not a member of ``process_group``.
    """
    return distributed_transport(process_group) is not None


# ---------------------------------------------------------------------------------------------------------
# DataParallel: the in-process master/slave exchange.
# ---------------------------------------------------------------------------------------------------------


class ReplicaSyncError(RuntimeError):
    """A replica could not complete a synchronized layer: a peer failed, or did not arrive in time."""


class _Failure(NamedTuple):
    error: BaseException


class FutureResult:
    """A single-slot result that one thread puts and another waits for, with a timeout.

    ``put`` may carry an exception instead (see :meth:`put_error`); ``get`` then raises
    :class:`ReplicaSyncError` from it.
    """

    def __init__(self) -> None:
        self._result: Any = None
        self._ready = False
        self._cond = threading.Condition(threading.Lock())

    def put(self, result: Any) -> None:
        with self._cond:
            self._result = result
            self._ready = True
            self._cond.notify_all()

    def put_error(self, error: BaseException) -> None:
        self.put(_Failure(error))

    def get(self, timeout: Optional[float] = None) -> Any:
        """Wait for the result and take it (the slot is empty again afterwards).

        Raises:
            ReplicaSyncError: after ``timeout`` seconds, or if an error was put.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready, timeout):
                raise ReplicaSyncError(f"no result from the master replica within {timeout} s")
            result, self._result, self._ready = self._result, None, False
        if isinstance(result, _Failure):
            raise ReplicaSyncError(f"the master replica failed: {result.error!r}") from result.error
        return result


class SlavePipe(NamedTuple):
    """A slave replica's end of a :class:`SyncMaster`: send a message, wait for the master's answer."""

    identifier: int
    queue: queue.Queue[Any]
    result: FutureResult
    timeout: Optional[float]

    def run_slave(self, msg: Any) -> Any:
        """Send ``msg`` to the master and return its answer for this replica.

        Raises:
            ReplicaSyncError: if the master fails or does not answer within ``timeout`` seconds.
        """
        self.queue.put((self.identifier, msg))
        return self.result.get(self.timeout)


class SyncMaster:
    """The master replica's end of the exchange (the classic Synchronized-BatchNorm design).

    Each slave registers once per replication (``register_slave``); in every forward the master collects
    one message from each slave, calls ``master_callback`` on ``[(copy_id, msg), ...]`` sorted by copy_id
    (the master's own message first), and hands each slave its entry of the returned list.

    Nothing waits forever: the master gives up after ``timeout`` seconds without a slave's message, any
    failure of the callback is delivered to every slave, and :meth:`abort` wakes every waiter with an error
    (the DataParallel runners call it when a replica raises).

    Args:
        master_callback: ``[(copy_id, msg)] -> [(copy_id, result)]``, one entry per replica.
        timeout: seconds to wait for a peer; None waits forever.
    """

    def __init__(
        self,
        master_callback: Callable[[list[tuple[int, Any]]], list[tuple[int, Any]]],
        timeout: Optional[float] = DEFAULT_REPLICA_TIMEOUT,
    ) -> None:
        self._master_callback = master_callback
        self.timeout = timeout
        self._queue: queue.Queue[Any] = queue.Queue()
        self._registry: dict[int, FutureResult] = {}
        # Set once the master has run; the next registration then starts a new replication round.
        self._activated = False

    @property
    def nr_slaves(self) -> int:
        return len(self._registry)

    def register_slave(self, identifier: int) -> SlavePipe:
        """Register the replica with ``copy_id == identifier`` (> 0) and return its pipe.

        As in the classic design, the first registration after the master has run starts a new replication
        round: the previous round's slaves are forgotten, so one SyncMaster can serve every forward.

        Raises:
            ValueError: if ``identifier`` is not positive (0 is the master) or is already registered in
                this round.
        """
        if identifier < 1:
            raise ValueError(f"expected a slave copy_id > 0 (got {identifier}); copy 0 is the master")
        if self._activated:
            self._activated = False
            self._registry.clear()
            self._queue = queue.Queue()
        if identifier in self._registry:
            raise ValueError(f"replica {identifier} is already registered with this SyncMaster")
        future = FutureResult()
        self._registry[identifier] = future
        return SlavePipe(identifier, self._queue, future, self.timeout)

    def run_master(self, master_msg: Any) -> Any:
        """Collect every slave's message, reduce with the callback, answer the slaves, return the master's.

        Raises:
            ReplicaSyncError: if a slave does not arrive within ``timeout`` seconds or the run was aborted.
            Exception: whatever the callback raised (every slave receives it as a ReplicaSyncError).
        """
        self._activated = True
        intermediates = [(0, master_msg)]
        for _ in range(self.nr_slaves):
            try:
                item = self._queue.get(timeout=self.timeout)
            except queue.Empty:
                missing = sorted(set(self._registry) - {i for i, _ in intermediates})
                error = ReplicaSyncError(
                    f"replica(s) {missing} did not reach this synchronized layer within {self.timeout} s"
                )
                self.abort(error)
                raise error from None
            if isinstance(item, _Failure):
                raise ReplicaSyncError(f"another replica failed: {item.error!r}") from item.error
            intermediates.append(item)
        intermediates.sort(key=lambda pair: pair[0])
        try:
            results = self._master_callback(intermediates)
        except BaseException as error:
            self.abort(error)
            raise
        for copy_id, result in results:
            if copy_id != 0:
                self._registry[copy_id].put(result)
        return results[0][1]

    def abort(self, error: BaseException) -> None:
        """Wake the master and every slave waiting in this exchange with ``error``."""
        self._queue.put(_Failure(error))
        for future in self._registry.values():
            future.put_error(error)


class DataParallelTransport:
    """Sums over the DataParallel replicas of this process, then over processes if ``inner`` is given.

    The master replica adds the replicas' tensors on its device with differentiable ops and sends each
    replica the total moved to its device. Because the exchange is part of the autograd graph, backward
    needs no cross-thread barrier: the engine (one thread on CPU) sums the replicas' gradients at the
    master's node and hands the total back to each replica, which is the all-reduce of the gradients.

    Args:
        exchange: the :class:`SyncMaster` (replica 0) or this replica's :class:`SlavePipe`.
        inner: a transport over processes that the master applies to the in-process total, or None.
    """

    name = "dataparallel"

    def __init__(self, exchange: SyncMaster | SlavePipe, inner: Optional[DistributedTransport] = None) -> None:
        self.exchange = exchange
        self.inner = inner

    def all_reduce(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        if isinstance(self.exchange, SyncMaster):
            return self.exchange.run_master((list(tensors), self.inner))
        return self.exchange.run_slave((list(tensors), None))

    def verify_agreement(self, key: str, description: str, verified: set[Any]) -> None:
        """Replicas of one module always agree; the master checks the process group, if any."""
        if self.inner is not None and isinstance(self.exchange, SyncMaster):
            self.inner.verify_agreement(key, description, verified)


def sum_replica_messages(intermediates: list[tuple[int, Any]]) -> list[tuple[int, list[Tensor]]]:
    """The :class:`SyncMaster` callback of :class:`DataParallelTransport`: sum, reduce over processes, scatter.

    Args:
        intermediates: ``[(copy_id, (tensors, inner))]``; the master's entry (copy_id 0) carries ``inner``.

    Returns:
        ``[(copy_id, totals on that replica's device)]``.
    """
    master_tensors, inner = intermediates[0][1]
    totals = []
    for position, master_tensor in enumerate(master_tensors):
        total = master_tensor
        for _, (tensors, _) in intermediates[1:]:
            total = total + tensors[position].to(master_tensor.device)
        totals.append(total)
    if inner is not None:
        totals = inner.all_reduce(totals)
    return [
        (copy_id, [total.to(tensor.device) for total, tensor in zip(totals, tensors)])
        for copy_id, (tensors, _) in intermediates
    ]


def new_sync_master(timeout: Optional[float] = DEFAULT_REPLICA_TIMEOUT) -> SyncMaster:
    """A :class:`SyncMaster` wired to :func:`sum_replica_messages`."""
    return SyncMaster(sum_replica_messages, timeout)


def _cpu_autocast_state() -> tuple[bool, torch.dtype]:
    try:
        return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    except TypeError:  # torch < 2.4
        return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()


def run_replicas_in_threads(
    replicas: Sequence[Callable[..., Any]],
    inputs: Sequence[tuple[Any, ...]],
    kwargs: Sequence[dict[str, Any]],
    on_error: Callable[[BaseException], None],
) -> list[Any]:
    """Run ``replicas[i](*inputs[i], **kwargs[i])`` in one thread each and return the outputs in order.

    Grad mode and CPU autocast state are carried into the threads, as ``torch.nn.parallel.parallel_apply``
    does. When a replica raises, ``on_error`` is called at once (to wake peers blocked in an exchange),
    every thread is joined, and the first error is re-raised in the caller.

    Raises:
        Exception: the first exception raised by a replica.
    """
    grad_enabled = torch.is_grad_enabled()
    autocast_enabled, autocast_dtype = _cpu_autocast_state()
    outputs: list[Any] = [None] * len(replicas)
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        try:
            with torch.set_grad_enabled(grad_enabled), torch.autocast(
                "cpu", enabled=autocast_enabled, dtype=autocast_dtype
            ):
                outputs[i] = replicas[i](*inputs[i], **kwargs[i])
        except BaseException as error:  # noqa: B036 - re-raised in the caller below
            with lock:
                errors.append((i, error))
            on_error(error)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(replicas))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        # Prefer the root cause over the ReplicaSyncErrors it triggered in the peers.
        errors.sort(key=lambda pair: (isinstance(pair[1], ReplicaSyncError), pair[0]))
        raise errors[0][1]
    return outputs
