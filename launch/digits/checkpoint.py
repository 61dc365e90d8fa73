"""Checkpoints of the digits job: what a resumed run needs to continue exactly, and the checks before it does.

The checkpoint holds the model and optimizer, the position (completed epochs, completed steps of the next one,
the sampler epoch), every rank's RNG states and running sums, the metrics so far, the config and torchrun's run id
(so that a restart of the same launch finds its own checkpoint), all as tensors and plain containers: it loads
with ``torch.load(weights_only=True)``. The learning rate is a closed-form function of the position
(:func:`launch.digits.optim.cosine_schedule`), so no scheduler state is saved.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from launch.common.config import ConfigError
from launch.common.io import atomic_write
from launch.digits.config import DigitsConfig
from launch.digits.loop import EpochProgress
from launch.digits.runtime import Runtime

CHECKPOINT_FORMAT = 1
CHECKPOINT_NAME = "checkpoint.pt"
# Keys that may differ between a checkpoint's config and the run that resumes it: where outputs go, how
# progress is shown, how long a collective may wait, how far to train, the eval batch (eval-mode BatchNorm
# uses the running statistics, so it does not change results). Any other difference changes what a
# training step computes (model, data, batch, optimizer, seed, parallel mode, device), and is refused.
RESUME_MAY_CHANGE = (
    "output_dir",
    "progress_bar",
    "timeout_s",
    "resume",
    "train.epochs",
    "train.checkpoint_every_steps",
    "data.eval_batch_size",
)
_RESUME_KEYS = ("step", "sampler_epoch", "world_size", "replicas_per_process", "rng", "epoch_sums", "metrics")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed: unreadable, not this job's, or written under an incompatible config."""


def save_checkpoint(
    path: Path,
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    epoch: int,
    cfg: DigitsConfig,
    resume_state: dict[str, Any] | None = None,
) -> None:
    """Save the bare model's state_dict (loadable into plain or synchronized BatchNorm), the optimizer state
    (its param groups carry each ``initial_lr``), the number of completed epochs, the config and ``resume_state`` (see
    :func:`resume_state`). Every value is a tensor or a plain container: it loads with ``weights_only=True``."""
    payload = {
        "format": CHECKPOINT_FORMAT,
        "model": net.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "config": dataclasses.asdict(cfg),
        **(resume_state or {}),
    }
    atomic_write(path, lambda f: torch.save(payload, f))


# ---------------------------------------------------------------------------------------------------------
# Resume.


def _rng_devices(runtime: Runtime, replicas: int) -> list[torch.device]:
    """The CUDA devices whose generators this process draws dropout masks from (none on the CPU)."""
    if runtime.device.type != "cuda":
        return []
    if replicas > 1:  # DataParallel over devices 0..replicas-1
        return [torch.device("cuda", i) for i in range(replicas)]
    return [runtime.device]


def _gather_rows(tensor: Tensor, runtime: Runtime) -> Tensor:
    """Every rank's ``tensor`` stacked in rank order, on the CPU: shape (world_size, *tensor.shape). A collective."""
    if runtime.world_size == 1:
        return tensor.detach().cpu().unsqueeze(0)
    local = tensor.detach().to(runtime.device).contiguous()
    rows = [torch.empty_like(local) for _ in range(runtime.world_size)]
    dist.all_gather(rows, local)
    return torch.stack(rows).cpu()


def resume_state(
    net: nn.Module,
    progress: EpochProgress,
    epoch_in_progress: int,
    runtime: Runtime,
    replicas: int,
    metrics: dict[str, Any],
    elapsed_s: dict[str, float],
) -> dict[str, Any]:
    """What a checkpoint needs beyond the model and optimizer to resume exactly; call it on every rank.

    Gathers, in rank order (collectives): every rank's CPU generator state (``rng.torch``, uint8
    (world_size, 5056)), its CUDA generator states if any (``rng.cuda``, uint8 (world_size, devices, n)),
    its running sums over the epoch in progress (``epoch_sums``, float64 (world_size, 3): loss sum,
    correct, count) and, mid-epoch, every buffer (``rank_buffers``: with plain BatchNorm the running
    statistics differ across ranks until the end-of-epoch average). Rank 0's copy is the one written.
    """
    rng = {"torch": _gather_rows(torch.get_rng_state(), runtime)}
    devices = _rng_devices(runtime, replicas)
    if devices:
        rng["cuda"] = _gather_rows(torch.stack([torch.cuda.get_rng_state(d) for d in devices]), runtime)
    sums = torch.tensor([progress.loss_sum, progress.correct, progress.count], dtype=torch.float64)
    rank_buffers = {}
    if progress.step > 0:
        rank_buffers = {name: _gather_rows(buffer, runtime) for name, buffer in net.named_buffers()}
    return {
        "step": progress.step,
        "sampler_epoch": epoch_in_progress,
        "world_size": runtime.world_size,
        "replicas_per_process": replicas,
        "rng": rng,
        "epoch_sums": _gather_rows(sums, runtime),
        "rank_buffers": rank_buffers,
        "metrics": metrics,
        "elapsed_s": dict(elapsed_s),
        "launch_id": runtime.launch_id,
    }


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint at ``path``, loaded on the CPU with ``torch.load(weights_only=True)``: it never runs code.

    Raises:
        CheckpointError: if the file cannot be read or unpickled with ``weights_only=True`` (anything but
            tensors and plain containers), or is not a mapping.
    """
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # UnpicklingError, RuntimeError (truncated zip), OSError, EOFError, ...
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"cannot load checkpoint {path} with torch.load(weights_only=True): {first_line}"
        ) from None
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"checkpoint {path}: expected a mapping (got {type(checkpoint).__name__})")
    return checkpoint


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_resumable(checkpoint: dict[str, Any], cfg: DigitsConfig, world_size: int, path: str | Path) -> None:
    """Refuse a checkpoint this run cannot continue exactly.

    Args:
        checkpoint: as returned by :func:`load_checkpoint`.
        cfg: the resuming run's config.
        world_size: the resuming run's number of processes.
        path: the checkpoint's path, for messages.

    Raises:
        CheckpointError: if it is not a format-1 checkpoint of this job with resume state, if its config
            differs from ``cfg`` in a key outside :data:`RESUME_MAY_CHANGE` (all such keys are named,
            with both values; a key the checkpoint lacks counts as its default), if it was written by a
            different number of processes, or if it is past ``cfg.train.epochs``.
    """
    missing = [key for key in ("format", "model", "optimizer", "epoch", "config") if key not in checkpoint]
    if checkpoint.get("format") != CHECKPOINT_FORMAT or missing:
        raise CheckpointError(
            f"checkpoint {path} is not a resumable checkpoint of launch.digits.train (format "
            f"{checkpoint.get('format')!r}, expected {CHECKPOINT_FORMAT}; missing keys: {', '.join(missing) or 'none'})"
        )
    missing = [key for key in _RESUME_KEYS if key not in checkpoint]
    if missing:
        raise CheckpointError(f"checkpoint {path} has no resume state (missing keys: {', '.join(missing)})")
    saved = _flatten(dataclasses.asdict(DigitsConfig()))
    saved.update(_flatten(checkpoint["config"]) if isinstance(checkpoint["config"], dict) else {})
    current = _flatten(dataclasses.asdict(cfg))
    differing = [
        f"{key}: {saved.get(key, '<absent>')!r} in the checkpoint, {current.get(key, '<unknown key>')!r} now"
        for key in sorted(set(saved) | set(current))
        if key not in RESUME_MAY_CHANGE and saved.get(key, "<absent>") != current.get(key, "<unknown key>")
    ]
    if differing:
        raise CheckpointError(
            f"cannot resume from {path}: its config differs in {len(differing)} key(s) that must match: "
            + "; ".join(differing)
            + f". Only {', '.join(RESUME_MAY_CHANGE)} may change on resume; "
            "set the others back, or start afresh in another output_dir (or without resume)"
        )
    if checkpoint["world_size"] != world_size:
        raise CheckpointError(
            f"cannot resume from {path}: it was written by {checkpoint['world_size']} process(es), this run has "
            f"{world_size}; launch {checkpoint['world_size']} (every rank's data shard, RNG and sums are in it)"
        )
    epoch, step = checkpoint["epoch"], checkpoint["step"]
    if epoch > cfg.train.epochs or (epoch == cfg.train.epochs and step > 0):
        raise CheckpointError(
            f"cannot resume from {path}: it is at epoch {epoch} (+{step} steps), past train.epochs="
            f"{cfg.train.epochs}; set train.epochs to at least {epoch}"
        )


def find_resume_checkpoint(cfg: DigitsConfig, world_size: int, launch_id: str | None = None) -> dict[str, Any] | None:
    """The checkpoint to continue from, loaded and checked, or None to start afresh.

    That is the checkpoint in ``cfg.output_dir`` if ``cfg.resume``, or if it was written under ``launch_id`` (an
    earlier attempt of this torchrun launch: the job was restarted after a worker died); else None, as when there is
    none.

    Raises:
        CheckpointError: see :func:`load_checkpoint` and :func:`check_resumable`.
    """
    path = Path(cfg.output_dir) / CHECKPOINT_NAME
    if not path.is_file() or not (cfg.resume or launch_id is not None):
        return None
    if cfg.resume:
        checkpoint = load_checkpoint(path)
    else:
        try:
            checkpoint = load_checkpoint(path)
        except CheckpointError:  # not one this launch wrote (its writes are atomic): overwritten, as without torchrun
            return None
        if checkpoint.get("launch_id") != launch_id:
            return None  # another launch's: started afresh and overwritten
    check_resumable(checkpoint, cfg, world_size, path)
    return checkpoint


def restore(
    checkpoint: dict[str, Any],
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    runtime: Runtime,
    replicas: int,
) -> EpochProgress:
    """Load the checkpoint into the model, the optimizer and this rank's generators; its epoch progress.

    The learning rate is not restored: the caller's :func:`~launch.digits.optim.cosine_schedule` sets it from the
    position, on the cosine of the current ``train.epochs`` (which may have changed).
    """
    if checkpoint["replicas_per_process"] != replicas:
        raise CheckpointError(
            f"cannot resume: the checkpoint was written with {checkpoint['replicas_per_process']} replica(s) per "
            f"process, this run has {replicas}"
        )
    rank = runtime.rank
    net.load_state_dict(checkpoint["model"])
    rank_buffers = checkpoint.get("rank_buffers", {})
    with torch.no_grad():
        for name, buffer in net.named_buffers():
            if name in rank_buffers:
                buffer.copy_(rank_buffers[name][rank])
    optimizer.load_state_dict(checkpoint["optimizer"])
    # clone(): a row of the stacked states is a view at a storage offset, which set_rng_state misreads
    # (torch 2.13: "Invalid mt19937 state", or a crash).
    torch.set_rng_state(checkpoint["rng"]["torch"][rank].clone())
    devices = _rng_devices(runtime, replicas)
    if devices:
        for device, state in zip(devices, checkpoint["rng"]["cuda"][rank]):
            torch.cuda.set_rng_state(state.clone(), device)
    loss_sum, correct, count = checkpoint["epoch_sums"][rank].tolist()
    return EpochProgress(checkpoint["step"], loss_sum, int(correct), int(count))


def check_same_position(values: list[int], runtime: Runtime, output_dir: str) -> None:
    """Fail on every rank unless every rank starts from the same checkpoint position (a collective)."""
    rows = _gather_rows(torch.tensor(values, dtype=torch.int64), runtime)
    if not all(torch.equal(row, rows[0]) for row in rows):
        positions = ", ".join(
            f"rank {r}: " + ("epoch {1} step {2}".format(*row.tolist()) if row[0] else "no checkpoint")
            for r, row in enumerate(rows)
        )
        raise RuntimeError(
            f"ranks disagree on where to resume ({positions}): every node must see the same "
            f"{output_dir}/{CHECKPOINT_NAME}; put output_dir on storage shared by all nodes"
        )
