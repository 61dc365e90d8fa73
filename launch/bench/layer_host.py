"""The host work of one synchronized layer, per direction: aten ops and Python calls, syncbn_dist's native kernels
against ``torch.nn.SyncBatchNorm``'s (issue 34, item 3), and the eager host time per layer on the CPU.

    .venv/bin/python -m launch.bench.layer_host                        # (8, 64, 14, 14) float32, prints the table
    .venv/bin/python -m launch.bench.layer_host shape=[256,512] repeats=400

- Counts: world size 2 over gloo, steady state (after warm-up), a non-leaf input and ``torch.autograd.grad`` for the
  input, weight and bias (``launch.common.counting.count_layer``'s setting): the ops the forward and the backward
  dispatch (:class:`~launch.common.counting.OpCounter`; on a GPU each is a kernel launch or host work) and the Python
  function calls cProfile sees (built-ins included; the backward's include ``torch.autograd.grad``'s own, the same
  for both). torch's side is ``nn.SyncBatchNorm.forward``'s training path and its autograd function, whose five
  CUDA-only kernels (``batch_norm_stats``, ``batch_norm_gather_stats_with_counts``, ``batch_norm_elemt``,
  ``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``) are registered for CPU tensors in the worker
  processes by plain-op emulations (:func:`_emulate_cuda_kernels`): each still dispatches as one op, and the
  emulations' own Python is left out of the calls. Over gloo torch's function gathers with ``all_gather`` into a
  list (one ``empty_like`` per rank and a ``stack``); over NCCL, ``all_gather_into_tensor`` (one ``empty`` and a
  view): one op fewer at world size 2.
- Time: one process, a one-member gloo group with the synchronization forced, native kernels, one intra-op thread:
  the median µs of a forward + backward against ``nn.BatchNorm2d``'s, interleaved (as ``launch.bench.compiled_graph``
  times its eager rows). Read the ratio; the machine is shared.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from launch.common.config import ConfigError, config_error_exit, parse_config, positive, ruled

_EMULATIONS = __file__
_EMULATION_NAMES = frozenset({"dims", "shape", "stats", "gather", "elemt", "reduce", "backward_elemt"})


@dataclass
class LayerHostConfig:
    shape: list[int] = ruled([8, 64, 14, 14], "2 or 4 positive sizes", lambda v: len(v) in (2, 4) and min(v) > 0)
    repeats: int = positive(300)  # timed rounds (interleaved)


def _emulate_cuda_kernels() -> Any:
    """Register CPU kernels for the five CUDA-only ops of torch's SyncBatchNorm function, written in plain ops (the
    semantics of torch's CUDA kernels, float32 sums: enough for counting). Returns the library (keep it alive)."""
    library = torch.library.Library("aten", "IMPL")

    def dims(x: Tensor) -> list[int]:
        return [0, *range(2, x.dim())]

    def shape(x: Tensor) -> list[int]:
        return [1, -1] + [1] * (x.dim() - 2)

    def stats(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        var, mean = torch.var_mean(x, dims(x), correction=0)
        return mean, torch.rsqrt(var + eps)

    def gather(x: Tensor, mean_all: Tensor, invstd_all: Tensor, running_mean: Optional[Tensor],
               running_var: Optional[Tensor], momentum: float, eps: float, counts: Tensor) -> tuple[Tensor, Tensor]:
        n = counts.view(-1, 1)
        total = n.sum()
        mean = (mean_all * n).sum(0) / total
        var = (((1 / invstd_all**2 - eps) + (mean_all - mean) ** 2) * n).sum(0) / total
        if running_mean is not None and running_var is not None:
            running_mean.lerp_(mean.to(running_mean.dtype), momentum)
            running_var.lerp_((var * total / (total - 1)).to(running_var.dtype), momentum)
        return mean, torch.rsqrt(var + eps)

    def elemt(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor, invstd: Tensor,
              eps: float) -> Tensor:
        y = (x - mean.view(shape(x))) * invstd.view(shape(x))
        y = y if weight is None else y * weight.view(shape(x))
        return y if bias is None else y + bias.view(shape(x))

    def reduce(dy: Tensor, x: Tensor, mean: Tensor, invstd: Tensor, weight: Optional[Tensor], input_g: bool,
               weight_g: bool, bias_g: bool) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
        sum_dy, sum_dy_xmu = dy.sum(dims(x)), (dy * (x - mean.view(shape(x)))).sum(dims(x))
        return sum_dy, sum_dy_xmu, sum_dy_xmu * invstd if weight_g else None, sum_dy if bias_g else None

    def backward_elemt(dy: Tensor, x: Tensor, mean: Tensor, invstd: Tensor, weight: Optional[Tensor], sum_dy: Tensor,
                       sum_dy_xmu: Tensor, count: Tensor) -> Tensor:
        n, s = count.sum(), shape(x)
        grad = dy - (sum_dy / n).view(s) - (x - mean.view(s)) * (invstd**2 * sum_dy_xmu / n).view(s)
        grad = grad * invstd.view(s)
        return grad if weight is None else grad * weight.view(s)

    for name, kernel in (("batch_norm_stats", stats), ("batch_norm_gather_stats_with_counts", gather),
                         ("batch_norm_elemt", elemt), ("batch_norm_backward_reduce", reduce),
                         ("batch_norm_backward_elemt", backward_elemt)):
        library.impl(name, kernel, "CPU")
    return library


class _TorchSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """``nn.SyncBatchNorm.forward``'s training path (without its refusal of CPU tensors), on the world group."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        import torch.distributed as dist
        from torch.nn.modules._functions import SyncBatchNorm as function

        self._check_input_dim(input)
        if input.size(1) == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / self.num_batches_tracked.item()
        running_mean = self.running_mean if not self.training or self.track_running_stats else None
        running_var = self.running_var if not self.training or self.track_running_stats else None
        process_group = dist.group.WORLD
        world_size = dist.get_world_size(process_group)
        return function.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, momentum, process_group, world_size
        )


def _calls_outside(profile: cProfile.Profile, file: str) -> int:
    """cProfile's call count, leaving out the calls of :func:`_emulate_cuda_kernels`' functions (defined in ``file``)
    and every call they make."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    skipped = {f for f in stats if f[0] == file and f[2] in _EMULATION_NAMES}
    total = 0
    for function, (_, calls, _, _, callers) in stats.items():
        if function in skipped:
            continue
        if not callers:
            total += calls
        total += sum((c[1] if isinstance(c, tuple) else c) for caller, c in callers.items() if caller not in skipped)
    return total


def _count(layer: nn.Module, shape: list[int], rank: int) -> dict[str, int]:
    from launch.common.counting import OpCounter

    gen = torch.Generator().manual_seed(rank)
    leaf = torch.randn(shape, generator=gen).requires_grad_()
    dy = torch.randn(shape, generator=gen)
    params = [layer.weight, layer.bias]
    for _ in range(3):  # warm-up: one-time work (syncbn_dist's agreement check)
        x = leaf * 1.0
        torch.autograd.grad(layer(x), [x, *params], dy)
    x = leaf * 1.0
    with OpCounter() as forward:
        y = layer(x)
    with OpCounter() as backward:
        torch.autograd.grad(y, [x, *params], dy)
    x = leaf * 1.0
    profile = cProfile.Profile()
    profile.enable()
    y = layer(x)
    profile.disable()
    forward_calls = _calls_outside(profile, _EMULATIONS)
    profile = cProfile.Profile()
    profile.enable()
    torch.autograd.grad(y, [x, *params], dy)
    profile.disable()
    return {"forward ops": forward.total, "backward ops": backward.total, "forward calls": forward_calls,
            "backward calls": _calls_outside(profile, _EMULATIONS)}


def _worker(rank: int, world_size: int, shape: list[int]) -> dict[str, dict[str, int]]:
    import syncbn_dist

    library = _emulate_cuda_kernels()
    plain = nn.BatchNorm2d(shape[1]) if len(shape) == 4 else nn.BatchNorm1d(shape[1])
    torch_layer = _TorchSyncBatchNorm(shape[1])
    counts = {"syncbn_dist": _count(syncbn_dist.convert_model(plain), shape, rank),
              "torch.nn.SyncBatchNorm": _count(torch_layer, shape, rank)}
    del library
    return counts


def _times(shape: list[int], repeats: int) -> dict[str, float]:
    import syncbn_dist
    from launch.bench.compiled_graph import _median_us
    from launch.bench.kernel_profile import one_member_group
    from launch.bench.resnet50_step import force_sync

    with one_member_group("cpu"):
        x = torch.randn(shape, requires_grad=True)
        grad = torch.randn(shape)
        plain = nn.BatchNorm2d(shape[1]) if len(shape) == 4 else nn.BatchNorm1d(shape[1])
        layer = force_sync(syncbn_dist.convert_model(nn.BatchNorm2d(shape[1]) if len(shape) == 4
                                                     else nn.BatchNorm1d(shape[1])))
        for _ in range(5):
            layer(x).backward(grad)
            plain(x).backward(grad)
        return _median_us({"plain": lambda: plain(x).backward(grad), "syncbn_dist": lambda: layer(x).backward(grad)},
                          repeats)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        cfg = parse_config(LayerHostConfig, argv, __doc__.splitlines()[0])
    except ConfigError as error:
        return config_error_exit(error)
    from launch.common.spawn import run_distributed

    counts = run_distributed(_worker, 2, cfg.shape, timeout=300)[0]
    torch.set_num_threads(1)
    times = _times(cfg.shape, cfg.repeats)
    print(f"# One synchronized layer's host work, {tuple(cfg.shape)} float32, torch {torch.__version__}\n")
    print("| per layer | forward ops | backward ops | forward Python calls | backward Python calls |")
    print("|---|---|---|---|---|")
    for name, row in counts.items():
        print(f"| {name} | {row['forward ops']} | {row['backward ops']} | {row['forward calls']} | "
              f"{row['backward calls']} |")
    print(f"\neager CPU forward + backward, one-member group, 1 thread: syncbn_dist {times['syncbn_dist']:.1f} µs, "
          f"nn.BatchNorm{len(cfg.shape) - 2 or 1}d {times['plain']:.1f} µs, ratio "
          f"{times['syncbn_dist'] / times['plain']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
