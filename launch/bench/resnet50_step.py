"""A ResNet-50 training step with each library's synchronized BatchNorm forced over a one-member group (issue 34).

    python3 -m launch.bench.resnet50_step output=outputs/bench_gpu/resnet50_step.md   # a GPU box: the G1-G3 tables
    python3 -m launch.bench.resnet50_step 'variants=[plain,torch_function,syncbn_dist_native]' dtypes=[bfloat16]
    .venv/bin/python -m launch.bench.resnet50_step device=cpu width=8 image_size=32 batch_size=4 steps=2 \\
        warmup=2 rounds=1 compile_backend=aot_eager                                    # CPU, toy size, seconds

The model is :class:`launch.bench.models.ResNet50` (torchvision's resnet50 topology, 53 BatchNorm2d) in
channels_last, one fixed batch of ``(batch_size, 3, image_size, image_size)`` images, cross-entropy, SGD with
momentum; each step is ``zero_grad``, forward and loss (under bf16 autocast for ``bfloat16``, parameters float32
either way), backward and ``optimizer.step()``. One process, the default group of this process alone (NCCL on
cuda, gloo on cpu), and every synchronized variant forced through its synchronized path although the group has one
member, as on several GPUs:

- ``plain``: ``nn.BatchNorm2d`` (cuDNN on cuda), no collective;
- ``torch_function``: ``torch.nn.modules._functions.SyncBatchNorm`` (what ``nn.SyncBatchNorm`` runs on several
  GPUs) with ``world_size=1``; CUDA only, its kernels refuse CPU tensors;
- ``naive``: :class:`launch.bench.models.NaiveSyncBatchNorm2d`, a differentiable all_reduce of E[x], E[x^2];
- ``syncbn_dist_native``: :func:`syncbn_dist.convert_model` with each layer's transport a
  :class:`syncbn_dist.comm.DistributedTransport` on the group (:func:`force_sync`), eager;
- ``plain_compile``, ``syncbn_dist_compile``: ``torch.compile(model)`` of ``plain`` and of ``syncbn_dist_native``'s
  model (``mode="default"``); ``plain_reduce_overhead``, ``syncbn_dist_reduce_overhead``: the same with
  ``mode="reduce-overhead"`` (CUDA graphs; CUDA only, inductor only).

Eager variants run in every dtype of ``dtypes``, the torch.compile ones in every dtype of ``compile_dtypes``. Each
(variant, dtype) is a row with its own copy of one initial model. The first two steps of every row are checked
against ``plain``'s in the same dtype (the losses, and the logits of the first step); with the layer forced onto a
group of one, every synchronized variant computes plain BatchNorm, so they differ by rounding only. After
``warmup`` steps, one step of each row is counted: collectives per step (``torch.profiler``'s ``c10d::`` op events,
e.g. ``c10d::allreduce_``: an eager ``torch.distributed`` call, a functional collective and a compiled graph's
collective each dispatch one; not counted inside a replayed CUDA graph) and, on cuda, the CUDA kernels one step
runs (the profiler's device events, copies and fills left out; not counted in a replayed CUDA graph either) and the
device time of the step (every device event's duration summed, CUDA graphs included: the cost once the host is
hidden); then, in eager rows, the aten ops one step dispatches (:class:`launch.common.counting.OpCounter`; not
torch.compile rows, which Dynamo would leave eager for good). Then ``rounds`` interleaved rounds run ``steps`` steps
of every row each, the first row rotating (launch/bench/step.py's rounds), each step timed alone: CUDA events on
cuda, ``perf_counter`` on cpu. A row's time is the median over its ``rounds * steps`` steps, in ms.

It prints one markdown table (ms per step, ratio to ``plain`` in the same dtype and mode, aten ops, collectives,
CUDA kernels and device ms per step), the skipped rows with the reason, and issue 34's targets: G1 syncbn_dist
eager / torch's function eager (<= 0.9), G2 syncbn_dist / plain under ``torch.compile`` (<= 1.15), G3 the same under
``mode="reduce-overhead"`` (<= 1.10). With ``output=PATH`` it writes that markdown to PATH followed by every
measurement and the resolved config as JSON in a fenced block (:func:`read_report` reads it back): one file.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules._functions import SyncBatchNorm as TorchSyncBatchNormFunction
from torch.profiler import ProfilerActivity, profile

import syncbn_dist
from launch.bench.config import _each_of
from launch.bench.kernel_profile import one_member_group
from launch.bench.models import NaiveSyncBatchNorm2d, ResNet50, _naive_from, _replace_batchnorm
from launch.bench.report import _table
from launch.bench.summary import fmt
from launch.common.config import ConfigError, config_error_exit, one_of, parse_config, positive, ruled
from launch.common.counting import OpCounter
from launch.common.io import write_text
from syncbn_dist.comm import DistributedTransport
from syncbn_dist.layer.batchnorm import SyncBatchNorm

EAGER_VARIANTS = ("plain", "torch_function", "naive", "syncbn_dist_native")
# torch.compile variant -> (the eager variant whose model it compiles, torch.compile's mode).
COMPILED_VARIANTS = {
    "plain_compile": ("plain", "default"),
    "syncbn_dist_compile": ("syncbn_dist_native", "default"),
    "plain_reduce_overhead": ("plain", "reduce-overhead"),
    "syncbn_dist_reduce_overhead": ("syncbn_dist_native", "reduce-overhead"),
}
VARIANTS = EAGER_VARIANTS + tuple(COMPILED_VARIANTS)
# Why a variant cannot run on CPU.
CUDA_ONLY = {
    "torch_function": "torch's batch_norm_stats/batch_norm_elemt kernels are CUDA only (they refuse CPU tensors)",
    "plain_reduce_overhead": 'mode="reduce-overhead" is CUDA graphs: CUDA only',
    "syncbn_dist_reduce_overhead": 'mode="reduce-overhead" is CUDA graphs: CUDA only',
}
LABELS = {
    "plain": "plain nn.BatchNorm2d",
    "torch_function": "torch.nn.SyncBatchNorm's function",
    "naive": "naive (all_reduce of E[x], E[x²])",
    "syncbn_dist_native": "syncbn_dist, native kernels",
    "plain_compile": "plain, torch.compile",
    "syncbn_dist_compile": "syncbn_dist, torch.compile",
    "plain_reduce_overhead": 'plain, torch.compile "reduce-overhead"',
    "syncbn_dist_reduce_overhead": 'syncbn_dist, torch.compile "reduce-overhead"',
}
STEP_DTYPES = ("bfloat16", "float32")
# Issue 34's targets: (id, what, numerator variant, denominator variant, bound on the ratio of their medians).
TARGETS = (
    ("G1", "syncbn_dist eager / torch's function eager", "syncbn_dist_native", "torch_function", 0.9),
    ("G2", 'syncbn_dist / plain, torch.compile mode="default"', "syncbn_dist_compile", "plain_compile", 1.15),
    ("G3", 'syncbn_dist / plain, mode="reduce-overhead"', "syncbn_dist_reduce_overhead", "plain_reduce_overhead", 1.10),
)
# The row each variant's ratio is taken against: plain in the same dtype and the same compile mode.
BASELINE = {
    **{v: "plain" for v in EAGER_VARIANTS},
    **{v: "plain_compile" for v, (_, mode) in COMPILED_VARIANTS.items() if mode == "default"},
    **{v: "plain_reduce_overhead" for v, (_, mode) in COMPILED_VARIANTS.items() if mode == "reduce-overhead"},
}
_JSON_FENCE = "```json"


@dataclass
class ResNet50StepConfig:
    device: str = one_of("cuda", "cpu", "cuda")
    width: int = positive(64)  # the stem's width; torchvision's ResNet-50 is 64 (25.6 M parameters)
    # 32 or more: ResNet-50 divides the side by 32 (the last stage is 1x1 at 32).
    image_size: int = ruled(224, ">= 32", lambda v: v >= 32)
    batch_size: int = ruled(64, ">= 2", lambda v: v >= 2)  # >= 2 values per channel at the 1x1 last stage
    num_classes: int = positive(1000)
    steps: int = positive(5)  # timed steps of every row per round
    rounds: int = positive(4)
    # Untimed steps of every row first; the first two are the checked ones, and reduce-overhead records its CUDA
    # graphs in its first calls.
    warmup: int = ruled(3, ">= 2", lambda v: v >= 2)
    dtypes: list[str] = _each_of(list(STEP_DTYPES), STEP_DTYPES)  # the eager rows' dtypes
    compile_dtypes: list[str] = _each_of(["bfloat16"], STEP_DTYPES)  # the torch.compile rows' dtypes
    variants: list[str] = ruled(
        list(VARIANTS),
        "listing distinct variants among " + " | ".join(repr(v) for v in VARIANTS),
        lambda v: bool(v) and len(set(v)) == len(v) and set(v) <= set(VARIANTS),
    )
    compile_backend: str = "inductor"  # torch.compile's backend; mode is passed to inductor only
    lr: float = positive(0.1)
    momentum: float = ruled(0.9, "in [0, 1)", lambda v: 0 <= v < 1)
    seed: int = 0
    output: Optional[str] = None  # a markdown file: the table, then the JSON record


def parse(argv: Optional[Sequence[str]]) -> ResNet50StepConfig:
    """The config from ``argv``.

    Raises:
        ConfigError: see :func:`launch.common.config.load_config`; also for ``device=cuda`` without CUDA, and for
            ``mode="reduce-overhead"`` variants with a backend other than inductor.
    """
    cfg = parse_config(ResNet50StepConfig, argv, __doc__.splitlines()[0])
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config key 'device': 'cuda' was asked for but CUDA is not available")
    reduce_overhead = [v for v in cfg.variants if COMPILED_VARIANTS.get(v, ("", ""))[1] == "reduce-overhead"]
    if reduce_overhead and cfg.compile_backend != "inductor" and cfg.device == "cuda":
        raise ConfigError(
            f"config key 'compile_backend': variants {reduce_overhead} need 'inductor' (got {cfg.compile_backend!r})"
        )
    return cfg


class _ForcedSync:
    """Mixed into a converted syncbn_dist layer: in training its transport is a :class:`DistributedTransport` on
    its ``process_group`` even where the group has one member (whose layer would run plain BatchNorm)."""

    process_group: Optional[Any]
    training: bool

    def _select_transport(
        self, input: Tensor, compiling: bool, recomputing: bool = False
    ) -> Optional[DistributedTransport]:
        return DistributedTransport(self.process_group) if self.training else None


@functools.cache
def _forced_class(cls: type) -> type:
    return type("Forced" + cls.__name__, (_ForcedSync, cls), {"__module__": __name__})


def force_sync(model: nn.Module) -> nn.Module:
    """Make every syncbn_dist layer of ``model`` synchronize over its process group in training, even a group of one.

    Each :class:`syncbn_dist.SyncBatchNorm` below ``model`` becomes an instance of a subclass of its own class whose
    only change is the transport (the benchmark's and the gpu tests' forcing; the library itself never does this).
    Returns ``model``.
    """
    for module in model.modules():
        if isinstance(module, SyncBatchNorm) and not isinstance(module, _ForcedSync):
            module.__class__ = _forced_class(type(module))
    return model


class TorchFunctionBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose training forward is torch's ``SyncBatchNorm`` autograd function on the default group
    with ``world_size=1`` (as ``nn.SyncBatchNorm.forward`` calls it on several GPUs); eval is ``nn.BatchNorm2d``.

    CUDA only: the function's ``batch_norm_stats`` and ``batch_norm_elemt`` have no CPU kernels.
    """

    def forward(self, input: Tensor) -> Tensor:
        if not self.training:
            return super().forward(input)
        self.num_batches_tracked.add_(1)
        # nn.SyncBatchNorm's factor: momentum, or the cumulative average's 1 / num_batches_tracked.
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        return TorchSyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.running_mean, self.running_var, self.eps, momentum, dist.group.WORLD, 1
        )


def _torch_function_from(old: nn.BatchNorm2d) -> nn.Module:
    new = TorchFunctionBatchNorm2d(old.num_features, old.eps, old.momentum)
    new.load_state_dict(old.state_dict())
    return new.to(old.weight.device)


def build_variant(eager_variant: str, base: nn.Module) -> nn.Module:
    """A deep copy of ``base`` (plain ``nn.BatchNorm2d`` layers, same weights) as ``eager_variant``'s model, its
    synchronized path forced on the default group.

    Raises:
        ValueError: for a name not in :data:`EAGER_VARIANTS`.
    """
    model = copy.deepcopy(base)
    if eager_variant == "plain":
        return model
    if eager_variant == "torch_function":
        return _replace_batchnorm(model, _torch_function_from)
    if eager_variant == "naive":
        model = _replace_batchnorm(model, _naive_from(None))
        for module in model.modules():
            if isinstance(module, NaiveSyncBatchNorm2d):
                module.sync_alone = True
        return model
    if eager_variant == "syncbn_dist_native":
        return force_sync(syncbn_dist.convert_model(model))
    raise ValueError(f"expected a variant in {EAGER_VARIANTS} (got {eager_variant!r})")


# A row's counts, each None where not counted (:func:`_profiled_counts`, :class:`OpCounter`).
COUNTS = ("aten_ops", "collectives", "cuda_kernels", "device_ms")


class _Row:
    """One (variant, dtype): its own copy of the model, its SGD optimizer, and :meth:`step`, one training step."""

    def __init__(self, variant: str, dtype: str, base: nn.Module, cfg: ResNet50StepConfig, x: Tensor, y: Tensor):
        eager, mode = COMPILED_VARIANTS.get(variant, (variant, None))
        self.variant, self.dtype, self.mode = variant, dtype, mode
        self.model = build_variant(eager, base)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        self.forward: Callable[[Tensor], Tensor] = self.model
        if mode is not None:
            compile_mode = mode if cfg.compile_backend == "inductor" else None  # other backends take no mode
            self.forward = torch.compile(self.model, backend=cfg.compile_backend, mode=compile_mode)
        self.x, self.y = x, y
        self.times_ms: list[float] = []
        self.measured: dict[str, Any] = {}

    def step(self) -> tuple[Tensor, Tensor]:
        """zero_grad, forward and cross-entropy (bf16 autocast for ``bfloat16``), backward, SGD step.

        Returns the (batch_size, num_classes) logits and the loss, not synchronized with the device.
        """
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs may be overwritten now
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.x.device.type, dtype=torch.bfloat16, enabled=self.dtype == "bfloat16"):
            logits = self.forward(self.x)
            loss = F.cross_entropy(logits, self.y)
        loss.backward()
        self.optimizer.step()
        return logits, loss


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_steps(row: _Row, steps: int, device: torch.device) -> list[float]:
    """ms of each of ``steps`` consecutive steps: CUDA events around each on cuda (the host does not wait between
    steps), ``perf_counter`` on cpu."""
    _synchronize(device)
    if device.type != "cuda":
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            row.step()
            times.append(1e3 * (time.perf_counter() - start))
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        row.step()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def _profiled_counts(row: _Row, device: torch.device) -> dict[str, Any]:
    """What one profiled step of ``row`` runs: ``collectives`` (the profiler's ``c10d::`` op events: eager
    ``torch.distributed`` calls, functional collectives and compiled graphs' collectives each dispatch one), and on
    cuda ``cuda_kernels`` (copies and fills left out) and ``device_ms``, the summed duration of every device event
    (kernels, copies and fills, in ms: the device's busy time, the step's cost once the host is hidden).

    In a replayed CUDA graph (``mode="reduce-overhead"``) no op is dispatched, so only ``device_ms`` is reported."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        row.step()
        _synchronize(device)
    events = prof.key_averages()
    replayed = row.mode == "reduce-overhead"
    counts: dict[str, Any] = {
        "collectives": None if replayed else sum(e.count for e in events if e.key.startswith("c10d::")),
        "cuda_kernels": None,
        "device_ms": None,
    }
    if device.type != "cuda":
        return counts
    on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    if not replayed:
        counts["cuda_kernels"] = sum(e.count for e in on_device if not e.key.startswith(("Memcpy", "Memset")))
    counts["device_ms"] = sum(e.device_time_total for e in on_device) / 1e3
    return counts


def _check_and_warm_up(row: _Row, warmup: int, device: torch.device) -> None:
    """The first ``warmup`` steps; the first two losses and the first step's logits (float32, on the host) go into
    ``row.measured``, with the warm-up's seconds and, for torch.compile rows, Dynamo's graph breaks and inductor's
    CUDA-graph skips."""
    torch._dynamo.utils.counters.clear()
    started = time.perf_counter()
    logits, loss = row.step()
    first_logits = logits.detach().float().cpu()
    losses = [loss.item()]
    losses.append(row.step()[1].item())
    for _ in range(warmup - 2):
        row.step()
    _synchronize(device)
    row.measured.update(losses=losses, warmup_s=round(time.perf_counter() - started, 2))
    row.first_logits = first_logits
    if row.mode is not None:
        counters = torch._dynamo.utils.counters
        row.measured["graph_breaks"] = sum(counters["graph_break"].values())
        row.measured["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]


def measure(cfg: ResNet50StepConfig) -> dict[str, Any]:
    """Every row of ``cfg`` checked, counted and timed in the current one-member default group; the report's record.

    Returns ``{"device", "torch", "config", "rows": [...], "skipped": {variant: reason}, "targets": [...]}``; each row
    has ``variant``, ``dtype``, ``mode``, ``median_ms``, ``times_ms``, ``ratio`` (to ``baseline``), ``aten_ops``,
    ``collectives``, ``cuda_kernels``, ``device_ms`` (None where not counted), ``losses`` (the first two steps'),
    ``max_abs_logit_diff`` (the first step's logits against eager ``plain``'s in the same dtype) and ``warmup_s``.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    torch.manual_seed(cfg.seed)
    base = ResNet50(width=cfg.width, num_classes=cfg.num_classes).to(device, memory_format=torch.channels_last)
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    x = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size, generator=generator)
    x = x.to(device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(cfg.num_classes, (cfg.batch_size,), generator=generator).to(device)

    skipped = {v: CUDA_ONLY[v] for v in cfg.variants if device.type == "cpu" and v in CUDA_ONLY}
    rows = [
        _Row(variant, dtype, base, cfg, x, y)
        for variant in cfg.variants
        if variant not in skipped
        for dtype in (cfg.compile_dtypes if variant in COMPILED_VARIANTS else cfg.dtypes)
    ]
    # Each torch.compile row is a new model instance under the same code (ResNet50.forward): one cache entry each.
    with torch._dynamo.config.patch(cache_size_limit=max(8, 2 * len(rows))):
        for row in rows:
            print(f"[resnet50_step] {row.variant} {row.dtype}: warm-up ...", flush=True)
            _check_and_warm_up(row, cfg.warmup, device)
        for row in rows:
            row.measured.update(_profiled_counts(row, device))
            if row.variant in EAGER_VARIANTS:  # a torch.compile frame met under a dispatch mode stays eager for good
                with OpCounter() as ops:
                    row.step()
                row.measured["aten_ops"] = ops.total
        for index in range(cfg.rounds):
            shift = index % max(len(rows), 1)
            for row in rows[shift:] + rows[:shift]:  # every row once per round, the first one rotating
                row.times_ms += _timed_steps(row, cfg.steps, device)

    plain = {row.dtype: row for row in rows if row.variant == "plain"}
    medians = {(row.variant, row.dtype): statistics.median(row.times_ms) for row in rows}
    records = []
    for row in rows:
        baseline = medians.get((BASELINE[row.variant], row.dtype))
        reference = plain.get(row.dtype)
        records.append(
            {
                "variant": row.variant,
                "label": LABELS[row.variant],
                "dtype": row.dtype,
                "mode": row.mode,
                "median_ms": medians[(row.variant, row.dtype)],
                "times_ms": row.times_ms,
                "baseline": BASELINE[row.variant],
                "ratio": None if baseline is None else medians[(row.variant, row.dtype)] / baseline,
                "aten_ops": row.measured.get("aten_ops"),
                "collectives": row.measured.get("collectives"),
                "cuda_kernels": row.measured.get("cuda_kernels"),
                "device_ms": row.measured.get("device_ms"),
                "max_abs_logit_diff": None
                if reference is None
                else (row.first_logits - reference.first_logits).abs().max().item(),
                **{k: v for k, v in row.measured.items() if k not in COUNTS},
            }
        )
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "config": dataclasses.asdict(cfg),
        "rows": records,
        "skipped": skipped,
        "targets": _targets(medians, cfg),
    }


def _targets(medians: dict[tuple[str, str], float], cfg: ResNet50StepConfig) -> list[dict[str, Any]]:
    """Issue 34's G rows, one per target, numerator and dtype: the ratio of the two medians, None where one of them
    did not run."""
    found = []
    for target, what, numerator, denominator, bound in TARGETS:
        dtypes = cfg.compile_dtypes if numerator in COMPILED_VARIANTS else cfg.dtypes
        for dtype in dtypes:
            if numerator not in cfg.variants or denominator not in cfg.variants:
                continue
            over = medians.get((denominator, dtype))
            ratio = None if over is None or (numerator, dtype) not in medians else medians[(numerator, dtype)] / over
            found.append(
                {
                    "id": target,
                    "what": what,
                    "numerator": numerator,
                    "denominator": denominator,
                    "dtype": dtype,
                    "ratio": ratio,
                    "bound": bound,
                    "met": None if ratio is None else ratio <= bound,
                }
            )
    return found


def _count(value: Optional[int]) -> str:
    return "–" if value is None else str(value)


def markdown(record: dict[str, Any]) -> str:
    """The report's tables: every row's ms per step, ratio, counts; the skipped variants; the G targets."""
    cfg = record["config"]
    timed = cfg["rounds"] * cfg["steps"]
    lines = [
        "## ResNet-50 training step, synchronization forced over a one-member group",
        "",
        f"{record['device']}, torch {record['torch']}: ResNet-50 topology at width {cfg['width']}, batch "
        f"{cfg['batch_size']}, {cfg['image_size']}×{cfg['image_size']}, channels_last, SGD with momentum; median "
        f"of {timed} steps ({cfg['rounds']} interleaved rounds × {cfg['steps']}) after {cfg['warmup']} warm-up "
        f"steps; ratio to plain in the same dtype and mode. Counts per step: aten ops dispatched, collectives, CUDA "
        "kernels, and the device's busy time in ms (the summed duration of one profiled step's device events; – where "
        "not counted).",
        "",
    ]
    rows = [
        [
            row["label"],
            row["dtype"],
            fmt(row["median_ms"], ".2f"),
            fmt(row["ratio"], ".2f"),
            _count(row["aten_ops"]),
            _count(row["collectives"]),
            _count(row["cuda_kernels"]),
            "–" if row["device_ms"] is None else fmt(row["device_ms"], ".2f"),
        ]
        for row in record["rows"]
    ]
    header = ["step", "dtype", "ms per step", "/ plain", "aten ops", "collectives", "CUDA kernels", "device ms"]
    lines += _table(header, rows)
    if record["skipped"]:
        lines += ["", "Skipped:"] + [f"- `{name}`: {reason}" for name, reason in record["skipped"].items()]
    if record["targets"]:
        targets = [
            [
                t["id"],
                f"{LABELS[t['numerator']]} / {LABELS[t['denominator']]}",
                t["dtype"],
                fmt(t["ratio"], ".2f"),
                f"≤ {t['bound']}",
                {True: "yes", False: "no", None: "not measured"}[t["met"]],
            ]
            for t in record["targets"]
        ]
        lines += [""] + _table(["target", "ratio of", "dtype", "ratio", "bound", "met"], targets)
    return "\n".join(lines) + "\n"


def write_report(path: str | Path, record: dict[str, Any]) -> None:
    """The markdown of :func:`markdown`, then ``record`` as JSON in a fenced block, to ``path`` (atomically)."""
    write_text(path, markdown(record) + "\n" + _JSON_FENCE + "\n" + json.dumps(record, indent=1) + "\n```\n")


def read_report(path: str | Path) -> dict[str, Any]:
    """The record a report written by :func:`write_report` holds."""
    text = Path(path).read_text()
    return json.loads(text[text.index(_JSON_FENCE) + len(_JSON_FENCE) : text.rindex("```")])


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        cfg = parse(argv)
    except ConfigError as error:
        return config_error_exit(error)
    started = time.perf_counter()
    with one_member_group(cfg.device):
        try:
            record = measure(cfg)
        finally:
            # Compiled code's caches hold the process group: release them first (docs/compile.md).
            torch._dynamo.reset()
            gc.collect()
    args = sys.argv[1:] if argv is None else list(argv)
    record["command"] = " ".join(["python -m launch.bench.resnet50_step", *args])
    record["wall_s"] = round(time.perf_counter() - started, 1)
    print(markdown(record))
    if cfg.output is not None:
        write_report(cfg.output, record)
        print(f"[resnet50_step] wrote {cfg.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
