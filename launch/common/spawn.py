"""The one multi-process launcher of the tests and the benchmark: real process groups, no mocks, no torchrun.

Usage::

    def _worker(rank: int, world_size: int, shape) -> dict:   # module level, so spawn can pickle it
        ...
        return {"rank": rank}

    results = run_distributed(_worker, 2, (4, 3))             # every rank's return value, by rank

Each worker runs in a fresh spawned process with the default process group initialized (gloo, or nccl with one
GPU per rank; file:// rendezvous in a private temp dir, so no port races), ``threads`` intra-op threads, and a
collective timeout. A worker exception raises in the caller with the worker's traceback; a hang is killed after
``timeout``. The benchmark spawns its workers this way instead of running under torchrun because one command
measures several world sizes.

Jobs started as subprocesses under torchrun get :func:`launch.common.torchrun.env_outside_torchrun`.
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

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
    backend: str,
    threads: int,
) -> None:
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        try:
            value = worker(rank, world_size, *args)
        finally:
            # Compiled code's caches hold the process group: release them and collect what they leave first
            # (docs/compile.md, "Exiting a compiled job").
            torch._dynamo.reset()
            gc.collect()
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
    timeout: Optional[float] = 120.0,
    collective_timeout: float = 60.0,
    backend: str = "gloo",
    threads: int = 1,
) -> list[Any]:
    """Run ``worker(rank, world_size, *args)`` in ``world_size`` processes; return their results by rank.

    Args:
        worker: a module-level function (spawn pickles it by name); its return value must pickle.
        world_size: the number of processes, one rank each.
        timeout: seconds for the whole run before the workers are killed (None: no limit).
        collective_timeout: seconds a collective may wait before it raises (the process group's timeout).
        backend: "gloo", or "nccl" with GPU ``rank`` for each rank.
        threads: intra-op threads per process.

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
                args=(worker, rank, world_size, init_file, args, results, collective_timeout, backend, threads),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        deadline = math.inf if timeout is None else time.monotonic() + timeout
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
