"""The single-layer microbenchmark worker: forward+backward of one synchronized layer against F.batch_norm.

It runs in a one-member process group. ``syncbn_dist`` is forced through its synchronized path with a
:class:`syncbn_dist.comm.DistributedTransport` on that group (the module itself would skip the collective
for one member), so the figure is the local compute of the sync path plus a one-member all_reduce. On CUDA
it also times torch's own ``SyncBatchNorm`` autograd function at world size 1 (the one ``nn.SyncBatchNorm``
runs in training). Every variant is timed in the same repetition loop (A B C A B C ...); the result is the
median per variant, with the aten ops and the bytes per activation element one forward+backward dispatches and
moves at the op interface (:func:`launch.common.counting.count_layer`: non-leaf input, ``autograd.grad`` for input,
weight and bias), beside the modelled bytes of torch.nn.SyncBatchNorm's CUDA kernel sequence
(:data:`TORCH_SYNCBN_CUDA_ACCESSES_PER_ELEMENT`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

from launch.common.counting import count_layer
from syncbn_dist.comm import DistributedTransport
from syncbn_dist.layer.functions import sync_batch_norm

_MOMENTUM = 0.1
_EPS = 1e-5
# References that may be missing or fail on some device/dtype; F.batch_norm and syncbn_dist must run.
_OPTIONAL = ("torch SyncBatchNorm fn",)
# F.batch_norm plus syncbn_dist's two collectives: the floor of any synchronized BatchNorm with one collective per
# direction.
F_BATCH_NORM_WITH_COLLECTIVES = "F.batch_norm + collectives"
# torch.nn.SyncBatchNorm's CUDA kernels touch each activation element 8 times at their interface: forward
# batch_norm_stats reads x (1) and batch_norm_elemt reads x and writes y (2); backward batch_norm_backward_reduce
# reads dy and x (2) and batch_norm_backward_elemt reads dy and x and writes dx (3). Per-channel tensors and the
# collectives are O(C). 8 x 4 = 32 bytes per float32 element (16 for bfloat16): the floor of any exact design with
# one collective per direction (statistics before normalizing, reductions before dx).
TORCH_SYNCBN_CUDA_ACCESSES_PER_ELEMENT = 8
TORCH_SYNCBN_MODEL = "torch SyncBatchNorm CUDA (model)"


class _SameCollectives(torch.autograd.Function):
    """Identity on the output of F.batch_norm that sends syncbn_dist's two collectives: (2C + 6,) float64 in each
    direction, the statistics and the collective's tag (dummy payloads)."""

    @staticmethod
    def forward(ctx: Any, output: Tensor) -> Tensor:
        num_features = output.size(1)
        dist.all_reduce(output.new_zeros(2 * num_features + 6, dtype=torch.float64))
        ctx.num_features = num_features
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        dist.all_reduce(grad.new_zeros(2 * ctx.num_features + 6, dtype=torch.float64))
        return grad


class _Case:
    """Inputs and per-variant closures for one (shape, dtype, memory format)."""

    def __init__(self, shape: list[int], dtype: torch.dtype, channels_last: bool, device: torch.device) -> None:
        generator = torch.Generator().manual_seed(0)
        num_features = shape[1]
        x = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
        dy = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
        if channels_last:
            x, dy = x.contiguous(memory_format=torch.channels_last), dy.contiguous(memory_format=torch.channels_last)
        self.x = x.requires_grad_()
        self.dy = dy
        # Parameters and buffers in the input dtype, as after ``model.to(dtype)``.
        self.weight = torch.ones(num_features, device=device, dtype=dtype).requires_grad_()
        self.bias = torch.zeros(num_features, device=device, dtype=dtype).requires_grad_()
        self.running_mean = torch.zeros(num_features, device=device, dtype=dtype)
        self.running_var = torch.ones(num_features, device=device, dtype=dtype)
        self.device = device

    def variants(self) -> dict[str, Callable[[Tensor], Tensor]]:
        transport = DistributedTransport(None)
        def plain(x: Tensor) -> Tensor:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True, _MOMENTUM, _EPS)

        def synchronized(x: Tensor) -> Tensor:
            return sync_batch_norm(
                x, self.weight, self.bias, self.running_mean, self.running_var, _MOMENTUM, _EPS, transport
            )

        found: dict[str, Callable[[Tensor], Tensor]] = {
            "F.batch_norm": plain,
            F_BATCH_NORM_WITH_COLLECTIVES: lambda x: _SameCollectives.apply(plain(x)),
            "syncbn_dist": synchronized,
        }
        if self.device.type == "cuda":
            from torch.nn.modules._functions import SyncBatchNorm as TorchSyncBatchNormFunction

            found["torch SyncBatchNorm fn"] = lambda x: TorchSyncBatchNormFunction.apply(
                x, self.weight, self.bias, self.running_mean, self.running_var, _EPS, _MOMENTUM, dist.group.WORLD, 1
            )
        return found

    def run(self, fn: Callable[[Tensor], Tensor]) -> None:
        self.x.grad = self.weight.grad = self.bias.grad = None
        fn(self.x).backward(self.dy)

    def timed(self, fn: Callable[[Tensor], Tensor]) -> float:
        self.x.grad = self.weight.grad = self.bias.grad = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        fn(self.x).backward(self.dy)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start


def _top_ops(case: _Case, fn: Callable[[Tensor], Tensor], repeats: int, count: int) -> list[dict[str, Any]]:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if case.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            case.run(fn)
    averages = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [
        {"op": e.key, "self_cpu_us": round(e.self_cpu_time_total / repeats, 1), "calls": e.count // repeats}
        for e in averages[:count]
    ]


def micro_worker(rank: int, world_size: int, micro: dict[str, Any]) -> dict[str, Any]:
    """Time every case of ``micro`` (a :class:`launch.bench.config.MicroConfig` as a dict) in a one-member group."""
    assert world_size == 1, "the microbenchmark runs in a one-member group"
    device = torch.device("cuda", 0) if dist.get_backend() == "nccl" else torch.device("cpu")
    cases = []
    worst: tuple[float, Any] = (0.0, None)
    for shape in micro["shapes"]:
        for dtype_name in micro["dtypes"]:
            for memory_format in micro["memory_formats"]:
                if memory_format == "channels_last" and len(shape) != 4:
                    continue  # channels_last exists for 4D tensors only
                case = _Case(shape, getattr(torch, dtype_name), memory_format == "channels_last", device)
                fns = case.variants()
                errors = {}
                for name in _OPTIONAL:
                    if name in fns:  # an optional reference that fails (e.g. a dtype it lacks) is reported, not fatal
                        try:
                            case.run(fns[name])
                        except Exception as error:  # noqa: BLE001 - recorded in the report
                            errors[name] = repr(error)
                            del fns[name]
                for _ in range(micro["warmup"]):
                    for fn in fns.values():
                        case.run(fn)
                times: dict[str, list[float]] = {name: [] for name in fns}
                for _ in range(micro["repeats"]):
                    for name, fn in fns.items():
                        times[name].append(case.timed(fn))
                medians = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
                ops, bytes_per_element = {}, {}
                for name, fn in fns.items():
                    op_counter, byte_counter = count_layer(fn, case.x, case.dy, [case.weight, case.bias])
                    ops[name] = op_counter.total
                    bytes_per_element[name] = round(byte_counter.total / case.x.numel(), 2)
                bytes_per_element[TORCH_SYNCBN_MODEL] = TORCH_SYNCBN_CUDA_ACCESSES_PER_ELEMENT * case.x.element_size()
                ratio = medians["syncbn_dist"] / medians["F.batch_norm"]
                entry = {
                    "shape": list(shape),
                    "dtype": dtype_name,
                    "memory_format": memory_format,
                    "median_ms": {name: 1e3 * m for name, m in medians.items()},
                    "ratio": ratio,
                    "ops": ops,
                    "bytes_per_element": bytes_per_element,
                    "errors": errors,
                }
                cases.append(entry)
                if ratio > worst[0]:
                    worst = (ratio, (case, fns, entry))
    profiles = {}
    if micro["profile"] and worst[1] is not None:
        case, fns, entry = worst[1]
        profiles = {
            "case": {k: entry[k] for k in ("shape", "dtype", "memory_format")},
            "ops": {name: _top_ops(case, fn, 5, micro["profile_top"]) for name, fn in fns.items()},
        }
    return {
        "backend": dist.get_backend(),
        "device": "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads(),
        "cases": cases,
        "profile": profiles,
    }

