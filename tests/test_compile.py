"""torch.compile of the synchronized path over real gloo process groups.

- ``torch.compile(model, fullgraph=True)`` trains a converted model over a process group with the aot_eager and
  inductor backends: every step equals eager mode (outputs, input and parameter gradients, running statistics,
  num_batches_tracked) with uneven and empty shards, momentum=None, channels_last input and bfloat16 autocast;
  a compiled step runs exactly one float64 all_reduce of 2C + 6 values per layer in each direction (the statistics and
  the collective's tag).
- ``torch.compile(DistributedDataParallel(model))``: no graph break beyond those DDP causes with plain BatchNorm.
- The safety features under compile: the agreement check (``LayerMismatchError`` on every rank, at compile time),
  the global-count-1 error on every rank, debug mode (runs the layer eagerly: one graph break per layer), and
  activation checkpointing (refused by dynamo with fullgraph=True; otherwise eager, with one running-stats update).
- A compiled job exits 0 under torchrun, every time.
- ``syncbn_dist.kernels.tracing.is_compiling`` is True in a frame Dynamo traces and False in a replica thread's eager
  forward (torch 2.11 evaluated an ``assume_constant_result`` function outside the trace, where it was False).
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import syncbn_dist
from launch.common.spawn import run_distributed
from launch.common.torchrun import env_outside_torchrun
from syncbn_dist.kernels.tracing import eager_replica_thread, is_compiling

C = 4
# Per-rank batch sizes of each step: uneven, then an empty rank (the last rank), then even.
STEPS = [[4, 3, 2], [3, 1, 0], [2, 2, 2]]
# Inductor's (world size 2): uneven with a rank of one sample, the same swapped, then even at a size both ranks have
# compiled. dynamic=False compiles a graph per shape, and the ranks' graphs are the same, so a shape one rank compiled
# is an inductor cache hit for the other: two shapes compiled in all, one on each rank at once, where STEPS costs five
# (two at once for the even step).
INDUCTOR_STEPS = [[3, 1], [1, 3], [3, 3]]


def _model(channels_last: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, C, 3, padding=1),
        nn.BatchNorm2d(C),
        nn.ReLU(),
        nn.Conv2d(C, C, 1),
        nn.BatchNorm2d(C, momentum=None),  # cumulative average: 1 / num_batches_tracked
        nn.Flatten(),
        nn.Linear(C * 25, C),
        nn.BatchNorm1d(C),
    )
    model = syncbn_dist.convert_model(model)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def _batch(rank: int, step: int, sizes: Sequence[int], channels_last: bool) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(sizes[rank], 3, 5, 5, generator=gen) * 2 + 1
    dy = torch.randn(sizes[rank], C, generator=gen)
    return (x.contiguous(memory_format=torch.channels_last) if channels_last else x), dy


def _train(
    model: nn.Module, forward: Any, rank: int, world_size: int, variant: str, steps: Sequence[Sequence[int]]
) -> list[dict[str, Tensor]]:
    channels_last = variant == "channels_last"
    records = []
    for step, sizes in enumerate(steps):
        x, dy = _batch(rank, step, sizes[:world_size], channels_last)
        model.zero_grad(set_to_none=True)
        x.requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "bfloat16"):
            y = forward(x)
        y.float().backward(dy)
        record = {"y": y.detach().float(), "dx": x.grad.clone()}
        record.update({f"grad {n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        record.update({n: b.clone() for n, b in model.named_buffers()})
        records.append(record)
    return records


def _compiled_step_collectives(compiled: Any, rank: int, sizes: Sequence[int]) -> list[tuple[list[int], str]]:
    """(shape, dtype) of every gloo all_reduce one compiled training step runs, as the profiler records them."""
    x, dy = _batch(rank, 0, sizes, channels_last=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        compiled(x.requires_grad_()).backward(dy)
    events = [e for e in prof.events() if e.name == "gloo:all_reduce"]
    if events and not hasattr(events[0], "input_dtypes"):
        # torch 2.11's FunctionEvent has no input_dtypes (2.13 has); its kineto events carry the same record.
        kineto = prof.profiler.kineto_results.events()
        return [(e.shapes()[0], e.dtypes()[0]) for e in kineto if e.name() == "gloo:all_reduce"]
    return [(e.input_shapes[0], e.input_dtypes[0]) for e in events]


def _worker_compiled_equals_eager(
    rank: int, world_size: int, backend: str, variants: Sequence[str], steps: Sequence[Sequence[int]]
) -> dict:
    results: dict[str, Any] = {"graph_breaks": 0}
    for variant in variants:
        # A fresh dynamo state per variant: the variants' compiled models share code objects, whose recompile
        # limit (8 graphs each, one per batch shape with dynamic=False) would otherwise be reached across them.
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        eager = _model(channels_last=variant == "channels_last")
        compiled_model = copy.deepcopy(eager)
        compiled = torch.compile(compiled_model, backend=backend, fullgraph=True, dynamic=False)
        results[variant] = (
            _train(compiled_model, compiled, rank, world_size, variant, steps),
            _train(eager, eager, rank, world_size, variant, steps),
        )
        if variant == "float32":
            results["collectives"] = _compiled_step_collectives(compiled, rank, steps[0][:world_size])
        results["graph_breaks"] += sum(torch._dynamo.utils.counters["graph_break"].values())
    return results


def _check_equal(results: Sequence[dict], variants: Sequence[str], backend: str) -> None:
    # Three synchronized layers of C channels: one float64 all_reduce of 2C + 6 values each in forward and one of the
    # same size each in backward (the statistics and the collective's tag: syncbn_dist.comm.tags), inside the compiled
    # graphs, and nothing else (DDP is not used here).
    expected_collectives = [([2 * C + 6], "double")] * 6
    for rank, result in enumerate(results):
        assert result["graph_breaks"] == 0, f"rank {rank}: {result['graph_breaks']} graph breaks"
        assert result["collectives"] == expected_collectives, f"rank {rank}: {result['collectives']}"
        for variant in variants:
            compiled, eager = result[variant]
            for step, (c, e) in enumerate(zip(compiled, eager)):
                assert c.keys() == e.keys()
                for key in c:
                    what = f"{backend} {variant} rank {rank} step {step} {key}"
                    if key.endswith("num_batches_tracked"):
                        assert torch.equal(c[key], e[key]), what
                        continue
                    # Compiled graphs reorder and fuse float32 (bfloat16 under autocast) arithmetic: a few ulps of
                    # O(1) values; parameter gradients are sums over the global batch (tens to hundreds of O(1)
                    # products), so they get a relative tolerance as well; bfloat16 outputs carry 8 bits.
                    tol = {"rtol": 1e-5, "atol": 1e-5}
                    if key.startswith("grad "):
                        tol = {"rtol": 1e-4, "atol": 1e-4}
                    if variant == "bfloat16":
                        tol = {"rtol": 1e-2, "atol": 1e-2}
                        if key.startswith("grad "):
                            # Eager (the native kernels) and the compiled graph (syncbn_dist.kernels' source) each
                            # round grad_input to bfloat16 within an ulp of the float64 value, but not alike; a conv
                            # weight gradient sums up to 225 products of those (measured: 0.047 apart where the
                            # gradient's largest values are about 10, 2^-8 * 10 = 0.04 being one bfloat16 ulp there).
                            tol = {"rtol": 1e-2, "atol": 8e-2}
                    torch.testing.assert_close(c[key], e[key], **tol, msg=lambda m, w=what: f"{w}: {m}")


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size", [pytest.param(2, marks=pytest.mark.over_budget("3 variants x 3 step shapes compiled")), 3]
)
def test_fullgraph_aot_eager_equals_eager(world_size: int) -> None:
    """Over 30 s at world size 2: three variants (float32, channels_last, bfloat16 autocast), each compiled from a
    reset Dynamo once per step shape (dynamic=False: three shapes, uneven and empty shards), and a compiled step
    profiled for its collectives; the compilations are what the test checks."""
    # Every variant at world size 2 (uneven and empty shards); world size 3 repeats float32, whose collectives are
    # the ones that change with more members (the layout and dtype variants change no collective).
    variants = ["float32", "channels_last", "bfloat16"] if world_size == 2 else ["float32"]
    results = run_distributed(_worker_compiled_equals_eager, world_size, "aot_eager", variants, STEPS, timeout=280)
    _check_equal(results, variants, "aot_eager")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(not any(shutil.which(cc) for cc in ("g++", "c++")), reason="inductor needs a C++ compiler")
@pytest.mark.over_budget("inductor compiles the ranks' graphs for two shapes, from an empty cache in CI")
def test_fullgraph_inductor_equals_eager() -> None:
    """Inductor's compiled model (fullgraph) equals eager on every rank: outputs, gradients, running statistics, and
    the compiled step's collectives.

    Over 30 s from an empty inductor cache (41 CPU seconds alone on 2 cores, 54 with STEPS; 9 s warm):
    dynamic=False compiles a forward and a backward graph for each shape, two shapes across the two ranks (uneven
    shards, one of one sample); inductor's generated C++ is what the test checks."""
    results = run_distributed(_worker_compiled_equals_eager, 2, "inductor", ["float32"], INDUCTOR_STEPS, timeout=280)
    _check_equal(results, ["float32"], "inductor")


# ---------------------------------------------------------------------------------------------------------
# DDP graph breaks, and the safety features under compile.
# ---------------------------------------------------------------------------------------------------------


def _ddp_graph_breaks(convert: bool) -> int:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, C, 3), nn.BatchNorm2d(C), nn.ReLU(), nn.Conv2d(C, C, 1), nn.BatchNorm2d(C))
    if convert:
        model = syncbn_dist.convert_model(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    compiled = torch.compile(ddp, backend="aot_eager")
    for step in range(2):
        compiled(torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(step))).sum().backward()
    return sum(torch._dynamo.utils.counters["graph_break"].values())


class _CheckpointedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3)
        self.bn = syncbn_dist.SynchronizedBatchNorm2d(C)

    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(lambda t: self.bn(self.conv(t)).relu(), x, use_reentrant=False)


def _error_chain(error: BaseException) -> list[BaseException]:
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _worker_safety(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"ddp": (_ddp_graph_breaks(False), _ddp_graph_breaks(True))}

    # The agreement check: rank 1's layer has other channels (the collectives would mismatch and abort gloo).
    torch._dynamo.reset()
    channels = C if rank == 0 else C + 2
    layer = syncbn_dist.SynchronizedBatchNorm1d(channels)
    try:
        torch.compile(layer, backend="aot_eager", fullgraph=True)(torch.randn(3, channels))
        out["mismatch"] = None
    except Exception as error:  # noqa: BLE001 - the chain is inspected below
        out["mismatch"] = [(type(e).__name__, str(e)) for e in _error_chain(error)]

    # A global batch of one value per channel: rank 0 holds one row, the others none.
    torch._dynamo.reset()
    layer = syncbn_dist.SynchronizedBatchNorm1d(C)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    compiled(torch.randn(3, C))  # a valid step first
    try:
        compiled(torch.randn(1 if rank == 0 else 0, C))
        out["count_one"] = None
    except Exception as error:  # noqa: BLE001
        out["count_one"] = [(type(e).__name__, str(e)) for e in _error_chain(error)]

    # Activation checkpointing: with fullgraph=True dynamo refuses the buffer update inside the checkpoint region;
    # without it the region falls back to eager, where the running statistics are updated once, not twice.
    out["checkpoint"] = {}
    for fullgraph in (True, False):
        torch._dynamo.reset()
        block = _CheckpointedBlock()
        try:
            torch.compile(block, backend="aot_eager", fullgraph=fullgraph)(torch.randn(2, 3, 5, 5)).sum().backward()
            out["checkpoint"][fullgraph] = int(block.bn.num_batches_tracked)
        except Exception as error:  # noqa: BLE001
            out["checkpoint"][fullgraph] = [(type(e).__name__, str(e)) for e in _error_chain(error)]

    # Debug mode: the layer runs eagerly (a graph break per synchronized layer) and still checks every call.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    syncbn_dist.set_debug(True)
    try:
        model = _model()
        eager = copy.deepcopy(model)
        compiled = torch.compile(model, backend="aot_eager")
        x, _ = _batch(rank, 0, STEPS[0], False)
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5)
        out["debug_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    finally:
        syncbn_dist.set_debug(False)
    return out


@pytest.mark.distributed
def test_safety_features_under_compile() -> None:
    results = run_distributed(_worker_safety, 2, timeout=280)
    for rank, r in enumerate(results):
        plain, converted = r["ddp"]
        assert converted == plain, f"rank {rank}: DDP + syncbn_dist {converted} graph breaks, plain BN {plain}"
        assert r["mismatch"] is not None, f"rank {rank}: a layer mismatch compiled"
        assert any(name == "LayerMismatchError" for name, _ in r["mismatch"]), r["mismatch"]
        assert any("num_features=4" in text and "num_features=6" in text for _, text in r["mismatch"]), r["mismatch"]
        assert r["count_one"] is not None, f"rank {rank}: a global count of 1 did not raise"
        assert any("Expected more than 1 value per channel" in text for _, text in r["count_one"]), r["count_one"]
        assert isinstance(r["checkpoint"][True], list), f"rank {rank}: fullgraph checkpointing compiled"
        assert any("side effect" in text for _, text in r["checkpoint"][True]), r["checkpoint"][True]
        assert r["checkpoint"][False] == 1, f"rank {rank}: num_batches_tracked {r['checkpoint'][False]}, expected 1"
        assert r["debug_breaks"] >= 3, f"rank {rank}: debug mode should run each synchronized layer eagerly"


# Ranks that mix compiled and eager. Rank 0's batch sizes change every step, rank 1's do not: with dynamic=False and a
# recompile limit of 1, rank 0's Dynamo runs its later steps eagerly while rank 1 replays its compiled graph.
MIXED_STEPS = [[3, 3], [2, 3], [4, 3]]


def _global_batch(step: int, world_size: int) -> tuple[Tensor, Tensor]:
    """Every rank's batch of ``step`` of MIXED_STEPS (each rank can make all of them), concatenated, in float64."""
    parts = [_batch(rank, step, MIXED_STEPS[step][:world_size], False) for rank in range(world_size)]
    return torch.cat([x for x, _ in parts]).double(), torch.cat([dy for _, dy in parts]).double()


def _counting(backend: str, calls: list[int]) -> Any:
    """``backend``, counting the calls of the graphs it compiles (how many steps ran compiled)."""

    def compile_graph(graph: torch.fx.GraphModule, example_inputs: Sequence[Tensor]) -> Any:
        compiled = torch._dynamo.lookup_backend(backend)(graph, example_inputs)

        def call(*args: Any) -> Any:
            calls[0] += 1
            return compiled(*args)

        return call

    return compile_graph


def _train_mixed_steps_exactly(model: nn.Module, forward: Any, rank: int, world_size: int) -> None:
    """The MIXED_STEPS training steps of ``model`` through ``forward``, each against float64 nn.BatchNorm on the global
    batch: this rank's rows of the output and input gradient, the parameter gradients summed over the ranks, and every
    buffer."""
    reference = syncbn_dist.revert_model(copy.deepcopy(_model())).double()
    for step in range(len(MIXED_STEPS)):
        x, dy = _batch(rank, step, MIXED_STEPS[step][:world_size], False)
        model.zero_grad(set_to_none=True)
        y = forward(x.requires_grad_())
        y.backward(dy)
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
        torch.distributed.all_reduce(grads)  # parameter gradients stay local (DDP would average them)
        x_all, dy_all = _global_batch(step, world_size)
        reference.zero_grad(set_to_none=True)
        y_all = reference(x_all.requires_grad_())
        y_all.backward(dy_all)
        start = sum(MIXED_STEPS[step][:rank])
        rows = slice(start, start + x.size(0))
        # float32 layers against float64: float32 rounding of O(1) values through three layers and three steps.
        close = {"rtol": 1e-4, "atol": 1e-4}
        torch.testing.assert_close(y.detach().double(), y_all[rows].detach(), **close)
        torch.testing.assert_close(x.grad.double(), x_all.grad[rows], **close)
        expected_grads = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        torch.testing.assert_close(grads, expected_grads, **close)
        for (name, buffer), expected in zip(model.named_buffers(), reference.buffers()):
            torch.testing.assert_close(buffer.double(), expected.double(), **close, msg=f"step {step}: {name}")


def _worker_fallback_to_eager(rank: int, world_size: int, backend: str) -> int:
    """Three training steps of the converted model compiled with a recompile limit of 1 (so rank 0 runs eagerly from
    its second step on), exact (:func:`_train_mixed_steps_exactly`). Returns how many steps ran compiled."""
    torch._dynamo.reset()
    model = _model()
    calls = [0]
    with torch._dynamo.config.patch(recompile_limit=1):
        compiled = torch.compile(model, backend=_counting(backend, calls), dynamic=False)
        _train_mixed_steps_exactly(model, compiled, rank, world_size)
    return calls[0]


def _worker_rank0_evaluates_first(rank: int, world_size: int, backend: str) -> int:
    """Rank 0 alone runs the compiled model in eval mode first (a validation before training), then every rank trains
    it compiled, exactly (:func:`_train_mixed_steps_exactly`): rank 0's training trace is a recompilation, rank 1's a
    first compilation, and rank 0's later shapes recompile on it alone. Returns how many graphs ran."""
    torch._dynamo.reset()
    model = _model()
    calls = [0]
    compiled = torch.compile(model, backend=_counting(backend, calls), dynamic=False)
    if rank == 0:
        model.eval()
        with torch.no_grad():
            compiled(_batch(rank, 0, [5, 5], False)[0])
        model.train()
    _train_mixed_steps_exactly(model, compiled, rank, world_size)
    return calls[0]


def _worker_one_rank_compiled(rank: int, world_size: int, backend: str) -> list[tuple[str, str]]:
    """Rank 0 compiles the model, rank 1 runs it eagerly: the error chain each rank raises."""
    torch._dynamo.reset()
    model = _model()
    forward = torch.compile(model, backend=backend) if rank == 0 else model
    x, dy = _batch(rank, 0, MIXED_STEPS[0], False)
    with pytest.raises(Exception) as raised:  # noqa: PT011 - the chain is returned and inspected
        forward(x.requires_grad_()).backward(dy)
    torch.distributed.barrier()  # nobody is left inside a collective
    return [(type(e).__name__, str(e)) for e in _error_chain(raised.value)]


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_rank_compiled_beside_an_eager_rank_raises_on_every_rank(backend: str) -> None:
    """Compiling on one rank only: every rank raises LayerMismatchError at the first layer, saying why."""
    for rank, chain in enumerate(run_distributed(_worker_one_rank_compiled, 2, backend, timeout=120,
                                                 collective_timeout=30)):
        assert any(name == "LayerMismatchError" for name, _ in chain), f"rank {rank}: {chain}"
        assert any("compile the model on every rank or on none" in text for _, text in chain), f"rank {rank}: {chain}"


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_rank_that_falls_back_to_eager_after_the_recompile_limit_trains_exactly(backend: str) -> None:
    """Rank 0 hits Dynamo's recompile limit and runs eagerly beside rank 1's compiled graph: still exact."""
    compiled_steps = run_distributed(_worker_fallback_to_eager, 2, backend, timeout=240, collective_timeout=60)
    assert compiled_steps == [1, 3], compiled_steps  # rank 0 ran its last two steps eagerly, rank 1 all compiled


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_an_evaluation_on_rank_0_alone_before_training_compiled_trains_exactly(backend: str) -> None:
    """The trace-time check gathers in the compilation of a frame that first traces the group's training calls, on
    every rank alike, not in the frame's first compilation: before, rank 1 gathered alone at its first compilation
    (rank 0's was the eval graph's) and both ranks failed at the group's timeout."""
    graphs = run_distributed(_worker_rank0_evaluates_first, 2, backend, timeout=240, collective_timeout=30)
    assert graphs[0] >= 4 and graphs[1] >= 3, graphs  # rank 0's eval graph, then every training step compiled


def _worker_cumulative_average(rank: int, world_size: int) -> list[float]:
    """Four compiled (aot_eager) training forwards of a float64 layer with momentum=None: the greatest relative
    difference of its running statistics from float64 nn.BatchNorm's on the global batches, after each."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = syncbn_dist.SynchronizedBatchNorm1d(C, momentum=None).double()
    reference = nn.BatchNorm1d(C, momentum=None).double()
    compiled = torch.compile(layer, backend="aot_eager", dynamic=False)
    differences = []
    for step in range(4):
        batches = [torch.randn(3, C, generator=torch.Generator().manual_seed(10 * step + r), dtype=torch.float64)
                   for r in range(world_size)]
        compiled(batches[rank])
        reference(torch.cat(batches))
        differences.append(max(((mine - theirs).abs() / theirs.abs()).max().item()
                                for mine, theirs in ((layer.running_mean, reference.running_mean),
                                                     (layer.running_var, reference.running_var))))
    return differences


@pytest.mark.distributed
def test_a_compiled_cumulative_average_in_float64_matches_batchnorm_in_float64() -> None:
    """momentum=None's factor 1 / num_batches_tracked, traced, is taken in the buffers' precision: before, it was a
    float32 tensor, and from the third forward the float64 running statistics were off by up to 3e-8 relative."""
    for rank, differences in enumerate(run_distributed(_worker_cumulative_average, 2, timeout=120)):
        # float64 rounding of O(1) values over four updates.
        assert max(differences) < 1e-13, f"rank {rank}: {differences}"


def _worker_compiled_autograd(rank: int, world_size: int, skip_a_backward: bool) -> Any:
    """Eager forwards, backwards by compiled autograd (aot_eager): exact (returns how many backward graphs ran), or,
    where rank 1 skips its second backward (after the group's first step), the error each rank raises and after how
    many seconds."""
    torch._dynamo.reset()
    model = _model()
    calls = [0]
    backward_compiler = torch.compile(backend=_counting("aot_eager", calls))
    if not skip_a_backward:
        with torch._dynamo.compiled_autograd._enable(backward_compiler):
            _train_mixed_steps_exactly(model, model, rank, world_size)
        return calls[0]
    start = time.monotonic()
    with pytest.raises(Exception) as raised:  # noqa: PT011 - the chain is returned and inspected
        for step in range(len(MIXED_STEPS)):
            y = model(_batch(rank, step, MIXED_STEPS[step], False)[0].requires_grad_())
            if rank == 0 or step != 1:
                with torch._dynamo.compiled_autograd._enable(backward_compiler):
                    y.sum().backward()
    return type(raised.value).__name__, str(raised.value), time.monotonic() - start


@pytest.mark.distributed
def test_compiled_autograd_over_an_eager_forward_trains_exactly_and_checks_its_collectives() -> None:
    """Compiled autograd traces the backward's collective, with its tag check as an op of the graph: exact, and a rank
    that skips a backward makes every rank raise at once (before, the compiled backward skipped the check: rank 0 went
    on, rank 1 raised alone, and both failed at the group's timeout)."""
    backward_graphs = run_distributed(_worker_compiled_autograd, 2, False, timeout=240, collective_timeout=60)
    assert all(graphs >= 1 for graphs in backward_graphs), backward_graphs
    for rank, (name, message, seconds) in enumerate(
        run_distributed(_worker_compiled_autograd, 2, True, timeout=240, collective_timeout=60)
    ):
        assert name == "LayerMismatchError", f"rank {rank}: {name}: {message}"
        assert "rank 0: layer '7' (SynchronizedBatchNorm1d): backward" in message, f"rank {rank}: {message}"
        assert seconds < 30, f"rank {rank} raised after {seconds:.0f} s: it waited for a peer"


_JOB = textwrap.dedent(
    """
    import gc
    import torch, torch.distributed as dist, torch.nn as nn
    import syncbn_dist


    def train():
        model = syncbn_dist.convert_model(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()))
        model = nn.parallel.DistributedDataParallel(model)
        compiled = torch.compile(model, backend="{backend}")
        for step in range(2):
            compiled(torch.randn(2 + dist.get_rank(), 3, 6, 6)).sum().backward()


    dist.init_process_group("gloo")
    try:
        train()
    finally:
        # The exit sequence docs/compile.md gives: drop dynamo's compiled caches (they keep the model, and so the
        # process group, alive) and collect the cycles they leave before destroying the group, so that no gloo
        # object is left to be destroyed during interpreter finalization, which can abort the process.
        torch._dynamo.reset()
        gc.collect()
        dist.destroy_process_group()
    """
)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("aot_eager", marks=[pytest.mark.over_budget("three torchrun launches"), pytest.mark.plumbing]),
        pytest.param("inductor", marks=[pytest.mark.slow, pytest.mark.plumbing]),
    ],
)
def test_compiled_job_exits_zero_under_torchrun(tmp_path: Path, backend: str) -> None:
    """A compiled DDP job exits 0 under torchrun, three times in a row with aot_eager, once with inductor.

    Over 30 s with aot_eager: three torchrun launches, each an agent and two workers that import torch and compile.
    The exit code of a real torchrun job is the assertion (the abort at exit it guards against came in 8 of 24
    loaded runs), so no pooled rank can stand in, and the repetitions are what catch an intermittent abort."""
    script = tmp_path / "job.py"
    script.write_text(_JOB.format(backend=backend))
    env = env_outside_torchrun(PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    for attempt in range(3 if backend == "aot_eager" else 1):
        done = subprocess.run(torchrun, env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, f"attempt {attempt}: exit {done.returncode}\n{done.stderr[-3000:]}"


def test_clip_mode_without_peers_compiles_whole_and_equals_eager() -> None:
    """eps_mode "clip" with no process group runs the synchronized Function on a group of one: it traces with
    fullgraph=True (no agreement check to run) and gives eager's output, gradients and running stats."""
    layers = [syncbn_dist.SynchronizedBatchNorm2d(3).double() for _ in range(2)]
    for layer in layers:
        layer.eps_mode = "clip"
    compiled = torch.compile(layers[1], backend="aot_eager", fullgraph=True)
    scales = torch.tensor([1e-3, 1.0, 2.0], dtype=torch.float64).view(1, 3, 1, 1)  # channel 0 is clipped
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64) * scales
    results = []
    for forward, layer in ((layers[0], layers[0]), (compiled, layers[1])):
        inp = x.clone().requires_grad_()
        out = forward(inp)
        out.pow(2).sum().backward()
        results.append([out.detach(), inp.grad, layer.weight.grad, layer.running_var])
    for eager, traced in zip(*results):
        # The same float64 kernels in both; the compiled graph may reorder a few float64 operations.
        torch.testing.assert_close(traced, eager, rtol=1e-12, atol=1e-12)


def test_is_compiling_is_true_while_dynamo_traces_and_false_in_an_eager_replica() -> None:
    def branch(x: Tensor) -> Tensor:
        return x + 1.0 if is_compiling() else x - 1.0

    assert torch.compile(branch, fullgraph=True, backend="eager")(torch.zeros(1)).item() == 1.0
    assert branch(torch.zeros(1)).item() == -1.0

    def in_replica(x: Tensor) -> Tensor:  # a frame of its own: a fresh trace, nothing cached
        return x + 1.0 if is_compiling() else x - 1.0

    # torch.compiler.is_compiling() is True during any trace, process-wide; a replica's eager forward must not see it.
    with eager_replica_thread():
        assert torch.compile(in_replica, fullgraph=True, backend="eager")(torch.zeros(1)).item() == -1.0
