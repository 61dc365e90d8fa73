"""The comparison's config (a typed default for every key) and the digits runs it sweeps.

A run is ``(mode, batch_size, seed)`` with ``mode`` one of :data:`MODES`. :func:`run_overrides` gives the run's
``KEY=VALUE`` overrides of the digits job's config (``train_config``), :func:`digits_config` the validated
config they build, and :func:`train_command` the command line that trains the run on its own.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from launch.common.config import (
    ConfigError,
    argument_parser,
    distinct_ints,
    load_config,
    one_of,
    positive,
    ruled,
)
from launch.common.readme import check_readme_key
from launch.digits.config import DigitsConfig, check_launch, load_digits_config

MODES = ("plain_bn", "sync_bn", "single_bn")
RANKS_MODES = ("plain_bn", "sync_bn")  # the runs on nproc ranks, in one torchrun launch (launch.compare.ranks)
SINGLE_MODES = ("single_bn",)  # the one-process runs


# The README section the report rewrites when ``readme`` is set (launch.common.readme).
README_SECTION = "compare table"


@dataclass
class CompareConfig:
    """The comparison. Training settings other than these come from ``train_config``."""

    output_dir: str = "outputs/compare"  # each run's config.yaml, metrics.json, checkpoint.pt and log.txt
    report_dir: str = "docs"  # compare.png, compare.md and compare.json (the README shows the figure)
    # A markdown file whose "compare table" section the report rewrites (README.md for make compare), or null.
    readme: Optional[str] = None
    train_config: str = "configs/digits.yaml"
    nproc: int = positive(4)  # ranks of the plain and synchronized runs
    batch_sizes: list[int] = distinct_ints([1, 2, 4, 8, 16], 1)  # images per rank; the reference uses nproc * b
    seeds: list[int] = distinct_ints([0, 1, 2])  # per point; seeds[0] also seeds the step-by-step check
    epochs: int = positive(3)
    # The learning rate at global batch G: lr * (G / lr_batch) ** 0.5 (sqrt), lr * G / lr_batch (linear), or lr.
    lr: float = positive(0.1)
    lr_batch: int = positive(64)
    lr_scaling: str = one_of("sqrt", "sqrt", "linear", "constant")
    # true: the digits model's Linear-BatchNorm1d head at every point with 2 or more images per rank; at 1 image
    # per rank the head has no BatchNorm1d in all three runs (plain BatchNorm1d cannot train on one value per
    # channel). false: no BatchNorm1d at any point.
    head_bn: bool = True
    # 0 so that the runs can be equal: the digits job draws dropout masks from seed + rank, which no split of the
    # batch over ranks reproduces in one process.
    dropout: float = ruled(0.0, "in [0, 1)", lambda v: 0 <= v < 1)
    device: str = one_of("cpu", "cpu", "auto", "cuda")  # cpu: any machine can start nproc processes
    # More KEY=VALUE overrides of the digits config for every run (e.g. data.test_fraction=0.9 for a quick
    # check); the keys this comparison sets per run are refused.
    train_overrides: list[str] = ruled([], "a list of KEY=VALUE strings", lambda v: all("=" in s for s in v))
    equivalence_batch_size: int = positive(4)  # per rank, in the step-by-step check
    equivalence_steps: int = positive(89)  # SGD steps of the step-by-step check (89 = one epoch at 4 x 4)
    timeout_s: float = positive(3600.0)  # per subprocess (the ranks' phase)
    report_only: bool = False  # true: rebuild the report from output_dir's runs, train nothing


# What run_overrides sets; train_overrides may not.
_OWN_KEYS = (
    "output_dir",
    "seed",
    "device",
    "progress_bar",
    "resume",
    "data.batch_size",
    "model.dropout",
    "model.sync_bn",
    "model.head_bn",
    "train.epochs",
    "train.lr",
)


def load_compare_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> CompareConfig:
    """The validated config: defaults, then the YAML file at ``path`` (if any), then ``KEY=VALUE`` ``overrides``.

    Raises:
        ConfigError: if the file is missing or not a mapping, a key is unknown, a value has the wrong type or is
            out of range, or ``train_overrides`` sets a key the comparison sets per run; the message names the
            key.
    """
    cfg = load_config(CompareConfig, path, overrides)
    for override in cfg.train_overrides:
        key = override.partition("=")[0]
        if key in _OWN_KEYS:
            raise ConfigError(
                f"config key 'train_overrides': {key!r} is set per run by launch.compare (use its own keys: "
                "batch_sizes, seeds, epochs, lr, head_bn, dropout, device)"
            )
    return cfg


def check_runs(cfg: CompareConfig) -> None:
    """Check every run's digits config, and that it can start where the comparison starts it.

    Raises:
        ConfigError: naming the key, for a run whose digits config is invalid (``train_config``, or a key of
            ``train_overrides``) or cannot launch on ``run_nproc`` processes (see
            :func:`launch.digits.config.check_launch`).
    """
    for mode, batch_size, seed in sweep(cfg):
        nproc = run_nproc(cfg, mode)
        env = {"WORLD_SIZE": str(nproc), "LOCAL_RANK": str(nproc - 1)}  # its last rank, as torchrun sets it
        check_launch(digits_config(cfg, mode, batch_size, seed), env)


def parse_compare_config(argv: Sequence[str] | None, description: str) -> CompareConfig:
    """The config from a command line ``[--config PATH] [KEY=VALUE ...]``, every run of it checked.

    Raises:
        ConfigError: see :func:`load_compare_config` and :func:`check_runs`; or ``readme`` names a file without
            the README section this recipe writes.
    """
    args = argument_parser(description).parse_args(argv)
    cfg = load_compare_config(args.config, args.overrides)
    check_runs(cfg)
    check_readme_key(cfg.readme, README_SECTION)
    return cfg


def learning_rate(cfg: CompareConfig, global_batch: int) -> float:
    """The learning rate at ``global_batch`` images per step, by ``cfg.lr_scaling`` from ``cfg.lr`` at
    ``cfg.lr_batch`` (square-root scaling: Krizhevsky 2014, arXiv:1404.5997; linear: Goyal et al. 2017,
    arXiv:1706.02677)."""
    ratio = global_batch / cfg.lr_batch
    return cfg.lr * {"sqrt": math.sqrt(ratio), "linear": ratio, "constant": 1.0}[cfg.lr_scaling]


def head_bn(cfg: CompareConfig, batch_size: int) -> bool:
    """Whether the head has BatchNorm1d at ``batch_size`` images per rank (the same in the three runs of a point):
    ``cfg.head_bn``, except at 1 image per rank, where plain BatchNorm1d would see one value per channel."""
    return cfg.head_bn and batch_size > 1


def run_dir(cfg: CompareConfig, mode: str, batch_size: int, seed: int) -> Path:
    """Where the digits job writes the run ``mode`` (one of :data:`MODES`) at ``batch_size`` images per rank."""
    return Path(cfg.output_dir) / f"b{batch_size}" / mode / f"seed{seed}"


def run_nproc(cfg: CompareConfig, mode: str) -> int:
    """The processes of a run of ``mode``: ``nproc``, or 1 for the one-process reference."""
    return 1 if mode == "single_bn" else cfg.nproc


def run_overrides(
    cfg: CompareConfig, mode: str, batch_size: int, seed: int, output_dir: Path | None = None
) -> list[str]:
    """The digits job's ``KEY=VALUE`` overrides for ``mode`` at ``batch_size`` images per rank: the three modes
    differ only in BatchNorm's sync and in the split of the same global batch over processes."""
    global_batch = cfg.nproc * batch_size
    output_dir = run_dir(cfg, mode, batch_size, seed) if output_dir is None else output_dir
    return [
        *cfg.train_overrides,
        f"output_dir={output_dir}",
        f"seed={seed}",
        f"device={cfg.device}",
        "progress_bar=false",
        "resume=false",
        f"data.batch_size={global_batch if mode == 'single_bn' else batch_size}",
        f"model.dropout={cfg.dropout}",
        f"model.sync_bn={str(mode == 'sync_bn').lower()}",
        f"model.head_bn={str(head_bn(cfg, batch_size)).lower()}",
        f"train.epochs={cfg.epochs}",
        f"train.lr={learning_rate(cfg, global_batch)!r}",
    ]


def digits_config(
    cfg: CompareConfig, mode: str, batch_size: int, seed: int, output_dir: Path | None = None
) -> DigitsConfig:
    """The digits job's config of the run: ``train_config`` with :func:`run_overrides`.

    Raises:
        ConfigError: naming the key (see :func:`launch.digits.config.load_digits_config`).
    """
    return load_digits_config(cfg.train_config, run_overrides(cfg, mode, batch_size, seed, output_dir))


def train_command(cfg: CompareConfig, mode: str, batch_size: int, seed: int) -> str:
    """The shell command that trains the run on its own with launch.digits.train (what the comparison runs
    in-process)."""
    nproc = run_nproc(cfg, mode)
    launcher = ["python"] if nproc == 1 else ["torchrun", "--standalone", f"--nproc_per_node={nproc}"]
    args = ["-m", "launch.digits.train", "--config", cfg.train_config, *run_overrides(cfg, mode, batch_size, seed)]
    return shlex.join(launcher + args)


def sweep(cfg: CompareConfig, modes: tuple[str, ...] = MODES) -> list[tuple[str, int, int]]:
    """Every run as ``(mode, batch_size, seed)``, seed by seed (a stopped sweep has whole seeds to show)."""
    return [(mode, b, seed) for seed in cfg.seeds for b in cfg.batch_sizes for mode in modes]
