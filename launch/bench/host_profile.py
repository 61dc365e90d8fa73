"""Where the host time of one compiled synchronized layer goes: which regions take their direct call, and cProfile.

    .venv/bin/python -m launch.bench.host_profile                                   # (32, 64, 28, 28) float32, CPU
    python3 -m launch.bench.host_profile device=cuda shape=[256,512]                # a GPU box, NCCL world of one

It runs the microbenchmark's ``syncbn_dist compiled`` variant (forward + backward, one-member group: gloo on CPU,
NCCL on CUDA), prints for every compiled region of :mod:`syncbn_dist.kernels` and each signature it met whether
its later calls run inductor's graph directly (:mod:`syncbn_dist.kernels.direct_call`) or go through ``torch.compile``,
then the wall µs per step and the Python functions with the most own time under :mod:`cProfile` (which slows
Python code, not kernels: read the ranking, not the absolute times). On a GPU, where one layer at these sizes is
bound by the host, this is what tells the per-call cost apart (docs/design.md, "Where K1's time goes").
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from launch.bench.kernel_profile import KernelProfileConfig, one_member_group, parse_profile_config
from launch.bench.micro import COMPILED, _Case, _Replay
from launch.common.config import ConfigError, config_error_exit, positive
from syncbn_dist.kernels import compiled as kernels


@dataclass
class HostProfileConfig(KernelProfileConfig):
    """kernel_profile's shape, dtype, memory_format, device, steps and warmup; how many functions to list."""

    top: int = positive(25)


def region_paths() -> list[str]:
    """One line per compiled region and signature: ``direct`` or ``torch.compile``."""
    lines = []
    for name, region in sorted(vars(kernels).items()):
        region = region.region if isinstance(region, _Replay) else region
        if isinstance(region, kernels._CompiledKernel):
            for signature, direct in region.direct.items():
                lines.append(f"{name:28s} {'direct' if direct is not None else 'torch.compile':14s} {signature}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        cfg = parse_profile_config(HostProfileConfig, argv, __doc__.splitlines()[0])
    except ConfigError as error:
        return config_error_exit(error)
    device = torch.device(cfg.device)
    torch.set_num_threads(1)
    with one_member_group(cfg.device):
        case = _Case(cfg.shape, getattr(torch, cfg.dtype), cfg.memory_format == "channels_last", device)
        step = case.variants()[COMPILED]
        for _ in range(cfg.warmup):
            case.run(step)
        print("\n".join(region_paths()))
        seconds = sorted(case.timed(step) for _ in range(cfg.steps))
        print(f"median {seconds[len(seconds) // 2] * 1e6:.1f} µs per forward+backward (synchronized, no profiler)")
        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.enable()
        for _ in range(cfg.steps):
            case.run(step)
        if device.type == "cuda":
            torch.cuda.synchronize()
        profiler.disable()
        print(f"under cProfile: {(time.perf_counter() - start) / cfg.steps * 1e6:.1f} µs per step")
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(cfg.top)
        print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
