"""The one multi-process launcher of the tests and the benchmark: real process groups, no mocks, no torchrun.

Usage::

    def _worker(rank: int, world_size: int, shape) -> dict:   # module level, so spawn can pickle it
        ...
        return {"rank": rank}

    results = run_distributed(_worker, 2, (4, 3))             # every rank's return value, by rank

Each worker runs with the default process group initialized (gloo, or nccl with one GPU per rank; file://
rendezvous in a private temp dir, so no port races), ``threads`` intra-op threads, and a collective timeout. A worker
exception raises in the caller with the worker's traceback; a hang is killed after ``timeout``. The benchmark spawns
its workers this way instead of running under torchrun because one command measures several world sizes.

By default every call spawns fresh processes. Inside :func:`pooled_worlds` (the test suite's session, see
tests/conftest.py) gloo jobs run in long-lived rank processes instead (:mod:`launch.common.worlds`), each job on a
process group of its own and each rank's state put back after it; ``fresh=True`` keeps a job on fresh processes.

Jobs started as subprocesses under torchrun get :func:`launch.common.torchrun.env_outside_torchrun`.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch.multiprocessing as mp

from .rank_jobs import job_results, run_on_group

if TYPE_CHECKING:
    from .worlds import WorldPool

# The pool of long-lived worlds that run_distributed uses, while pooled_worlds() is active; None: fresh processes.
_POOL: Optional[WorldPool] = None


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
    try:
        value = run_on_group(worker, rank, world_size, init_file, args, collective_timeout, backend, threads)
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
    fresh: bool = False,
) -> list[Any]:
    """Run ``worker(rank, world_size, *args)`` in ``world_size`` processes; return their results by rank.

    Args:
        worker: a module-level function (spawn pickles it by name); its return value must pickle.
        world_size: the number of processes, one rank each.
        timeout: seconds for the whole run before the workers are killed (None: no limit).
        collective_timeout: seconds a collective may wait before it raises (the process group's timeout).
        backend: "gloo", or "nccl" with GPU ``rank`` for each rank.
        threads: intra-op threads per process.
        fresh: spawn new processes even inside :func:`pooled_worlds`: for a job that must own its processes (it
            signals or hangs a rank, or asserts what only a new process shows: import-time environment, first
            compilations). Jobs of other backends than gloo always run fresh.

    Raises:
        AssertionError: with every failing rank's traceback if any worker raised or exited abnormally.
        TimeoutError: if the workers did not all finish within ``timeout`` seconds (they are killed).
    """
    if _POOL is not None and not fresh and backend == "gloo":
        return _POOL.run(worker, world_size, args, timeout, collective_timeout, threads)
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
    return job_results(reports, world_size, hung, timeout, lambda rank: procs[rank].exitcode)


def pooled_job_cpu_s() -> float:
    """The CPU seconds the ranks of the current :func:`pooled_worlds` spent in jobs so far (0 outside one)."""
    return 0.0 if _POOL is None else _POOL.job_cpu_s


@contextlib.contextmanager
def pooled_worlds(max_ranks: int = 8) -> Iterator[WorldPool]:
    """Within the block, :func:`run_distributed` runs gloo jobs on long-lived rank processes
    (:class:`worlds.WorldPool`); on leaving it, they exit. For test suites: a benchmark keeps fresh processes.

    A rank process dies with the thread that spawned it (:mod:`launch.common.worlds`): call
    :func:`run_distributed` in the block from a thread that outlives it, such as the main thread.

    Args:
        max_ranks: the most rank processes alive at once (several sets where jobs' environments differ); the least
            recently used set exits to make room.
    """
    from .worlds import WorldPool

    global _POOL
    pool, previous = WorldPool(max_ranks), _POOL
    _POOL = pool
    try:
        yield pool
    finally:
        _POOL = previous
        pool.close()
