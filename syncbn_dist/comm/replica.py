"""The DataParallel transport: the in-process master/slave exchange between replicas running in threads.

:class:`SyncMaster`, :class:`SlavePipe` and :class:`FutureResult` follow the classic Synchronized-BatchNorm
design; :class:`DataParallelTransport` sums over the replicas and, on the master, optionally over processes.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable, NamedTuple, Optional, Sequence

from torch import Tensor

from .distributed import DistributedTransport

__all__ = [
    "DEFAULT_REPLICA_TIMEOUT",
    "DataParallelTransport",
    "FutureResult",
    "ReplicaSyncError",
    "SlavePipe",
    "SyncMaster",
    "new_sync_master",
    "sum_replica_messages",
]

# How long a replica waits for the others at one synchronized layer before giving up (seconds).
DEFAULT_REPLICA_TIMEOUT = float(os.environ.get("SYNCBN_REPLICA_TIMEOUT", "300"))

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
