"""Why synchronized BatchNorm matters: plain vs synchronized BatchNorm on digits as the per-rank batch shrinks.

Commands (from the repository root)::

    make compare      # = .venv/bin/python launch/compare.py --config configs/compare.yaml
    .venv/bin/python launch/compare.py --config configs/compare.yaml --set epochs=1 --set "seeds=[0]" \
        --set output_dir=outputs/compare_quick --set report_dir=outputs/compare_quick
    .venv/bin/python launch/compare.py --config configs/compare.yaml --report-only   # redraw from output_dir

For every per-rank batch ``b`` of ``batch_sizes`` and every seed of ``seeds`` it trains train.py's digits model
three ways, with the same global batch ``nproc * b``, learning rate, schedule and epochs:

1. ``plain_bn``: ``nproc`` ranks x ``b`` images, plain per-rank BatchNorm (running statistics averaged before
   each evaluation);
2. ``sync_bn``: the same with syncbn_dist's synchronized BatchNorm (statistics of the global batch);
3. ``single_bn``: one process, plain BatchNorm on ``nproc * b`` images (the reference).

Each run is train.py's own job: ``train.run`` on the config that ``launch/train.py --config <train_config>
--set ...`` would build (the command is recorded per run in compare.json). The ``nproc``-rank runs share one
torchrun launch of this script (``--ranks-worker``: one process group, one start-up instead of one per run),
which then checks the equivalence claim, *SyncBN on W ranks x b equals BatchNorm in one process at W*b*, step
by step: ``equivalence_steps`` SGD steps where rank 0 also trains the plain single-process model on the union
of the W ranks' batches, comparing the loss, every parameter and every running statistic after each step. The
one-process runs then run in this process. Rank 0 (and this process) show one progress bar per phase: the run
in progress (per-rank batch, kind, seed) and the time left.

It writes ``compare.png`` (final test accuracy and training loss against the per-rank batch, with the spread over
seeds; the step-by-step equivalence), ``compare.md`` (a summary) and ``compare.json`` (every number of every
run) to ``report_dir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import torch
import torch.distributed as dist
import yaml
from torch import Tensor, nn
from torch.utils.data import DistributedSampler
from tqdm import tqdm

log = logging.getLogger("compare")

MODES = ("plain_bn", "sync_bn", "single_bn")
LABELS = {
    "plain_bn": "plain BatchNorm, {w} ranks",
    "sync_bn": "syncbn_dist, {w} ranks",
    "single_bn": "BatchNorm, 1 process, same global batch",
}


def _load_train() -> ModuleType:
    """launch/train.py as a module (launch/ is not a package; the library never imports from it)."""
    name = "syncbn_launch_train"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name("train.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and get_type_hints look the module up by name
        spec.loader.exec_module(module)
    return sys.modules[name]


train = _load_train()


# ---------------------------------------------------------------------------------------------------------
# Config: typed defaults; the file and --set only override (validated by train.py's checker).
# ---------------------------------------------------------------------------------------------------------


def _positive(default: Any) -> Any:
    return field(default=default, metadata={"rule": ("> 0", lambda v: v > 0)})


def _int_list(default: list[int], text: str, minimum: int | None) -> Any:
    def check(values: list[Any]) -> bool:
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
        return bool(values) and ints and len(set(values)) == len(values) and (minimum is None or min(values) >= minimum)

    return field(default_factory=lambda: list(default), metadata={"rule": (text, check)})


@dataclass
class CompareConfig:
    """The comparison. Training settings other than these come from ``train_config``."""

    output_dir: str = "outputs/compare"  # each run's config.yaml, metrics.json, checkpoint.pt and log.txt
    report_dir: str = "docs"  # compare.png, compare.md and compare.json (the README shows the figure)
    train_config: str = "configs/digits.yaml"
    nproc: int = _positive(4)  # ranks of the plain and synchronized runs
    # Images per rank; the one-process reference uses nproc * b.
    batch_sizes: list = _int_list([1, 2, 4, 8, 16], "a non-empty list of distinct ints >= 1", 1)
    # Seeds per point; seeds[0] also seeds the step-by-step equivalence check.
    seeds: list = _int_list([0, 1, 2], "a non-empty list of distinct ints", None)
    epochs: int = _positive(3)
    # The learning rate at global batch G: lr * (G / lr_batch) ** 0.5 (sqrt), lr * G / lr_batch (linear), or lr.
    lr: float = _positive(0.1)
    lr_batch: int = _positive(64)
    lr_scaling: Literal["sqrt", "linear", "constant"] = "sqrt"
    # true: train.py's Linear-BatchNorm1d head at every point with 2 or more images per rank; at 1 image per rank
    # the head has no BatchNorm1d in all three runs (plain BatchNorm1d cannot train on one value per channel).
    # false: no BatchNorm1d at any point.
    head_bn: bool = True
    # 0 so that the runs can be equal: train.py draws dropout masks from seed + rank, which no split of the
    # batch over ranks reproduces in one process.
    dropout: float = field(default=0.0, metadata={"rule": ("in [0, 1)", lambda v: 0 <= v < 1)})
    device: Literal["cpu", "auto", "cuda"] = "cpu"  # cpu: any machine can start nproc processes
    # More train.py --set overrides for every run (e.g. data.test_fraction=0.9 for a quick check); the keys this
    # script sets per run are refused.
    train_overrides: list = field(
        default_factory=list,
        metadata={"rule": ("a list of KEY=VALUE strings", lambda v: all(isinstance(s, str) and "=" in s for s in v))},
    )
    equivalence_batch_size: int = _positive(4)  # per rank, in the step-by-step check
    equivalence_steps: int = _positive(89)  # SGD steps of the step-by-step check (89 = one epoch at 4 x 4)
    timeout_s: float = _positive(3600.0)  # per subprocess (the ranks' phase, or the whole sweep in one)


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


def load_config(path: str | Path | None, overrides: tuple[str, ...] | list[str] = ()) -> CompareConfig:
    """The validated config: defaults, then the YAML file at ``path`` (if any), then ``overrides``.

    Raises:
        train.ConfigError: if the file is missing or not a mapping, a key is unknown, a value has the wrong type
            or is out of range, or ``train_overrides`` sets a key this script sets per run; the message names the
            key.
    """
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise train.ConfigError(f"config file not found: {path}")
        try:
            values = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise train.ConfigError(f"config file {path} is not valid YAML: {error}") from None
    for override in overrides:
        train._apply_override(values, override)
    cfg = train._build(CompareConfig, values)
    for override in cfg.train_overrides:
        key = override.partition("=")[0]
        if key in _OWN_KEYS:
            raise train.ConfigError(
                f"config key 'train_overrides': {key!r} is set per run by compare.py (use its own keys: "
                "batch_sizes, seeds, epochs, lr, head_bn, dropout, device)"
            )
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
    """Where train.py writes the run ``mode`` (one of :data:`MODES`) at ``batch_size`` images per rank."""
    return Path(cfg.output_dir) / f"b{batch_size}" / mode / f"seed{seed}"


def run_nproc(cfg: CompareConfig, mode: str) -> int:
    return 1 if mode == "single_bn" else cfg.nproc


def run_overrides(
    cfg: CompareConfig, mode: str, batch_size: int, seed: int, output_dir: Path | None = None
) -> list[str]:
    """train.py's ``--set`` overrides for ``mode`` at ``batch_size`` images per rank: the three modes differ only
    in BatchNorm's sync and in the split of the same global batch over processes."""
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


def train_command(cfg: CompareConfig, mode: str, batch_size: int, seed: int) -> str:
    """The launch/train.py command line that trains the run on its own (what this script runs in-process)."""
    launcher = "python" if mode == "single_bn" else f"torchrun --standalone --nproc_per_node={cfg.nproc}"
    sets = " ".join(f"--set {o}" for o in run_overrides(cfg, mode, batch_size, seed))
    return f"{launcher} launch/train.py --config {cfg.train_config} {sets}"


def sweep(cfg: CompareConfig, modes: tuple[str, ...] = MODES) -> list[tuple[str, int, int]]:
    """Every run as ``(mode, batch_size, seed)``, seed by seed (a stopped sweep has whole seeds to show)."""
    return [(mode, b, seed) for seed in cfg.seeds for b in cfg.batch_sizes for mode in modes]


def _steps(cfg: CompareConfig, mode: str, batch_size: int, num_train: int) -> int:
    """train.py's SGD steps of the run: DistributedSampler(drop_last) shards, incomplete batches dropped."""
    return (num_train // run_nproc(cfg, mode)) // (cfg.nproc * batch_size if mode == "single_bn" else batch_size)


# ---------------------------------------------------------------------------------------------------------
# Do the runs see the same global batches? Checked on train.py's own loaders.
# ---------------------------------------------------------------------------------------------------------


def _batch_rows(images: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """The batch as a multiset: its distinct (label, pixels) rows, sorted, and their counts."""
    rows = torch.cat([labels.unsqueeze(1).to(images.dtype), images.flatten(1)], dim=1)
    return torch.unique(rows, dim=0, return_counts=True)


def same_global_batches(ranks_cfg: Any, single_cfg: Any, world_size: int, epochs: int = 2) -> bool:
    """Whether train.py gives one process with ``single_cfg``, at every step of the first ``epochs`` epochs,
    the same samples as the union of the batches of ``world_size`` ranks with ``ranks_cfg`` (train.py
    ``Config``s); the order inside a batch does not matter.

    Runs train.py's ``build_loaders`` for each rank and for one process, as train.py's epoch loop does
    (``sampler.set_epoch(epoch)`` from epoch 1). No process group is needed.
    """
    cpu = torch.device("cpu")
    ranks = [train.build_loaders(ranks_cfg, train.Runtime(r, world_size, cpu, False), 1) for r in range(world_size)]
    single_loader, _, single_sampler = train.build_loaders(single_cfg, train.Runtime(0, 1, cpu, False), 1)
    for epoch in range(1, epochs + 1):
        for _, _, sampler in ranks:
            if sampler is not None:
                sampler.set_epoch(epoch)
        if single_sampler is not None:
            single_sampler.set_epoch(epoch)
        rank_batches = [list(loader) for loader, _, _ in ranks]
        single_batches = list(single_loader)
        if any(len(b) != len(single_batches) for b in rank_batches):
            return False
        for step, (images, labels) in enumerate(single_batches):
            union_images = torch.cat([batches[step][0] for batches in rank_batches])
            union_labels = torch.cat([batches[step][1] for batches in rank_batches])
            (rows, counts), (union_rows, union_counts) = (
                _batch_rows(images, labels),
                _batch_rows(union_images, union_labels),
            )
            if rows.shape != union_rows.shape or not (
                torch.equal(rows, union_rows) and torch.equal(counts, union_counts)
            ):
                return False
    return True


# ---------------------------------------------------------------------------------------------------------
# The step-by-step equivalence check (runs under torchrun, or under tests/launcher.py).
# ---------------------------------------------------------------------------------------------------------


def global_batches(num_samples: int, world_size: int, batch_size: int, steps: int, seed: int) -> list[list[Tensor]]:
    """Per step, every rank's indices, drawn exactly as train.py's DistributedSampler draws them.

    Returns:
        ``steps`` lists of ``world_size`` int64 index tensors of ``batch_size`` each: rank r's batch at
        that step. DistributedSampler gives rank r the positions r, r + W, r + 2W, ... of a permutation, so
        the union at step k is the contiguous chunk ``perm[k*W*b : (k+1)*W*b]``: what a one-replica
        DistributedSampler (a per-epoch seeded shuffle) gives one process at batch W*b.
    """
    out: list[list[Tensor]] = []
    epoch = 0
    while len(out) < steps:
        epoch += 1
        per_rank = []
        for rank in range(world_size):
            sampler = DistributedSampler(range(num_samples), world_size, rank, shuffle=True, seed=seed, drop_last=True)
            sampler.set_epoch(epoch)
            per_rank.append(torch.tensor(list(sampler)).split(batch_size))
        full = len(per_rank[0]) - (len(per_rank[0][-1]) < batch_size)  # the loader drops an incomplete batch
        out.extend([per_rank[r][k] for r in range(world_size)] for k in range(full))
    return out[:steps]


def _flat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def _max_abs(a: Tensor, b: Tensor) -> float:
    return (a - b).abs().max().item()


_STATS = ("running_mean", "running_var")


def state_differences(a: dict[str, Tensor], b: dict[str, Tensor]) -> dict[str, float]:
    """Max absolute difference of the parameters and of the running statistics of two state_dicts of one model
    (plain and synchronized BatchNorm have the same keys); ``num_batches_tracked`` is compared for equality."""
    stats = [k for k in a if k.endswith(_STATS)]
    params = [k for k in a if not k.endswith((*_STATS, "num_batches_tracked"))]
    tracked = [k for k in a if k.endswith("num_batches_tracked")]
    return {
        "params": _max_abs(_flat([a[k] for k in params]), _flat([b[k] for k in params])),
        "running_stats": _max_abs(_flat([a[k] for k in stats]), _flat([b[k] for k in stats])),
        "num_batches_tracked_equal": all(torch.equal(a[k], b[k]) for k in tracked),
    }


def _optimizer(net: nn.Module, cfg: Any) -> torch.optim.Optimizer:
    """train.py's optimizer, at a constant learning rate (its cosine schedule steps once per epoch)."""
    t = cfg.train
    return torch.optim.SGD(
        net.parameters(), lr=t.lr, momentum=t.momentum, nesterov=t.momentum > 0, weight_decay=t.weight_decay
    )


def _sgd_step(model: nn.Module, optimizer: torch.optim.Optimizer, images: Tensor, labels: Tensor) -> Tensor:
    loss = nn.functional.cross_entropy(model(images), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def _accuracy(logits: Tensor, labels: Tensor) -> float:
    return (logits.argmax(1) == labels).double().mean().item()


def equivalence_steps(
    cfg: Any,
    runtime: Any,
    train_set: tuple[Tensor, Tensor],
    test_set: tuple[Tensor, Tensor],
    steps: int,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any] | None:
    """Train train.py's DDP model on this rank's shard and, on rank 0, the single-process model on the union.

    Every rank builds ``train.build_model(cfg, runtime)`` (synchronized BatchNorm when ``cfg.model.sync_bn``,
    plain per-rank BatchNorm otherwise, in DistributedDataParallel) and trains it on its ``cfg.data.batch_size``
    images per step. Rank 0 also builds the one-process model (plain ``nn.BatchNorm``, same seed and optimizer)
    and trains it on the concatenation of all ranks' batches, comparing the two after every step. As a yardstick
    for rounding it trains a second one-process model on the same batches with the images in reverse order:
    mathematically the same step, in floating point a different order of summation.

    Args:
        cfg: a train.py ``Config`` (``parallel: ddp``); dropout should be 0 (see :class:`CompareConfig`).
        runtime: this process's train.py ``Runtime`` inside an initialized process group.
        train_set, test_set: (images (N, 1, 8, 8) float32, labels (N,) int64), the same on every rank.
        steps: SGD steps; batches are drawn as train.py's DistributedSampler draws them.
        dtype: of the models and the images (train.py trains in float32; float64 shows what is rounding).

    Returns:
        On rank 0, per step: the global mean loss of the ranks' and the one-process model (``loss_ranks``,
        ``loss_single``); the max absolute difference of the loss, the parameters and the running statistics
        between them (``loss``, ``params``, ``running_stats``) and between the two one-process models
        (``control_*``); whether ``num_batches_tracked`` agrees. At the end: both models' test accuracy and the
        max absolute difference of their test logits. None on the other ranks.
    """
    device, world_size, rank = runtime.device, runtime.world_size, runtime.rank
    images, labels = train_set[0].to(device, dtype), train_set[1].to(device)
    batches = global_batches(len(labels), world_size, cfg.data.batch_size, steps, cfg.seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build the models in dtype: DDP must wrap parameters of their final dtype
    try:
        torch.manual_seed(cfg.seed)
        model, net, _ = train.build_model(cfg, runtime)
        singles = []
        if rank == 0:
            for _ in range(2):  # the one-process model and its reversed-order twin
                torch.manual_seed(cfg.seed)
                singles.append(train.build_model(cfg, train.Runtime(0, 1, device, False))[0])
    finally:
        torch.set_default_dtype(default_dtype)
    optimizer = _optimizer(net, cfg)
    single_opts = [_optimizer(single, cfg) for single in singles]
    keys = ("loss_ranks", "loss_single", "loss", "params", "running_stats", "num_batches_tracked_equal")
    keys += ("control_loss", "control_params", "control_running_stats")
    record: dict[str, list[Any]] = {k: [] for k in keys}
    for m in (model, *singles):
        m.train()
    for batch in batches:
        mine = batch[rank]
        loss = _sgd_step(model, optimizer, images[mine], labels[mine])
        total = torch.tensor([loss.item() * len(mine), len(mine)], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        if rank != 0:
            continue
        everything = torch.cat(batch)
        single_loss, control_loss = (
            _sgd_step(m, opt, images[order], labels[order]).item()
            for m, opt, order in zip(singles, single_opts, (everything, everything.flip(0)))
        )
        loss_ranks = (total[0] / total[1]).item()
        diffs = state_differences(net.state_dict(), singles[0].state_dict())
        control = state_differences(singles[1].state_dict(), singles[0].state_dict())
        for key, value in (
            ("loss_ranks", loss_ranks),
            ("loss_single", single_loss),
            ("loss", abs(loss_ranks - single_loss)),
            ("params", diffs["params"]),
            ("running_stats", diffs["running_stats"]),
            ("num_batches_tracked_equal", diffs["num_batches_tracked_equal"]),
            ("control_loss", abs(control_loss - single_loss)),
            ("control_params", control["params"]),
            ("control_running_stats", control["running_stats"]),
        ):
            record[key].append(value)
    if rank != 0:
        return None
    test_images, test_labels = test_set[0].to(device, dtype), test_set[1].to(device)
    net.eval()
    singles[0].eval()
    with torch.no_grad():
        logits, single_logits = net(test_images), singles[0](test_images)
    return {
        "world_size": world_size,
        "batch_size": cfg.data.batch_size,
        "steps": steps,
        "sync_bn": cfg.model.sync_bn,
        "dtype": str(dtype).replace("torch.", ""),
        **record,
        "test_acc_ranks": _accuracy(logits, test_labels),
        "test_acc_single": _accuracy(single_logits, test_labels),
        "test_logits": _max_abs(logits.double(), single_logits.double()),
    }


DTYPES = (torch.float32, torch.float64)


def _equivalence(cfg: CompareConfig, runtime: Any) -> None:
    """The step-by-step check on this process group; rank 0 writes ``output_dir/equivalence/equivalence.json``
    (one entry per dtype of :data:`DTYPES`)."""
    out = Path(cfg.output_dir) / "equivalence"
    overrides = run_overrides(cfg, "sync_bn", cfg.equivalence_batch_size, cfg.seeds[0], out)
    train_cfg = train.load_config(cfg.train_config, overrides)
    train_set, test_set = train.load_data(train_cfg.data)
    results = {}
    for dtype in DTYPES:
        log.info("equivalence in %s, %d steps", dtype, cfg.equivalence_steps)
        args = (train_cfg, runtime, train_set.tensors, test_set.tensors, cfg.equivalence_steps, dtype)
        results[str(dtype).replace("torch.", "")] = equivalence_steps(*args)
    if runtime.rank == 0:
        train.write_json(out / "equivalence.json", results)


# ---------------------------------------------------------------------------------------------------------
# The runs: train.py's job, in-process, one after the other.
# ---------------------------------------------------------------------------------------------------------


class _RunLog:
    """train.py's log of one run goes to the run's log.txt (rank 0; other ranks keep warnings on stderr)."""

    def __init__(self, path: Path, is_main: bool) -> None:
        self.logger, self.handler = logging.getLogger("train"), None
        if is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.handler = logging.FileHandler(path, mode="w")
            self.handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))

    def __enter__(self) -> None:
        self.logger.propagate = self.handler is None
        self.logger.setLevel(logging.INFO if self.handler else logging.WARNING)
        if self.handler:
            self.logger.addHandler(self.handler)

    def __exit__(self, *exc_info: Any) -> None:
        if self.handler:
            self.logger.removeHandler(self.handler)
            self.handler.close()


def train_runs(cfg: CompareConfig, runtime: Any, runs: list[tuple[str, int, int]], desc: str) -> dict[str, float]:
    """Run train.py's job (``train.run``) for every ``(mode, batch_size, seed)`` of ``runs``, with the config that
    train.py's command line builds from :func:`run_overrides`; show progress on rank 0.

    Returns:
        Each run's wall time in seconds (set-up and evaluation included), keyed ``b{b}/{mode}/seed{seed}``.

    Raises:
        KeyboardInterrupt: on every rank, when a run stopped on SIGINT/SIGTERM (train.py checkpoints and returns).
    """
    num_train = len(train.load_data(train.load_config(cfg.train_config, run_overrides(cfg, *runs[0])).data)[0])
    total = sum(cfg.epochs * _steps(cfg, mode, b, num_train) for mode, b, _ in runs)
    bar = tqdm(total=total, desc=desc, unit="step", disable=runtime.rank != 0, dynamic_ncols=True)
    times = {}
    for mode, b, seed in runs:
        bar.set_postfix_str(f"{b}/rank {mode} seed {seed}")
        run_cfg = train.load_config(cfg.train_config, run_overrides(cfg, mode, b, seed))
        start = time.perf_counter()
        with _RunLog(Path(run_cfg.output_dir) / "log.txt", runtime.rank == 0):
            train.run(run_cfg, runtime)
        times[f"b{b}/{mode}/seed{seed}"] = time.perf_counter() - start
        metrics = json.loads((Path(run_cfg.output_dir) / "metrics.json").read_text()) if runtime.rank == 0 else {}
        stopped = torch.tensor(["stopped_at" in metrics], dtype=torch.int64, device=runtime.device)  # nccl: on GPU
        if runtime.world_size > 1:
            dist.all_reduce(stopped, op=dist.ReduceOp.MAX)  # every rank stops the sweep together
        if stopped.item():
            bar.close()
            raise KeyboardInterrupt(f"{run_cfg.output_dir}: stopped by a signal (train.py checkpointed it)")
        bar.update(cfg.epochs * _steps(cfg, mode, b, num_train))
    bar.close()
    return times


def _ranks_worker(cfg: CompareConfig) -> int:
    """The torchrun entry: every ``nproc``-rank run of the sweep, then the step-by-step check. Rank 0 writes
    ``output_dir/times_ranks.json``."""
    runs = sweep(cfg, ("plain_bn", "sync_bn"))
    runtime = train.init_distributed(train.load_config(cfg.train_config, run_overrides(cfg, *runs[0])))
    if runtime.rank != 0:
        log.setLevel(logging.WARNING)  # rank 0 tells the story
    try:
        times = train_runs(cfg, runtime, runs, f"{cfg.nproc} ranks")
        start = time.perf_counter()
        _equivalence(cfg, runtime)
        times["equivalence"] = time.perf_counter() - start
        if runtime.rank == 0:
            train.write_json(Path(cfg.output_dir) / "times_ranks.json", times)
    except KeyboardInterrupt as stop:
        log.warning("%s", stop)
        return 130
    finally:
        dist.destroy_process_group()
    return 0


def _torchrun(nproc: int, script_args: list[str], log_path: Path, timeout_s: float) -> float:
    """Run ``python -m torch.distributed.run --standalone --nproc_per_node=nproc ...``; its wall time in s.

    The workers' stderr (rank 0's progress bar) comes through; torchrun's and the workers' stdout go to
    ``log_path``.

    Raises:
        RuntimeError: if it exits with a non-zero status (pointing at the log).
    """
    env = dict(os.environ, OMP_NUM_THREADS="1")  # one intra-op thread per process: the processes share the cores
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command += script_args
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_path, "w") as log_file:
        log_file.write("$ " + " ".join(command) + "\n")
        log_file.flush()
        code = subprocess.run(command, stdout=log_file, env=env, timeout=timeout_s).returncode
    elapsed = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"{' '.join(command[3:])} exited with status {code} (see above and {log_path})")
    return elapsed


def run_all(cfg: CompareConfig, config_args: list[str]) -> dict[str, float]:
    """The sweep and the step-by-step check; wall times in seconds: per run, per phase (start-up included)."""
    out = Path(cfg.output_dir)
    log.info(
        "%d-rank runs (%d) and the step-by-step check, in one torchrun launch ...",
        cfg.nproc,
        len(sweep(cfg, ("plain_bn", "sync_bn"))),
    )
    args = [str(Path(__file__).resolve()), *config_args, "--ranks-worker"]
    phase_ranks = _torchrun(cfg.nproc, args, out / "ranks_log.txt", cfg.timeout_s)
    times = json.loads((out / "times_ranks.json").read_text())
    times["phase_ranks"] = phase_ranks
    log.info("one-process runs (%d) ...", len(sweep(cfg, ("single_bn",))))
    start = time.perf_counter()
    device = train._pick_device(train.load_config(cfg.train_config, [f"device={cfg.device}"]), 0)
    times.update(train_runs(cfg, train.Runtime(0, 1, device, False), sweep(cfg, ("single_bn",)), "1 process"))
    times["phase_single"] = time.perf_counter() - start
    return times


# ---------------------------------------------------------------------------------------------------------
# The numbers, the figure and the summary.
# ---------------------------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (n - 1; 0 for one value), min and max of ``values``."""
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def _run_record(cfg: CompareConfig, mode: str, b: int, seed: int, times: dict[str, float]) -> dict[str, Any]:
    path = run_dir(cfg, mode, b, seed) / "metrics.json"
    m = json.loads(path.read_text())
    if len(m["epochs"]) != cfg.epochs or "stopped_at" in m:
        raise RuntimeError(f"{path}: {len(m['epochs'])} complete epochs (expected {cfg.epochs})")
    return {
        "seed": seed,
        "world_size": m["world_size"],
        "batch_size_per_bn": m["batch_size_per_bn"],
        "global_batch_size": m["global_batch_size"],
        "steps_per_epoch": m["steps_per_epoch"],
        "bn_transport": m.get("bn_transport"),
        "lr": m["epochs"][0]["lr"],
        "epochs": [{k: row[k] for k in ("epoch", "lr", "loss", "train_acc", "test_acc")} for row in m["epochs"]],
        "final_test_acc": m["epochs"][-1]["test_acc"],
        "best_test_acc": max(row["test_acc"] for row in m["epochs"]),
        "final_loss": m["epochs"][-1]["loss"],
        "train_time_s": m.get("total_time_s"),
        "wall_time_s": times.get(f"b{b}/{mode}/seed{seed}"),
        "command": train_command(cfg, mode, b, seed),
    }


def collect(cfg: CompareConfig, same_batches: dict[int, bool], times: dict[str, float]) -> dict[str, Any]:
    """The raw numbers of the comparison from the runs' outputs under ``output_dir``: every run's per-epoch
    metrics, per point the mean and spread over seeds, and the step-by-step check."""
    points = []
    for b in cfg.batch_sizes:
        runs = {mode: [_run_record(cfg, mode, b, seed, times) for seed in cfg.seeds] for mode in MODES}
        sync, single = runs["sync_bn"], runs["single_bn"]
        points.append(
            {
                "batch_size": b,
                "global_batch_size": cfg.nproc * b,
                "lr": learning_rate(cfg, cfg.nproc * b),
                "head_bn": head_bn(cfg, b),
                "same_global_batches": same_batches[b],
                "runs": runs,
                "final_test_acc": {mode: spread([r["final_test_acc"] for r in rs]) for mode, rs in runs.items()},
                "final_loss": {mode: spread([r["final_loss"] for r in rs]) for mode, rs in runs.items()},
                # syncbn_dist against the one-process reference, seed by seed (the same computation when train.py
                # gives them the same global batches, up to float32 rounding amplified by training).
                "sync_vs_single": {
                    "final_test_acc": max(abs(a["final_test_acc"] - c["final_test_acc"]) for a, c in zip(sync, single)),
                    "final_loss": max(abs(a["final_loss"] - c["final_loss"]) for a, c in zip(sync, single)),
                },
            }
        )
    _, test_set = train.load_data(train.load_config(cfg.train_config, run_overrides(cfg, *sweep(cfg)[0])).data)
    return {
        "config": dataclasses.asdict(cfg),
        "lr_rule": lr_rule(cfg),
        "test_images": len(test_set),
        "points": points,
        "equivalence": json.loads((Path(cfg.output_dir) / "equivalence" / "equivalence.json").read_text()),
        "wall_time_s": times,
    }


def lr_rule(cfg: CompareConfig | dict[str, Any]) -> str:
    """The learning-rate rule in words."""
    c = cfg if isinstance(cfg, dict) else dataclasses.asdict(cfg)
    lr, batch = c["lr"], c["lr_batch"]
    return {
        "sqrt": f"lr = {lr:g} x sqrt(global batch / {batch}) (square-root scaling)",
        "linear": f"lr = {lr:g} x global batch / {batch} (linear scaling)",
        "constant": f"lr = {lr:g} at every global batch",
    }[c["lr_scaling"]]


STYLES = {
    "plain_bn": {"color": "tab:red", "marker": "o"},
    "sync_bn": {"color": "tab:blue", "marker": "s"},
    "single_bn": {"color": "black", "linestyle": "--", "marker": "x"},
}


def _plot_sweep(ax: Any, result: dict[str, Any], key: str, scale: float, names: dict[str, str]) -> None:
    """Mean over seeds (line), min-max over seeds (error bar) and every seed (faint dots) against the batch."""
    points = result["points"]
    xs = [p["batch_size"] for p in points]
    for i, mode in enumerate(MODES):
        shift = 2 ** (0.04 * (i - 1))  # side by side on the log axis, so that the bars do not hide each other
        x = [v * shift for v in xs]
        stats = [p[key][mode] for p in points]
        mean = [scale * s["mean"] for s in stats]
        below = [scale * (s["mean"] - s["min"]) for s in stats]
        above = [scale * (s["max"] - s["mean"]) for s in stats]
        ax.errorbar(x, mean, yerr=[below, above], capsize=3, label=names[mode], **STYLES[mode])
        for xi, p in zip(x, points):
            seeds = [scale * r[key] for r in p["runs"][mode]]
            ax.scatter([xi] * len(seeds), seeds, color=STYLES[mode]["color"], alpha=0.3, s=12)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [point_label(result["config"], p) for p in points])
    ax.grid(alpha=0.3)
    ax.legend()


def _plot_equivalence(eq_ax: Any, diff_ax: Any, result: dict[str, Any]) -> None:
    """The step-by-step check: the two loss curves, and the differences after each step."""
    f32, f64 = result["equivalence"]["float32"], result["equivalence"]["float64"]
    w, b = f32["world_size"], f32["batch_size"]
    steps = range(1, len(f32["loss_ranks"]) + 1)
    eq_ax.plot(steps, f32["loss_ranks"], color="tab:blue", linewidth=4, alpha=0.45, label=f"syncbn_dist, {w} x {b}")
    eq_ax.plot(steps, f32["loss_single"], color="black", linestyle="--", linewidth=1, label=f"BatchNorm, 1 x {w * b}")
    eq_ax.set(
        title=f"equivalence: loss per SGD step, same global batches (float32)\n"
        f"max |difference| {max(f32['loss']):.1g} (float32), {max(f64['loss']):.1g} (float64)",
        xlabel="step",
        ylabel="training loss of the global batch",
    )
    eq_ax.legend()
    eq_ax.grid(alpha=0.3)

    def positive(values: list[float]) -> list[float]:
        return [v if v > 0 else math.nan for v in values]  # exactly equal: no point on a log axis

    lines = (
        (f32, "", "tab:blue", f"syncbn_dist {w}x{b} vs BatchNorm 1x{w * b}, float32"),
        (f32, "control_", "tab:gray", f"BatchNorm 1x{w * b} vs itself with the batch reversed, float32"),
        (f64, "", "tab:green", f"syncbn_dist {w}x{b} vs BatchNorm 1x{w * b}, float64"),
    )
    for eq, prefix, color, label in lines:
        params, stats = eq[f"{prefix}params"], eq[f"{prefix}running_stats"]
        label += f" (max {max(params):.1g} / {max(stats):.1g})"
        diff_ax.plot(steps, positive(params), color=color, label=label)
        diff_ax.plot(steps, positive(stats), color=color, linestyle=":")
    diff_ax.set_yscale("log")
    diff_ax.set_ylim(top=1e6)  # room for the legend above the curves
    diff_ax.set(
        title="max absolute difference after each step\n(solid: parameters, dotted: running statistics)",
        xlabel="step",
        ylabel="max |difference|",
    )
    diff_ax.legend(fontsize="x-small", loc="upper left")
    diff_ax.grid(alpha=0.3)


def plot(result: dict[str, Any], path: Path) -> None:
    """compare.png: final test accuracy and training loss against the per-rank batch (mean, min-max and every
    seed), above the step-by-step equivalence."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    w, n = cfg["nproc"], len(cfg["seeds"])
    names = {mode: LABELS[mode].format(w=w) for mode in MODES}
    star = "; *: no BatchNorm1d head" if any(cfg["head_bn"] and not p["head_bn"] for p in result["points"]) else ""
    fig, ((acc_ax, loss_ax), (eq_ax, diff_ax)) = plt.subplots(2, 2, figsize=(13, 9.5))
    _plot_sweep(acc_ax, result, "final_test_acc", 100.0, names)
    acc_ax.set(
        title=f"final test accuracy: mean, bars min-max over {n} seeds",
        xlabel=f"images per rank (global batch {w} x that{star})",
        ylabel="test accuracy (%)",
    )
    _plot_sweep(loss_ax, result, "final_loss", 1.0, names)
    loss_ax.set_yscale("log")
    loss_ax.set(
        title=f"final training loss (last epoch): mean, bars min-max over {n} seeds",
        xlabel=f"images per rank (global batch {w} x that{star})",
        ylabel="cross-entropy",
    )
    _plot_equivalence(eq_ax, diff_ax, result)
    fig.suptitle(
        f"digits, {cfg['epochs']} epochs, {result['lr_rule']}: BatchNorm statistics over each rank's images "
        f"vs the global batch"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def point_label(cfg: dict[str, Any], point: dict[str, Any]) -> str:
    """The per-rank batch, starred where the head lacks the BatchNorm1d that the other points have."""
    return f"{point['batch_size']}{'*' if cfg['head_bn'] and not point['head_bn'] else ''}"


def mean_pm(s: dict[str, float], percent: bool) -> str:
    """``mean ± std`` of a :func:`spread`, in percent or to 4 decimals."""
    if percent:
        return f"{100 * s['mean']:.1f} ± {100 * s['std']:.1f} %"
    return f"{s['mean']:.4f} ± {s['std']:.4f}"


def summary(result: dict[str, Any], figure: str) -> str:
    """compare.md: the figure, the sweep's means and spreads, and the step-by-step check, as markdown."""
    cfg, points = result["config"], result["points"]
    f32, f64 = result["equivalence"]["float32"], result["equivalence"]["float64"]
    w, seeds = cfg["nproc"], cfg["seeds"]
    times = result["wall_time_s"]
    total = times.get("total")
    took = f"took {total / 60:.1f} min" if total is not None else "(wall time not recorded)"
    if cfg["head_bn"]:
        head = (
            "train.py's (three conv-BatchNorm2d blocks and a Linear-BatchNorm1d head) at 2 images per rank and "
            "more; at 1 image per rank (marked *) its head has no BatchNorm1d (`model.head_bn=false`) in all three "
            "runs, because plain BatchNorm1d cannot train on the one value per channel it would see: that point "
            "compares the conv layers' BatchNorm2d alone"
        )
    else:
        head = (
            "train.py's with a head without BatchNorm1d (`model.head_bn=false`) at every point; the three conv "
            "layers keep BatchNorm2d"
        )
    lines = [
        "# Plain vs synchronized BatchNorm as the per-rank batch shrinks",
        "",
        f"Digits (`{cfg['train_config']}`) on {w} ranks with {', '.join(map(str, cfg['batch_sizes']))} images per "
        f"rank; at each point plain per-rank BatchNorm, syncbn_dist, and BatchNorm in one process at the same "
        f"global batch, seeds {', '.join(map(str, seeds))}. Every run: {cfg['epochs']} epochs, dropout "
        f"{cfg['dropout']}, SGD with Nesterov momentum and a cosine schedule from train.py, learning rate "
        f"{result['lr_rule']}, the same at every point for the three. The model is {head}. "
        f"`make compare` (`python launch/compare.py --config configs/compare.yaml`) {took} (wall time, every "
        f"process's start-up included; {_cpu_count()} CPU cores, {w} processes).",
        "",
        f"![compare]({figure})",
        "",
        f"Final test accuracy, mean ± standard deviation over the {len(seeds)} seeds (min–max in the figure, every "
        f"run in compare.json):",
        "",
        "| images per rank | plain BatchNorm | syncbn_dist | one process, same global batch |",
        "|---|---|---|---|",
    ]
    for p in points:
        acc = p["final_test_acc"]
        lines.append(f"| {point_label(cfg, p)} | " + " | ".join(mean_pm(acc[m], True) for m in MODES) + " |")
    lines += [
        "",
        "Final training loss (mean over the last epoch), and the run settings:",
        "",
        "| images per rank | global batch | learning rate | steps per epoch | plain BatchNorm | syncbn_dist "
        "| one process |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in points:
        loss = p["final_loss"]
        steps = p["runs"]["sync_bn"][0]["steps_per_epoch"]
        lines.append(
            f"| {point_label(cfg, p)} | {p['global_batch_size']} | {p['lr']:.4g} | {steps} | "
            + " | ".join(mean_pm(loss[m], False) for m in MODES)
            + " |"
        )
    worst = max(points, key=lambda p: p["sync_vs_single"]["final_test_acc"])
    same = all(p["same_global_batches"] for p in points)
    lines += [
        "",
        "**syncbn_dist against one process.** "
        + (
            f"train.py gives the one process the same global batches as the {w} ranks at every point, so the two "
            "runs are the same computation up to float32 rounding, which training amplifies (see the step-by-step "
            "check below): "
            if same
            else f"train.py does not give the one process the same global batches as the {w} ranks at every point "
            "(same_global_batches in compare.json), so the two agree only statistically: "
        )
        + f"the largest final test accuracy difference of a seed is "
        f"{100 * worst['sync_vs_single']['final_test_acc']:.2f} points (at {point_label(cfg, worst)} images per rank).",
    ]

    def maxima(eq: dict[str, Any], prefix: str = "") -> str:
        return ", ".join(
            f"{name} {max(eq[prefix + key]):.1g}"
            for key, name in (("loss", "loss"), ("params", "parameters"), ("running_stats", "running statistics"))
        )

    lines += [
        "",
        f"**Equivalence, step by step.** {f32['steps']} SGD steps of train.py's model (the sweep's) and optimizer "
        f"(constant learning rate {result['equivalence_lr']:.4g}) on the same global batches (train.py's "
        f"`DistributedSampler` shards): syncbn_dist on {f32['world_size']} gloo processes x {f32['batch_size']} "
        f"images against plain `nn.BatchNorm` in one process on all {f32['world_size'] * f32['batch_size']}. Max "
        "absolute difference over the steps:",
        "",
        f"- float64: {maxima(f64)}; test logits after the last step {f64['test_logits']:.1g}.",
        f"- float32 (as trained): {maxima(f32)}; test logits {f32['test_logits']:.1g}, test accuracy "
        f"{_pct(f32['test_acc_ranks'])} vs {_pct(f32['test_acc_single'])}.",
        f"- float32 yardstick, the one-process model against itself with each batch in reverse order (the same "
        f"step in exact arithmetic): {maxima(f32, 'control_')}.",
        f"- `num_batches_tracked` equal after every step: "
        f"{'yes' if all(f32['num_batches_tracked_equal'] + f64['num_batches_tracked_equal']) else 'NO'}.",
        "",
        _float32_story(f32, f64),
        "",
    ]
    return "\n".join(lines)


def first_jump(values: list[float], factor: float = 10.0) -> int | None:
    """The first step (1-based) after which ``values`` grew more than ``factor``-fold in one step, or None."""
    for step in range(1, len(values)):
        if values[step] > factor * max(values[step - 1], 1e-300):
            return step + 1
    return None


def _float32_story(f32: dict[str, Any], f64: dict[str, Any]) -> str:
    """What the float32 differences do, from the numbers: rounding level throughout, or a jump and where."""
    steps = len(f32["params"])
    text = f"In float64 the two agree to rounding over all {steps} steps (parameters {max(f64['params']):.1g}). "
    jump, control = first_jump(f32["params"]), first_jump(f32["control_params"])
    if jump is None:
        return text + f"In float32 they stay at rounding level too (parameters {max(f32['params']):.1g})."
    before, after = f32["params"][jump - 2], f32["params"][jump - 1]
    text += (
        f"In float32 they agree to rounding until step {jump}, where the parameters' difference jumps from "
        f"{before:.1g} to {after:.1g} in one step, most likely a rounding-level difference tipping a discrete "
        "choice (a ReLU or a max-pool) the other way; training carries the difference on from there. "
    )
    if control is None:
        return text + (
            f"The yardstick has no such jump within these {steps} steps (parameters "
            f"{max(f32['control_params']):.1g}); where such a branch falls is a matter of luck."
        )
    return text + (
        f"The yardstick, in which only the order of summation changes, jumps the same way at step {control} "
        f"({f32['control_params'][control - 2]:.1g} to {f32['control_params'][control - 1]:.1g})."
    )


def report(cfg: CompareConfig, same_batches: dict[int, bool], times: dict[str, float]) -> dict[str, Any]:
    """Write compare.json, compare.png and compare.md to ``report_dir``; return the numbers."""
    result = collect(cfg, same_batches, times)
    result["equivalence_lr"] = learning_rate(cfg, cfg.nproc * cfg.equivalence_batch_size)
    out = Path(cfg.report_dir)
    train.write_json(out / "compare.json", result)
    plot(result, out / "compare.png")
    text = summary(result, "compare.png")
    train._atomic_write(out / "compare.md", lambda f: f.write(text.encode()))
    return result


# ---------------------------------------------------------------------------------------------------------
# The job.
# ---------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run the comparison (or, with ``--ranks-worker`` under torchrun, one rank of its ``nproc``-rank phase).

    Returns 2 (after printing the reason) for a bad config, before anything runs; 130 when a signal stopped it.
    """
    parser = argparse.ArgumentParser(description="Plain vs synchronized BatchNorm on digits (see the docstring).")
    parser.add_argument("--config", type=Path, default=None, help="YAML config; omitted keys keep their defaults")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from output_dir's runs")
    parser.add_argument("--ranks-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        for run in sweep(cfg):  # every run's config is valid before anything starts
            train.check_launch(train.load_config(cfg.train_config, run_overrides(cfg, *run)), env={})
    except train.ConfigError as error:
        print(f"{Path(sys.argv[0]).name}: error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.ranks_worker:
        return _ranks_worker(cfg)
    config_args = [] if args.config is None else ["--config", str(args.config)]
    config_args += [a for override in args.overrides for a in ("--set", override)]
    start = time.perf_counter()
    same_batches = {
        b: same_global_batches(
            *(train.load_config(cfg.train_config, run_overrides(cfg, m, b, cfg.seeds[0])) for m in MODES[1:]),
            cfg.nproc,
            epochs=1,
        )
        for b in cfg.batch_sizes
    }
    if args.report_only:
        times = json.loads((Path(cfg.output_dir) / "times.json").read_text())
    else:
        train.write_config(Path(cfg.output_dir) / "config.yaml", cfg)
        try:
            times = run_all(cfg, config_args)
        except KeyboardInterrupt as stop:
            log.warning("stopped: %s", stop)
            return 130
        times["total"] = time.perf_counter() - start
        train.write_json(Path(cfg.output_dir) / "times.json", times)
    result = report(cfg, same_batches, times)
    log.info(
        "final test accuracy (mean over seeds), plain / syncbn_dist / one process: %s; wrote %s",
        "; ".join(
            f"{p['batch_size']}/rank " + " / ".join(f"{100 * p['final_test_acc'][m]['mean']:.1f} %" for m in MODES)
            for p in result["points"]
        ),
        cfg.report_dir,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
