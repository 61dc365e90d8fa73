"""Why synchronized BatchNorm matters: plain vs synchronized BatchNorm on digits with tiny per-rank batches.

Commands (from the repository root)::

    make compare      # = .venv/bin/python launch/compare.py --config configs/compare.yaml
    .venv/bin/python launch/compare.py --config configs/compare.yaml --set epochs=2 \
        --set output_dir=outputs/compare_quick --set report_dir=outputs/compare_quick
    .venv/bin/python launch/compare.py --config configs/compare.yaml --report-only   # redraw from output_dir

It drives ``launch/train.py`` through its command line (``python -m torch.distributed.run ... --config
configs/digits.yaml --set ...``) three times with the same seed and settings:

1. ``plain_bn``: ``nproc`` ranks x ``batch_size`` images, plain per-rank BatchNorm (running statistics
   averaged before each evaluation);
2. ``sync_bn``: the same with syncbn_dist's synchronized BatchNorm (statistics of the global batch);
3. ``single_bn``: one process, plain BatchNorm on ``nproc * batch_size`` images.

Then it checks the equivalence claim, *SyncBN on W ranks x b equals BatchNorm in one process at W*b*, step
by step: ``equivalence_steps`` SGD steps on W gloo processes (``--equivalence-worker`` under torchrun,
train.py's DDP + synchronized model) where rank 0 also trains the plain single-process model on the union of
the W ranks' batches, comparing the loss, every parameter and every running statistic after each step.

It writes ``compare.png`` (test accuracy and loss per epoch; the overlapping equivalence curves and their
difference), ``compare.md`` (a summary) and ``compare.json`` (the raw numbers) to ``report_dir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import math
import os
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

log = logging.getLogger("compare")

RUNS = ("plain_bn", "sync_bn", "single_bn")
LABELS = {
    "plain_bn": "plain BatchNorm, {w} ranks x {b}",
    "sync_bn": "syncbn_dist, {w} ranks x {b}",
    "single_bn": "BatchNorm, 1 process x {wb}",
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


@dataclass
class CompareConfig:
    """The comparison. Training settings other than these come from ``train_config``."""

    output_dir: str = "outputs/compare"  # each run's config.yaml, metrics.json, checkpoint.pt and log.txt
    report_dir: str = "docs"  # compare.png, compare.md and compare.json (the README shows the figure)
    train_config: str = "configs/digits.yaml"
    nproc: int = _positive(4)  # ranks of the plain and synchronized runs
    batch_size: int = _positive(4)  # per rank; the single-process run uses nproc * batch_size
    epochs: int = _positive(8)
    seed: int = 0
    # 0 so that the runs can be equal: train.py draws dropout masks from seed + rank, which no split of the
    # batch over ranks reproduces in one process.
    dropout: float = field(default=0.0, metadata={"rule": ("in [0, 1)", lambda v: 0 <= v < 1)})
    device: Literal["cpu", "auto", "cuda"] = "cpu"  # cpu: any machine can start nproc processes
    equivalence_steps: int = _positive(89)  # SGD steps of the step-by-step check (89 = one epoch at 4 x 4)
    timeout_s: float = _positive(1800.0)  # per training subprocess


def load_config(path: str | Path | None, overrides: tuple[str, ...] | list[str] = ()) -> CompareConfig:
    """The validated config: defaults, then the YAML file at ``path`` (if any), then ``overrides``.

    Raises:
        train.ConfigError: if the file is missing or not a mapping, a key is unknown, or a value has the
            wrong type or is out of range; the message names the key.
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
    return train._build(CompareConfig, values)


def run_overrides(cfg: CompareConfig, run: str, output_dir: Path | None = None) -> list[str]:
    """The ``--set`` overrides of train.py for ``run`` (one of :data:`RUNS`): everything but BatchNorm's
    sync and the split of the global batch over processes is the same."""
    batch_size = cfg.batch_size * cfg.nproc if run == "single_bn" else cfg.batch_size
    output_dir = Path(cfg.output_dir) / run if output_dir is None else output_dir
    return [
        f"output_dir={output_dir}",
        f"seed={cfg.seed}",
        f"device={cfg.device}",
        "progress_bar=false",
        f"data.batch_size={batch_size}",
        f"model.dropout={cfg.dropout}",
        f"model.sync_bn={str(run == 'sync_bn').lower()}",
        f"train.epochs={cfg.epochs}",
    ]


def run_nproc(cfg: CompareConfig, run: str) -> int:
    return 1 if run == "single_bn" else cfg.nproc


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


def _equivalence_worker(cfg: CompareConfig) -> int:
    """The torchrun entry of the step-by-step check: rank 0 writes ``output_dir/equivalence/equivalence.json``
    (one entry per dtype of :data:`DTYPES`)."""
    out = Path(cfg.output_dir) / "equivalence"
    train_cfg = train.load_config(cfg.train_config, run_overrides(cfg, "sync_bn", out))
    runtime = train.init_distributed(train_cfg)
    try:
        train_set, test_set = train.load_data(train_cfg.data)
        results = {}
        for dtype in DTYPES:
            log.info("equivalence in %s, %d steps", dtype, cfg.equivalence_steps)
            args = (train_cfg, runtime, train_set.tensors, test_set.tensors, cfg.equivalence_steps, dtype)
            results[str(dtype).replace("torch.", "")] = equivalence_steps(*args)
        if runtime.rank == 0:
            train.write_json(out / "equivalence.json", results)
    finally:
        dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------------------
# The runs, as subprocesses.
# ---------------------------------------------------------------------------------------------------------


def _torchrun(nproc: int, script_args: list[str], log_path: Path, timeout_s: float) -> float:
    """Run ``python -m torch.distributed.run --standalone --nproc_per_node=nproc ...``; its wall time in s.

    Raises:
        RuntimeError: if it exits with a non-zero status (with the end of its log).
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
        code = subprocess.run(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
    elapsed = time.perf_counter() - start
    if code != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise RuntimeError(f"{' '.join(command[3:])} exited with status {code}; end of {log_path}:\n{tail}")
    return elapsed


def run_all(cfg: CompareConfig, config_args: list[str]) -> dict[str, float]:
    """Run the three trainings and the step-by-step check; their wall times in seconds (start-up included)."""
    out = Path(cfg.output_dir)
    times = {}
    for run in RUNS:
        log.info("training %s (%d process(es)) ...", run, run_nproc(cfg, run))
        args = [str(Path(__file__).resolve().with_name("train.py")), "--config", cfg.train_config]
        args += [a for override in run_overrides(cfg, run) for a in ("--set", override)]
        times[run] = _torchrun(run_nproc(cfg, run), args, out / run / "log.txt", cfg.timeout_s)
        log.info("%s done in %.1f s", run, times[run])
    log.info("step-by-step equivalence check (%d processes, %d steps) ...", cfg.nproc, cfg.equivalence_steps)
    args = [str(Path(__file__).resolve()), *config_args, "--equivalence-worker"]
    times["equivalence"] = _torchrun(cfg.nproc, args, out / "equivalence" / "log.txt", cfg.timeout_s)
    log.info("equivalence done in %.1f s", times["equivalence"])
    return times


# ---------------------------------------------------------------------------------------------------------
# The numbers, the figure and the summary.
# ---------------------------------------------------------------------------------------------------------


def collect(cfg: CompareConfig, same_batches: bool, times: dict[str, float]) -> dict[str, Any]:
    """The raw numbers of the comparison from the runs' outputs under ``output_dir``."""
    out = Path(cfg.output_dir)
    runs = {run: json.loads((out / run / "metrics.json").read_text()) for run in RUNS}
    for run, metrics in runs.items():
        if len(metrics["epochs"]) != cfg.epochs:
            raise RuntimeError(f"{out / run / 'metrics.json'}: {len(metrics['epochs'])} epochs (expected {cfg.epochs})")
    equivalence = json.loads((out / "equivalence" / "equivalence.json").read_text())
    sync, single = runs["sync_bn"]["epochs"], runs["single_bn"]["epochs"]
    epoch_level = {
        "same_global_batches": same_batches,
        "loss": max(abs(a["loss"] - b["loss"]) for a, b in zip(sync, single)),
        "train_acc": max(abs(a["train_acc"] - b["train_acc"]) for a, b in zip(sync, single)),
        "test_acc": max(abs(a["test_acc"] - b["test_acc"]) for a, b in zip(sync, single)),
        **state_differences(
            *(
                torch.load(out / run / "checkpoint.pt", weights_only=True, map_location="cpu")["model"]
                for run in ("sync_bn", "single_bn")
            )
        ),
    }
    _, test_set = train.load_data(train.load_config(cfg.train_config, run_overrides(cfg, "sync_bn")).data)
    return {
        "config": dataclasses.asdict(cfg),
        "test_images": len(test_set),
        "runs": {
            run: {
                "world_size": m["world_size"],
                "batch_size_per_bn": m["batch_size_per_bn"],
                "global_batch_size": m["global_batch_size"],
                "steps_per_epoch": m["steps_per_epoch"],
                "bn_transport": m.get("bn_transport"),
                "epochs": [
                    {k: row[k] for k in ("epoch", "lr", "loss", "train_acc", "test_acc")} for row in m["epochs"]
                ],
                "final_test_acc": m["epochs"][-1]["test_acc"],
                "best_test_acc": max(row["test_acc"] for row in m["epochs"]),
                "train_time_s": m.get("total_time_s"),
            }
            for run, m in runs.items()
        },
        "sync_vs_single": epoch_level,
        "equivalence": equivalence,
        "wall_time_s": times,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    """compare.png: test accuracy and loss per epoch of the three runs, and the step-by-step equivalence."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    w, b = cfg["nproc"], cfg["batch_size"]
    names = {run: LABELS[run].format(w=w, b=b, wb=w * b) for run in RUNS}
    styles = {
        "plain_bn": {"color": "tab:red", "marker": "o"},
        "sync_bn": {"color": "tab:blue", "marker": "s"},
        "single_bn": {"color": "black", "linestyle": "--", "marker": "x"},
    }
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (acc_ax, loss_ax), (eq_ax, diff_ax) = axes
    for run in RUNS:
        rows = result["runs"][run]["epochs"]
        epochs = [r["epoch"] for r in rows]
        acc_ax.plot(epochs, [100 * r["test_acc"] for r in rows], label=names[run], **styles[run])
        loss_ax.plot(epochs, [r["loss"] for r in rows], label=names[run], **styles[run])
    acc_ax.set(title="test accuracy per epoch", xlabel="epoch", ylabel="test accuracy (%)")
    loss_ax.set(title="training loss per epoch (mean over the epoch)", xlabel="epoch", ylabel="cross-entropy")
    loss_ax.set_yscale("log")
    for ax in (acc_ax, loss_ax):
        ax.legend()
        ax.grid(alpha=0.3)

    f32, f64 = result["equivalence"]["float32"], result["equivalence"]["float64"]
    steps = range(1, len(f32["loss_ranks"]) + 1)
    eq_ax.plot(steps, f32["loss_ranks"], color="tab:blue", linewidth=4, alpha=0.45, label=names["sync_bn"])
    eq_ax.plot(steps, f32["loss_single"], color="black", linestyle="--", linewidth=1, label=names["single_bn"])
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
    fig.suptitle(
        f"digits, seed {cfg['seed']}: BatchNorm statistics over {b} images per rank vs the global batch of {w * b}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def summary(result: dict[str, Any], figure: str) -> str:
    """compare.md: the figure, final accuracies and the maximum differences, as markdown."""
    cfg, runs, ep = result["config"], result["runs"], result["sync_vs_single"]
    f32, f64 = result["equivalence"]["float32"], result["equivalence"]["float64"]
    w, b = cfg["nproc"], cfg["batch_size"]
    names = {run: LABELS[run].format(w=w, b=b, wb=w * b) for run in RUNS}
    total = result["wall_time_s"]["total"]
    lines = [
        f"# Plain vs synchronized BatchNorm, {b} images per rank x {w} ranks",
        "",
        f"Digits (`{cfg['train_config']}`), seed {cfg['seed']}, {cfg['epochs']} epochs, dropout {cfg['dropout']}, "
        f"the same global batch ({w * b} images), learning rate and schedule in every run. "
        f"`make compare` (`python launch/compare.py --config configs/compare.yaml`) took {total / 60:.1f} min "
        f"(wall time, every process's start-up included; {_cpu_count()} CPU cores, {cfg['nproc']} processes).",
        "",
        f"![compare]({figure})",
        "",
        "| run | BatchNorm statistics over | final test accuracy | best test accuracy | final training loss |",
        "|---|---|---|---|---|",
    ]
    statistics = {
        "plain_bn": f"{b} images (each rank its own)",
        "sync_bn": f"{w * b} images ({b} per rank, synchronized)",
        "single_bn": f"{w * b} images",
    }
    for run in RUNS:
        r = runs[run]
        lines.append(
            f"| {names[run]} | {statistics[run]} | {_pct(r['final_test_acc'])} "
            f"| {_pct(r['best_test_acc'])} | {r['epochs'][-1]['loss']:.4f} |"
        )

    plain, sync = runs["plain_bn"], runs["sync_bn"]
    gap = plain["final_test_acc"] - sync["final_test_acc"]
    lines += [
        "",
        f"**Plain vs synchronized.** With statistics over {b} images per rank the training loss ends "
        f"{plain['epochs'][-1]['loss'] / sync['epochs'][-1]['loss']:.1f}x higher than with syncbn_dist "
        f"({plain['epochs'][-1]['loss']:.4f} vs {sync['epochs'][-1]['loss']:.4f}). The final test accuracy, "
        f"evaluated with running statistics (averaged over the ranks for plain BatchNorm), differs by "
        f"{100 * gap:+.2f} points for plain BatchNorm, {round(gap * result['test_images']):+d} of "
        f"{result['test_images']} test images (one seed).",
    ]

    def maxima(eq: dict[str, Any], prefix: str = "") -> str:
        return ", ".join(
            f"{name} {max(eq[prefix + key]):.1g}"
            for key, name in (("loss", "loss"), ("params", "parameters"), ("running_stats", "running statistics"))
        )

    lines += [
        "",
        f"**Equivalence, step by step.** {f32['steps']} SGD steps of train.py's model and optimizer on the same "
        f"global batches (train.py's `DistributedSampler` shards): syncbn_dist on {f32['world_size']} gloo "
        f"processes x {f32['batch_size']} images against plain `nn.BatchNorm` in one process on all "
        f"{f32['world_size'] * f32['batch_size']}. Max absolute difference over the steps:",
        "",
        f"- float64: {maxima(f64)}; test logits after the last step {f64['test_logits']:.1g}.",
        f"- float32 (as trained): {maxima(f32)}; test logits {f32['test_logits']:.1g}, test accuracy "
        f"{_pct(f32['test_acc_ranks'])} vs {_pct(f32['test_acc_single'])}.",
        f"- float32 yardstick, the one-process model against itself with each batch in reverse order (the same "
        f"step in exact arithmetic): {maxima(f32, 'control_')}.",
        f"- `num_batches_tracked` equal after every step: "
        f"{'yes' if all(f32['num_batches_tracked_equal'] + f64['num_batches_tracked_equal']) else 'NO'}.",
        "",
        "In float64 the two agree to rounding. In float32, training amplifies a rounding-level difference step "
        "after step; the yardstick shows one process drifting as far from itself when only the order of summation "
        "changes.",
        "",
    ]
    epoch_diffs = (
        f"max |difference| per epoch: loss {ep['loss']:.2g}, train accuracy {ep['train_acc']:.2g}, test accuracy "
        f"{ep['test_acc']:.2g}; final checkpoints: parameters {ep['params']:.2g}, running statistics "
        f"{ep['running_stats']:.2g}"
    )
    if ep["same_global_batches"]:
        lines.append(
            f"**Whole runs.** train.py gives the single process the same global batches as the {w} ranks, so the "
            f"syncbn_dist and single-process runs are the same computation up to float32 rounding, which "
            f"{cfg['epochs']} epochs amplify as above: {epoch_diffs}."
        )
    else:
        lines.append(
            f"**Whole runs.** train.py shuffles differently in one process (a `DataLoader` shuffle) than over {w} "
            f"ranks (`DistributedSampler`), so the single-process run sees other global batches and its curves "
            f"agree only statistically ({epoch_diffs}). The exact claim is the step-by-step check above."
        )
    lines.append("")
    return "\n".join(lines)


def report(cfg: CompareConfig, same_batches: bool, times: dict[str, float]) -> dict[str, Any]:
    """Write compare.json, compare.png and compare.md to ``report_dir``; return the numbers."""
    result = collect(cfg, same_batches, times)
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
    """Run the comparison (or, with ``--equivalence-worker`` under torchrun, one rank of the step-by-step check).

    Returns 2 (after printing the reason) for a bad config, before anything runs.
    """
    parser = argparse.ArgumentParser(description="Plain vs synchronized BatchNorm on digits (see the docstring).")
    parser.add_argument("--config", type=Path, default=None, help="YAML config; omitted keys keep their defaults")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from output_dir's runs")
    parser.add_argument("--equivalence-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        for run in RUNS:  # the runs' configs are valid before anything starts
            train.load_config(cfg.train_config, run_overrides(cfg, run))
    except train.ConfigError as error:
        print(f"{Path(sys.argv[0]).name}: error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.equivalence_worker:
        return _equivalence_worker(cfg)
    config_args = [] if args.config is None else ["--config", str(args.config)]
    config_args += [a for override in args.overrides for a in ("--set", override)]
    start = time.perf_counter()
    same_batches = same_global_batches(
        *(train.load_config(cfg.train_config, run_overrides(cfg, run)) for run in ("sync_bn", "single_bn")), cfg.nproc
    )
    if args.report_only:
        times = json.loads((Path(cfg.output_dir) / "times.json").read_text())
    else:
        train.write_config(Path(cfg.output_dir) / "config.yaml", cfg)
        times = run_all(cfg, config_args)
        times["total"] = time.perf_counter() - start
        train.write_json(Path(cfg.output_dir) / "times.json", times)
    result = report(cfg, same_batches, times)
    f32, f64 = result["equivalence"]["float32"], result["equivalence"]["float64"]
    log.info(
        "final test accuracy: %s; equivalence max |diff| of params: %.1g (float32; %.1g reversing the batch), "
        "%.1g (float64); wrote %s",
        ", ".join(f"{run} {_pct(result['runs'][run]['final_test_acc'])}" for run in RUNS),
        max(f32["params"]),
        max(f32["control_params"]),
        max(f64["params"]),
        cfg.report_dir,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
