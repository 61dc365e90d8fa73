"""Process launching and collective observation for the benchmark.

:func:`launch` runs ``worker(rank, world_size, *args)`` in ``world_size`` spawned processes with a real
process group (nccl when every rank can have its own GPU, else gloo on CPU; file:// rendezvous, so no port
races) and returns what rank 0 returned. The benchmark spawns its own workers instead of running under
torchrun because one command measures several world sizes.

:class:`CollectiveCounter` counts the ``torch.distributed`` collectives called from Python while it is
active, with their payload bytes. It only observes: every call goes through to the real function.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

# Collectives whose calls the counter records. DDP's gradient buckets are reduced from C++ and are not seen.
_COUNTED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "all_to_all",
)
# Positional index of the tensor each collective sends, where it is not the first argument.
_SENT_ARG = {"all_gather": 1, "all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}


def pick_backend(world_size: int, device: str) -> str:
    """``"nccl"`` if ``device`` allows CUDA and there is a GPU for every rank, else ``"gloo"``.

    Raises:
        ValueError: if ``device`` is not "auto", "cpu" or "cuda", or "cuda" is asked for without enough GPUs.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"expected device 'auto', 'cpu' or 'cuda' (got {device!r})")
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


def _sent_bytes(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    index = _SENT_ARG.get(name, 0)
    tensor = args[index] if len(args) > index else kwargs.get("tensor", kwargs.get("input_tensor"))
    if isinstance(tensor, Tensor):
        return tensor.numel() * tensor.element_size()
    if isinstance(tensor, (list, tuple)):  # all_to_all and friends take lists
        return sum(t.numel() * t.element_size() for t in tensor if isinstance(t, Tensor))
    return 0


def _group_of(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[Any]:
    if "group" in kwargs:
        return kwargs["group"]
    positions = {"all_reduce": 2, "broadcast": 2, "all_gather": 2, "all_gather_into_tensor": 2}
    index = positions.get(name)
    return args[index] if index is not None and len(args) > index else None


class CollectiveCounter:
    """Records every counted collective called through ``torch.distributed`` while the context is active.

    Each record is ``{"op", "phase", "bytes", "dtype", "group"}``: ``phase`` is whatever the caller last set
    on :attr:`phase` (e.g. "forward", "backward"), ``bytes`` the payload sent by this rank, ``group`` "world"
    for the default group or "other". Wrapping is observation only: the real collective runs unchanged.
    Code that bound a collective by name at import time (``from torch.distributed import all_reduce``) or
    calls it from C++ (DDP's gradient buckets) is not seen.
    """

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.phase = "forward"
        self._originals: dict[str, Callable[..., Any]] = {}

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            group = _group_of(name, args, kwargs)
            sent = args[_SENT_ARG.get(name, 0)] if len(args) > _SENT_ARG.get(name, 0) else None
            self.calls.append(
                {
                    "op": name,
                    "phase": self.phase,
                    "bytes": _sent_bytes(name, args, kwargs),
                    "dtype": str(sent.dtype).replace("torch.", "") if isinstance(sent, Tensor) else None,
                    "group": "world" if group is None or group is dist.group.WORLD else "other",
                }
            )
            return original(*args, **kwargs)

        return counted

    def __enter__(self) -> CollectiveCounter:
        for name in _COUNTED:
            if hasattr(dist, name):
                self._originals[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._originals[name]))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()
