"""Tests of syncbn_dist.comm: the master/slave exchange, the DataParallel transport and the distributed transport.

The thread tests use real threads and the real :class:`SyncMaster`; nothing waits on a clock except where a
timeout is the behaviour under test (then it is short), and waits that must be ended by an abort use a long
timeout, so only the abort can end them before pytest-timeout does. The distributed tests use real gloo
process groups through ``launch/common/spawn.py``; collectives are recorded by the c10d ops they dispatch
(``launch.common.counting.OpCounter``, one per thread; the real collectives run).
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from launch.common.counting import OpCounter
from launch.common.spawn import run_distributed
from syncbn_dist import SynchronizedBatchNorm1d
from syncbn_dist.comm import (
    DataParallelTransport,
    DistributedTransport,
    FutureResult,
    ReplicaSyncError,
    SlavePipe,
    SyncMaster,
    distributed_transport,
    new_sync_master,
    run_replicas_in_threads,
)
from syncbn_dist.comm.distributed import cached_distributed_transport

# A wait that only an abort (or a delivered result) may end: far beyond the per-test pytest-timeout below.
LONG = 600.0


class _Thread(threading.Thread):
    """A thread that keeps the return value or the exception of its target."""

    def __init__(self, target: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self._target_fn = target
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._target_fn()
        except BaseException as error:  # noqa: B036 - inspected by the test
            self.error = error


def _start(target: Callable[[], Any]) -> _Thread:
    thread = _Thread(target)
    thread.start()
    return thread


def _wait_until(predicate: Callable[[], bool]) -> None:
    """Spin until ``predicate()`` holds (used to order thread arrivals; pytest-timeout bounds a bug)."""
    event = threading.Event()
    while not predicate():
        event.wait(0.001)


def _long_pipe(pipe: SlavePipe) -> SlavePipe:
    """The same slave endpoint with a wait that only the master's answer or an abort can end."""
    return pipe._replace(timeout=LONG)


# ------------------------------------------------------------------------------------------------------------
# FutureResult
# ------------------------------------------------------------------------------------------------------------


def test_future_result_put_then_get_and_slot_empties() -> None:
    future = FutureResult()
    payload = object()
    future.put(payload)
    assert future.get(timeout=0) is payload
    with pytest.raises(ReplicaSyncError, match="within"):
        future.get(timeout=0.01)  # the slot was taken: nothing left to get


@pytest.mark.timeout(60)
def test_future_result_get_waits_for_a_put_from_another_thread() -> None:
    future = FutureResult()
    getter = _start(lambda: future.get(timeout=LONG))
    future.put("answer")
    getter.join()
    assert getter.error is None
    assert getter.result == "answer"


def test_future_result_get_times_out_with_replica_sync_error() -> None:
    with pytest.raises(ReplicaSyncError, match="within 0.05 s"):
        FutureResult().get(timeout=0.05)


@pytest.mark.timeout(60)
def test_future_result_put_error_raises_in_the_waiter() -> None:
    future = FutureResult()
    getter = _start(lambda: future.get(timeout=LONG))
    cause = KeyError("peer failed")
    future.put_error(cause)
    getter.join()
    assert isinstance(getter.error, ReplicaSyncError)
    assert getter.error.__cause__ is cause


# ------------------------------------------------------------------------------------------------------------
# SyncMaster / SlavePipe
# ------------------------------------------------------------------------------------------------------------


def test_register_slave_twice_raises() -> None:
    master = SyncMaster(lambda items: items, timeout=1.0)
    master.register_slave(1)
    master.register_slave(2)
    assert master.nr_slaves == 2
    with pytest.raises(ValueError, match="replica 1 is already registered"):
        master.register_slave(1)
    assert master.nr_slaves == 2


@pytest.mark.timeout(60)
def test_master_collects_messages_sorted_by_copy_id_and_answers_each_slave() -> None:
    seen: list[list[tuple[int, Any]]] = []

    def callback(items: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        seen.append(list(items))
        total = sum(msg for _, msg in items)
        return [(copy_id, (copy_id, msg, total)) for copy_id, msg in items]

    master = SyncMaster(callback, timeout=LONG)
    pipes = {i: master.register_slave(i) for i in (1, 2, 3)}
    # Make the slaves arrive in the order 3, 1, 2 so that the queue order is not the copy_id order.
    slaves = {}
    for arrived, copy_id in enumerate((3, 1, 2), start=1):
        slaves[copy_id] = _start(lambda c=copy_id: pipes[c].run_slave(10 * c))
        _wait_until(lambda n=arrived: pipes[1].queue.qsize() == n)
    master_result = master.run_master(0)
    for thread in slaves.values():
        thread.join()

    assert seen == [[(0, 0), (1, 10), (2, 20), (3, 30)]]
    assert master_result == (0, 0, 60)
    for copy_id, thread in slaves.items():
        assert thread.error is None
        assert thread.result == (copy_id, 10 * copy_id, 60)


@pytest.mark.timeout(60)
def test_master_runs_several_rounds_in_order() -> None:
    master = SyncMaster(lambda items: [(c, sum(m for _, m in items)) for c, _ in items], timeout=LONG)
    pipe = master.register_slave(1)
    slave = _start(lambda: [pipe.run_slave(r) for r in range(5)])
    master_results = [master.run_master(100 * r) for r in range(5)]
    slave.join()
    assert slave.error is None
    assert master_results == slave.result == [101 * r for r in range(5)]


@pytest.mark.timeout(60)
def test_one_master_serves_a_new_replication_round_after_it_ran() -> None:
    # The classic pattern: one SyncMaster per layer for the whole run; every forward re-registers the slaves.
    master = SyncMaster(lambda items: [(c, sum(m for _, m in items)) for c, _ in items], timeout=LONG)
    for round_ in range(3):
        pipes = [master.register_slave(i) for i in (1, 2)]  # would raise "already registered" without a reset
        assert master.nr_slaves == 2
        slaves = [_start(lambda p=p, r=round_: p.run_slave(r + p.identifier)) for p in pipes]
        assert master.run_master(round_) == 3 * round_ + 3
        for thread in slaves:
            thread.join()
            assert thread.error is None and thread.result == 3 * round_ + 3


@pytest.mark.timeout(60)
def test_callback_error_reaches_the_master_and_every_slave() -> None:
    cause = RuntimeError("callback exploded")

    def callback(items: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        raise cause

    master = SyncMaster(callback, timeout=LONG)
    pipes = [_long_pipe(master.register_slave(i)) for i in (1, 2)]
    slaves = [_start(lambda p=p: p.run_slave("msg")) for p in pipes]
    with pytest.raises(RuntimeError, match="callback exploded"):
        master.run_master("msg")
    for thread in slaves:
        thread.join()
        assert isinstance(thread.error, ReplicaSyncError)
        assert thread.error.__cause__ is cause


@pytest.mark.timeout(60)
def test_missing_slave_times_out_the_master_and_wakes_the_slaves_that_arrived() -> None:
    master = SyncMaster(lambda items: items, timeout=0.2)
    pipes = {i: _long_pipe(master.register_slave(i)) for i in (1, 2, 3)}
    arrived = [_start(lambda c=c: pipes[c].run_slave(c)) for c in (1, 3)]  # replica 2 never comes
    _wait_until(lambda: pipes[1].queue.qsize() == 2)
    with pytest.raises(ReplicaSyncError, match=r"replica\(s\) \[2\] did not reach"):
        master.run_master(0)
    for thread in arrived:
        thread.join()
        # Woken by the master's abort (their own wait is LONG), with the master's reason.
        assert isinstance(thread.error, ReplicaSyncError)
        assert "did not reach" in str(thread.error.__cause__)


@pytest.mark.timeout(60)
def test_a_slave_waits_for_the_masters_collective_past_its_timeout_but_not_for_a_missing_master() -> None:
    """replica_timeout bounds the wait for this process's replicas only: once the master has every message, a slave
    waits for its callback (a collective over processes, bounded by the process group's timeout) as long as it runs;
    a master that never arrives is reported within the timeout."""
    timeout = 0.2

    def slow_callback(items: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        time.sleep(5 * timeout)  # a peer process that is late at the all_reduce
        return [(copy_id, msg + 1) for copy_id, msg in items]

    master = SyncMaster(slow_callback, timeout=timeout)
    slave = _start(lambda: master.register_slave(1).run_slave(10))
    assert master.run_master(0) == 1
    slave.join()
    assert slave.error is None and slave.result == 11

    absent = SyncMaster(lambda items: items, timeout=timeout)
    started = time.monotonic()
    with pytest.raises(ReplicaSyncError, match=f"no result from the master replica within {timeout} s"):
        absent.register_slave(1).run_slave(10)  # the master replica never comes
    assert time.monotonic() - started < 10 * timeout


@pytest.mark.timeout(60)
def test_abort_wakes_the_waiting_master_and_slaves() -> None:
    master = SyncMaster(lambda items: items, timeout=LONG)
    pipes = [_long_pipe(master.register_slave(i)) for i in (1, 2)]
    slave = _start(lambda: pipes[0].run_slave("here"))  # replica 2 never comes, so the master waits
    _wait_until(lambda: pipes[0].queue.qsize() == 1)
    waiting_master = _start(lambda: master.run_master("here"))
    _wait_until(lambda: pipes[0].queue.qsize() == 0)  # the master took the slave's message and waits on
    cause = RuntimeError("a replica failed")
    master.abort(cause)
    waiting_master.join()
    slave.join()
    assert isinstance(waiting_master.error, ReplicaSyncError)
    assert waiting_master.error.__cause__ is cause
    assert isinstance(slave.error, ReplicaSyncError)
    assert slave.error.__cause__ is cause


@pytest.mark.timeout(60)
def test_abort_before_anyone_arrives_fails_the_next_exchange_on_both_sides() -> None:
    master = SyncMaster(lambda items: items, timeout=LONG)
    pipe = _long_pipe(master.register_slave(1))
    master.abort(RuntimeError("replica 1 failed before the layer"))
    with pytest.raises(ReplicaSyncError):
        master.run_master(0)
    with pytest.raises(ReplicaSyncError):
        pipe.run_slave(1)


# ------------------------------------------------------------------------------------------------------------
# DataParallelTransport and run_replicas_in_threads
# ------------------------------------------------------------------------------------------------------------


def _transports(num_replicas: int, timeout: float = LONG) -> list[DataParallelTransport]:
    master = new_sync_master(timeout)
    return [DataParallelTransport(master)] + [
        DataParallelTransport(master.register_slave(i)) for i in range(1, num_replicas)
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_replicas", [2, 3, 4])
def test_dataparallel_transport_sums_in_float64_and_is_differentiable(num_replicas: int) -> None:
    gen = torch.Generator().manual_seed(num_replicas)
    # 1e8 + small integers: exact in float64, not representable in float32, so a float32 detour shows.
    counts = [torch.tensor([1e8 + i], dtype=torch.float64, requires_grad=True) for i in range(num_replicas)]
    moments = [torch.randn(2, 3, generator=gen, dtype=torch.float64, requires_grad=True) for _ in counts]
    weights = [torch.randn(2, 3, generator=gen, dtype=torch.float64) for _ in counts]
    count_weights = [torch.randn(1, generator=gen, dtype=torch.float64) for _ in counts]
    transports = _transports(num_replicas)

    def replica(i: int) -> list[Tensor]:
        out = transports[i].all_reduce([counts[i], moments[i]])
        # Each replica's own loss term; the gathered loss below is their sum, as DataParallel's would be.
        return [out[0], out[1], (out[0] * count_weights[i]).sum() + (out[1] * weights[i]).sum()]

    outputs = run_replicas_in_threads(
        [lambda i=i: replica(i) for i in range(num_replicas)],
        [()] * num_replicas,
        [{}] * num_replicas,
        lambda error: None,
    )
    expected_count = sum(c.detach() for c in counts)
    expected_moments = sum(m.detach() for m in moments)
    for count, moment, _ in outputs:
        assert count.dtype == moment.dtype == torch.float64
        assert count.item() == expected_count.item() == num_replicas * 1e8 + sum(range(num_replicas))
        # Same additions in the same order (replica 0 first): exact.
        torch.testing.assert_close(moment, expected_moments, rtol=0, atol=0)
    torch.stack([loss for _, _, loss in outputs]).sum().backward()
    # d(loss)/d(input_i) = sum over every replica j of d(loss_j)/d(total): the all-reduce of the gradients.
    for i in range(num_replicas):
        # Float64 sums of a few O(1) numbers in a different order: a few ulps.
        torch.testing.assert_close(counts[i].grad, sum(count_weights), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(moments[i].grad, sum(weights), rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(60)
def test_dataparallel_transport_sends_each_replica_its_own_copy_of_the_total() -> None:
    transports = _transports(2)
    inputs = [[torch.full((3,), 1.0 + i, dtype=torch.float64)] for i in range(2)]
    outputs = run_replicas_in_threads(
        [lambda i=i: transports[i].all_reduce(inputs[i]) for i in range(2)], [(), ()], [{}, {}], lambda e: None
    )
    for i, (out,) in enumerate(outputs):
        assert torch.equal(out, torch.full((3,), 3.0, dtype=torch.float64))
        assert torch.equal(inputs[i][0], torch.full((3,), 1.0 + i, dtype=torch.float64))  # inputs untouched


@pytest.mark.timeout(60)
@pytest.mark.parametrize("failing", [0, 1, 2])
def test_run_replicas_in_threads_raises_the_root_cause_and_wakes_the_peers(failing: int) -> None:
    transports = _transports(3)
    master = transports[0].exchange
    before = set(threading.enumerate())

    def replica(i: int) -> list[Tensor]:
        if i == failing:
            raise KeyError(f"replica {i} broke before the exchange")
        return transports[i].all_reduce([torch.ones(2, dtype=torch.float64)])

    with pytest.raises(KeyError, match=f"replica {failing} broke"):
        run_replicas_in_threads(
            [lambda i=i: replica(i) for i in range(3)], [()] * 3, [{}] * 3, lambda error: master.abort(error)
        )
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]


@pytest.mark.timeout(60)
def test_run_replicas_in_threads_carries_grad_mode_and_keeps_order() -> None:
    def replica(scale: float) -> tuple[float, bool]:
        return scale, torch.is_grad_enabled()

    with torch.no_grad():
        outputs = run_replicas_in_threads([replica] * 3, [(1.0,), (2.0,), (3.0,)], [{}] * 3, lambda e: None)
    assert outputs == [(1.0, False), (2.0, False), (3.0, False)]
    outputs = run_replicas_in_threads([replica] * 2, [(5.0,), (6.0,)], [{}] * 2, lambda e: None)
    assert outputs == [(5.0, True), (6.0, True)]


# ------------------------------------------------------------------------------------------------------------
# distributed_transport and DistributedTransport over gloo
# ------------------------------------------------------------------------------------------------------------


def test_distributed_transport_is_none_without_a_process_group() -> None:
    assert not dist.is_initialized()
    assert distributed_transport(None) is None


def _check_distributed_transport(rank: int, world_size: int) -> None:
    transport = distributed_transport(None)
    assert isinstance(transport, DistributedTransport)
    assert transport.name == "distributed"
    ranks = range(world_size)

    def rank_data(r: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        gen = torch.Generator().manual_seed(100 + r)
        count = torch.tensor([1e8 + 3 * r + 1], dtype=torch.float64)
        moments = torch.randn(2, 3, generator=gen, dtype=torch.float64)
        weight_count = torch.randn(1, generator=gen, dtype=torch.float64)
        weight_moments = torch.randn(2, 3, generator=gen, dtype=torch.float64)
        return count, moments, weight_count, weight_moments

    data = [rank_data(r) for r in ranks]
    for grad_count, grad_moments in [(False, True), (True, True), (True, False), (False, False)]:
        count, moments, weight_count, weight_moments = (t.clone() for t in data[rank])
        count.requires_grad_(grad_count)
        moments.requires_grad_(grad_moments)
        with OpCounter() as counter:
            out_count, out_moments = transport.all_reduce([count, moments])
            forward_calls = list(counter.payloads)
            loss = (out_count * weight_count).sum() + (out_moments * weight_moments).sum()
            if loss.requires_grad:
                loss.backward()
            backward_calls = counter.payloads[len(forward_calls) :]
        # One coalesced float64 collective each way; backward sends only the grads that are needed.
        assert forward_calls == [("c10d.allreduce_", 1 + 6, torch.float64)]
        expected_backward = 1 * grad_count + 6 * grad_moments
        assert backward_calls == ([("c10d.allreduce_", expected_backward, torch.float64)] if expected_backward else [])
        assert out_count.item() == sum(d[0].item() for d in data)  # exact in float64 (not in float32)
        # Float64 sums over ranks in the backend's order: a few ulps.
        torch.testing.assert_close(out_moments.detach(), sum(d[1] for d in data), rtol=1e-12, atol=1e-12)
        assert out_moments.shape == (2, 3)
        # The inputs are not reduced in place.
        assert torch.equal(count.detach(), data[rank][0]) and torch.equal(moments.detach(), data[rank][1])
        if grad_count:
            torch.testing.assert_close(count.grad, sum(d[2] for d in data), rtol=1e-12, atol=1e-12)
        if grad_moments:
            torch.testing.assert_close(moments.grad, sum(d[3] for d in data), rtol=1e-12, atol=1e-12)


def _check_distributed_transport_groups(rank: int, world_size: int) -> None:
    own_groups = [dist.new_group([r]) for r in range(world_size)]  # every rank takes part in each new_group
    pair = dist.new_group(list(range(world_size)))
    assert distributed_transport(own_groups[rank]) is None  # a group of one needs no sync
    other = own_groups[(rank + 1) % world_size]
    with pytest.raises(ValueError, match=f"rank {rank} is not a member"):
        distributed_transport(other)
    transport = distributed_transport(pair)
    assert isinstance(transport, DistributedTransport) and transport.process_group is pair
    (total,) = transport.all_reduce([torch.full((2,), float(rank + 1), dtype=torch.float64)])
    assert torch.equal(total, torch.full((2,), float(sum(range(1, world_size + 1))), dtype=torch.float64))


def _check_hierarchical_transport(rank: int, world_size: int) -> None:
    """Two thread replicas per process; the master also all-reduces over processes: the sum covers all four."""
    num_replicas = 2
    transports = _transports(num_replicas)
    transports[0].inner = DistributedTransport(None)
    values = {
        (r, i): torch.tensor([float(10 * r + i + 1)], dtype=torch.float64)
        for r in range(world_size)
        for i in range(num_replicas)
    }
    weights = {key: torch.tensor([float(key[0] + 2 * key[1] + 1)], dtype=torch.float64) for key in values}
    inputs = [values[rank, i].clone().requires_grad_() for i in range(num_replicas)]
    counters = [OpCounter() for _ in range(num_replicas + 1)]  # one per replica thread, the last for this thread

    def replica(i: int) -> Tensor:
        with counters[i]:
            return transports[i].all_reduce([inputs[i]])[0]

    with counters[-1]:
        outputs = run_replicas_in_threads(
            [lambda i=i: replica(i) for i in range(num_replicas)],
            [()] * num_replicas,
            [{}] * num_replicas,
            lambda error: transports[0].exchange.abort(error),
        )
        assert sum(len(c.payloads) for c in counters) == 1  # one collective per process, on the master replica
        sum(((out * weights[rank, i]).sum() for i, out in enumerate(outputs)), torch.zeros(())).backward()
        assert sum(len(c.payloads) for c in counters) == 2
    for out in outputs:
        assert out.item() == sum(v.item() for v in values.values())
    for grad in (inputs[i].grad for i in range(num_replicas)):
        assert grad.item() == sum(w.item() for w in weights.values())


def _worker(rank: int, world_size: int) -> None:
    _check_distributed_transport(rank, world_size)
    _check_distributed_transport_groups(rank, world_size)
    _check_hierarchical_transport(rank, world_size)


@pytest.mark.distributed
def test_transports_over_gloo() -> None:
    run_distributed(_worker, 2)


def _check_cached_transports(rank: int, world_size: int, second_world: str) -> None:
    """The layer's eager transport is kept per group while the default group lives, found again for a new one, and
    keeps no process group alive once torch.distributed destroyed it."""
    own_groups = [dist.new_group([r]) for r in range(world_size)]
    pair = dist.new_group(list(range(world_size)))
    first = cached_distributed_transport(None)
    assert isinstance(first, DistributedTransport) and first is cached_distributed_transport(None)
    assert first.process_group is None  # the world group, looked up at each collective
    assert cached_distributed_transport(pair) is cached_distributed_transport(pair) is not first
    assert cached_distributed_transport(pair).process_group is pair
    assert cached_distributed_transport(own_groups[rank]) is None
    for _ in range(2):  # a non-member is refused at every call, not only the first
        with pytest.raises(ValueError, match=f"rank {rank} is not a member"):
            cached_distributed_transport(own_groups[(rank + 1) % world_size])
    (total,) = cached_distributed_transport(pair).all_reduce([torch.ones(2, dtype=torch.float64)])
    assert torch.equal(total, torch.full((2,), float(world_size), dtype=torch.float64))

    layer = SynchronizedBatchNorm1d(3, momentum=None).double()
    xs = [torch.randn(2 + r, 3, generator=torch.Generator().manual_seed(r), dtype=torch.float64) for r in range(2)]
    reference = torch.nn.BatchNorm1d(3, momentum=None, dtype=torch.float64)
    out = layer(xs[rank])
    assert layer.last_transport == "distributed"
    old_groups = [weakref.ref(g) for g in (dist.group.WORLD, pair, own_groups[rank])]  # (the others: an int)
    del pair, own_groups
    dist.destroy_process_group()  # the world, and every group of it, ends; a new world starts on the same ranks
    gc.collect()
    # Freed with the world, not at interpreter exit (where freeing a gloo group can abort the process).
    assert [g() for g in old_groups] == [None] * len(old_groups)
    dist.init_process_group("gloo", init_method=f"file://{second_world}", rank=rank, world_size=world_size)
    second = cached_distributed_transport(None)
    assert isinstance(second, DistributedTransport) and second is not first
    out_second = layer(xs[rank])  # on the new world: both batches, both steps, as one BatchNorm would see them
    expected = reference(torch.cat(xs))
    rows = slice(sum(len(x) for x in xs[:rank]), sum(len(x) for x in xs[: rank + 1]))
    torch.testing.assert_close(out, expected[rows])
    torch.testing.assert_close(out_second, reference(torch.cat(xs))[rows])
    torch.testing.assert_close(layer.running_mean, reference.running_mean)
    torch.testing.assert_close(layer.running_var, reference.running_var)


@pytest.mark.distributed
def test_cached_transports_follow_the_default_group(tmp_path: Any) -> None:
    run_distributed(_check_cached_transports, 2, str(tmp_path / "second_world"))
