"""The sweep's runs: the digits job (``launch.digits.train.run``) in-process, one run after the other.

:func:`run_all` starts the ``nproc``-rank phase (:mod:`launch.compare.ranks`) under torchrun, then trains the
one-process runs here; :func:`train_runs` trains a list of runs in one process group (or in one process).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from launch.common.config import to_yaml
from launch.common.io import write_text
from launch.common.torchrun import run_torchrun
from launch.compare.config import RANKS_MODES, SINGLE_MODES, CompareConfig, digits_config, run_nproc, sweep
from launch.digits.data import load_data
from launch.digits.runtime import Runtime, pick_device
from launch.digits.train import run

log = logging.getLogger("compare")


class _RunLog:
    """The digits job's log of one run goes to the run's log.txt (rank 0; other ranks keep warnings on stderr)."""

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


def _steps(cfg: CompareConfig, mode: str, batch_size: int, num_train: int) -> int:
    """The digits job's SGD steps per epoch of the run: DistributedSampler(drop_last) shards, incomplete batches
    dropped."""
    return (num_train // run_nproc(cfg, mode)) // (cfg.nproc * batch_size if mode == "single_bn" else batch_size)


def train_runs(cfg: CompareConfig, runtime: Runtime, runs: list[tuple[str, int, int]], desc: str) -> dict[str, float]:
    """Run the digits job (``launch.digits.train.run``) for every ``(mode, batch_size, seed)`` of ``runs``, with
    the config its command line builds from :func:`~launch.compare.config.run_overrides`; show progress on rank 0.

    Returns:
        Each run's wall time in seconds (set-up and evaluation included), keyed ``b{b}/{mode}/seed{seed}``.

    Raises:
        KeyboardInterrupt: on every rank, when a run stopped on SIGINT/SIGTERM (the job checkpoints and returns).
    """
    num_train = len(load_data(digits_config(cfg, *runs[0]).data)[0])
    total = sum(cfg.epochs * _steps(cfg, mode, b, num_train) for mode, b, _ in runs)
    bar = tqdm(total=total, desc=desc, unit="step", disable=runtime.rank != 0, dynamic_ncols=True)
    times = {}
    for mode, b, seed in runs:
        bar.set_postfix_str(f"{b}/rank {mode} seed {seed}")
        run_cfg = digits_config(cfg, mode, b, seed)
        start = time.perf_counter()
        with _RunLog(Path(run_cfg.output_dir) / "log.txt", runtime.rank == 0):
            run(run_cfg, runtime)
        times[f"b{b}/{mode}/seed{seed}"] = time.perf_counter() - start
        metrics = json.loads((Path(run_cfg.output_dir) / "metrics.json").read_text()) if runtime.rank == 0 else {}
        stopped = torch.tensor(["stopped_at" in metrics], dtype=torch.int64, device=runtime.device)  # nccl: on GPU
        if runtime.world_size > 1:
            dist.all_reduce(stopped, op=dist.ReduceOp.MAX)  # every rank stops the sweep together
        if stopped.item():
            bar.close()
            raise KeyboardInterrupt(f"{run_cfg.output_dir}: stopped by a signal (the job checkpointed it)")
        bar.update(cfg.epochs * _steps(cfg, mode, b, num_train))
    bar.close()
    return times


def run_all(cfg: CompareConfig) -> dict[str, float]:
    """The sweep and the step-by-step check; wall times in seconds: per run, per phase (start-up included).

    Writes the resolved config to ``output_dir/config.yaml``, which the ``nproc``-rank phase reads.

    Raises:
        RuntimeError: if the ``nproc``-rank phase fails (see ``output_dir/ranks_log.txt``).
        KeyboardInterrupt: when a signal stopped a run.
    """
    out = Path(cfg.output_dir)
    header = "# The resolved config of this comparison (defaults + config file + KEY=VALUE overrides).\n"
    write_text(out / "config.yaml", to_yaml(cfg, header))
    log.info(
        "%d-rank runs (%d) and the step-by-step check, in one torchrun launch ...",
        cfg.nproc,
        len(sweep(cfg, RANKS_MODES)),
    )
    args = ["--config", str(out / "config.yaml")]
    phase_ranks = run_torchrun(cfg.nproc, "launch.compare.ranks", args, out / "ranks_log.txt", cfg.timeout_s)
    times = json.loads((out / "times_ranks.json").read_text())
    times["phase_ranks"] = phase_ranks
    singles = sweep(cfg, SINGLE_MODES)
    log.info("one-process runs (%d) ...", len(singles))
    start = time.perf_counter()
    device = pick_device(digits_config(cfg, *singles[0]), 0)
    times.update(train_runs(cfg, Runtime(0, 1, device, False), singles, "1 process"))
    times["phase_single"] = time.perf_counter() - start
    return times
