"""Process launching for the benchmark.

:func:`launch` runs ``worker(rank, world_size, *args)`` in ``world_size`` spawned processes with a real
process group (nccl when every rank can have its own GPU, else gloo on CPU; file:// rendezvous, so no port
races) and returns what rank 0 returned. The benchmark spawns its own workers instead of running under
torchrun because one command measures several world sizes.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def pick_backend(world_size: int, device: str) -> str:
    """``"nccl"`` if ``device`` ("auto", "cpu" or "cuda", as the config checks) allows CUDA and there is a GPU for
    every rank, else ``"gloo"``.

    Raises:
        ValueError: if "cuda" is asked for without enough GPUs.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    enough_gpus = gpus >= world_size
    if device == "cuda" and not enough_gpus:
        raise ValueError(f"device 'cuda' needs {world_size} GPUs (got {gpus})")
    return "nccl" if device != "cpu" and enough_gpus else "gloo"


def _entry(
    rank: int,
    worker: Callable[..., Any],
    world_size: int,
    backend: str,
    init_file: str,
    result_path: str,
    threads: int,
    timeout_s: float,
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        result = worker(rank, world_size, *args)
        if rank == 0:
            with open(result_path, "wb") as f:
                pickle.dump(result, f)
    finally:
        torch._dynamo.reset()  # compiled variants' caches hold the process group: release them first (docs/compile.md)
        dist.destroy_process_group()


def launch(
    worker: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    threads: int = 1,
    timeout_s: float = 300.0,
) -> Any:
    """Run ``worker(rank, world_size, *args)`` in ``world_size`` processes; return rank 0's result.

    ``worker`` must be a module-level function (spawn pickles it by name). Each process uses ``threads``
    intra-op threads and has its default process group initialized with ``backend``; a collective that
    waits longer than ``timeout_s`` raises, so a broken run fails instead of hanging.

    Raises:
        torch.multiprocessing.ProcessRaisedException: with the worker's traceback if any rank raised.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        result_path = os.path.join(tmp, "result.pkl")
        mp.start_processes(
            _entry,
            args=(worker, world_size, backend, init_file, result_path, threads, timeout_s, args),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        with open(result_path, "rb") as f:
            return pickle.load(f)
