"""What each fast path syncbn_dist keeps is worth in a training step: the step with and without it, interleaved.

    .venv/bin/python -m launch.bench.fast_paths                                    # prints the table
    .venv/bin/python -m launch.bench.fast_paths output=docs/performance_fast_paths.md
    .venv/bin/python -m launch.bench.fast_paths round_budget_s=20 scenarios=[latency]

A fast path is kept only where a step figure shows it is worth more than the step's noise (docs/design.md, "Private
torch APIs"). For each one (:data:`FAST_PATHS`), a copy of the package with that path retired, a one-line change, is
imported beside syncbn_dist under another name. Two gloo ranks each build the scenario's DDP model
(configs/bench_<scenario>.yaml) from the same weights with both packages and run their training steps alternately,
round by round, the first of the pair alternating; a round's time is the slower rank's. The table gives the median of
the rounds' paired differences (without - with), its 95% bootstrap interval, and that median over the step's.
"""

from __future__ import annotations

import importlib
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel

import syncbn_dist
from launch.bench.models import build_model
from launch.bench.run import _machine
from launch.bench.summary import _paired_difference
from launch.common.config import ConfigError, config_error_exit, parse_config, positive
from launch.common.io import write_text
from launch.common.spawn import run_distributed

ROOT = Path(__file__).resolve().parents[2]
# name: (file of the package, the line that keeps the path, the line that retires it)
FAST_PATHS = {
    "cpp_apply": (
        "layer/functions.py",
        "super(Function, _SyncBatchNormFunction).apply(*args)",
        "_SyncBatchNormFunction.apply(*args)",
    ),
    "transport_cache": (
        "layer/batchnorm.py",
        "else cached_distributed_transport(",
        "else distributed_transport(",
    ),
}
_CHECK_EVERY = 20  # rounds between the ranks' joint decision to go on


@dataclass
class FastPathsConfig:
    paths: list[str] = field(default_factory=lambda: list(FAST_PATHS))
    scenarios: list[str] = field(default_factory=lambda: ["latency", "resnet_b4"])
    world_size: int = positive(2)
    warmup_steps: int = positive(10)
    round_budget_s: float = positive(120.0)  # per path and scenario: no new block of rounds starts after it
    max_rounds: int = positive(4000)
    output: Optional[str] = None  # a markdown report to write, or None


def _retired_copy(path: str, directory: str) -> str:
    """Copy the package into ``directory`` as ``syncbn_dist_without_<path>`` with ``path`` retired; its name."""
    relative, keep, retire = FAST_PATHS[path]
    name = f"syncbn_dist_without_{path}"
    shutil.copytree(Path(syncbn_dist.__file__).parent, Path(directory, name))
    source = Path(directory, name, relative)
    text = source.read_text()
    if text.count(keep) != 1:
        raise RuntimeError(f"expected {keep!r} once in syncbn_dist/{relative}: FAST_PATHS is out of date")
    source.write_text(text.replace(keep, retire))
    return name


def _worker(rank: int, world_size: int, scenario: dict[str, Any], directory: str, name: str, cfg: Any) -> Any:
    sys.path.insert(0, directory)
    without = importlib.import_module(name)
    models = {}
    for label, library in (("with", syncbn_dist), ("without", without)):
        torch.manual_seed(scenario["seed"])
        model = library.convert_model(build_model(
            scenario["model"], scenario["in_channels"], scenario["width"], scenario.get("num_layers", 0),
            scenario["num_classes"],
        ))
        ddp = DistributedDataParallel(model, bucket_cap_mb=scenario["bucket_cap_mb"])
        models[label] = ddp, torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    size = scenario["image_size"]
    x = torch.randn(scenario["batch_size"], scenario["in_channels"], size, size, generator=generator)
    y = torch.randint(0, scenario["num_classes"], (scenario["batch_size"],), generator=generator)

    def step(label: str) -> float:
        ddp, optimizer = models[label]
        start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        return time.perf_counter() - start

    for _ in range(cfg.warmup_steps):
        step("with"), step("without")
    times: dict[str, list[float]] = {"with": [], "without": []}
    start = time.perf_counter()
    while len(times["with"]) < cfg.max_rounds:
        for round_ in range(_CHECK_EVERY):
            for label in ("with", "without") if round_ % 2 == 0 else ("without", "with"):
                times[label].append(step(label))
        go_on = torch.tensor([float(time.perf_counter() - start < cfg.round_budget_s)])
        dist.broadcast(go_on, src=0)
        if not go_on.item():
            break
    slowest = torch.tensor([times["with"], times["without"]], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def measure(cfg: FastPathsConfig) -> list[dict[str, Any]]:
    """One row per fast path and scenario: the paired difference of the steps without and with it."""
    rows = []
    for path in cfg.paths:
        for scenario_name in cfg.scenarios:
            scenario = yaml.safe_load((ROOT / "configs" / f"bench_{scenario_name}.yaml").read_text())
            with tempfile.TemporaryDirectory() as directory:
                name = _retired_copy(path, directory)
                with_path, without_path = run_distributed(
                    _worker, cfg.world_size, scenario, directory, name, cfg, timeout=cfg.round_budget_s + 900,
                    fresh=True,
                )[0]
            step = statistics.median(with_path)
            difference = _paired_difference(with_path, without_path)
            rows.append({"path": path, "scenario": scenario_name, "rounds": len(with_path),
                         "step_ms": step * 1e3, **{k: v * 1e3 for k, v in difference.items()},
                         "ratio": difference["median"] / step})
            print(_row(rows[-1]), flush=True)
    return rows


def _row(row: dict[str, Any]) -> str:
    return (f"| {row['path']} | {row['scenario']} | {row['rounds']} | {row['step_ms']:.3f} | "
            f"{row['median']:+.3f} | [{row['ci95_low']:+.3f}, {row['ci95_high']:+.3f}] | {row['ratio'] * 100:+.1f}% |")


def render(rows: list[dict[str, Any]], cfg: FastPathsConfig) -> str:
    machine = _machine()
    lines = [
        "# Fast paths: the training step with and without each",
        "",
        "Generated by `python -m launch.bench.fast_paths output=docs/performance_fast_paths.md`; the only copy of "
        f"these numbers. {machine['cpu']} ({machine['nproc']} CPUs), torch {machine['torch']}, "
        f"Python {machine['python']}, W={cfg.world_size} gloo, one intra-op thread per rank.",
        "",
        "Each row: one DDP training step of the scenario (configs/bench_<scenario>.yaml) with syncbn_dist as it is and "
        "with the fast path retired, alternating in the same two processes. Difference: the median of the rounds' "
        "paired differences (without - with, ms; positive: the path saves time), with its 95% bootstrap interval; "
        "ratio: that median over the step's median with the path. What each path is: docs/design.md, \"Private torch "
        "APIs and changes to torch's classes\".",
        "",
        "| fast path | scenario | rounds | step with (ms) | difference (ms) | 95% interval | ratio |",
        "|---|---|---|---|---|---|---|",
        *(_row(row) for row in rows),
        "",
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        cfg = parse_config(FastPathsConfig, argv, __doc__.splitlines()[0])
        unknown = sorted(set(cfg.paths) - set(FAST_PATHS))
        if unknown:
            raise ConfigError(f"paths: expected names from {sorted(FAST_PATHS)} (got {unknown})")
    except ConfigError as error:
        return config_error_exit(error)
    report = render(measure(cfg), cfg)
    print(report)
    if cfg.output is not None:
        write_text(cfg.output, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
