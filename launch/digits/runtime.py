"""Where a digits process runs: its rank, world size and device, and the process group under torchrun."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from launch.digits.config import DigitsConfig


@dataclass
class Runtime:
    """Where this process runs: its rank, the world size, its device, and whether it owns a process group."""

    rank: int
    world_size: int
    device: torch.device
    distributed: bool
    launch_id: str | None = None  # see launch_id()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launch_id(env: Mapping[str, str] | None = None) -> str | None:
    """The id of this torchrun launch, the same in every attempt and on every node, or None without one.

    torchrun's run id (``--rdzv_id``; ``--standalone`` draws a random one per launch), from ``TORCHELASTIC_RUN_ID``.
    torchrun's placeholder ``none`` (no ``--rdzv_id`` given) is not an id: it is the same for every launch.
    A checkpoint written under an id is resumed by a later attempt of the same launch (a restart) without
    ``resume=true`` (:func:`launch.digits.checkpoint.find_resume_checkpoint`).
    """
    run_id = (os.environ if env is None else env).get("TORCHELASTIC_RUN_ID", "")
    return None if run_id in ("", "none") else run_id


def pick_device(cfg: DigitsConfig, local_rank: int) -> torch.device:
    """The device of this process: the CPU, or with CUDA (``device: cuda``, or ``auto`` with a GPU) GPU
    ``local_rank`` (DDP) or GPU 0 (DataParallel, which scatters from it)."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if cfg.parallel == "dataparallel":
        return torch.device("cuda", 0)
    return torch.device("cuda", local_rank)


def init_distributed(cfg: DigitsConfig) -> Runtime:
    """Start the default process group under torchrun (``RANK`` set): nccl for CUDA, gloo for CPU.

    Without torchrun this is one process (rank 0, world size 1) and no group is started. CPU thread
    replicas get one intra-op thread each unless ``OMP_NUM_THREADS`` says otherwise.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(cfg, local_rank)
    if cfg.parallel == "dataparallel" and device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # The replica threads are the parallelism, as torchrun's processes are (torchrun sets
        # OMP_NUM_THREADS=1): intra-op threads on top of them oversubscribe the cores, ~10x slower here.
        torch.set_num_threads(1)
    if "RANK" not in os.environ:
        return Runtime(0, 1, device, distributed=False)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout_s))
    return Runtime(dist.get_rank(), dist.get_world_size(), device, distributed=True, launch_id=launch_id())
