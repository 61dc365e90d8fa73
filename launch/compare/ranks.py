"""The comparison's ``nproc``-rank phase, one torchrun launch: every plain and synchronized run, then the
step-by-step equivalence check.

:mod:`launch.compare.run` starts it with the resolved config it wrote (from the repository root)::

    python -m torch.distributed.run --standalone --nproc_per_node=4 -m launch.compare.ranks \
        --config outputs/compare/config.yaml

The runs share one process group (one start-up instead of one per run). Rank 0 shows the progress bar and writes
``output_dir/times_ranks.json`` (each run's wall time, and the check's) and
``output_dir/equivalence/equivalence.json`` (the check, one entry per dtype of
:data:`~launch.compare.equivalence.DTYPES`). A bad config exits 2 before the process group starts; a signal that
stopped a run exits 130.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from launch.common.config import ConfigError, config_error_exit
from launch.common.io import write_json
from launch.compare.config import RANKS_MODES, CompareConfig, digits_config, parse_compare_config, sweep
from launch.compare.equivalence import DTYPES, equivalence_steps
from launch.compare.runs import train_runs
from launch.digits.data import load_data
from launch.digits.runtime import Runtime, init_distributed

log = logging.getLogger("compare")


def _equivalence(cfg: CompareConfig, runtime: Runtime) -> None:
    """The step-by-step check on this process group; rank 0 writes ``output_dir/equivalence/equivalence.json``."""
    out = Path(cfg.output_dir) / "equivalence"
    train_cfg = digits_config(cfg, "sync_bn", cfg.equivalence_batch_size, cfg.seeds[0], out)
    train_set, test_set = load_data(train_cfg.data)
    results = {}
    for dtype in DTYPES:
        log.info("equivalence in %s, %d steps", dtype, cfg.equivalence_steps)
        args = (train_cfg, runtime, train_set.tensors, test_set.tensors, cfg.equivalence_steps, dtype)
        results[str(dtype).replace("torch.", "")] = equivalence_steps(*args)
    if runtime.rank == 0:
        write_json(out / "equivalence.json", results)


def main(argv: Sequence[str] | None = None) -> int:
    """Run this rank's part of the phase with the config from ``[--config PATH] [KEY=VALUE ...]``.

    Returns 2 (after printing the reason) for a bad config or a launch on other than ``nproc`` torchrun ranks,
    before the process group starts; 130 when a signal
    stopped a run (the digits job checkpointed it); 0 otherwise.
    """
    try:
        cfg = parse_compare_config(argv, "The nproc-rank phase of launch.compare.run (under torchrun).")
        world_size = os.environ.get("WORLD_SIZE") if "RANK" in os.environ else None
        if world_size != str(cfg.nproc):
            raise ConfigError(
                f"config key 'nproc': this phase runs under torchrun --nproc_per_node={cfg.nproc} "
                f"(got WORLD_SIZE={world_size})"
            )
    except ConfigError as error:
        return config_error_exit(error)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    runs = sweep(cfg, RANKS_MODES)
    runtime = init_distributed(digits_config(cfg, *runs[0]))
    if runtime.rank != 0:
        log.setLevel(logging.WARNING)  # rank 0 tells the story
    try:
        times = train_runs(cfg, runtime, runs, f"{cfg.nproc} ranks")
        start = time.perf_counter()
        _equivalence(cfg, runtime)
        times["equivalence"] = time.perf_counter() - start
        if runtime.rank == 0:
            write_json(Path(cfg.output_dir) / "times_ranks.json", times)
    except KeyboardInterrupt as stop:
        log.warning("%s", stop)
        return 130
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # record: an uncaught exception (with its traceback) goes into torchrun's failure report.
    sys.exit(record(main)())
