"""The DataParallel transport: the classic master/slave exchange (:class:`SyncMaster`, :class:`SlavePipe`,
:class:`FutureResult`) between replicas running in threads. docs/design.md, "The DataParallel exchange".
"""

from __future__ import annotations

import functools
import queue
import threading
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ..settings import DEFAULT_REPLICA_TIMEOUT
from .distributed import DistributedTransport

__all__ = [
    "install_placeholder_cuda_guard",
    "run_replicas_in_threads",
    "DataParallelTransport",
    "FutureResult",
    "ReplicaSyncError",
    "Replication",
    "SlavePipe",
    "SyncMaster",
    "new_sync_master",
    "sum_replica_messages",
]


class ReplicaSyncError(RuntimeError):
    """A replica could not complete a synchronized layer: a peer failed, or did not arrive in time."""


class _Failure(NamedTuple):
    """A failure delivered to the waiters of an exchange: the root cause and, when known, where it happened."""

    error: BaseException
    copy_id: Optional[int] = None
    where: str = ""

    def to_error(self) -> ReplicaSyncError:
        who = "another replica" if self.copy_id is None else f"replica {self.copy_id}"
        if self.copy_id == 0:
            who += " (the master)"
        at = f" in {self.where}" if self.where else ""
        return ReplicaSyncError(f"{who} failed{at}: {self.error!r}")


class FutureResult:
    """A single-slot result that one thread puts and another waits for, with a timeout.

    ``put`` may carry an exception instead (:meth:`put_error`); ``get`` then raises :class:`ReplicaSyncError` from it.
    After :meth:`mark_collected` the timeout no longer applies: the rest of the wait is the producer's collective.
    """

    def __init__(self) -> None:
        self._result: Any = None
        self._ready = False
        self._collected = False
        self._cond = threading.Condition(threading.Lock())

    def put(self, result: Any) -> None:
        """Fill the slot with ``result`` (any object) and wake the waiter."""
        with self._cond:
            self._result = result
            self._ready = True
            self._cond.notify_all()

    def mark_collected(self) -> None:
        """The producer has what it needs from the waiters: the result comes without the waiters' timeout."""
        with self._cond:
            self._collected = True
            self._cond.notify_all()

    def put_error(self, error: BaseException, copy_id: Optional[int] = None, where: str = "") -> None:
        """Make the waiter raise :class:`ReplicaSyncError` from ``error``.

        Args:
            error: the root cause.
            copy_id: the replica that failed; None if unknown.
            where: the layer it failed in, for the message.
        """
        self.put(_Failure(error, copy_id, where))

    def get(self, timeout: Optional[float] = None) -> Any:
        """Wait for the result and take it, emptying the slot.

        Args:
            timeout: seconds to wait until the result or :meth:`mark_collected` comes; None waits forever.

        Returns:
            What :meth:`put` stored.

        Raises:
            ReplicaSyncError: if an error was put, or no result nor :meth:`mark_collected` came in ``timeout`` s.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self._collected, timeout):
                raise ReplicaSyncError(f"no result from the master replica within {timeout} s")
            self._cond.wait_for(lambda: self._ready)
            result, self._result, self._ready, self._collected = self._result, None, False, False
        if isinstance(result, _Failure):
            raise result.to_error() from result.error
        return result


class SlavePipe(NamedTuple):
    """A slave replica's end of a :class:`SyncMaster`: send a message, wait for the master's answer."""

    identifier: int
    queue: queue.Queue[Any]
    result: FutureResult
    timeout: Optional[float]
    master: Optional[SyncMaster] = None

    def run_slave(self, msg: Any) -> Any:
        """Send ``msg`` to the master and return its answer for this replica.

        Args:
            msg: this replica's message for the master's callback (:class:`DataParallelTransport`: its tensors).

        Returns:
            This replica's entry of the callback's result.

        Raises:
            ReplicaSyncError: if the master fails or does not answer within ``timeout`` seconds.
        """
        failure = None if self.master is None else self.master._failure
        if failure is not None:  # the round was aborted and this replica already took its error
            raise failure.to_error() from failure.error
        self.queue.put((self.identifier, msg))
        return self.result.get(self.timeout)

    def report_failure(self, error: BaseException, where: str = "") -> None:
        """Report that this replica failed (in ``where``): every waiting peer raises (:meth:`SyncMaster.abort`)."""
        if self.master is not None:
            self.master.abort(error, self.identifier, where)
        else:
            self.queue.put(_Failure(error, self.identifier, where))


class SyncMaster:
    """The master replica's end of the exchange (the classic Synchronized-BatchNorm design).

    Each slave registers once per replication (:meth:`register_slave`); in every forward the master collects one
    message from each, calls ``master_callback`` on ``[(copy_id, msg), ...]`` sorted by copy_id (its own first) and
    hands each slave its entry of the result. A missing slave times out; a failure wakes every waiter (:meth:`abort`).

    Args:
        master_callback: ``[(copy_id, msg)] -> [(copy_id, result)]``, one entry per replica.
        timeout: seconds to wait for a peer (None: forever). Default: ``SYNCBN_REPLICA_TIMEOUT`` or 300
        replication: the :class:`Replication` whose exchanges abort together. Default: ``None`` (this one alone)
    """

    def __init__(
        self,
        master_callback: Callable[[list[tuple[int, Any]]], list[tuple[int, Any]]],
        timeout: Optional[float] = DEFAULT_REPLICA_TIMEOUT,
        replication: Optional[Replication] = None,
    ) -> None:
        self._master_callback = master_callback
        self.timeout = timeout
        self._queue: queue.Queue[Any] = queue.Queue()
        self._registry: dict[int, FutureResult] = {}
        self._activated = False  # the master has run: the next registration starts a new round
        self._failure: Optional[_Failure] = None  # the round's first; later ones are its consequences, not delivered
        self._failure_lock = threading.Lock()
        self.replication = replication
        if replication is not None:
            replication.add(self)

    @property
    def nr_slaves(self) -> int:
        return len(self._registry)

    def register_slave(self, identifier: int) -> SlavePipe:
        """Register a slave replica and return its pipe; the first registration after the master has run starts a
        new round, so one SyncMaster serves every forward.

        Args:
            identifier: the replica's ``copy_id`` (1, 2, ...).

        Returns:
            The replica's :class:`SlavePipe`.

        Raises:
            ValueError: if ``identifier`` < 1 (0 is the master) or is already registered in this round.
        """
        if identifier < 1:
            raise ValueError(f"expected a slave copy_id > 0 (got {identifier}); copy 0 is the master")
        if self._activated:
            self._activated = False
            self._registry.clear()
            self._queue = queue.Queue()
            self._failure = None
        if identifier in self._registry:
            raise ValueError(f"replica {identifier} is already registered with this SyncMaster")
        future = FutureResult()
        self._registry[identifier] = future
        return SlavePipe(identifier, self._queue, future, self.timeout, self)

    def run_master(self, master_msg: Any) -> Any:
        """Collect every slave's message, reduce with the callback, answer the slaves, return the master's.

        Args:
            master_msg: the master replica's own message (copy_id 0).

        Returns:
            The master's entry of the callback's result.

        Raises:
            ReplicaSyncError: if a slave does not arrive within ``timeout`` seconds or the run was aborted.
            Exception: whatever the callback raised (every slave receives it as a ReplicaSyncError).
        """
        self._activated = True
        if self._failure is not None:  # aborted, and the failure on the queue was already taken
            raise self._failure.to_error() from self._failure.error
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
                raise item.to_error() from item.error
            intermediates.append(item)
        intermediates.sort(key=lambda pair: pair[0])
        # Every replica has arrived: the callback's collective over processes is bounded by the group's own timeout.
        for future in self._registry.values():
            future.mark_collected()
        try:
            results = self._master_callback(intermediates)
        except BaseException as error:
            self.abort(error)
            raise
        for copy_id, result in results:
            if copy_id != 0:
                self._registry[copy_id].put(result)
        return results[0][1]

    def report_failure(self, error: BaseException, where: str = "") -> None:
        """Report that the master replica (copy 0) failed (in ``where``); see :meth:`abort`."""
        self.abort(error, 0, where)

    def abort(self, error: BaseException, copy_id: Optional[int] = None, where: str = "") -> None:
        """Wake every replica waiting in this exchange (and its :class:`Replication`'s), once a round: each raises
        :class:`ReplicaSyncError` from ``error``, naming replica ``copy_id`` (None: unknown) and ``where``."""
        failure = _Failure(error, copy_id, where)
        if self.replication is not None:
            self.replication.abort(failure)
        else:
            self._abort_round(failure)

    def _abort_round(self, failure: _Failure) -> None:
        with self._failure_lock:
            if self._failure is not None:
                return
            self._failure = failure
        self._queue.put(failure)
        for future in self._registry.values():
            future.put(failure)


class Replication:
    """The exchanges of one ``execute_replication_callbacks`` call, which fail together: an abort reaches peers
    waiting at a later layer. Each :class:`SyncMaster` made with ``replication=`` adds itself."""

    def __init__(self) -> None:
        self._masters: list[SyncMaster] = []
        self._failure: Optional[_Failure] = None
        self._lock = threading.Lock()

    def add(self, master: SyncMaster) -> None:
        with self._lock:
            self._masters.append(master)
            failure = self._failure
        if failure is not None:
            master._abort_round(failure)

    def abort(self, failure: _Failure) -> None:
        """Deliver ``failure`` to every exchange of the replication (the first failure only)."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = failure
            masters = list(self._masters)
        for master in masters:
            master._abort_round(failure)


class DataParallelTransport:
    """Sums over the DataParallel replicas of this process, then over processes if ``inner`` is given.

    The master sums with differentiable ops: backward needs no barrier (docs/design.md, "Transports").

    Args:
        exchange: the :class:`SyncMaster` (replica 0) or this replica's :class:`SlavePipe`.
        inner: a transport over processes that the master applies to the in-process total. Default: ``None``
    """

    name = "dataparallel"
    differentiable_exchange = True
    exchange_name = "replica exchange"

    def __init__(self, exchange: SyncMaster | SlavePipe, inner: Optional[DistributedTransport] = None) -> None:
        self.exchange = exchange
        self.inner = inner

    def all_reduce(self, tensors: Sequence[Tensor], tags: Optional[tuple[Any, Any, bool]] = None) -> list[Tensor]:
        """Differentiable sums over the replicas (and processes); ``tags``: :meth:`DistributedTransport.all_reduce`."""
        if isinstance(self.exchange, SyncMaster):
            return self.exchange.run_master((list(tensors), self.inner, tags))
        return self.exchange.run_slave((list(tensors), None, None))

    def agreement_group(self) -> Any:
        """Replicas of one module always agree; the master checks the process group, if any."""
        if self.inner is not None and isinstance(self.exchange, SyncMaster):
            return self.inner.agreement_group()
        return None


def sum_replica_messages(intermediates: list[tuple[int, Any]]) -> list[tuple[int, list[Tensor]]]:
    """The :class:`SyncMaster` callback of :class:`DataParallelTransport`: sum, reduce over processes, scatter.

    Args:
        intermediates: ``[(copy_id, (tensors, inner, tags))]``; only the master's (copy_id 0) has ``inner``, ``tags``.

    Returns:
        ``[(copy_id, totals on that replica's device)]``.
    """
    master_tensors, inner, tags = intermediates[0][1]
    totals = []
    for position, master_tensor in enumerate(master_tensors):
        total = master_tensor
        for _, (tensors, _, _) in intermediates[1:]:
            total = total + tensors[position].to(master_tensor.device)
        totals.append(total)
    if inner is not None:
        totals = inner.all_reduce(totals, tags=tags)
    return [
        (copy_id, [total.to(tensor.device) for total, tensor in zip(totals, tensors)])
        for copy_id, (tensors, _, _) in intermediates
    ]


def new_sync_master(
    timeout: Optional[float] = DEFAULT_REPLICA_TIMEOUT, replication: Optional[Replication] = None
) -> SyncMaster:
    """A :class:`SyncMaster` wired to :func:`sum_replica_messages`, part of ``replication`` if given."""
    return SyncMaster(sum_replica_messages, timeout, replication)


@functools.cache
def install_placeholder_cuda_guard() -> None:
    """Have torch install its placeholder CUDA device guard (torch 2.11, no GPU) from the main thread or else a parked
    daemon thread, so that no replica thread owns it (docs/design.md, "Replica threads")."""
    if torch.cuda.is_available() or not hasattr(torch._C, "_ensureCUDADeviceGuardSet"):
        return
    if threading.current_thread() is threading.main_thread():
        torch._C._ensureCUDADeviceGuardSet()
        return
    installed = threading.Event()

    def own_the_guard() -> None:
        torch._C._ensureCUDADeviceGuardSet()
        installed.set()
        threading.Event().wait()  # parked: the guard lives as long as this thread

    threading.Thread(target=own_the_guard, name="syncbn_dist-cuda-guard", daemon=True).start()
    installed.wait()


def run_replicas_in_threads(
    replicas: Sequence[Callable[..., Any]],
    inputs: Sequence[tuple[Any, ...]],
    kwargs: Sequence[dict[str, Any]],
    on_error: Callable[[BaseException], None],
) -> list[Any]:
    """Run ``replicas[i](*inputs[i], **kwargs[i])`` in one thread each and return the outputs in order.

    Grad mode and CPU autocast state are carried into the threads, as ``torch.nn.parallel.parallel_apply`` does.
    When a replica raises, ``on_error`` is called at once (to wake peers blocked in an exchange).

    Raises:
        Exception: the first replica's exception, a root cause preferred over the ReplicaSyncErrors it caused.
    """
    install_placeholder_cuda_guard()
    grad_enabled = torch.is_grad_enabled()
    autocast_enabled, autocast_dtype = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
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
        errors.sort(key=lambda pair: (isinstance(pair[1], ReplicaSyncError), pair[0]))
        raise errors[0][1]
    return outputs
