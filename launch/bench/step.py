"""The training-step benchmark worker: DDP step time, collectives, ops, communication floors and peak memory.

One launch measures every variant at one world size. Each rank builds one DDP model per variant from the
same initial weights and its own fixed batch (a ``_compiled`` variant is ``torch.compile`` of its DDP model,
the scenario's ``compile_backend``, compiled during warm-up), then:

1. warms every variant up;
2. runs one step of each variant under a :class:`~launch.common.counting.CollectiveCounter` (collectives per step and
   bytes per collective, counted, by phase), and, but for the compiled variants, one under
   :class:`~launch.common.counting.OpCounter` (aten ops dispatched per step: on a GPU each is a kernel launch or
   host-side work; Dynamo skips a frame it meets under a dispatch mode for good, which would leave a compiled
   variant eager for its timed rounds);
3. runs ``rounds`` interleaved rounds (``A B C probe, B C A probe, C A B probe, ...``: every variant once per
   round, the starting one rotating) so that machine drift and position effects hit every variant alike. A
   variant's time in a round is the mean of ``steps_per_round`` steps, the slowest rank's. The in-step floor
   is the ``floor`` variant, timed like the others; the back-to-back probe times ``floor_repeats``
   back-to-back ``all_reduce`` calls of each payload size that (b) sends, on DDP's group;
4. measures peak memory of each variant (see :func:`_measure_memory`);
5. optionally profiles one step of (a) and (b).

Rank 0 returns everything as plain Python data.
"""

from __future__ import annotations

import ctypes
import gc
import inspect
import json
import os
import tempfile
import time
from collections import Counter
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

import syncbn_dist
from launch.bench.models import COMPILED_SUFFIX, DEBUG_VARIANTS, build_model, build_variant
from launch.common.counting import CollectiveCounter, OpCounter

_MIB = 2.0**20
_DDP_PARAMETERS = inspect.signature(DistributedDataParallel.__init__).parameters


class _Runner:
    """One variant's DDP model, optimizer and fixed batch; :meth:`step` is one training step."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        scenario: dict[str, Any],
        x: Any,
        y: Any,
        compiled: bool,
        debug: bool = False,
    ) -> None:
        device_ids = [device.index] if device.type == "cuda" else None
        # Newer torch renames broadcast_buffers to forward_sync_buffers (and warns on the old name).
        key = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_PARAMETERS else "broadcast_buffers"
        self.model = DistributedDataParallel(
            model,
            device_ids=device_ids,
            bucket_cap_mb=scenario["bucket_cap_mb"],
            **{key: scenario["broadcast_buffers"]},
        )
        # torch.compile of the DDP module: dynamo's DDP optimizer splits the graph at gradient buckets, as
        # PyTorch recommends for DDP; the BatchNorm layers add no break of their own (tests/test_compile.py).
        backend = scenario["compile_backend"]
        self.forward = torch.compile(self.model, backend=backend, dynamic=False) if compiled else self.model
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.x, self.y = x, y
        self.debug = debug  # syncbn_dist's debug mode during this variant's steps

    def step(self, counter: Optional[CollectiveCounter] = None) -> None:
        previous = syncbn_dist.is_debug_enabled()
        syncbn_dist.set_debug(self.debug)
        try:
            self._step(counter)
        finally:
            syncbn_dist.set_debug(previous)

    def _step(self, counter: Optional[CollectiveCounter]) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if counter is not None:
            counter.phase = "forward"
        loss = F.cross_entropy(self.forward(self.x), self.y)
        if counter is not None:
            counter.phase = "backward"
        loss.backward()
        self.optimizer.step()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_steps(runner: _Runner, steps: int, device: torch.device) -> float:
    """Seconds per step over ``steps`` steps, started together on every rank."""
    dist.barrier()
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        runner.step()
    _synchronize(device)
    return (time.perf_counter() - start) / steps


def _timed_all_reduce(buffer: torch.Tensor, repeats: int, device: torch.device) -> float:
    """Seconds per ``all_reduce`` of ``buffer`` on the default group, over ``repeats`` back-to-back calls."""
    dist.barrier()
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(buffer)
    _synchronize(device)
    return (time.perf_counter() - start) / repeats


def _proc_status_kib(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0). False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _release_free_memory() -> None:
    """Collect garbage and hand glibc's free heap back to the OS, so RSS tracks live memory more closely."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _profiled_alloc_peak(runner: _Runner) -> float:
    """Peak bytes of CPU tensor memory allocated during one step, from the profiler's memory events.

    The profiler reports a running total of bytes allocated since it started; its maximum over the step is
    the CPU counterpart of ``torch.cuda.max_memory_allocated() - memory_allocated()`` before the step.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner.step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    totals = [
        e["args"]["Total Allocated"]
        for e in events
        if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0
    ]
    return float(max(totals, default=0))


def _measure_memory(runner: _Runner, steps: int, device: torch.device) -> dict[str, Optional[float]]:
    """Peak memory of ``steps`` steps of one variant, in MiB.

    Variants share a process, so each one is measured against a reset high-water mark:

    - ``rss_peak_mib``: the process's peak RSS (VmHWM) during the steps, after resetting it to the current
      RSS with ``/proc/self/clear_refs``; ``rss_step_mib`` is that peak minus the RSS before the steps.
      Without clear_refs support they fall back to ``ru_maxrss`` (lifetime peak) and None.
    - ``alloc_step_mib``: peak tensor bytes allocated during a step above what was allocated before it
      (the profiler's memory events on CPU, ``torch.cuda.max_memory_allocated`` on CUDA).
    - ``cuda_max_allocated_mib``: ``torch.cuda.max_memory_allocated`` during the steps (CUDA only).
    """
    result: dict[str, Optional[float]] = {}
    _release_free_memory()
    dist.barrier()
    rss_before = _proc_status_kib("VmRSS")
    has_reset = _reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        allocated_before = torch.cuda.memory_allocated(device)
    for _ in range(steps):
        runner.step()
    _synchronize(device)
    peak = _proc_status_kib("VmHWM") if has_reset else None
    if peak is None:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result["rss_peak_mib"] = peak / 1024.0
    result["rss_step_mib"] = (peak - rss_before) / 1024.0 if has_reset and rss_before is not None else None
    if device.type == "cuda":
        result["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated(device) / _MIB
        result["alloc_step_mib"] = (torch.cuda.max_memory_allocated(device) - allocated_before) / _MIB
    else:
        result["cuda_max_allocated_mib"] = None
        result["alloc_step_mib"] = _profiled_alloc_peak(runner) / _MIB
    return result


def _top_ops(runner: _Runner, count: int) -> list[dict[str, Any]]:
    """The ``count`` ops with the most self CPU time in one step (every rank must call this together)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.step()
    averages = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"op": e.key, "self_cpu_us": round(e.self_cpu_time_total, 1), "calls": e.count} for e in averages[:count]]


def _probe_buffer(nbytes: int, dtype_name: str, device: torch.device) -> torch.Tensor:
    dtype = getattr(torch, dtype_name)
    return torch.zeros(nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=device)


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def step_worker(rank: int, world_size: int, scenario: dict[str, Any]) -> dict[str, Any]:
    """Measure every variant of ``scenario`` (a :class:`~launch.bench.config.ScenarioConfig` as a dict) at
    ``world_size``."""
    started = time.perf_counter()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    variants = [v for v in scenario["variants"] if v != "torch_syncbn" or device.type == "cuda"]
    skipped = [v for v in scenario["variants"] if v not in variants]

    torch.manual_seed(scenario["seed"])
    base = build_model(
        scenario["model"], scenario["in_channels"], scenario["width"], scenario["num_layers"], scenario["num_classes"]
    )
    base = base.to(device)
    generator = torch.Generator().manual_seed(scenario["seed"] + 1 + rank)
    shape = (scenario["batch_size"], scenario["in_channels"], scenario["image_size"], scenario["image_size"])
    x = torch.randn(shape, generator=generator).to(device)
    y = torch.randint(scenario["num_classes"], (scenario["batch_size"],), generator=generator).to(device)
    # Created once, collectively, and shared by every layer of the dedicated-group variant (P5).
    dedicated = dist.new_group(list(range(world_size))) if "syncbn_dist_dedicated" in variants else None
    runners = {
        v: _Runner(
            build_variant(v, base, dedicated), device, scenario, x, y, v.endswith(COMPILED_SUFFIX), v in DEBUG_VARIANTS
        )
        for v in variants
    }

    stages = {"setup": time.perf_counter() - started}
    mark = time.perf_counter()
    compile_seconds: dict[str, float] = {}
    graph_breaks: dict[str, int] = {}
    for name, runner in runners.items():
        torch._dynamo.utils.counters.clear()
        warm = time.perf_counter()
        for _ in range(scenario["warmup_steps"]):
            runner.step()
        if name.endswith(COMPILED_SUFFIX):
            compile_seconds[name] = time.perf_counter() - warm
            graph_breaks[name] = sum(torch._dynamo.utils.counters["graph_break"].values())

    collectives: dict[str, list[dict[str, Any]]] = {}
    for name, runner in runners.items():
        with CollectiveCounter() as counter:
            runner.step(counter)
        collectives[name] = counter.calls
    # Not the compiled variants: a frame Dynamo meets under a TorchDispatchMode (the counter) is skipped from then on,
    # so one counted step would leave the model's forward eager, under Dynamo's callback, for every timed round.
    ops: dict[str, Optional[int]] = {}
    for name, runner in runners.items():
        if name.endswith(COMPILED_SUFFIX):
            ops[name] = None
            continue
        with OpCounter() as counter:
            runner.step()
        ops[name] = counter.total

    # The floor: one all_reduce per collective that (b) sends, at its payload size, on DDP's group.
    probe_source = collectives.get("syncbn_dist", [])
    sizes = Counter((c["bytes"], c["dtype"]) for c in probe_source if c["op"] == "all_reduce")
    probes = {key: _probe_buffer(key[0], key[1], device) for key in sizes}

    stages["warmup_and_count"], mark = time.perf_counter() - mark, time.perf_counter()

    times: dict[str, list[float]] = {v: [] for v in variants}
    probe_times: dict[tuple[int, str], list[float]] = {key: [] for key in probes}
    order = list(runners)
    for index in range(scenario["rounds"]):
        # Every round runs each variant once; the starting variant rotates, so no variant always runs first.
        shift = index % len(order)
        for name in order[shift:] + order[:shift]:
            times[name].append(_timed_steps(runners[name], scenario["steps_per_round"], device))
        for key, buffer in probes.items():
            probe_times[key].append(_timed_all_reduce(buffer, scenario["floor_repeats"], device))
        # Stop early, together, once the time budget is spent (a loaded machine still finishes in time).
        if index + 1 >= scenario["min_rounds"]:
            if _max_over_ranks([time.perf_counter() - mark], device)[0] > scenario["round_budget_s"]:
                break
    stages["rounds"], mark = time.perf_counter() - mark, time.perf_counter()

    for name in variants:
        times[name] = _max_over_ranks(times[name], device)
    if compile_seconds:
        compile_seconds = dict(zip(compile_seconds, _max_over_ranks(list(compile_seconds.values()), device)))
    for key in probes:
        probe_times[key] = _max_over_ranks(probe_times[key], device)

    memory = {}
    for name, runner in runners.items():
        measured = _measure_memory(runner, scenario["memory_steps"], device)
        keys = sorted(k for k, v in measured.items() if v is not None)
        maxima = _max_over_ranks([measured[k] for k in keys], device)
        memory[name] = {**{k: None for k in measured}, **dict(zip(keys, maxima))}

    stages["memory"], mark = time.perf_counter() - mark, time.perf_counter()
    profiles = {}
    if scenario["profile"]:
        for name in ("bn", "syncbn_dist"):
            if name in runners:
                profiles[name] = _top_ops(runners[name], scenario["profile_top"])
    stages["profile"] = time.perf_counter() - mark

    return {
        "world_size": world_size,
        "backend": dist.get_backend(),
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "variants": variants,
        "skipped_variants": skipped,
        "step_seconds": times,
        "collectives": collectives,
        "ops_per_step": ops,
        "compile_seconds": compile_seconds,
        "graph_breaks": graph_breaks,
        "floor_probes": [
            {"bytes": key[0], "dtype": key[1], "per_step": sizes[key], "seconds": probe_times[key]} for key in probes
        ],
        "memory": memory,
        "profiles": profiles,
        "stage_seconds": {key: round(value, 2) for key, value in stages.items()},
    }
