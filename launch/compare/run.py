"""Why synchronized BatchNorm matters: plain vs synchronized BatchNorm on digits as the per-rank batch shrinks.

Commands (from the repository root)::

    make compare      # = .venv/bin/python -m launch.compare.run --config configs/compare.yaml
    .venv/bin/python -m launch.compare.run --config configs/compare.yaml epochs=1 'seeds=[0]' \
        output_dir=outputs/compare_quick report_dir=outputs/compare_quick
    .venv/bin/python -m launch.compare.run --config configs/compare.yaml report_only=true   # redraw from output_dir
    .venv/bin/python -m launch.compare.run --help

For every per-rank batch ``b`` of ``batch_sizes`` and every seed of ``seeds`` it trains the digits model
(:mod:`launch.digits`) three ways, with the same global batch ``nproc * b``, learning rate, schedule and epochs:

1. ``plain_bn``: ``nproc`` ranks x ``b`` images, plain per-rank BatchNorm (running statistics averaged before
   each evaluation);
2. ``sync_bn``: the same with syncbn_dist's synchronized BatchNorm (statistics of the global batch);
3. ``single_bn``: one process, plain BatchNorm on ``nproc * b`` images (the reference).

Each run is the digits job itself: ``launch.digits.train.run`` on the config that ``launch.digits.train --config
<train_config> KEY=VALUE ...`` would build (the command is recorded per run in compare.json). The ``nproc``-rank
runs share one torchrun launch of :mod:`launch.compare.ranks` (one process group, one start-up instead of one per
run), which then checks the equivalence claim, *SyncBN on W ranks x b equals BatchNorm in one process at W*b*,
step by step: ``equivalence_steps`` SGD steps where rank 0 also trains the plain single-process model on the
union of the W ranks' batches, comparing the loss, every parameter and every running statistic after each step.
The one-process runs then run in this process. Rank 0 (and this process) show one progress bar per phase: the
run in progress (per-rank batch, kind, seed) and the time left.

It writes ``compare.png`` (final test accuracy and training loss against the per-rank batch, with the spread over
seeds; the step-by-step equivalence), ``compare.md`` (a summary) and ``compare.json`` (every number of every
run) to ``report_dir``, and the resolved config to ``output_dir/config.yaml``. A bad config (of the comparison,
or of any run) exits 2 before anything runs; a signal that stops a run exits 130.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from launch.common.config import ConfigError, config_error_exit
from launch.common.io import write_json, write_text
from launch.common.readme import fill_section
from launch.compare.config import MODES, README_SECTION, CompareConfig, parse_compare_config
from launch.compare.plot import plot
from launch.compare.report import collect
from launch.compare.runs import run_all
from launch.compare.summary import accuracy_table, summary

log = logging.getLogger("compare")


def report(cfg: CompareConfig, times: dict[str, float]) -> dict[str, Any]:
    """Write compare.json, compare.png and compare.md to ``report_dir``; return the numbers."""
    result = collect(cfg, times)
    out = Path(cfg.report_dir)
    write_json(out / "compare.json", result)
    plot(result, out / "compare.png")
    write_text(out / "compare.md", summary(result, "compare.png"))
    if cfg.readme is not None:
        fill_section(cfg.readme, README_SECTION, "\n".join(accuracy_table(result)))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison with the config from the command line ``[--config PATH] [KEY=VALUE ...]``.

    Returns 2 (after printing the reason) for a bad config, before anything runs; 130 when a signal stopped it.
    """
    try:
        cfg = parse_compare_config(argv, "Plain vs synchronized BatchNorm on digits (see the module docstring).")
    except ConfigError as error:
        return config_error_exit(error)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    start = time.perf_counter()
    if cfg.report_only:
        times = json.loads((Path(cfg.output_dir) / "times.json").read_text())
    else:
        try:
            times = run_all(cfg)
        except KeyboardInterrupt as stop:
            log.warning("stopped: %s", stop)
            return 130
        times["total"] = time.perf_counter() - start
        write_json(Path(cfg.output_dir) / "times.json", times)
    result = report(cfg, times)
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
