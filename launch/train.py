"""Train a small BatchNorm CNN on scikit-learn's digits with synchronized BatchNorm.

Commands (from the repository root)::

    make train                       # = .venv/bin/torchrun --standalone --nproc_per_node=2 launch/train.py \
                                     #       --config configs/digits.yaml
    make train-dp                    # = .venv/bin/python launch/train.py --config configs/digits_dp.yaml
    torchrun --standalone --nproc_per_node=2 launch/train.py --config configs/digits.yaml \
        --set train.epochs=3 --set output_dir=outputs/quick
    torchrun --standalone --nproc_per_node=2 launch/train.py --config configs/digits.yaml --resume
    make train-multinode             # two "nodes" x 1 process on loopback: this command, twice at once
    OMP_NUM_THREADS=1 torchrun --nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d \
        --rdzv_endpoint=127.0.0.1:29510 --rdzv_id=digits-multinode --local_addr=127.0.0.1 \
        launch/train.py --config configs/digits_multinode.yaml
    python launch/train.py --help

``parallel: ddp`` runs one process per rank under torchrun: the BatchNorm layers are converted with
:func:`syncbn_dist.convert_model` and the model is wrapped in DistributedDataParallel (world_size > 1
only). ``parallel: dataparallel`` runs one process with :class:`syncbn_dist.DataParallelWithCallback`
over every CUDA device, or over ``cpu_replicas`` CPU thread replicas when there is no GPU.

The config is validated completely (unknown keys, types, ranges, launch mode, and with ``resume`` the
checkpoint's compatibility) before any process group starts. Rank 0 logs, writes ``config.yaml`` (the
resolved config), and after every epoch ``checkpoint.pt`` and ``metrics.json`` under ``output_dir``, each
atomically. Before each epoch's checkpoint, every rank's parameters and running statistics are
all-gathered and compared; the job fails if they differ.

Stopping and resuming: SIGTERM or SIGINT (torchrun forwards both to every worker) makes the job stop at
the next training step that all ranks agree on (a one-element all_reduce at every step boundary), write a
checkpoint of the last completed step and exit 0. ``--resume`` (``resume: true``) continues from
``output_dir/checkpoint.pt``, mid-epoch included; for ``parallel: ddp`` the resumed run reproduces the
uninterrupted run. The checkpoint holds the model, optimizer and scheduler, the position (completed
epochs, completed steps of the next one, the sampler epoch), every rank's RNG states and running sums,
the metrics so far and the config, all as tensors and plain containers: it loads with
``torch.load(weights_only=True)``. The job's randomness comes only from torch: dropout draws from the
global CPU (and CUDA) generators, which are checkpointed; the data order is a function of
``(seed, sampler epoch)``; Python's ``random`` and NumPy are not used.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import itertools
import json
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
import types
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Union, get_args, get_origin, get_type_hints

import torch
import torch.distributed as dist
import yaml
from torch import Tensor, nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from tqdm import tqdm

import syncbn_dist
from syncbn_dist import SyncBatchNorm

log = logging.getLogger("train")

# ---------------------------------------------------------------------------------------------------------
# Config: dataclasses with a typed default for every key; range rules live next to the defaults.
# ---------------------------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """A bad config file, key, type, value or launch mode; raised before any process group starts."""


def _rule(text: str, check: Callable[[Any], bool]) -> dict[str, Any]:
    """Field metadata: the value must satisfy ``check``; ``text`` says how (e.g. "> 0")."""
    return {"rule": (text, check)}


def _positive(default: Any) -> Any:
    return field(default=default, metadata=_rule("> 0", lambda v: v > 0))


def _non_negative(default: Any) -> Any:
    return field(default=default, metadata=_rule(">= 0", lambda v: v >= 0))


def _fraction(default: float, text: str, check: Callable[[float], bool]) -> Any:
    return field(default=default, metadata=_rule(text, check))


@dataclass
class DataConfig:
    """The digits data (scikit-learn's bundled 1,797 8x8 images) and its loaders."""

    batch_size: int = _positive(16)  # per rank (ddp) or per replica (dataparallel): what each BatchNorm sees
    eval_batch_size: int = _positive(512)
    test_fraction: float = _fraction(0.2, "in (0, 1)", lambda v: 0 < v < 1)
    split_seed: int = 0  # the stratified train/test split; fixed so every run and rank sees the same split


@dataclass
class ModelConfig:
    """The CNN: three conv-BatchNorm2d blocks and a Linear-BatchNorm1d head (or a Linear head without BatchNorm)."""

    width: int = _positive(32)  # channels of the first block; later layers use 2x and 4x
    dropout: float = _fraction(0.1, "in [0, 1)", lambda v: 0 <= v < 1)
    bn_momentum: float = _fraction(0.1, "in (0, 1]", lambda v: 0 < v <= 1)
    sync_bn: bool = True  # false keeps plain per-rank BatchNorm (the baseline of `make compare`)
    # false: the head's hidden Linear has a bias and no BatchNorm1d. Plain per-rank BatchNorm1d cannot train on
    # one image per rank (one value per channel: torch raises); the conv layers' BatchNorm2d still can.
    head_bn: bool = True


@dataclass
class TrainConfig:
    """SGD with Nesterov momentum and a per-epoch cosine learning-rate schedule."""

    epochs: int = _positive(12)
    lr: float = _non_negative(0.1)  # for the global batch (all ranks/replicas together)
    momentum: float = _fraction(0.9, "in [0, 1)", lambda v: 0 <= v < 1)
    weight_decay: float = _non_negative(5.0e-4)


@dataclass
class Config:
    """The whole job. Every key has a typed default here; YAML files and ``--set`` only override.

    Field annotations are evaluated at runtime (``get_type_hints``) to check types: on Python 3.9 write
    ``Optional[X]`` in them, not ``X | None``.
    """

    output_dir: str = "outputs/digits"
    seed: int = 0
    parallel: Literal["ddp", "dataparallel"] = "ddp"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    cpu_replicas: int = _positive(2)  # dataparallel without CUDA: this many CPU thread replicas
    timeout_s: float = _positive(300.0)  # collective timeout of the process group
    progress_bar: bool = True
    resume: bool = False  # continue from output_dir/checkpoint.pt (start afresh, with a warning, if there is none)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# Optional[X] and, on Python >= 3.10, X | None.
_UNIONS = (Union, types.UnionType) if hasattr(types, "UnionType") else (Union,)


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in _UNIONS:
        return " | ".join(_type_name(a) for a in get_args(tp))
    return "None" if tp is type(None) else tp.__name__


def _matches(value: Any, tp: Any) -> bool:
    origin = get_origin(tp)
    if origin is Literal:
        return value in get_args(tp)
    if origin in _UNIONS:
        return any(_matches(value, arg) for arg in get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:  # YAML writes 1.0 as 1; bool is an int subclass but never a number here
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _build(cls: type, values: Any, prefix: str = "") -> Any:
    """An instance of the dataclass ``cls`` from a (nested) mapping, checking keys, types and ranges."""
    if not isinstance(values, dict):
        where = prefix.rstrip(".") or "the config file"
        raise ConfigError(f"{where}: expected a mapping of keys (got {type(values).__name__} {values!r})")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = get_type_hints(cls)
    kwargs = {}
    for name, value in values.items():
        key = f"{prefix}{name}"
        if name not in fields:
            raise ConfigError(f"unknown config key '{key}' (known keys here: {', '.join(sorted(fields))})")
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, f"{key}.")
            continue
        if not _matches(value, tp):
            hint = ""
            if tp is float and isinstance(value, str):
                hint = "; PyYAML reads 1e-3 as a string, write 1.0e-3"
            raise ConfigError(
                f"config key '{key}': expected {_type_name(tp)} (got {type(value).__name__} {value!r}{hint})"
            )
        if tp is float:
            value = float(value)
        rule = fields[name].metadata.get("rule")
        if rule is not None and not rule[1](value):
            raise ConfigError(f"config key '{key}': expected a value {rule[0]} (got {value!r})")
        kwargs[name] = value
    return cls(**kwargs)


def _apply_override(values: dict[str, Any], override: str) -> None:
    """Set ``a.b.c=value`` in the nested mapping; the value is parsed as YAML (so 3 is an int, true a bool)."""
    key, sep, text = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"expected --set KEY=VALUE with a dotted KEY such as train.epochs=3 (got {override!r})")
    try:
        value = yaml.safe_load(text) if text else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"config key '{key}': cannot parse value {text!r} as YAML ({error})") from None
    *parents, leaf = key.split(".")
    node = values
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{'.'.join(parents[: i + 1])}' is not a section, cannot set '{key}'")
        node = child
    node[leaf] = value


def load_config(path: str | Path | None, overrides: tuple[str, ...] | list[str] = ()) -> Config:
    """The validated config: defaults, then the YAML file at ``path`` (if any), then ``overrides``.

    Args:
        path: a YAML file whose keys are a subset of :class:`Config`'s (nested sections as mappings).
        overrides: ``"dotted.key=value"`` strings; each value is parsed as YAML.

    Returns:
        The config, with every key typed and in range.

    Raises:
        ConfigError: if the file is missing or not a YAML mapping, a key is unknown, a value has the
            wrong type, or a value is out of range. The message names the key.
    """
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as error:
            raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
        if loaded is not None:
            if not isinstance(loaded, dict):
                raise ConfigError(f"config file {path}: expected a mapping of keys (got {type(loaded).__name__})")
            values = loaded
    for override in overrides:
        _apply_override(values, override)
    return _build(Config, values)


def check_launch(cfg: Config, env: dict[str, str] | None = None) -> None:
    """Reject a config that cannot run in this launch (torchrun or not, CUDA or not), before any setup.

    Raises:
        ConfigError: for ``parallel: dataparallel`` under torchrun with more than one process,
            ``device: cuda`` without CUDA, or more processes on this node than GPUs.
    """
    env = os.environ if env is None else env
    world_size = int(env.get("WORLD_SIZE", "1"))
    if cfg.parallel == "dataparallel" and world_size > 1:
        raise ConfigError(
            f"config key 'parallel': 'dataparallel' runs in one process; launch it with python, not "
            f"torchrun (got WORLD_SIZE={world_size}), or use parallel=ddp"
        )
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config key 'device': 'cuda' was asked for but CUDA is not available")
    local_rank = int(env.get("LOCAL_RANK", "0"))
    if cfg.device != "cpu" and torch.cuda.is_available() and local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"config key 'device': local rank {local_rank} has no GPU of its own ({torch.cuda.device_count()} "
            "visible); start at most one process per GPU, or set device=cpu"
        )


def parse_args(argv: list[str] | None = None) -> Config:
    """The config from the command line: ``--config PATH`` and any number of ``--set KEY=VALUE``."""
    parser = argparse.ArgumentParser(
        description="Train a BatchNorm CNN on digits with synchronized BatchNorm (see the module docstring).",
    )
    parser.add_argument("--config", type=Path, default=None, help="YAML config; omitted keys keep their defaults")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one key, dotted for sections, e.g. --set train.epochs=3 (repeatable)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from output_dir/checkpoint.pt (the same as --set resume=true)",
    )
    args = parser.parse_args(argv)
    return load_config(args.config, [*args.overrides, *(["resume=true"] if args.resume else [])])


# ---------------------------------------------------------------------------------------------------------
# Process group.
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Runtime:
    """Where this process runs: its rank, the world size, its device, and whether it owns a process group."""

    rank: int
    world_size: int
    device: torch.device
    distributed: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _pick_device(cfg: Config, local_rank: int) -> torch.device:
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if cfg.parallel == "dataparallel":
        return torch.device("cuda", 0)
    return torch.device("cuda", local_rank)


def init_distributed(cfg: Config) -> Runtime:
    """Start the default process group under torchrun (``RANK`` set): nccl for CUDA, gloo for CPU.

    Without torchrun this is one process (rank 0, world size 1) and no group is started. CPU thread
    replicas get one intra-op thread each unless ``OMP_NUM_THREADS`` says otherwise.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _pick_device(cfg, local_rank)
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
    return Runtime(dist.get_rank(), dist.get_world_size(), device, distributed=True)


# ---------------------------------------------------------------------------------------------------------
# Data.
# ---------------------------------------------------------------------------------------------------------


def load_data(cfg: DataConfig) -> tuple[TensorDataset, TensorDataset]:
    """The digits as (N, 1, 8, 8) float32 images and int64 labels: a seeded stratified train/test split.

    Pixels (0..16) are standardized with the mean and std of the training images only.
    """
    # Imported here: scikit-learn (and SciPy) take seconds to import, which a bad config should not wait for.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.from_numpy(digits.images).float().unsqueeze(1)
    labels = torch.from_numpy(digits.target).long()
    train_idx, test_idx = train_test_split(
        torch.arange(len(labels)).numpy(),
        test_size=cfg.test_fraction,
        stratify=digits.target,
        random_state=cfg.split_seed,
    )
    train_idx, test_idx = torch.from_numpy(train_idx), torch.from_numpy(test_idx)
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    return TensorDataset(images[train_idx], labels[train_idx]), TensorDataset(images[test_idx], labels[test_idx])


def build_loaders(cfg: Config, runtime: Runtime, replicas: int) -> tuple[DataLoader, DataLoader, DistributedSampler]:
    """The training loader (this rank's shard), the test loader (the full test set) and the sampler.

    A :class:`DistributedSampler` (one replica when there is one process) gives every rank a disjoint
    shard of equal size (``drop_last=True`` drops the few samples that do not divide evenly instead of
    repeating some), so every rank runs the same number of steps, which synchronized BatchNorm requires.
    The order is a function of ``(seed, epoch)`` alone (call ``sampler.set_epoch`` before each epoch), so
    a resumed run sees the same batches; the union of the W ranks' k-th batches is the one-process run's
    k-th batch at W times the batch size. Training batches are ``batch_size * replicas`` (split across
    DataParallel replicas) and incomplete ones are dropped, so no BatchNorm ever sees a tiny last batch.
    """
    train_set, test_set = load_data(cfg.data)
    sampler = DistributedSampler(
        train_set, runtime.world_size, runtime.rank, shuffle=True, seed=cfg.seed, drop_last=True
    )
    train_loader = DataLoader(
        train_set,
        batch_size=cfg.data.batch_size * replicas,
        sampler=sampler,
        # The loader draws a (here unused) worker base seed per epoch from its generator; a private one
        # keeps that draw out of the global generator, which then serves dropout alone.
        generator=torch.Generator().manual_seed(cfg.seed),
        drop_last=True,
    )
    test_loader = DataLoader(test_set, batch_size=cfg.data.eval_batch_size, shuffle=False)
    return train_loader, test_loader, sampler


# ---------------------------------------------------------------------------------------------------------
# Model.
# ---------------------------------------------------------------------------------------------------------


def _conv_bn(in_channels: int, out_channels: int, bn_momentum: float) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),  # BatchNorm's shift makes a bias redundant
        nn.BatchNorm2d(out_channels, momentum=bn_momentum),
        nn.ReLU(inplace=True),
    )


class DigitsNet(nn.Module):
    """A CNN for 1x8x8 digits: conv-BN-ReLU x2, pool, conv-BN-ReLU, pool, then Linear-BatchNorm1d-ReLU-Linear
    (Linear-ReLU-Linear with ``cfg.head_bn`` false).

    Shape:
        - Input: (N, 1, 8, 8)
        - Output: (N, num_classes) logits
    """

    def __init__(self, cfg: ModelConfig, num_classes: int = 10) -> None:
        super().__init__()
        w, m = cfg.width, cfg.bn_momentum
        self.features = nn.Sequential(
            _conv_bn(1, w, m),
            _conv_bn(w, w, m),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            _conv_bn(w, 2 * w, m),
            nn.MaxPool2d(2),  # 4x4 -> 2x2
        )
        head_bn = [nn.BatchNorm1d(4 * w, momentum=m)] if cfg.head_bn else []
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * w * 4, 4 * w, bias=not cfg.head_bn),
            *head_bn,
            nn.ReLU(inplace=True),
            nn.Dropout(cfg.dropout),
            nn.Linear(4 * w, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def build_model(cfg: Config, runtime: Runtime) -> tuple[nn.Module, nn.Module, int]:
    """The model to train, the bare model (for eval and checkpoints), and the number of replicas per step.

    DDP (world_size > 1): BatchNorm layers are converted, then wrapped in DistributedDataParallel.
    DataParallel: converted, then wrapped in DataParallelWithCallback over every CUDA device, or over
    ``cpu_replicas`` CPU thread replicas. One process without torchrun keeps plain BatchNorm.
    """
    net = DigitsNet(cfg.model)
    if cfg.parallel == "dataparallel":
        net = syncbn_dist.convert_model(net).to(runtime.device)
        if runtime.device.type == "cuda":
            device_ids = list(range(torch.cuda.device_count()))
            return syncbn_dist.DataParallelWithCallback(net, device_ids=device_ids), net, len(device_ids)
        return syncbn_dist.DataParallelWithCallback(net, cpu_replicas=cfg.cpu_replicas), net, cfg.cpu_replicas
    net = net.to(runtime.device)
    if runtime.world_size == 1:
        return net, net, 1
    if cfg.model.sync_bn:
        net = syncbn_dist.convert_model(net)
    # No buffer sync in forward: DDP would otherwise copy rank 0's running statistics to every rank at each
    # step and hide any divergence; synchronized BatchNorm keeps them equal, and check_same_on_all_ranks
    # verifies that at the end. (torch >= 2.13 spells it forward_sync_buffers, older ones broadcast_buffers.)
    no_buffer_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        else {"broadcast_buffers": False}
    )
    device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
    return DistributedDataParallel(net, device_ids=device_ids, **no_buffer_sync), net, 1


def bn_transports(module: nn.Module) -> list[str]:
    """The ``last_transport`` of every synchronized BatchNorm layer (empty for plain BatchNorm)."""
    return sorted({m.last_transport or "unused" for m in module.modules() if isinstance(m, SyncBatchNorm)})


# ---------------------------------------------------------------------------------------------------------
# Train and evaluate.
# ---------------------------------------------------------------------------------------------------------


def _sum_over_ranks(values: list[float], runtime: Runtime) -> list[float]:
    totals = torch.tensor(values, dtype=torch.float64, device=runtime.device)
    if runtime.world_size > 1:
        dist.all_reduce(totals)
    return totals.tolist()


class StopRequest:
    """Turns SIGTERM and SIGINT into a request to stop at the next step boundary that every rank agrees on.

    Use it as a context manager around training: it installs the handlers (main thread only) and restores
    the previous ones on exit. A handler only records the signal; :meth:`agreed` all-reduces it (MAX over
    ranks, one int64) so that every rank stops at the same step, whichever ranks got the signal and when:
    a rank that left alone would leave the others waiting in the next collective. Repeated signals
    change nothing (a second Ctrl-C does not abort the checkpoint; torchrun SIGKILLs workers 30 s after
    forwarding a signal anyway).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _record(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum

    def agreed(self, runtime: Runtime) -> int:
        """The signal number some rank received (0 if none): the same value on every rank (a collective)."""
        if runtime.world_size == 1:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int64, device=runtime.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


@dataclass
class EpochProgress:
    """This rank's position in the epoch in progress and its running sums (what a mid-epoch resume needs)."""

    step: int = 0  # completed steps of this epoch
    loss_sum: float = 0.0
    correct: int = 0
    count: int = 0


def train_steps(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    runtime: Runtime,
    progress: EpochProgress,
    stop: StopRequest | None = None,
    desc: str = "",
    progress_bar: bool = False,
) -> int:
    """Run the epoch's steps from ``progress.step`` on, updating ``progress`` after each.

    Before every step (the first included) all ranks agree whether to stop; the batches already done are
    skipped (the sampler's order is fixed for the epoch), so the sums continue exactly where they stopped.

    Returns:
        0 when the epoch is complete, else the number of the signal that stopped it.
    """
    model.train()
    loss_fn = nn.CrossEntropyLoss()
    batches = itertools.islice(loader, progress.step, None)
    show = progress_bar and runtime.is_main
    bar = tqdm(batches, desc=desc, total=len(loader), initial=progress.step, leave=False, disable=not show)
    for images, labels in bar:
        signum = stop.agreed(runtime) if stop is not None else 0
        if signum:
            bar.close()
            return signum
        images, labels = images.to(runtime.device), labels.to(runtime.device)
        logits = model(images)
        loss = loss_fn(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        progress.loss_sum += loss.item() * len(labels)
        progress.correct += (logits.argmax(1) == labels).sum().item()
        progress.count += len(labels)
        progress.step += 1
        bar.set_postfix(loss=f"{loss.item():.4f}")
    return 0


def epoch_means(progress: EpochProgress, runtime: Runtime) -> tuple[float, float]:
    """The epoch's mean loss and accuracy over all ranks' samples (a collective)."""
    loss_sum, correct, count = _sum_over_ranks([progress.loss_sum, progress.correct, progress.count], runtime)
    return loss_sum / count, correct / count


def train_one_epoch(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    runtime: Runtime,
    desc: str,
    progress_bar: bool,
) -> tuple[float, float]:
    """One pass over this rank's shard; returns the mean loss and accuracy over all ranks' samples."""
    progress = EpochProgress()
    train_steps(model, loader, optimizer, runtime, progress, None, desc, progress_bar)
    return epoch_means(progress, runtime)


@torch.no_grad()
def evaluate(net: nn.Module, loader: DataLoader, device: torch.device) -> float:
    """Accuracy of the bare model in eval mode on the whole test set.

    Every rank evaluates the full (small) test set itself: eval-mode BatchNorm uses the running
    statistics and never communicates, the ranks hold identical models so they agree, and no rank
    idles in a collective waiting for rank 0 to finish evaluating.
    """
    net.eval()
    correct, count = 0, 0
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        correct += (net(images).argmax(1) == labels).sum().item()
        count += len(labels)
    assert all(t == "local" for t in bn_transports(net)), "eval-mode BatchNorm must not communicate"
    return correct / count


def _sha256(flat: Tensor) -> str:
    return hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()


def check_same_on_all_ranks(net: nn.Module) -> list[str]:
    """All-gather every parameter and buffer (running statistics included) and compare them across ranks.

    Returns:
        Every rank's state digest, in rank order: the SHA-256 of its state_dict as one float64 vector
        (one digest without a process group). Equal digests mean bit-identical states.

    Raises:
        RuntimeError: on every rank, naming the tensors that differ from rank 0's, if any do.
    """
    state = net.state_dict()
    # float64 holds float32 values and step counts exactly, so the comparison below is bit-for-bit.
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in state.values()])
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [_sha256(flat)]
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    sizes = [t.numel() for t in state.values()]
    differing = []
    for rank, other in enumerate(gathered[1:], start=1):
        for name, mine, theirs in zip(state, gathered[0].split(sizes), other.split(sizes)):
            if not torch.equal(mine, theirs):
                gap = (mine - theirs).abs().max().item()
                differing.append(f"{name} (rank {rank}, max abs difference {gap:.3g})")
    if differing:
        raise RuntimeError(
            f"model state differs across ranks; {len(differing)} tensor(s) differ from rank 0's: "
            + ", ".join(differing[:8])
            + (" ..." if len(differing) > 8 else "")
        )
    return [_sha256(other) for other in gathered]


# ---------------------------------------------------------------------------------------------------------
# Outputs.
# ---------------------------------------------------------------------------------------------------------


def _atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """Write ``path`` through ``write(binary_file)`` so that it is either the old file or the complete new one.

    A temp file in the same directory is written, flushed and fsynced, then renamed over ``path``
    (``os.replace`` is atomic on POSIX and Windows within one file system), then the directory is fsynced
    so the rename itself survives a crash.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o644)  # mkstemp makes the file private; outputs are ordinary files
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if hasattr(os, "O_DIRECTORY"):
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def write_json(path: Path, payload: Any) -> None:
    _atomic_write(path, lambda f: f.write((json.dumps(payload, indent=2) + "\n").encode()))


def write_config(path: Path, cfg: Config) -> None:
    text = "# The resolved config of this run (defaults + config file + --set overrides).\n"
    text += yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
    _atomic_write(path, lambda f: f.write(text.encode()))


def save_checkpoint(
    path: Path,
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    epoch: int,
    cfg: Config,
    resume_state: dict[str, Any] | None = None,
) -> None:
    """Save the bare model's state_dict (loadable into plain or synchronized BatchNorm), the optimizer and
    scheduler state, the number of completed epochs, the config and ``resume_state`` (see
    :func:`resume_state`). Every value is a tensor or a plain container: it loads with ``weights_only=True``."""
    payload = {
        "format": CHECKPOINT_FORMAT,
        "model": net.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "epoch": epoch,
        "config": dataclasses.asdict(cfg),
        **(resume_state or {}),
    }
    _atomic_write(path, lambda f: torch.save(payload, f))


# ---------------------------------------------------------------------------------------------------------
# Resume.
# ---------------------------------------------------------------------------------------------------------

CHECKPOINT_FORMAT = 1
CHECKPOINT_NAME = "checkpoint.pt"
# Keys that may differ between a checkpoint's config and the run that resumes it: where outputs go, how
# progress is shown, how long a collective may wait, how far to train, the eval batch (eval-mode BatchNorm
# uses the running statistics, so it does not change results). Any other difference changes what a
# training step computes (model, data, batch, optimizer, seed, parallel mode, device), and is refused.
RESUME_MAY_CHANGE = ("output_dir", "progress_bar", "timeout_s", "resume", "train.epochs", "data.eval_batch_size")
_RESUME_KEYS = ("step", "sampler_epoch", "world_size", "replicas_per_process", "rng", "epoch_sums", "metrics")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed: unreadable, not this job's, or written under an incompatible config."""


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


def check_resumable(checkpoint: dict[str, Any], cfg: Config, world_size: int, path: str | Path) -> None:
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
    missing = [key for key in ("format", "model", "optimizer", "scheduler", "epoch", "config") if key not in checkpoint]
    if checkpoint.get("format") != CHECKPOINT_FORMAT or missing:
        raise CheckpointError(
            f"checkpoint {path} is not a resumable checkpoint of launch/train.py (format "
            f"{checkpoint.get('format')!r}, expected {CHECKPOINT_FORMAT}; missing keys: {', '.join(missing) or 'none'})"
        )
    missing = [key for key in _RESUME_KEYS if key not in checkpoint]
    if missing:
        raise CheckpointError(f"checkpoint {path} has no resume state (missing keys: {', '.join(missing)})")
    saved = _flatten(dataclasses.asdict(Config()))
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


def find_resume_checkpoint(cfg: Config, world_size: int) -> dict[str, Any] | None:
    """With ``cfg.resume``, the checkpoint in ``cfg.output_dir``, loaded and checked; else, or if there is none, None.

    Raises:
        CheckpointError: see :func:`load_checkpoint` and :func:`check_resumable`.
    """
    path = Path(cfg.output_dir) / CHECKPOINT_NAME
    if not cfg.resume or not path.is_file():
        return None
    checkpoint = load_checkpoint(path)
    check_resumable(checkpoint, cfg, world_size, path)
    return checkpoint


def _restore(
    checkpoint: dict[str, Any],
    cfg: Config,
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    runtime: Runtime,
    replicas: int,
) -> EpochProgress:
    """Load the checkpoint into the model, optimizer, scheduler and this rank's generators; its epoch progress."""
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
    scheduler.load_state_dict(checkpoint["scheduler"])
    if scheduler.T_max != cfg.train.epochs:
        # train.epochs changed: continue on the cosine of the new length, as if it had been planned from the
        # start (CosineAnnealingLR's recursive update only scales the current lr, which would stay 0 after
        # extending a finished run).
        scheduler.T_max = cfg.train.epochs
        cosine = math.cos(math.pi * scheduler.last_epoch / scheduler.T_max)
        for group, base_lr in zip(optimizer.param_groups, scheduler.base_lrs):
            group["lr"] = scheduler.eta_min + (base_lr - scheduler.eta_min) * (1 + cosine) / 2
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    # clone(): a row of the stacked states is a view at a storage offset, which set_rng_state misreads
    # (torch 2.13: "Invalid mt19937 state", or a crash).
    torch.set_rng_state(checkpoint["rng"]["torch"][rank].clone())
    devices = _rng_devices(runtime, replicas)
    if devices:
        for device, state in zip(devices, checkpoint["rng"]["cuda"][rank]):
            torch.cuda.set_rng_state(state.clone(), device)
    loss_sum, correct, count = checkpoint["epoch_sums"][rank].tolist()
    return EpochProgress(checkpoint["step"], loss_sum, int(correct), int(count))


def _check_same_position(values: list[int], runtime: Runtime, output_dir: str) -> None:
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


# ---------------------------------------------------------------------------------------------------------
# The job.
# ---------------------------------------------------------------------------------------------------------


def run(cfg: Config, runtime: Runtime, checkpoint: dict[str, Any] | None = None) -> int:
    """Train, evaluate and checkpoint every epoch, check the ranks agree, and (rank 0) write the outputs.

    With ``cfg.resume``, continue from ``checkpoint`` (or the one in ``output_dir``). On SIGTERM/SIGINT,
    stop at the next step all ranks agree on, checkpoint it, and return 0.
    """
    out = Path(cfg.output_dir)
    with StopRequest() as stop:
        if checkpoint is None and cfg.resume:
            checkpoint = find_resume_checkpoint(cfg, runtime.world_size)
        return _run(cfg, runtime, checkpoint, stop, out)


def _run(cfg: Config, runtime: Runtime, checkpoint: dict[str, Any] | None, stop: StopRequest, out: Path) -> int:
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model, net, replicas = build_model(cfg, runtime)
    torch.manual_seed(cfg.seed + runtime.rank)  # then different dropout masks per rank
    train_loader, test_loader, sampler = build_loaders(cfg, runtime, replicas)
    optimizer = torch.optim.SGD(
        net.parameters(),
        lr=cfg.train.lr,
        momentum=cfg.train.momentum,
        nesterov=cfg.train.momentum > 0,
        weight_decay=cfg.train.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.train.epochs)
    metrics: dict[str, Any] = {
        "parallel": cfg.parallel,
        "world_size": runtime.world_size,
        "replicas_per_process": replicas,
        "batch_size_per_bn": cfg.data.batch_size,
        "global_batch_size": cfg.data.batch_size * replicas * runtime.world_size,
        "steps_per_epoch": len(train_loader),
        "epochs": [],
    }
    progress, completed, elapsed = EpochProgress(), 0, {"total": 0.0, "epoch": 0.0}
    if checkpoint is not None:
        progress = _restore(checkpoint, cfg, net, optimizer, scheduler, runtime, replicas)
        completed, metrics, elapsed = checkpoint["epoch"], checkpoint["metrics"], checkpoint["elapsed_s"]
        metrics.pop("stopped_at", None)
        metrics.setdefault("resumed_from", []).append({"epoch": completed, "step": progress.step})
    _check_same_position([checkpoint is not None, completed, progress.step], runtime, cfg.output_dir)
    if runtime.is_main:
        write_config(out / "config.yaml", cfg)
        if cfg.resume and checkpoint is None:
            log.warning("resume: no %s in %s, starting afresh", CHECKPOINT_NAME, out)
        elif checkpoint is None and (out / CHECKPOINT_NAME).is_file():
            log.warning("overwriting the checkpoint in %s (pass --resume to continue it instead)", out)
        if checkpoint is not None:
            log.info("resuming after epoch %d + %d steps from %s", completed, progress.step, out / CHECKPOINT_NAME)
        log.info(
            "parallel=%s world_size=%d replicas=%d device=%s batch/BatchNorm=%d global batch=%d steps/epoch=%d",
            cfg.parallel,
            runtime.world_size,
            replicas,
            runtime.device,
            cfg.data.batch_size,
            cfg.data.batch_size * replicas * runtime.world_size,
            len(train_loader),
        )

    def checkpoint_now(epoch_in_progress: int, epoch_start: float) -> None:
        now = time.perf_counter()
        spent = {"total": elapsed["total"] + now - session_start, "epoch": elapsed["epoch"] + now - epoch_start}
        state = resume_state(net, progress, epoch_in_progress, runtime, replicas, metrics, spent)
        if runtime.is_main:
            save_checkpoint(out / CHECKPOINT_NAME, net, optimizer, scheduler, epoch_in_progress - 1, cfg, state)

    session_start = time.perf_counter()  # training time: total_time_s excludes start-up, as epoch_time_s does
    for epoch in range(completed + 1, cfg.train.epochs + 1):
        epoch_start = time.perf_counter()
        sampler.set_epoch(epoch)
        lr = optimizer.param_groups[0]["lr"]
        desc = f"epoch {epoch}/{cfg.train.epochs}"
        signum = train_steps(model, train_loader, optimizer, runtime, progress, stop, desc, cfg.progress_bar)
        if signum:
            checkpoint_now(epoch, epoch_start)
            name = signal.Signals(signum).name
            metrics["stopped_at"] = {"epoch": epoch - 1, "step": progress.step, "signal": name}
            if runtime.is_main:
                write_json(out / "metrics.json", metrics)
            # Every rank says it stopped cleanly (non-main ranks log warnings only).
            log.warning(
                "%s: stopped after epoch %d + %d/%d steps; %s (continue with --resume)",
                name,
                epoch - 1,
                progress.step,
                len(train_loader),
                f"wrote {out / CHECKPOINT_NAME}" if runtime.is_main else "rank 0 wrote the checkpoint",
            )
            return 0
        loss, train_acc = epoch_means(progress, runtime)
        metrics["bn_transport"] = bn_transports(net)  # how BatchNorm synchronized during training
        scheduler.step()
        if not cfg.model.sync_bn:
            # Plain BatchNorm leaves every rank with its own running statistics; average them before
            # evaluating, as timm's distribute_bn does (one packed collective; a no-op on one process).
            syncbn_dist.sync_running_stats(net)
        test_acc = evaluate(net, test_loader, runtime.device)
        epoch_time = elapsed["epoch"] + time.perf_counter() - epoch_start
        row = {
            "epoch": epoch,
            "lr": lr,
            "loss": loss,
            "train_acc": train_acc,
            "test_acc": test_acc,
            "epoch_time_s": epoch_time,
        }
        metrics["epochs"].append(row)
        metrics["state_sha256"] = check_same_on_all_ranks(net)  # never checkpoint ranks that diverged
        progress, elapsed["epoch"] = EpochProgress(), 0.0
        checkpoint_now(epoch + 1, time.perf_counter())
        if runtime.is_main:
            log.info("%s loss %.4f train_acc %.4f test_acc %.4f (%.1f s)", desc, loss, train_acc, test_acc, epoch_time)
            write_json(out / "metrics.json", metrics)
    metrics["state_sha256"] = check_same_on_all_ranks(net)
    metrics["final_test_acc"] = metrics["epochs"][-1]["test_acc"]
    metrics["total_time_s"] = elapsed["total"] + time.perf_counter() - session_start
    if runtime.is_main:
        write_json(out / "metrics.json", metrics)
        log.info("done: test_acc %.4f in %.1f s; wrote %s", metrics["final_test_acc"], metrics["total_time_s"], out)
    return 0


def main(cfg: Config | None = None) -> int:
    """Run the job with ``cfg``, or with the config from the command line when it is None.

    Returns 2 (after printing the reason) for a bad config or a checkpoint that cannot be resumed, without
    starting a process group; 0 when training completes or stops on SIGTERM/SIGINT after checkpointing.
    """
    try:
        if cfg is None:
            cfg = parse_args()
        check_launch(cfg)
        checkpoint = find_resume_checkpoint(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as error:
        print(f"{Path(sys.argv[0]).name}: error: {error}", file=sys.stderr)
        return 2
    runtime = init_distributed(cfg)
    logging.basicConfig(
        level=logging.INFO if runtime.is_main else logging.WARNING,
        format=f"%(asctime)s [rank {runtime.rank}] %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        return run(cfg, runtime, checkpoint)
    finally:
        if runtime.distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    # record: under torchrun, an uncaught exception (with its traceback) goes into torchrun's failure report.
    sys.exit(record(main)())
