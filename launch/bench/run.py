"""The syncbn_dist benchmark: DDP training-step time per BatchNorm variant against the in-step synchronization
floor, compiled variants, aten ops and collectives per step, memory, and the one-layer microbenchmark.

Commands (from the repository root)::

    make bench                                               # = the line below, CPU, under 10 minutes
    .venv/bin/python -m launch.bench.run --config configs/bench.yaml
    .venv/bin/python -m launch.bench.run --config configs/bench.yaml scenario.rounds=5 micro.enabled=false
    .venv/bin/python -m launch.bench.run --config configs/bench.yaml scenarios=[bench_compute.yaml]
    .venv/bin/python -m launch.bench.run --config configs/bench.yaml device=cuda output_dir=outputs/bench_gpu

``KEY=VALUE`` overrides set config keys (dotted for nested ones; values are YAML); ``scenario.KEY=VALUE``
sets KEY in every scenario file; ``device=cuda`` (or ``cpu``) sets the device of every scenario and of the
microbenchmark (:mod:`launch.bench.config`). A bad config exits 2 with a message naming the key, before any
process starts. It spawns its own worker processes (gloo on CPU, nccl when every rank has its own GPU) for
each scenario and world size; on CUDA, world sizes above the GPU count are skipped and listed as skipped. It
writes ``performance.json`` (every measurement and the resolved config), ``performance_config.yaml`` (the
resolved config), ``performance.md`` (also printed) and ``performance.png`` to ``output_dir`` (``docs/`` for
``make bench``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from typing import Any, Optional
from unittest import mock

import torch

from launch.bench.backend import pick_backend
from launch.bench.config import (
    README_SECTION,
    BenchConfig,
    ResolvedBenchConfig,
    ScenarioConfig,
    check_launch,
    load_bench,
)
from launch.bench.micro import micro_worker
from launch.bench.models import COMPILED_SUFFIX
from launch.bench.report import markdown, plot, readme_tables
from launch.bench.step import step_worker
from launch.bench.summary import summarize
from launch.common.config import ConfigError, argument_parser, config_error_exit, to_yaml
from launch.common.io import write_text
from launch.common.readme import fill_section
from launch.common.spawn import run_distributed


def _machine() -> dict[str, Any]:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": model,
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
    }
    if hasattr(os, "getloadavg"):
        info["loadavg_start"] = list(os.getloadavg())
    return info


def run(cfg: BenchConfig, scenarios: list[ScenarioConfig], command: str) -> dict[str, Any]:
    """Run every scenario at every world size and the microbenchmark; write and return the summary."""
    os.makedirs(cfg.output_dir, exist_ok=True)
    resolved = ResolvedBenchConfig(**vars(cfg), scenario_configs=scenarios)
    micro_backend = pick_backend(1, cfg.micro.device) if cfg.micro.enabled else None  # fails before the scenarios

    started = time.perf_counter()
    machine = _machine()
    raw_scenarios = []
    for scenario in scenarios:
        runs = []
        skipped = []
        for world_size in scenario.world_sizes:
            if scenario.device == "cuda" and torch.cuda.device_count() < world_size:
                skipped.append(world_size)  # nccl needs one GPU per rank
                continue
            backend = pick_backend(world_size, scenario.device)
            variants = [
                v
                for v in scenario.variants
                if not v.endswith(COMPILED_SUFFIX)
                or not scenario.compile_world_sizes
                or world_size in scenario.compile_world_sizes
            ]
            print(f"[bench] {scenario.name}: world size {world_size} ({backend}) ...", flush=True)
            launched = time.perf_counter()
            result = run_distributed(
                step_worker,
                world_size,
                {**dataclasses.asdict(scenario), "variants": variants},
                timeout=None,  # rounds are bounded by round_budget_s; a stuck collective by timeout_s
                collective_timeout=scenario.timeout_s,
                backend=backend,
                threads=scenario.threads,
            )[0]
            runs.append({**result, "wall_seconds": round(time.perf_counter() - launched, 1)})
        raw_scenarios.append({"config": dataclasses.asdict(scenario), "runs": runs, "skipped_world_sizes": skipped})
    micro = None
    if cfg.micro.enabled:
        print("[bench] microbenchmark ...", flush=True)
        tunables = {"GLIBC_TUNABLES": cfg.micro.glibc_tunables} if cfg.micro.glibc_tunables else {}
        with mock.patch.dict(os.environ, tunables):  # the spawned worker reads them at start-up
            micro = run_distributed(
                micro_worker,
                1,
                dataclasses.asdict(cfg.micro),
                timeout=None,
                collective_timeout=cfg.micro.timeout_s,
                backend=micro_backend,
                threads=cfg.micro.threads,
            )[0]
        micro["glibc_tunables"] = cfg.micro.glibc_tunables
    if hasattr(os, "getloadavg"):
        machine["loadavg_end"] = list(os.getloadavg())
    machine["bench_seconds"] = round(time.perf_counter() - started, 1)

    summary = summarize(raw_scenarios, micro, machine, command, dataclasses.asdict(resolved), cfg.compute_scenario)
    table = markdown(summary)
    write_text(os.path.join(cfg.output_dir, "performance.json"), json.dumps(summary, indent=1) + "\n")
    header = (
        f"# The resolved config of `{command}`, as in performance.json: the bench keys, then every\n"
        "# scenario file after the overrides. launch.common.config.load_config(ResolvedBenchConfig, path) reads it.\n"
    )
    write_text(os.path.join(cfg.output_dir, "performance_config.yaml"), to_yaml(resolved, header))
    write_text(os.path.join(cfg.output_dir, "performance.md"), table)
    if cfg.readme is not None:
        fill_section(cfg.readme, README_SECTION, readme_tables(summary))
    if cfg.plot:
        plot(summary, os.path.join(cfg.output_dir, "performance.png"))
    print(table)
    written = ["performance.json", "performance_config.yaml", "performance.md"] + (
        ["performance.png"] if cfg.plot else []
    )
    print(f"[bench] wrote {cfg.output_dir}/" + ", ".join(written))
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    parser = argument_parser(__doc__.splitlines()[0], default_config="configs/bench.yaml")
    parser.epilog = "scenario.KEY=VALUE sets KEY in every scenario file; device=cpu|cuda sets every device."
    args = parser.parse_args(argv)
    try:
        cfg, scenarios = load_bench(args.config, args.overrides)
        check_launch(cfg)
    except ConfigError as error:
        return config_error_exit(error)
    command = " ".join(["python", "-m", "launch.bench.run", "--config", args.config, *args.overrides])
    run(cfg, scenarios, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
