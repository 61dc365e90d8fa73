"""Ranks that disagree fail loudly on every rank, never hang: agreement checks, debug mode, timeouts (gloo)."""

from __future__ import annotations

import copy
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import syncbn_dist
from launch.common.counting import OpCounter
from launch.common.spawn import run_distributed
from syncbn_dist import LayerMismatchError


def _error_or_none(fn: Any) -> str | None:
    try:
        fn()
    except LayerMismatchError as error:
        return str(error)
    return None


def _mismatched_num_features(rank: int, world_size: int) -> None:
    # Default mode: rank 0's layer has 4 features, rank 1's has 6; without the check gloo aborts the process.
    syncbn_dist.set_debug(False)
    features = 4 if rank == 0 else 6
    model = syncbn_dist.convert_model(nn.Sequential(nn.Linear(3, features), nn.BatchNorm1d(features)))
    message = _error_or_none(lambda: model(torch.randn(5, 3)))
    assert message is not None, "mismatched num_features must raise on every rank"
    assert "rank 0: layer '1' (SynchronizedBatchNorm1d): num_features=4" in message
    assert "rank 1: layer '1' (SynchronizedBatchNorm1d): num_features=6" in message
    assert "ranks [1] differ from rank 0" in message
    # The group is still usable afterwards: nobody is stuck in a collective.
    dist.barrier()

    # Mismatched dtypes are caught the same way (the payload is float64 either way, so nothing else would).
    layer = syncbn_dist.SynchronizedBatchNorm1d(2).to(torch.float64 if rank == 1 else torch.float32)
    x = torch.randn(4, 2, dtype=layer.weight.dtype)
    message = _error_or_none(lambda: layer(x))
    assert message is not None and "dtype=torch.float64" in message and "dtype=torch.float32" in message


def _agreement_is_checked_once_when_debug_is_off(rank: int, world_size: int) -> None:
    syncbn_dist.set_debug(False)
    layer = syncbn_dist.SynchronizedBatchNorm2d(3)
    x = torch.randn(2, 3, 4, 4, requires_grad=True)  # so that backward needs the global reductions
    with OpCounter() as first:
        layer(x).sum().backward()
    with OpCounter() as later:
        for _ in range(3):
            layer(x).sum().backward()
    # First forward and first backward: each one small all_gather (the agreement check) + one all_reduce.
    assert first.collectives == Counter({"c10d.allgather_": 2, "c10d.allreduce_": 2}), first.collectives
    # Afterwards exactly one collective per direction and nothing else.
    assert later.collectives == Counter({"c10d.allreduce_": 6}), later.collectives


def _debug_mode_checks_every_call(rank: int, world_size: int, expect_env_debug: bool) -> None:
    assert syncbn_dist.is_debug_enabled() is expect_env_debug
    syncbn_dist.set_debug(True)
    layer = syncbn_dist.SynchronizedBatchNorm1d(3)
    x = torch.randn(4, 3)
    with OpCounter() as counter:
        for _ in range(3):
            layer(x)
    assert counter.collectives == Counter({"c10d.allgather_": 3, "c10d.allreduce_": 3}), counter.collectives


def _debug_mode_names_reordered_layers(rank: int, world_size: int) -> None:
    syncbn_dist.set_debug(True)
    layers = syncbn_dist.convert_model(nn.ModuleDict({"a": nn.BatchNorm1d(4), "b": nn.BatchNorm1d(4)}))
    x = torch.randn(6, 4)
    layers["a"](x)
    layers["b"](x)
    # Same num_features, so the payloads have the same size: only debug mode can tell the layers apart.
    first, second = ("a", "b") if rank == 0 else ("b", "a")
    message = _error_or_none(lambda: layers[first](x))
    assert message is not None, "reordered layers must raise on every rank in debug mode"
    assert "rank 0: call #3 at layer 'a'" in message
    assert "rank 1: call #3 at layer 'b'" in message
    dist.barrier()


def _debug_mode_catches_a_skipped_layer(rank: int, world_size: int) -> None:
    syncbn_dist.set_debug(True)
    model = syncbn_dist.convert_model(nn.Sequential(nn.BatchNorm1d(4), nn.BatchNorm1d(4)))
    x = torch.randn(6, 4)
    model(x)
    # Rank 1 skips layer '0' this step, so the ranks meet at different layers.
    message = _error_or_none(lambda: model(x) if rank == 0 else model[1](x))
    assert message is not None
    assert "at layer '0'" in message and "at layer '1'" in message


def _two_layers() -> nn.ModuleDict:
    return syncbn_dist.convert_model(nn.ModuleDict({"a": nn.BatchNorm1d(4), "b": nn.BatchNorm1d(4)}))


def _step(layers: nn.ModuleDict, names: str, x: torch.Tensor) -> None:
    """Forward through the layers ``names`` (in that order), then backward."""
    y = x
    for name in names:
        y = layers[name](y)
    y.square().sum().backward()


def _a_rank_runs_an_extra_layer(rank: int, world_size: int, debug: bool, warm_up: bool) -> str:
    """Rank 0 runs ``b(a(x))``, rank 1 runs ``a(x)``, forward and backward; without a warm-up step it is the first time
    either rank runs a layer (default mode checks it), with one it is a later step (only debug mode checks it)."""
    syncbn_dist.set_debug(debug)
    layers = _two_layers()
    x = torch.randn(6, 4, requires_grad=True)
    if warm_up:
        _step(layers, "ab", x)
    message = _error_or_none(lambda: _step(layers, "ab" if rank == 0 else "a", x))
    assert message is not None, f"rank {rank}: ranks that run different layers must raise on every rank"
    dist.barrier()  # nobody is left inside a collective
    return message


def _bad_input_on_one_rank(rank: int, world_size: int) -> tuple[str, str]:
    """Rank 1's input has 5 channels where the layer has 4, at the layer's first call: rank 1 raises its own ValueError,
    rank 0 a LayerMismatchError that says what rank 1's input was."""
    syncbn_dist.set_debug(False)
    layer = syncbn_dist.SynchronizedBatchNorm1d(4)
    x = torch.randn(6, 4 if rank == 0 else 5)
    with pytest.raises(ValueError) as raised:
        layer(x)
    dist.barrier()
    return type(raised.value).__name__, str(raised.value)


def _checks_per_step(layer: nn.Module, x: torch.Tensor) -> int:
    """The agreement gathers of one forward and backward of ``layer``."""
    with OpCounter() as counter:
        layer(x).sum().backward()
    return counter.collectives["c10d.allgather_"]


def _agreement_follows_groups_and_copies(rank: int, world_size: int) -> list[int]:
    """What keys the gather check: each process group's first step (a destroyed group's record goes with it, even if
    the new group reuses its address); after it, a layer, or a copy of it, sends tagged collectives and gathers
    nothing (which collectives gather may depend only on the group's history, never on the collective)."""
    syncbn_dist.set_debug(False)
    x = torch.randn(4, 3, requires_grad=True)
    group = dist.new_group([0, 1])
    layer = syncbn_dist.SynchronizedBatchNorm1d(3, process_group=group)
    counts = [_checks_per_step(layer, x), _checks_per_step(layer, x)]
    dist.destroy_process_group(group)
    layer.process_group = dist.new_group([0, 1])
    counts.append(_checks_per_step(layer, x))
    on_world = syncbn_dist.SynchronizedBatchNorm1d(3)  # (a process group does not deep-copy)
    counts += [_checks_per_step(on_world, x), _checks_per_step(copy.deepcopy(on_world), x)]
    counts.append(_checks_per_step(on_world, x))
    return counts


@pytest.mark.distributed
def test_the_agreement_record_is_kept_per_layer_and_process_group() -> None:
    # First step: forward and backward checked; then nothing; a new group: checked. On the world group: checked; a
    # copy of the layer on it, and the layer again: not (the world group's first step is over).
    assert run_distributed(_agreement_follows_groups_and_copies, 2) == [[2, 0, 2, 2, 0, 0]] * 2


@pytest.mark.distributed
@pytest.mark.parametrize("debug, warm_up", [(False, False), (True, False), (True, True)])
def test_a_rank_that_runs_other_layers_raises_on_every_rank(debug: bool, warm_up: bool) -> None:
    # Rank 0's forward of 'b' meets rank 1's backward of 'a': both are checked (first calls, or debug mode).
    messages = run_distributed(_a_rank_runs_an_extra_layer, 2, debug, warm_up, timeout=60, collective_timeout=20)
    for message in messages:
        assert "rank 0: " in message and "layer 'b'" in message and "forward" in message, message
        assert "rank 1: " in message and "layer 'a'" in message and "backward" in message, message


@pytest.mark.distributed
def test_a_bad_input_on_one_rank_raises_on_every_rank() -> None:
    (kind_0, message_0), (kind_1, message_1) = run_distributed(_bad_input_on_one_rank, 2, timeout=60,
                                                               collective_timeout=20)
    assert kind_1 == "ValueError" and "expected input with 4 channels in dim 1" in message_1, message_1
    assert kind_0 == "LayerMismatchError", kind_0
    assert "rank 1: layer '<unnamed>' (SynchronizedBatchNorm1d): bad input: expected input with 4 channels" in message_0


@pytest.mark.distributed
def test_mismatched_layers_raise_on_every_rank() -> None:
    run_distributed(_mismatched_num_features, 2)
    run_distributed(_agreement_is_checked_once_when_debug_is_off, 2)


@pytest.mark.distributed
def test_debug_mode_names_the_layers_on_each_rank() -> None:
    run_distributed(_debug_mode_names_reordered_layers, 2)
    run_distributed(_debug_mode_catches_a_skipped_layer, 2)


@pytest.mark.distributed
@pytest.mark.slow
def test_debug_mode_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # Spawned workers inherit the environment and read SYNCBN_DEBUG when syncbn_dist is imported: fresh ones, which
    # import it with this environment.
    monkeypatch.setenv("SYNCBN_DEBUG", "1")
    run_distributed(_debug_mode_checks_every_call, 2, True, fresh=True)


def _dead_peer_times_out(rank: int, world_size: int, rank0_done: str) -> float:
    layer = syncbn_dist.SynchronizedBatchNorm1d(3)
    layer(torch.randn(4, 3))  # both ranks agree once
    if rank == 1:
        # Alive but never joins the next collective, like a stuck peer, until rank 0 has its error: exiting
        # earlier would close the connection and give rank 0 a "connection closed" error instead of the timeout.
        deadline = time.monotonic() + 30
        while not Path(rank0_done).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return 0.0
    start = time.monotonic()
    try:
        # gloo's own error when the process group timeout (3 s) passes while waiting for the peer (on a send or a
        # receive, depending on the collective's algorithm): not some other failure that merely came after 2 s.
        with pytest.raises(RuntimeError, match=r"Timed out waiting 3000ms for (recv|send) operation to complete"):
            layer(torch.randn(4, 3))
    finally:
        Path(rank0_done).touch()
    return time.monotonic() - start


@pytest.mark.distributed
@pytest.mark.slow
def test_a_peer_that_never_arrives_raises_after_the_process_group_timeout(tmp_path: Path) -> None:
    # The collective timeout given to init_process_group (3 s here) bounds the wait: rank 0 gets gloo's timeout
    # error instead of hanging; the launcher's own 60 s limit would fail the test if it hung.
    done = str(tmp_path / "rank0_done")
    # Fresh ranks: a group whose collective timed out is not one to hand to the next test.
    elapsed, _ = run_distributed(_dead_peer_times_out, 2, done, timeout=60, collective_timeout=3, fresh=True)
    assert elapsed >= 2.0  # it did wait for the peer first: the error is the timeout, not something else


def test_debug_switch_round_trips() -> None:
    before = syncbn_dist.is_debug_enabled()
    try:
        syncbn_dist.set_debug(True)
        assert syncbn_dist.is_debug_enabled()
        syncbn_dist.set_debug(False)
        assert not syncbn_dist.is_debug_enabled()
    finally:
        syncbn_dist.set_debug(before)
