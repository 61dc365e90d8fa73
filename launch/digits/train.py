"""Train a small BatchNorm CNN on scikit-learn's digits with synchronized BatchNorm.

Commands (from the repository root)::

    make train                       # = .venv/bin/torchrun --standalone --nproc_per_node=2 \
                                     #       -m launch.digits.train --config configs/digits.yaml
    make train-dp                    # = .venv/bin/python -m launch.digits.train --config configs/digits_dp.yaml
    torchrun --standalone --nproc_per_node=2 -m launch.digits.train --config configs/digits.yaml \
        train.epochs=3 output_dir=outputs/quick
    torchrun --standalone --nproc_per_node=2 -m launch.digits.train --config configs/digits.yaml resume=true
    make train-multinode             # two "nodes" x 1 process on loopback (see the Makefile)
    make train MAX_RESTARTS=3 ARGS=train.checkpoint_every_steps=20   # survive up to 3 dead workers
    python -m launch.digits.train --help

``parallel: ddp`` runs one process per rank under torchrun: the BatchNorm layers are converted with
:func:`syncbn_dist.convert_model` and the model is wrapped in DistributedDataParallel (world_size > 1 only).
``parallel: dataparallel`` runs one process with :class:`syncbn_dist.DataParallelWithCallback` over every CUDA
device, or over ``cpu_replicas`` CPU thread replicas when there is no GPU.

The config is validated completely (unknown keys, types, ranges, launch mode, and with ``resume`` the
checkpoint's compatibility) before any process group starts; a bad one exits 2. Rank 0 logs, writes
``config.yaml`` (the resolved config), and after every epoch ``checkpoint.pt`` and ``metrics.json`` under
``output_dir``, each atomically. Before each epoch's checkpoint, every rank's parameters and running statistics
are all-gathered and compared; the job fails if they differ.

SIGTERM or SIGINT (torchrun forwards both to every worker) makes the job stop at the next training step that all
ranks agree on, write a checkpoint of the last completed step and exit 0. ``resume=true`` continues from
``output_dir/checkpoint.pt``, mid-epoch included; for ``parallel: ddp`` the resumed run reproduces the
uninterrupted run bit for bit (:mod:`launch.digits.checkpoint` says what the checkpoint holds). The job's
randomness comes only from torch: dropout draws from the global CPU (and CUDA) generators, which are
checkpointed; the data order is a function of ``(seed, sampler epoch)``.

Under ``torchrun --max-restarts=N`` a worker that dies (SIGKILL, OOM) makes torchrun restart all of them; the new
attempt resumes from the last checkpoint this launch wrote, as with ``resume=true`` (the checkpoint records
torchrun's run id), so it redoes at most the steps since that checkpoint: up to an epoch, or
``train.checkpoint_every_steps``. Launch with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (``make train`` does): see
"Restarts and preemption" in docs/training.md.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import syncbn_dist
from launch.common.config import ConfigError, config_error_exit, parse_config, to_yaml
from launch.common.io import write_json, write_text
from launch.common.torchrun import restart_hazard
from launch.digits.checkpoint import (
    CHECKPOINT_NAME,
    check_same_position,
    find_resume_checkpoint,
    restore,
    resume_state,
    save_checkpoint,
)
from launch.digits.config import DigitsConfig, check_launch
from launch.digits.data import build_loaders
from launch.digits.loop import EpochProgress, check_same_on_all_ranks, epoch_means, evaluate, train_steps
from launch.digits.model import bn_transports, build_model
from launch.digits.optim import build_optimizer, cosine_schedule
from launch.digits.runtime import Runtime, init_distributed, launch_id
from launch.digits.stop import StopRequest, deaf_once_failed

log = logging.getLogger("train")


def run(cfg: DigitsConfig, runtime: Runtime, checkpoint: dict[str, Any] | None = None) -> int:
    """Train, evaluate and checkpoint every epoch, check the ranks agree, and (rank 0) write the outputs.

    With ``cfg.resume``, or in a torchrun restart, continue from ``checkpoint`` (or the one in ``output_dir``; see
    :func:`~launch.digits.checkpoint.find_resume_checkpoint`). With ``train.checkpoint_every_steps``, checkpoint
    inside epochs too. On SIGTERM/SIGINT, stop at the next step all ranks agree on, checkpoint it, and return 0.
    """
    with StopRequest() as stop:
        if checkpoint is None:
            checkpoint = find_resume_checkpoint(cfg, runtime.world_size, runtime.launch_id)
        return _run(cfg, runtime, checkpoint, stop, Path(cfg.output_dir))


def _run(cfg: DigitsConfig, runtime: Runtime, checkpoint: dict[str, Any] | None, stop: StopRequest, out: Path) -> int:
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model, net, replicas = build_model(cfg, runtime)
    torch.manual_seed(cfg.seed + runtime.rank)  # then different dropout masks per rank
    train_loader, test_loader, sampler = build_loaders(cfg, runtime, replicas)
    optimizer = build_optimizer(net, cfg.train)
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
        progress = restore(checkpoint, net, optimizer, runtime, replicas)
        completed, metrics, elapsed = checkpoint["epoch"], checkpoint["metrics"], checkpoint["elapsed_s"]
        metrics.pop("stopped_at", None)
        metrics.setdefault("resumed_from", []).append({"epoch": completed, "step": progress.step})
    scheduler = cosine_schedule(optimizer, cfg.train.epochs, completed)
    check_same_position([checkpoint is not None, completed, progress.step], runtime, cfg.output_dir)
    if runtime.is_main:
        header = "# The resolved config of this run (defaults + config file + KEY=VALUE overrides).\n"
        write_text(out / "config.yaml", to_yaml(cfg, header))
        if (hazard := restart_hazard()) is not None:
            log.warning(hazard)
        if cfg.resume and checkpoint is None:
            log.warning("resume: no %s in %s, starting afresh", CHECKPOINT_NAME, out)
        elif checkpoint is None and (out / CHECKPOINT_NAME).is_file():
            log.warning("overwriting the checkpoint in %s (set resume=true to continue it instead)", out)
        if checkpoint is not None:
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")
            why = "" if cfg.resume else f"torchrun launch {runtime.launch_id}, restart {restart}: "
            where = out / CHECKPOINT_NAME
            log.info("%sresuming after epoch %d + %d steps from %s", why, completed, progress.step, where)
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
            save_checkpoint(out / CHECKPOINT_NAME, net, optimizer, epoch_in_progress - 1, cfg, state)

    session_start = time.perf_counter()  # training time: total_time_s excludes start-up, as epoch_time_s does
    for epoch in range(completed + 1, cfg.train.epochs + 1):
        epoch_start = time.perf_counter()
        sampler.set_epoch(epoch)
        lr = optimizer.param_groups[0]["lr"]
        desc = f"epoch {epoch}/{cfg.train.epochs}"
        signum = train_steps(
            model,
            train_loader,
            optimizer,
            runtime,
            progress,
            stop,
            desc,
            cfg.progress_bar,
            checkpoint_every=cfg.train.checkpoint_every_steps,
            checkpoint=functools.partial(checkpoint_now, epoch, epoch_start),
            steps=max(len(train_loader) - runtime.rank, 0) if cfg.data.uneven_shards else None,
            uneven=cfg.data.uneven_shards,
        )
        if signum:
            checkpoint_now(epoch, epoch_start)
            name = signal.Signals(signum).name
            metrics["stopped_at"] = {"epoch": epoch - 1, "step": progress.step, "signal": name}
            if runtime.is_main:
                write_json(out / "metrics.json", metrics)
            # Every rank says it stopped cleanly (non-main ranks log warnings only).
            log.warning(
                "%s: stopped after epoch %d + %d/%d steps; %s (continue with resume=true)",
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


def main(cfg: DigitsConfig | None = None) -> int:
    """Run the job with ``cfg``, or with the config from the command line ``[--config PATH] [KEY=VALUE ...]``.

    Returns 2 (after printing the reason) for a bad config or a checkpoint that cannot be resumed, without
    starting a process group; 0 when training completes or stops on SIGTERM/SIGINT after checkpointing.
    """
    try:
        if cfg is None:
            cfg = parse_config(DigitsConfig, None, "Train a BatchNorm CNN on digits with synchronized BatchNorm.")
        check_launch(cfg)
        checkpoint = find_resume_checkpoint(cfg, int(os.environ.get("WORLD_SIZE", "1")), launch_id())
    except ConfigError as error:
        return config_error_exit(error)
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
    # record: under torchrun, an uncaught exception (with its traceback) goes into torchrun's failure report, which
    # deaf_once_failed keeps whole when the agent SIGTERMs this worker as it writes it.
    sys.exit(record(deaf_once_failed(main))())
