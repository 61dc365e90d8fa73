"""The first training step of a tiny DDP job under torchrun (2 ranks, gloo), per kernel setting, each with a cold
inductor cache: what a short job pays before its first step is done (issue 36, item 6).

    .venv/bin/python -m launch.bench.first_step                       # default, native, compiled; prints the table
    .venv/bin/python -m launch.bench.first_step settings=[default,auto] repeats=3
    torchrun --standalone --nproc_per_node=2 -m launch.bench.first_step role=worker kernels=native   # one job

Each job runs in a fresh ``TORCHINDUCTOR_CACHE_DIR`` (cold cache): a converted 3-layer conv/BatchNorm network in
DistributedDataParallel, SGD, batch 8 of 3x32x32 per rank, one intra-op thread per rank. A worker times its first
and second step (forward, loss, backward, optimizer step; the slowest rank's) and counts what compiled on the way
(Dynamo frames, syncbn_dist's compiled kernels). ``default`` sets nothing (``SYNCBN_DIST_KERNELS`` unset); the
others set ``SYNCBN_DIST_KERNELS``. The driver prints the median over ``repeats`` jobs and each setting's first
step over native's. Times are wall times on a shared machine: read the ratios.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from launch.common.config import ConfigError, config_error_exit, one_of, parse_config, positive, ruled
from launch.common.torchrun import env_outside_torchrun, torchrun_command

SETTINGS = ("default", "native", "compiled", "auto")


@dataclass
class FirstStepConfig:
    role: str = one_of("driver", "driver", "worker")
    kernels: str = one_of("default", *SETTINGS)  # worker: the setting it was started with (reported only)
    settings: list[str] = ruled(
        ["default", "native", "compiled"], f"each one of {', '.join(SETTINGS)}", lambda v: set(v) <= set(SETTINGS)
    )
    repeats: int = positive(1)
    nproc: int = positive(2)
    timeout_s: int = positive(300)  # per job; a worker still running after it dumps its stacks and exits
    steps: int = positive(2)


def _worker(cfg: FirstStepConfig) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # A job that hangs prints every thread's stack and exits, so that the driver says where.
    faulthandler.dump_traceback_later(max(cfg.timeout_s - 30, 10), exit=True)
    dist.init_process_group("gloo")
    try:
        return _steps(cfg)  # its DDP model is freed on return, before the process group is destroyed
    finally:
        torch._dynamo.reset()
        gc.collect()
        dist.destroy_process_group()


def _steps(cfg: FirstStepConfig) -> dict[str, Any]:
    """The timed steps of :func:`_worker`. A DDP model still alive when its process group was destroyed hung a
    rank at exit, once in a few jobs on a loaded machine: this function's return frees it first."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import syncbn_dist
    from syncbn_dist.kernels import compiled as kernels

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )
    ddp = nn.parallel.DistributedDataParallel(syncbn_dist.convert_model(model))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(dist.get_rank())
    images = torch.randn(8, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (8,), generator=generator)
    seconds = []
    for _ in range(cfg.steps):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(images), labels).backward()
        optimizer.step()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        seconds.append(float(elapsed))
    synchronized = all(m.last_transport == "distributed" for m in ddp.modules() if hasattr(m, "last_transport"))
    return {
        "kernels": cfg.kernels,
        "mode": syncbn_dist.get_kernels(),
        "first_step_s": seconds[0],
        "second_step_ms": 1e3 * seconds[1] if len(seconds) > 1 else None,
        "compiled_graphs": sum(kernel.graphs() for kernel in kernels.COMPILED_KERNELS),
        "dynamo_frames": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "synchronized": synchronized,
    }


def run_job(setting: str, nproc: int = 2, timeout_s: int = 300) -> dict[str, Any]:
    """One torchrun job of ``nproc`` ranks with kernel ``setting``, in a fresh inductor cache: rank 0's report and
    the job's wall time (torchrun's start to its exit)."""
    with tempfile.TemporaryDirectory() as cache:
        env = env_outside_torchrun(TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1")
        env.pop("SYNCBN_DIST_KERNELS", None)
        if setting != "default":
            env["SYNCBN_DIST_KERNELS"] = setting
        args = ["role=worker", f"kernels={setting}", f"timeout_s={timeout_s}"]
        command = torchrun_command(nproc, "launch.bench.first_step", args)
        start = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s + 60)
        wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{setting}: torchrun exited {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    report = next(json.loads(line) for line in reversed(done.stdout.splitlines()) if line.startswith("{"))
    return {**report, "job_s": wall}


def render(results: dict[str, list[dict[str, Any]]]) -> str:
    """The markdown table of the driver's jobs: medians per setting, first step over native's."""
    median = {name: statistics.median(r["first_step_s"] for r in runs) for name, runs in results.items()}
    native = median.get("native")
    lines = [
        "| setting | mode in force | first step, s | / native | second step, ms | job wall, s | compiled graphs | "
        "Dynamo frames |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        last = runs[-1]
        ratio = f"{median[name] / native:.2f}" if native else "–"
        second = statistics.median(r["second_step_ms"] for r in runs)
        job = statistics.median(r["job_s"] for r in runs)
        lines.append(
            f"| {name} | {last['mode']} | {median[name]:.3f} | {ratio} | {second:.1f} | {job:.1f} | "
            f"{last['compiled_graphs']} | {last['dynamo_frames']} |"
        )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        cfg = parse_config(FirstStepConfig, argv, __doc__.splitlines()[0])
    except ConfigError as error:
        return config_error_exit(error)
    if cfg.role == "worker":
        report = _worker(cfg)
        if os.environ.get("RANK", "0") == "0":
            print(json.dumps(report), flush=True)
        return 0
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in cfg.settings}
    for _ in range(cfg.repeats):  # interleaved, so that load on the machine spreads over every setting
        for name in cfg.settings:
            results[name].append(run_job(name, cfg.nproc, cfg.timeout_s))
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
