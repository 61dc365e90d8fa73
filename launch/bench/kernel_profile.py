"""Each kernel of one compiled synchronized layer beside torch's batch-norm kernels, in the same loop.

    .venv/bin/python -m launch.bench.kernel_profile                                     # (32, 64, 28, 28) float32
    .venv/bin/python -m launch.bench.kernel_profile shape=[256,512] dtype=bfloat16
    GLIBC_TUNABLES=glibc.malloc.trim_threshold=268435456:glibc.malloc.mmap_threshold=33554432 \\
        .venv/bin/python -m launch.bench.kernel_profile memory_format=channels_last        # as make bench's micro runs
    python3 -m launch.bench.kernel_profile device=cuda                       # a GPU box: Triton and CUDA kernels

It compiles the layer's two regions afresh with inductor's kernel profiling on (``cpp.enable_kernel_profile``: each
generated C++ kernel records a profiler event), runs the microbenchmark's ``syncbn_dist compiled`` and ``F.batch_norm``
variants alternately in a one-member gloo group on one thread, and prints the mean µs per step of every inductor
kernel and of ``native_batch_norm`` and its backward, then the four kernels' total against torch's two. This is
what tells the kernels' share of K1 from the per-call cost around them (docs/design.md, "Where K1's time goes").

With ``device=cuda`` (a one-member NCCL group) it profiles the GPU instead: for ``syncbn_dist compiled``,
``syncbn_dist`` (the native kernels), ``F.batch_norm`` and torch's SyncBatchNorm function, each alone, the mean
device µs per step of every CUDA kernel (Triton's and torch's) and their total, which is the layer's cost once the
host keeps ahead of the GPU.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from launch.bench.config import DTYPES, MEMORY_FORMATS
from launch.bench.micro import COMPILED, _Case
from launch.common.config import ConfigError, config_error_exit, one_of, parse_config, positive, ruled

_TORCH_KERNELS = ("aten::native_batch_norm", "aten::native_batch_norm_backward")
# The microbenchmark's variants whose CUDA kernels device=cuda profiles.
CUDA_VARIANTS = (COMPILED, "syncbn_dist", "F.batch_norm", "torch SyncBatchNorm fn")


@dataclass
class KernelProfileConfig:
    shape: list[int] = ruled(
        [32, 64, 28, 28], "listing a shape (N, C, *) of >= 2 sizes, each > 0", lambda v: len(v) >= 2 and min(v) > 0
    )
    dtype: str = one_of("float32", *DTYPES)
    memory_format: str = one_of("contiguous", *MEMORY_FORMATS)
    device: str = one_of("cpu", "cpu", "cuda")
    steps: int = positive(50)
    warmup: int = positive(10)


P = TypeVar("P", bound=KernelProfileConfig)


def kernel_times(cfg: KernelProfileConfig) -> dict[str, float]:
    """Mean µs per step of every inductor kernel of the compiled layer and of torch's batch-norm kernels."""
    from torch._inductor import config as inductor_config

    torch.set_num_threads(1)
    case = _Case(cfg.shape, getattr(torch, cfg.dtype), cfg.memory_format == "channels_last", torch.device("cpu"))
    variants = case.variants()
    steps = (variants[COMPILED], variants["F.batch_norm"])
    with (
        inductor_config.patch({"cpp.enable_kernel_profile": True, "fx_graph_cache": False}),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        for _ in range(cfg.warmup):
            for step in steps:
                case.run(step)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(cfg.steps):
            for step in steps:
                case.run(step)
    return {
        event.key: round(event.self_cpu_time_total / cfg.steps, 1)
        for event in prof.key_averages()
        if event.key.startswith("graph_") or event.key in _TORCH_KERNELS
    }


def device_kernel_times(cfg: KernelProfileConfig) -> dict[str, dict[str, float]]:
    """Per variant, the mean device µs per step of every CUDA kernel it launches (the variant profiled alone)."""
    case = _Case(cfg.shape, getattr(torch, cfg.dtype), cfg.memory_format == "channels_last", torch.device("cuda"))
    variants = case.variants()
    found = {}
    for name in CUDA_VARIANTS:
        step = variants[name]
        for _ in range(cfg.warmup):
            case.run(step)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(cfg.steps):
                case.run(step)
            torch.cuda.synchronize()
        found[name] = {
            event.key: round(event.self_device_time_total / cfg.steps, 2)
            for event in prof.key_averages()
            if event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total > 0
        }
    return found


def parse_profile_config(schema: type[P], argv: Optional[Sequence[str]], description: str) -> P:
    """``schema`` (this config or one extending it) from ``argv``; raises ConfigError, also for channels_last with a
    shape that is not 4D."""
    cfg = parse_config(schema, argv, description)
    if cfg.memory_format == "channels_last" and len(cfg.shape) != 4:
        raise ConfigError("memory_format=channels_last needs a 4D shape")
    return cfg


@contextlib.contextmanager
def one_member_group(device: str) -> Iterator[None]:
    """The default process group of this process alone: NCCL on GPU 0 for ``"cuda"``, else gloo; destroyed after."""
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        cfg = parse_profile_config(KernelProfileConfig, argv, __doc__.splitlines()[0])
    except ConfigError as error:
        return config_error_exit(error)
    if cfg.device == "cuda":
        with one_member_group(cfg.device):
            per_variant = device_kernel_times(cfg)
        for name, times in per_variant.items():
            print(f"{name}: {sum(times.values()):.2f} device µs per forward+backward")
            for kernel, micros in sorted(times.items(), key=lambda item: -item[1]):
                print(f"  {micros:9.2f} µs  {kernel[:110]}")
        return 0
    with one_member_group(cfg.device):
        times = kernel_times(cfg)
    for name, micros in sorted(times.items(), key=lambda item: -item[1]):
        print(f"{micros:10.1f} µs  {name}")
    ours = sum(micros for name, micros in times.items() if name.startswith("graph_"))
    theirs = sum(times.get(name, 0.0) for name in _TORCH_KERNELS)
    print(f"compiled kernels {ours:.1f} µs, torch's {theirs:.1f} µs, ratio {ours / theirs:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
