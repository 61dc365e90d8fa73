"""The digits training job's config: a typed default for every key, range rules beside the defaults.

Files and ``KEY=VALUE`` overrides only override (see :mod:`launch.common.config`). :func:`check_launch` rejects
a config that cannot run in this launch (torchrun or not, CUDA or not).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import torch

from launch.common.config import ConfigError, load_config, non_negative, one_of, positive, ruled


@dataclass
class DataConfig:
    """The digits data (scikit-learn's bundled 1,797 8x8 images) and its loaders."""

    batch_size: int = positive(16)  # per rank (ddp) or per replica (dataparallel): what each BatchNorm sees
    eval_batch_size: int = positive(512)
    test_fraction: float = ruled(0.2, "in (0, 1)", lambda v: 0 < v < 1)
    split_seed: int = 0  # the stratified train/test split; fixed so every run and rank sees the same split
    # Uneven shards: rank r runs r fewer batches per epoch than rank 0, the steps running under torch's Join with
    # syncbn_dist.join_layers (docs/training.md, "Uneven inputs"). ddp only; no checkpoint_every_steps.
    uneven_shards: bool = False


@dataclass
class ModelConfig:
    """The CNN: three conv-BatchNorm2d blocks and a Linear-BatchNorm1d head (or a Linear head without BatchNorm)."""

    width: int = positive(32)  # channels of the first block; later layers use 2x and 4x
    dropout: float = ruled(0.1, "in [0, 1)", lambda v: 0 <= v < 1)
    bn_momentum: float = ruled(0.1, "in (0, 1]", lambda v: 0 < v <= 1)
    sync_bn: bool = True  # false keeps plain per-rank BatchNorm (the baseline of `make compare`)
    # false: the head's hidden Linear has a bias and no BatchNorm1d. Plain per-rank BatchNorm1d cannot train on
    # one image per rank (one value per channel: torch raises); the conv layers' BatchNorm2d still can.
    head_bn: bool = True


@dataclass
class TrainConfig:
    """SGD with Nesterov momentum and a per-epoch cosine learning-rate schedule."""

    epochs: int = positive(12)
    lr: float = non_negative(0.1)  # for the global batch (all ranks/replicas together)
    momentum: float = ruled(0.9, "in [0, 1)", lambda v: 0 <= v < 1)
    weight_decay: float = non_negative(5.0e-4)
    # Also checkpoint every this many steps inside an epoch (0: at epoch ends and on SIGTERM only). A restarted or
    # resumed run continues from the last one bit for bit, so a dead worker costs at most this many steps.
    checkpoint_every_steps: int = non_negative(0)


@dataclass
class DigitsConfig:
    """The whole job. Every key has a typed default here; YAML files and ``KEY=VALUE`` overrides only override."""

    output_dir: str = "outputs/digits"
    seed: int = 0
    parallel: str = one_of("ddp", "ddp", "dataparallel")
    device: str = one_of("auto", "auto", "cpu", "cuda")
    cpu_replicas: int = positive(2)  # dataparallel without CUDA: this many CPU thread replicas
    timeout_s: float = positive(300.0)  # collective timeout of the process group
    # tqdm on rank 0: true, false, or "auto": on only when stderr is a terminal, so that logs redirected to a file
    # (SLURM, nohup, CI) get the per-epoch log lines and no carriage-return frames.
    progress_bar: Union[bool, str] = ruled("auto", "true, false or 'auto'", lambda v: v in (True, False, "auto"))
    resume: bool = False  # continue from output_dir/checkpoint.pt (start afresh, with a warning, if there is none)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def load_digits_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> DigitsConfig:
    """The validated job config: defaults, then the YAML file at ``path``, then ``KEY=VALUE`` ``overrides``.

    Raises:
        ConfigError: naming the key (see :func:`launch.common.config.load_config`).
    """
    return load_config(DigitsConfig, path, overrides)


def check_launch(cfg: DigitsConfig, env: Mapping[str, str] | None = None) -> None:
    """Reject a config that cannot run in this launch (torchrun or not, CUDA or not), before any setup.

    Raises:
        ConfigError: for ``parallel: dataparallel`` under torchrun with more than one process,
            ``device: cuda`` without CUDA, more processes on this node than GPUs, or ``data.uneven_shards`` outside
            ``parallel: ddp`` or with ``train.checkpoint_every_steps``.
    """
    env = os.environ if env is None else env
    world_size = int(env.get("WORLD_SIZE", "1"))
    if cfg.parallel == "dataparallel" and world_size > 1:
        raise ConfigError(
            f"config key 'parallel': 'dataparallel' runs in one process; launch it with python, not "
            f"torchrun (got WORLD_SIZE={world_size}), or use parallel=ddp"
        )
    if cfg.data.uneven_shards and (cfg.parallel != "ddp" or cfg.train.checkpoint_every_steps):
        raise ConfigError(
            "config key 'data.uneven_shards': uneven shards run under DDP's Join (parallel=ddp), where a checkpoint "
            "inside the epoch cannot be taken (set train.checkpoint_every_steps=0)"
        )
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config key 'device': 'cuda' was asked for but CUDA is not available")
    local_rank = int(env.get("LOCAL_RANK", "0"))
    if cfg.device != "cpu" and torch.cuda.is_available() and local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"config key 'device': local rank {local_rank} has no GPU of its own ({torch.cuda.device_count()} "
            "visible); start at most one process per GPU, or set device=cpu"
        )
