"""The comparison's numbers, from the runs' outputs under ``output_dir``: every run's metrics, per point the mean
and spread over seeds, and the step-by-step check (compare.json)."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from launch.compare.config import (
    MODES,
    CompareConfig,
    digits_config,
    head_bn,
    learning_rate,
    run_dir,
    sweep,
    train_command,
)
from launch.compare.equivalence import same_global_batches
from launch.digits.data import load_data


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


def _same_batches(cfg: CompareConfig, batch_size: int) -> bool:
    """Whether the digits job gives the one-process run the same global batches as the ``nproc`` ranks at
    ``batch_size`` images per rank (checked over one epoch, on seeds[0])."""
    ranks, single = (digits_config(cfg, mode, batch_size, cfg.seeds[0]) for mode in ("sync_bn", "single_bn"))
    return same_global_batches(ranks, single, cfg.nproc, epochs=1)


def collect(cfg: CompareConfig, times: dict[str, float]) -> dict[str, Any]:
    """The raw numbers of the comparison from the runs' outputs under ``output_dir``: every run's per-epoch
    metrics, per point the mean and spread over seeds, and the step-by-step check; ``times`` (wall times in
    seconds) as recorded by :func:`launch.compare.runs.run_all`.

    Raises:
        RuntimeError: if a run has fewer epochs than ``cfg.epochs`` (it stopped, or another config ran it).
    """
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
                "same_global_batches": _same_batches(cfg, b),
                "runs": runs,
                "final_test_acc": {mode: spread([r["final_test_acc"] for r in rs]) for mode, rs in runs.items()},
                "final_loss": {mode: spread([r["final_loss"] for r in rs]) for mode, rs in runs.items()},
                # syncbn_dist against the one-process reference, seed by seed (the same computation when the digits
                # job gives them the same global batches, up to float32 rounding amplified by training).
                "sync_vs_single": {
                    "final_test_acc": max(abs(a["final_test_acc"] - c["final_test_acc"]) for a, c in zip(sync, single)),
                    "final_loss": max(abs(a["final_loss"] - c["final_loss"]) for a, c in zip(sync, single)),
                },
            }
        )
    _, test_set = load_data(digits_config(cfg, *sweep(cfg)[0]).data)
    config = dataclasses.asdict(cfg)
    del config["report_only"]  # how this command ran, not what it compared: a redrawn report records the same
    return {
        "config": config,
        "lr_rule": lr_rule(cfg),
        "test_images": len(test_set),
        "points": points,
        "equivalence": json.loads((Path(cfg.output_dir) / "equivalence" / "equivalence.json").read_text()),
        "wall_time_s": times,
        "equivalence_lr": learning_rate(cfg, cfg.nproc * cfg.equivalence_batch_size),
    }


def lr_rule(cfg: CompareConfig) -> str:
    """The learning-rate rule in words."""
    lr, batch = cfg.lr, cfg.lr_batch
    return {
        "sqrt": f"lr = {lr:g} x sqrt(global batch / {batch}) (square-root scaling)",
        "linear": f"lr = {lr:g} x global batch / {batch} (linear scaling)",
        "constant": f"lr = {lr:g} at every global batch",
    }[cfg.lr_scaling]


def point_label(cfg: dict[str, Any], point: dict[str, Any]) -> str:
    """The per-rank batch of ``point`` (in compare.json, whose ``config`` is ``cfg``), starred where the head
    lacks the BatchNorm1d that the other points have."""
    return f"{point['batch_size']}{'*' if cfg['head_bn'] and not point['head_bn'] else ''}"
