"""Each kernel of one synchronized layer inside a user's ``torch.compile`` beside torch's batch-norm kernels, in the
same loop.

    .venv/bin/python -m launch.bench.kernel_profile                                     # (32, 64, 28, 28) float32
    .venv/bin/python -m launch.bench.kernel_profile shape=[256,512] dtype=bfloat16
    GLIBC_TUNABLES=glibc.malloc.trim_threshold=268435456:glibc.malloc.mmap_threshold=33554432 \\
        .venv/bin/python -m launch.bench.kernel_profile memory_format=channels_last        # as make bench's micro runs
    python3 -m launch.bench.kernel_profile device=cuda                       # a GPU box: Triton and CUDA kernels

The traced layer (:data:`TRACED`) is ``torch.compile`` of a converted BatchNorm layer whose synchronization is forced
onto a one-member group (:func:`launch.bench.resnet50_step.force_sync`): what a user's compiled model runs for each
of its syncbn_dist layers, the graph traced from :mod:`syncbn_dist.kernels` with its collectives in it. Compiled
afresh with inductor's kernel profiling on (``cpp.enable_kernel_profile``: each generated C++ kernel records a
profiler event), it runs alternately with the microbenchmark's ``F.batch_norm`` variant in a one-member gloo group
on one thread, and the script prints the mean µs per step of every inductor kernel and of ``native_batch_norm`` and
its backward, then the generated kernels' total against torch's two.

With ``device=cuda`` (a one-member NCCL group) it profiles the GPU instead: for the traced layer, ``syncbn_dist``
(eager), ``F.batch_norm`` and torch's SyncBatchNorm function, each alone, the mean device µs per step of every CUDA
kernel (Triton's and torch's) and their total, which is the layer's cost once the host keeps ahead of the GPU.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

import syncbn_dist
from launch.bench.config import DTYPES, MEMORY_FORMATS
from launch.bench.micro import _Case
from launch.common.config import ConfigError, config_error_exit, one_of, parse_config, positive, ruled

_TORCH_KERNELS = ("aten::native_batch_norm", "aten::native_batch_norm_backward")
TRACED = "syncbn_dist, torch.compile"
# The variants whose CUDA kernels device=cuda profiles: the traced layer, then the microbenchmark's.
CUDA_VARIANTS = (TRACED, "syncbn_dist", "F.batch_norm", "torch SyncBatchNorm fn")


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


def traced_layer(case: _Case) -> Callable[[Tensor], Tensor]:
    """``torch.compile`` of a converted BatchNorm layer for ``case``'s input (its device and dtype, ``num_features``
    its channels), synchronization forced onto the default group; each call clears the layer's parameter gradients
    first, as ``case`` does its own, so that no call accumulates into the last one's."""
    from launch.bench.resnet50_step import force_sync  # it imports this module

    batchnorm = nn.BatchNorm2d if case.x.dim() == 4 else nn.BatchNorm1d
    layer = force_sync(syncbn_dist.convert_model(batchnorm(case.x.size(1))))
    layer.to(device=case.device, dtype=case.x.dtype)
    compiled = torch.compile(layer)

    def step(x: Tensor) -> Tensor:
        layer.zero_grad(set_to_none=True)
        return compiled(x)

    return step


def kernel_times(cfg: KernelProfileConfig) -> dict[str, float]:
    """Mean µs per step of every inductor kernel of the traced layer and of torch's batch-norm kernels."""
    from torch._inductor import config as inductor_config

    torch.set_num_threads(1)
    case = _Case(cfg.shape, getattr(torch, cfg.dtype), cfg.memory_format == "channels_last", torch.device("cpu"))
    steps = (traced_layer(case), case.variants()["F.batch_norm"])
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
    variants = {TRACED: traced_layer(case), **case.variants()}
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


def parse_profile_config(argv: Optional[Sequence[str]]) -> KernelProfileConfig:
    """The config from ``argv``; raises ConfigError, also for channels_last with a shape that is not 4D."""
    cfg = parse_config(KernelProfileConfig, argv, __doc__.splitlines()[0])
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
        cfg = parse_profile_config(argv)
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
    print(f"generated kernels {ours:.1f} µs, torch's {theirs:.1f} µs, ratio {ours / theirs:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
