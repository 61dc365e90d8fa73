"""The one launcher for multi-process tests: real gloo process groups on loopback, no mocks.

Usage from a test module::

    def _worker(rank: int, world_size: int, shape) -> dict:   # module level, so spawn can pickle it
        ...asserts...
        return {"rank": rank}

    def test_something():
        results = run_distributed(_worker, 2, (4, 3))

Each worker runs in a fresh spawned process with the default process group initialized (gloo, file://
rendezvous in a private temp dir, so no port races), one intra-op thread, and a collective timeout.
A worker exception fails the test with the worker's traceback; a hang is killed after ``timeout``.

Jobs that a test starts as subprocesses (torchrun, ``python -m launch...``) get
:func:`launch.common.torchrun.env_outside_torchrun`.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(
    worker: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    args: tuple[Any, ...],
    results: Any,
    collective_timeout: float,
) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        try:
            value = worker(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle bytes, not torch's shared-memory tensor sharing: a worker's tensors would otherwise be
        # received through file descriptors of a process that may already have exited.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: B036 - reported to the parent, which fails the test
        results.put((rank, False, traceback.format_exc()))


def run_distributed(
    worker: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    collective_timeout: float = 60.0,
) -> list[Any]:
    """Run ``worker(rank, world_size, *args)`` in ``world_size`` processes; return their results by rank.

    Raises:
        AssertionError: with every failing rank's traceback if any worker raised or exited abnormally.
        TimeoutError: if the workers did not all finish within ``timeout`` seconds (they are killed).
    """
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_entry,
                args=(worker, rank, world_size, init_file, args, results, collective_timeout),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        reports: dict[int, tuple[bool, Any]] = {}
        while len(reports) < world_size and time.monotonic() < deadline:
            while not results.empty():
                rank, ok, value = results.get()
                reports[rank] = (ok, value)
            if len(reports) < world_size and all(not p.is_alive() for p in procs) and results.empty():
                break
            time.sleep(0.02)
        hung = len(reports) < world_size and any(p.is_alive() for p in procs)
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    failures = [f"rank {rank}:\n{value}" for rank, (ok, value) in sorted(reports.items()) if not ok]
    if failures:
        raise AssertionError("distributed worker(s) failed:\n" + "\n".join(failures))
    if hung:
        raise TimeoutError(f"distributed workers did not finish within {timeout} s (ranks reported: {sorted(reports)})")
    missing = [rank for rank in range(world_size) if rank not in reports]
    if missing:
        codes = {rank: procs[rank].exitcode for rank in missing}
        raise AssertionError(f"distributed worker(s) {missing} died without a report (exit codes {codes})")
    return [pickle.loads(reports[rank][1]) for rank in range(world_size)]
