"""The synchronized layer inside a user's ``torch.compile`` and its eager host cost, on the CPU (issue 34's C rows).

    .venv/bin/python -m launch.bench.compiled_graph                          # prints the table
    .venv/bin/python -m launch.bench.compiled_graph output=docs/performance_compiled_graph.md
    .venv/bin/python -m launch.bench.compiled_graph width=8 image_size=32 batch_size=4 repeats=20

``make bench`` writes ``docs/performance_compiled_graph.md``. One process, a one-member gloo group, and the
ResNet-50 topology (:class:`launch.bench.models.ResNet50`, channels_last) with plain ``nn.BatchNorm2d`` beside the
same model converted and its synchronization forced (:func:`launch.bench.resnet50_step.force_sync`):

- C1: inductor's generated kernels and bytes accessed (``torch._inductor.metrics``) for one training step compiled
  fresh, and the compile time; kernels per BatchNorm layer over plain's, bytes as a ratio;
- C4: what that generated C++ computes per activation element (:mod:`launch.bench.generated_code`): statements in
  float64, roots and divisions, in pointwise loops and in reductions;
- C3: Python function calls (cProfile) in a steady-state compiled step, those of ``torch.distributed``'s and
  syncbn_dist's Python among them (on the CPU, the check of each collective's tag), against the step's collectives;
  in eager mode, the host time of one collective
  of a layer's payload (the transport's ``sum_``, against ``torch.distributed.all_reduce``) and of one synchronized
  layer (forward + backward, native kernels) against ``nn.BatchNorm2d``'s, at a small shape where host work bounds
  both.

Counts are deterministic; times are medians of interleaved repeats on a shared machine.
"""

from __future__ import annotations

import copy
import cProfile
import pstats
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

import syncbn_dist
from launch.bench.generated_code import per_element_statements
from launch.bench.kernel_profile import one_member_group
from launch.bench.models import ResNet50
from launch.bench.resnet50_step import force_sync
from launch.common.config import ConfigError, config_error_exit, parse_config, positive
from syncbn_dist.comm import DistributedTransport


@dataclass
class CompiledGraphConfig:
    width: int = positive(16)  # ResNet-50's first stage width (torchvision: 64)
    image_size: int = positive(32)
    batch_size: int = positive(8)
    repeats: int = positive(200)  # eager timings: median over this many interleaved calls
    output: Optional[str] = None  # a markdown report to write, or None


class InductorCounts(NamedTuple):
    """What inductor generated for one compiled training step: kernels, bytes accessed (its own count), and the
    statements of its loops over activation elements by kind
    (:func:`launch.bench.generated_code.per_element_statements`: ``{"pointwise": Counter, "reduction": Counter}``)."""

    kernels: int
    bytes: int
    per_element: dict[str, Counter[str]]


def inductor_counts(model: nn.Module, x: Tensor) -> InductorCounts:
    """:class:`InductorCounts` for one compiled training step of ``model`` on ``x`` (forward and ``.sum().backward()``),
    compiled fresh: no FX graph or AOT autograd cache. Loops over more than 4 x the model's largest BatchNorm channel
    count are over activation elements (``x``'s batch is at least 8)."""
    from torch._inductor import config, metrics
    from torch._inductor.utils import run_and_get_code

    channels = max(m.num_features for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    torch._dynamo.reset()
    torch._logging.set_logs(inductor_metrics=True)  # inductor counts bytes only while this log is on
    try:
        with config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
            metrics.reset()
            _, sources = run_and_get_code(lambda: torch.compile(model)(x).sum().backward())
            return InductorCounts(
                metrics.generated_kernel_count,
                metrics.num_bytes_accessed,
                per_element_statements(sources, min_elements=4 * channels),
            )
    finally:
        torch._logging.set_logs()


def compiled_step_python_calls(step: Callable[[], Any]) -> tuple[int, int]:
    """cProfile's Python calls in one call of ``step``: all of them, and those in syncbn_dist's or
    ``torch.distributed``'s Python source."""
    profiler = cProfile.Profile()
    profiler.enable()
    step()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    total = sum(calls for _, calls, *_ in stats.values())
    ours = sum(
        calls for (file, *_), (_, calls, *_) in stats.items() if "syncbn_dist" in file or "torch/distributed" in file
    )
    return total, ours


def _median_us(functions: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median µs per call of each function, called in interleaved rounds."""
    times: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            start = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(values)[len(values) // 2] * 1e6 for name, values in times.items()}


def _layers(model: nn.Module) -> int:
    return sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())


def measure(cfg: CompiledGraphConfig) -> dict[str, Any]:
    """Every figure of the report; call inside a one-member gloo group."""
    torch.manual_seed(0)
    x = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size).contiguous(memory_format=torch.channels_last)
    plain = ResNet50(width=cfg.width, num_classes=10).to(memory_format=torch.channels_last)
    ours = force_sync(syncbn_dist.convert_model(copy.deepcopy(plain)))
    result: dict[str, Any] = {"layers": _layers(plain)}
    for name, model in (("plain", plain), ("syncbn_dist", ours)):
        start = time.perf_counter()
        counts = inductor_counts(model, x)
        result[name] = {
            "kernels": counts.kernels,
            "bytes": counts.bytes,
            "compile_s": time.perf_counter() - start,
            "per_element": {kind: dict(counter) for kind, counter in counts.per_element.items()},
        }
    for name, model in (("plain", plain), ("syncbn_dist", ours)):
        compiled = torch.compile(model)
        for _ in range(2):
            compiled(x).sum().backward()
        result[name]["python_calls"], result[name]["python_calls_dist"] = compiled_step_python_calls(
            lambda: compiled(x).sum().backward()  # noqa: B023 - called at once
        )
    result["collectives_per_step"] = 2 * result["layers"]

    payload = torch.zeros(2 * 64 + 1, dtype=torch.float64)
    transport = DistributedTransport(None)
    result["collective_us"] = _median_us(
        {
            "transport.sum_": lambda: transport.sum_(payload),
            "dist.all_reduce": lambda: dist.all_reduce(payload),
        },
        cfg.repeats,
    )
    small = torch.randn(8, 64, 14, 14, requires_grad=True)
    grad = torch.randn_like(small)
    bn = nn.BatchNorm2d(64)
    layer = force_sync(syncbn_dist.convert_model(nn.BatchNorm2d(64)))
    result["layer_us"] = _median_us(
        {
            "nn.BatchNorm2d": lambda: bn(small).backward(grad),
            "syncbn_dist": lambda: layer(small).backward(grad),
        },
        cfg.repeats,
    )
    return result


def render(result: dict[str, Any], cfg: CompiledGraphConfig) -> str:
    """The markdown report of :func:`measure`'s result."""
    plain, ours, layers = result["plain"], result["syncbn_dist"], result["layers"]
    kernels_per_layer = (ours["kernels"] - plain["kernels"]) / layers
    calls_per_layer = (ours["python_calls"] - plain["python_calls"]) / layers
    collective, layer = result["collective_us"], result["layer_us"]
    lines = [
        "# syncbn_dist in a user's torch.compile graph, and its eager host cost (CPU)",
        "",
        f"Generated by `python -m launch.bench.compiled_graph` (`make bench`) with torch {torch.__version__}, one "
        f"process, a one-member gloo group, {torch.get_num_threads()} intra-op thread(s). Model: the ResNet-50 "
        f"topology ({layers} BatchNorm2d) at width {cfg.width}, {cfg.image_size}x{cfg.image_size}, batch "
        f"{cfg.batch_size}, channels_last; syncbn_dist's layers forced to synchronize over the group.",
        "",
        "| training step, `torch.compile` (inductor) | plain nn.BatchNorm2d | syncbn_dist | per layer / ratio |",
        "|---|---|---|---|",
        f"| generated kernels (C1: <= plain + 3 per layer) | {plain['kernels']} | {ours['kernels']} | "
        f"+{kernels_per_layer:.2f} per layer |",
        f"| bytes accessed, inductor's count (C1: <= 1.05x) | {plain['bytes']:,} | {ours['bytes']:,} | "
        f"{ours['bytes'] / plain['bytes']:.3f}x |",
        f"| fresh compile, s | {plain['compile_s']:.1f} | {ours['compile_s']:.1f} | "
        f"{ours['compile_s'] / plain['compile_s']:.2f}x |",
        f"| Python calls in a compiled step (cProfile) | {plain['python_calls']} | {ours['python_calls']} | "
        f"{calls_per_layer:+.2f} per layer |",
        f"| of them in torch.distributed's or syncbn_dist's Python (C3: the CPU tag check, 2 a collective) | "
        f"{plain['python_calls_dist']} | "
        f"{ours['python_calls_dist']} | against {result['collectives_per_step']} collectives a step |",
        "",
        "| per activation element, generated C++ (C4) | plain nn.BatchNorm2d | syncbn_dist | |",
        "|---|---|---|---|",
        *_per_element_rows(plain["per_element"], ours["per_element"]),
        "",
        "| eager host time, median µs | |",
        "|---|---|",
        f"| one collective of a layer's payload (129 float64), the transport's `sum_` | "
        f"{collective['transport.sum_']:.1f} |",
        f"| the same through `torch.distributed.all_reduce` | {collective['dist.all_reduce']:.1f} |",
        f"| one synchronized layer, forward + backward, (8, 64, 14, 14), native kernels | "
        f"{layer['syncbn_dist']:.1f} |",
        f"| nn.BatchNorm2d, the same | {layer['nn.BatchNorm2d']:.1f} |",
        "",
    ]
    return "\n".join(lines)


def _per_element_rows(plain: dict[str, dict[str, int]], ours: dict[str, dict[str, int]]) -> list[str]:
    rows = []
    for loop in ("pointwise", "reduction"):
        for kind, label in (("statements", "statements"), ("double", "of them in float64"), ("root", "roots"),
                            ("division", "divisions")):
            rows.append(f"| {loop} loops: {label} | {plain[loop].get(kind, 0)} | {ours[loop].get(kind, 0)} | |")
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        cfg = parse_config(CompiledGraphConfig, argv, __doc__.splitlines()[0])
    except ConfigError as error:
        return config_error_exit(error)
    torch.set_num_threads(1)
    with one_member_group("cpu"):
        result = measure(cfg)
    report = render(result, cfg)
    print(report)
    if cfg.output is not None:
        Path(cfg.output).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
