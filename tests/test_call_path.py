"""The layer's calls read top-down (docs/design.md, "The package"): in synchronized training steps, forward and
backward, every call from one file of syncbn_dist into another goes down one order (the module, its Functions, the
per-call statistics, the kernels, the transports, the settings) and never back up to a file already left, as
torch's ``nn/modules/batchnorm.py`` calls ``nn/functional.py`` and never the reverse.

The calls are recorded with :func:`sys.setprofile` (and :func:`threading.setprofile` for the DataParallel replica
threads) over real steps, the first and a second one: DataParallel replicas in threads and a 2-rank gloo group. A new
call into a file above its caller fails here with the call named; if it is deliberate, the order below is what to
change, with docs/design.md's map.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import syncbn_dist
from launch.common.spawn import run_distributed

PACKAGE = os.path.dirname(syncbn_dist.__file__)

# Top to bottom; a file may call only files below it. A directory is one tier: its files call each other freely.
CALL_ORDER = (
    "integrations/",  # convert_model, the DataParallel callbacks: above the layer
    "layer/batchnorm.py",  # the modules
    "layer/identity.py",  # a layer's place in its model
    "layer/functions.py",  # the process-group Function, and the choice of kernels and autograd shape
    "layer/exchange_functions.py",  # the DataParallel replicas' Functions
    "layer/replay.py",  # checkpoint replay for replicas
    "layer/statistics.py",  # the global statistics of a call, the running statistics
    "kernels/compiled.py",  # the source a user's torch.compile traces
    "kernels/native.py",
    "kernels/statistics.py",  # the one derivation of the statistics from a summed payload
    "kernels/tracing.py",
    "comm/",  # transports
    "settings.py",
    "torch_changes.py",
)

Call = tuple[str, str, str, str]  # caller file, caller function, callee file, callee function


def tier(path: str) -> int:
    for index, prefix in enumerate(CALL_ORDER):
        if path == prefix or (prefix.endswith("/") and path.startswith(prefix)):
            return index
    raise AssertionError(f"syncbn_dist/{path} has no place in CALL_ORDER: add it where docs/design.md's map puts it")


@contextmanager
def cross_file_calls() -> Iterator[set[Call]]:
    """The calls from one syncbn_dist file into another while the block runs, on every thread."""
    calls: set[Call] = set()

    def profile(frame, event, arg) -> None:  # noqa: ANN001 (sys.setprofile's signature)
        if event != "call" or frame.f_back is None:
            return
        callee, caller = frame.f_code.co_filename, frame.f_back.f_code.co_filename
        if callee != caller and callee.startswith(PACKAGE) and caller.startswith(PACKAGE):
            calls.add((
                os.path.relpath(caller, PACKAGE), frame.f_back.f_code.co_name,
                os.path.relpath(callee, PACKAGE), frame.f_code.co_name,
            ))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def upward(calls: set[Call]) -> list[str]:
    """The calls that go up :data:`CALL_ORDER`, as readable lines."""
    return sorted(
        f"{caller}:{caller_fn} -> {callee}:{callee_fn}"
        for caller, caller_fn, callee, callee_fn in calls
        if tier(callee) < tier(caller)
    )


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3),
                         nn.BatchNorm1d(3))


def _steps(model: nn.Module, images: torch.Tensor) -> set[Call]:
    with cross_file_calls() as calls:
        for _ in range(2):
            model(images).square().sum().backward()
    return calls


def test_the_order_catches_a_call_up() -> None:
    assert upward({("kernels/native.py", "f", "layer/functions.py", "g")}) == [
        "kernels/native.py:f -> layer/functions.py:g"
    ]
    downward = {("layer/functions.py", "g", "kernels/native.py", "f"), ("comm/replica.py", "", "comm/agreement.py", "")}
    assert upward(downward) == []


def test_data_parallel_replicas_call_top_down(one_intra_op_thread: None) -> None:
    model = syncbn_dist.DataParallelWithCallback(syncbn_dist.convert_model(_net()), cpu_replicas=2)
    calls = _steps(model, torch.randn(8, 3, 8, 8))
    assert any(callee == "layer/exchange_functions.py" for _, _, callee, _ in calls)  # the path ran
    assert upward(calls) == []


def _process_group_worker(rank: int, world_size: int) -> tuple[bool, list[str]]:
    model = DistributedDataParallel(syncbn_dist.convert_model(_net()))
    calls = _steps(model, torch.randn(4, 3, 8, 8) + rank)
    dist.barrier()
    return any(callee == "layer/functions.py" for _, _, callee, _ in calls), upward(calls)


@pytest.mark.distributed
def test_a_process_group_calls_top_down() -> None:
    for ran, calls_up in run_distributed(_process_group_worker, 2):
        assert ran
        assert calls_up == []
