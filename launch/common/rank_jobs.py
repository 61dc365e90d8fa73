"""One job on the ranks of a process group: each rank's run on a group set up for it, and the job's results.

Shared by :mod:`launch.common.spawn` (a job on fresh processes) and :mod:`launch.common.worlds` (a job on long-lived
ranks), which both launch jobs and read their reports.
"""

from __future__ import annotations

import gc
import pickle
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["job_results", "run_on_group"]


def run_on_group(
    worker: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    args: tuple[Any, ...],
    collective_timeout: float,
    backend: str,
    threads: int,
) -> Any:
    """``worker(rank, world_size, *args)`` in this process, on a default process group set up for it and torn down
    after it (whether it returns or raises)."""
    torch.set_num_threads(threads)
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
        return worker(rank, world_size, *args)
    finally:
        # Compiled code's caches hold the process group: release them and collect what they leave first
        # (docs/compile.md, "Exiting a compiled job").
        torch._dynamo.reset()
        gc.collect()
        dist.destroy_process_group()


def job_results(
    reports: dict[int, tuple[bool, Any]], world_size: int, hung: bool, timeout: Optional[float], exit_codes: Any
) -> list[Any]:
    """The ranks' return values, by rank, from their ``(ok, pickled value or traceback)`` reports.

    Raises:
        AssertionError: with every failing rank's traceback, or naming the ranks that died without a report.
        TimeoutError: if ``hung`` (some ranks were still running at the deadline, and were killed).
    """
    failures = [f"rank {rank}:\n{value}" for rank, (ok, value) in sorted(reports.items()) if not ok]
    if failures:
        raise AssertionError("distributed worker(s) failed:\n" + "\n".join(failures))
    if hung:
        raise TimeoutError(f"distributed workers did not finish within {timeout} s (ranks reported: {sorted(reports)})")
    missing = [rank for rank in range(world_size) if rank not in reports]
    if missing:
        codes = {rank: exit_codes(rank) for rank in missing}
        raise AssertionError(f"distributed worker(s) {missing} died without a report (exit codes {codes})")
    return [pickle.loads(reports[rank][1]) for rank in range(world_size)]
