"""Which process-group backend a benchmark run gets: nccl when every rank can have its own GPU, else gloo."""

from __future__ import annotations

import torch


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
