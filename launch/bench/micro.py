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

import collections
import contextlib
import time
from typing import Any, Callable, Iterator, NamedTuple
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

import syncbn_dist
from launch.common.counting import count_layer
from syncbn_dist.comm import DistributedTransport
from syncbn_dist.kernels import compiled as kernels
from syncbn_dist.layer.batchnorm import _SoloTransport
from syncbn_dist.layer.functions import sync_batch_norm

_MOMENTUM = 0.1
_EPS = 1e-5
# References that may be missing or fail on some device/dtype; F.batch_norm and syncbn_dist must run.
_OPTIONAL = ("torch SyncBatchNorm fn",)
# The baseline of the compiled kernels' targets: F.batch_norm plus syncbn_dist's two collectives.
F_BATCH_NORM_WITH_COLLECTIVES = "F.batch_norm + collectives"
COMPILED = "syncbn_dist compiled"
COMPILED_WITH_PER_CHANNEL = "syncbn_dist compiled, with per-channel"
# Where the compiled layer's time goes: its regions compiled for a group of one (no collective inside), and its step
# with both regions replaced by their first results (what remains is host work around them).
COMPILED_NO_COLLECTIVE = "syncbn_dist compiled, no collective"
COMPILED_REGIONS_REPLAYED = "syncbn_dist compiled, regions replayed"
# Variants whose kernels run inside a compiled graph: the op and byte counters (dispatch modes) cannot see them.
_UNCOUNTED = (COMPILED, COMPILED_NO_COLLECTIVE, COMPILED_REGIONS_REPLAYED)
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


class _Replay:
    """A compiled region of :mod:`syncbn_dist.kernels` that, while ``on``, returns its first call's results for the
    shape, dtype and strides of its first argument."""

    def __init__(self, region: Callable[..., Any]) -> None:
        self.region, self.on, self.results = region, False, {}

    def __call__(self, first: Tensor, *args: Any) -> Any:
        if not self.on:
            return self.region(first, *args)
        key = (first.shape, first.dtype, first.stride())
        if key not in self.results:
            self.results[key] = self.region(first, *args)
        return self.results[key]


def _with_kernels(mode: str, fn: Callable[[Tensor], Tensor], replay: bool = False) -> Callable[[Tensor], Tensor]:
    """``fn`` run with ``syncbn_dist.set_kernels(mode)`` (forward and the backward that follows), the compiled
    regions replayed (:class:`_Replay`) if ``replay``."""

    def run(x: Tensor) -> Tensor:
        syncbn_dist.set_kernels(mode)
        for name in ("_forward_region", "_backward_region"):
            region = getattr(kernels, name)
            if not isinstance(region, _Replay):
                region = _Replay(region)
                setattr(kernels, name, region)
            region.on = replay
        return fn(x)

    return run


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

        def synchronized(x: Tensor, transport: Any = transport) -> Tensor:
            return sync_batch_norm(
                x, self.weight, self.bias, self.running_mean, self.running_var, _MOMENTUM, _EPS, transport
            )

        found: dict[str, Callable[[Tensor], Tensor]] = {
            "F.batch_norm": plain,
            F_BATCH_NORM_WITH_COLLECTIVES: lambda x: _SameCollectives.apply(plain(x)),
            "syncbn_dist": _with_kernels("native", synchronized),
            COMPILED: _with_kernels("compiled", synchronized),
            COMPILED_NO_COLLECTIVE: _with_kernels("compiled", lambda x: synchronized(x, _SoloTransport())),
            COMPILED_REGIONS_REPLAYED: _with_kernels("compiled", synchronized, replay=True),
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
                    if name in _UNCOUNTED:
                        continue
                    op_counter, byte_counter = count_layer(fn, case.x, case.dy, [case.weight, case.bias])
                    ops[name] = op_counter.total
                    bytes_per_element[name] = round(byte_counter.total / case.x.numel(), 2)
                bytes_per_element[TORCH_SYNCBN_MODEL] = TORCH_SYNCBN_CUDA_ACCESSES_PER_ELEMENT * case.x.element_size()
                ratio = medians["syncbn_dist"] / medians["F.batch_norm"]
                if micro["kernel_bytes"]:
                    compiled_bytes = compiled_bytes_per_element(case.x)
                    bytes_per_element[COMPILED] = compiled_bytes.activation
                    bytes_per_element[COMPILED_WITH_PER_CHANNEL] = compiled_bytes.total
                entry = {
                    "shape": list(shape),
                    "dtype": dtype_name,
                    "memory_format": memory_format,
                    "median_ms": {name: 1e3 * m for name, m in medians.items()},
                    "ratio": ratio,
                    "compiled_ratio": medians[COMPILED] / medians[F_BATCH_NORM_WITH_COLLECTIVES],
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
    syncbn_dist.set_kernels("native")
    return {
        "backend": dist.get_backend(),
        "device": "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads(),
        "cases": cases,
        "profile": profiles,
    }


class CompiledBytes(NamedTuple):
    """Bytes per activation element that inductor counts for one layer's compiled forward + backward kernels."""

    activation: float  # accesses of buffers the activation's size (x, y, dy, dx): K3's figure
    total: float  # with the per-channel tensors (statistics, coefficients, row sums): metrics.num_bytes_accessed


@contextlib.contextmanager
def _bytes_by_buffer_numel() -> Iterator[collections.Counter[int]]:
    """Inductor's byte count of every graph compiled inside, split by the numel of the buffer accessed.

    Inductor sums, per kernel, each buffer's accessed bytes (``get_read_write_buffer_accesses``) into
    ``metrics.num_bytes_accessed`` (``GraphLowering.count_bytes``); this records the same per-buffer figures with the
    buffer's element count, so that activation passes and per-channel tensors can be told apart.
    """
    from torch._inductor.graph import GraphLowering

    original = GraphLowering.count_bytes
    by_numel: collections.Counter[int] = collections.Counter()

    def counting(graph: GraphLowering) -> Any:
        for node in graph.scheduler.nodes:
            for name, accessed in node.get_read_write_buffer_accesses(include_reads=True, include_writes=True).items():
                buffer = graph.name_to_buffer.get(name) or graph.graph_inputs[name]
                by_numel[graph.sizevars.optimization_hint(buffer.get_numel(), fallback=0)] += accessed
        return original(graph)

    with mock.patch.object(GraphLowering, "count_bytes", counting):
        yield by_numel


def compiled_bytes_per_element(x: Tensor) -> CompiledBytes:
    """Bytes the compiled kernels of one layer's forward + backward access per element of ``x`` (inductor's
    ``torch._inductor.metrics.num_bytes_accessed``, from a fresh compilation of both regions: new kernel objects,
    the FX graph and AOT autograd caches off); no collective in the regions, which changes no kernel. The
    activation figure counts accesses of buffers with ``x.numel()`` elements only, as
    :data:`TORCH_SYNCBN_CUDA_ACCESSES_PER_ELEMENT` counts torch.nn.SyncBatchNorm's."""
    from torch._inductor import config, metrics

    forward = kernels._CompiledKernel(kernels.forward_region)
    backward = kernels._CompiledKernel(kernels.backward_region)
    x3 = kernels._as_3d(x.detach())
    weight = torch.ones(x.size(1), dtype=kernels._stat_dtype(x), device=x.device)
    torch._logging.set_logs(inductor_metrics=True)  # inductor counts bytes only while this log is on
    try:
        with (
            config.patch(fx_graph_cache=False),
            torch._functorch.config.patch(enable_autograd_cache=False),
            _bytes_by_buffer_numel() as by_numel,
        ):
            metrics.reset()
            _, mean, _, var, count, *_ = forward(x3, weight, weight * 0, _EPS, False, None)
            ones = kernels.channel_ones(x3)
            backward(torch.ones_like(x3), x3, weight, mean, var, count, ones, _EPS, False, None, True)
            accessed = metrics.num_bytes_accessed
    finally:
        torch._logging.set_logs()
    if sum(by_numel.values()) != accessed:
        raise RuntimeError(f"inductor's byte count {accessed} is not the sum of its buffers' {dict(by_numel)}")
    return CompiledBytes(round(by_numel[x.numel()] / x.numel(), 2), round(accessed / x.numel(), 2))
