"""The synchronized path's host cost and the eps modes.

- The op budget: one synchronized layer (world size 2 over gloo, steady state, native kernels) dispatches 19 aten
  ops in forward and 10 in backward, collectives and views included, with exactly one all_reduce per direction
  (FORWARD_OPS, BACKWARD_OPS; 18 and 9 before every collective carried its tag, at most 30 together by the budget
  syncbn_dist.comm.tags was built to). torch.nn.SyncBatchNorm's
  CUDA path dispatches 17 and 5 by its source over NCCL (18 and 5 over gloo, measured by
  ``python -m launch.bench.layer_host`` with its CUDA-only kernels emulated on CPU); what the extra ops buy is in
  docs/design.md, "Host cost per layer".
- The host-call budget: the same forward + backward (steady state) makes at most PYTHON_CALL_BUDGET Python function
  calls (cProfile's count, built-ins included) on each kernel set: the host work a small layer pays per call,
  counted where it cannot be timed.
- The byte budget: the same forward + backward moves at most BYTES_PER_ELEMENT bytes per float32 activation
  element at the op interface (launch.common.counting.BytesCounter), plus PER_CHANNEL_BYTES per channel for the
  per-channel statistics, for contiguous NCHW, channels_last and (N, C) inputs.
- ``set_sbn_eps_mode`` / ``SyncBatchNorm.eps_mode``: "clip" normalizes by ``sqrt(max(var, eps))`` (the classic
  library's "clamp"), on the local, DataParallel and distributed paths, checked against a float64 reference written
  out by hand (outputs, input and parameter gradients, running statistics), with a channel whose variance is below
  eps.
"""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Iterator, Sequence

import pytest
import torch
from torch import Tensor, nn

import syncbn_dist
from launch.common.counting import BytesCounter, OpCounter, count_layer
from launch.common.spawn import run_distributed
from syncbn_dist import DataParallelWithCallback, SynchronizedBatchNorm1d, SynchronizedBatchNorm2d, set_sbn_eps_mode
from syncbn_dist.kernels.native import LEAN_MIN_NUMEL

# Forward: the module's num_batches_tracked (1); the payload: the float64 copy, its statistics, and
# [mean, var + mean**2, 1, tag] with its first 2C + 1 values scaled by the count (6); the all_reduce and the slice of
# the summed tag it verifies (2); the global statistics: one split, the mean, M2, n - 1, one _foreach_div for both
# variances, and one stacked cast to float32 (8); the normalization (1); both running buffers in one _foreach_lerp_
# (1). Backward: the local reductions (1); the payload [sum(dy), sum(dy * x_hat), 0, tag], cast to float64 inside
# its cat by the float64 tail (1); the all_reduce and its tag's slice (2); the global means in float32 (3);
# grad_input as an inference batch norm, its difference from dy and the native scaling (3). Exact counts: a new op
# fails the test, so that the host cost cannot creep.
FORWARD_OPS, BACKWARD_OPS = 19, 10
OP_BUDGET = FORWARD_OPS + BACKWARD_OPS
# Measured with torch 2.13 CPU, float32 (bfloat16: 42). Forward: the float64 copy of x (read 4, write 8) and its
# statistics (8), the normalization (read x, write y: 8); backward: the local reductions (read dy, x: 8), then
# grad_input as an inference batch norm of x (8), its difference from dy (12) and the scaling (12). See
# docs/design.md for the floor (32 for torch.nn.SyncBatchNorm's CUDA kernels) and why aten ops on CPU stay above it.
BYTES_PER_ELEMENT = 68
PER_CHANNEL_BYTES = 600  # the C-sized tensors: statistics, payloads, parameters and their gradients
# The memory-lean regime (activations of at least syncbn_dist.kernels.native.LEAN_MIN_NUMEL elements): copy-free
# statistics on contiguous NCHW float32 (read x 4 + 4), the float64 copy elsewhere (12 + 8); the normalization (8);
# the local reductions (8); grad_input as one inference batch norm of x (8) and an addcmul_ with dy (12). Its op count
# is not held to OP_BUDGET (large layers pay for bytes, not ops) but to what it measures, so that it cannot creep.
LEAN_BYTES_PER_ELEMENT = {"contiguous": 44, "other": 56}
LEAN_PER_CHANNEL_BYTES = 700  # measured 690 (8, 64, 24, 24), 624 (600, 512): the float64 payload arithmetic
LEAN_OP_BUDGET = 44  # measured: 44 contiguous NCHW (the copy-free statistics), 36 channels_last and (N, C)
_SMALL_SHAPES = [((8, 64, 14, 14), False), ((8, 64, 14, 14), True), ((256, 512), False)]
_LEAN_SHAPES = [((8, 64, 24, 24), False), ((8, 64, 24, 24), True), ((600, 512), False)]
EPS = 1e-3


@pytest.fixture
def clip_mode() -> Iterator[None]:
    set_sbn_eps_mode("clip")
    yield
    set_sbn_eps_mode("plus")


# ---------------------------------------------------------------------------------------------------------
# The float64 reference for eps_mode "clip", written out by hand.
# ---------------------------------------------------------------------------------------------------------


def _clip_reference(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Batch norm over dims (0, 2, ...) with ``invstd = rsqrt(max(var, eps))``: output and unbiased variance."""
    dims = [0] + list(range(2, x.dim()))
    shape = [1, -1] + [1] * (x.dim() - 2)
    mean = x.mean(dims, keepdim=True)
    var = ((x - mean) ** 2).mean(dims, keepdim=True)
    out = (x - mean) * torch.rsqrt(torch.clamp(var, min=eps)) * weight.view(shape) + bias.view(shape)
    count = x.numel() // x.size(1)
    return out, var.flatten() * count / (count - 1)


def _data(shape: Sequence[int], seed: int) -> Tensor:
    """Float32 data whose channel 0 has a variance far below EPS (so it is clipped) and the others O(1)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) + 3.0
    x[:, 0] = 0.5 + 1e-3 * x[:, 0]
    return x


def _check_clip(
    outputs: Sequence[Tensor], grads: Sequence[Tensor], inputs: Sequence[Tensor], dys: Sequence[Tensor],
    layer: nn.Module, initial: dict[str, Tensor], what: str,
) -> None:
    x = torch.cat([t.double() for t in inputs]).requires_grad_()
    weight = initial["weight"].double().requires_grad_()
    bias = initial["bias"].double().requires_grad_()
    ref, unbiased_var = _clip_reference(x, weight, bias, EPS)
    ref.backward(torch.cat([d.double() for d in dys]))
    # float32 data and arithmetic on O(1) values (the clipped channel's x - mean is ~1e-3): float32 rounding.
    torch.testing.assert_close(torch.cat(outputs).double(), ref.detach(), rtol=1e-5, atol=1e-5, msg=what)
    torch.testing.assert_close(torch.cat(grads).double(), x.grad, rtol=1e-4, atol=1e-5, msg=what)
    # Parameter gradients are sums over the global batch (tens of O(1) products): float32 sums.
    torch.testing.assert_close(layer.weight.grad.double(), weight.grad, rtol=1e-4, atol=1e-4, msg=what)
    torch.testing.assert_close(layer.bias.grad.double(), bias.grad, rtol=1e-4, atol=1e-4, msg=what)
    expected_mean = initial["running_mean"].double() * 0.9 + 0.1 * x.detach().mean([0] + list(range(2, x.dim())))
    expected_var = initial["running_var"].double() * 0.9 + 0.1 * unbiased_var.detach()
    torch.testing.assert_close(layer.running_mean.double(), expected_mean, rtol=1e-6, atol=1e-6, msg=what)
    torch.testing.assert_close(layer.running_var.double(), expected_var, rtol=1e-5, atol=1e-9, msg=what)


def _initial(layer: nn.Module) -> dict[str, Tensor]:
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(0.5, 1.5, layer.num_features))
        layer.bias.copy_(torch.linspace(-0.2, 0.2, layer.num_features))
    return {k: v.detach().clone() for k, v in layer.state_dict().items()}


@pytest.mark.parametrize("shape", [(6, 4), (5, 4, 3, 2)])
def test_clip_mode_local_path_matches_hand_written_float64(clip_mode: None, shape: tuple[int, ...]) -> None:
    layer = (SynchronizedBatchNorm1d if len(shape) == 2 else SynchronizedBatchNorm2d)(4, eps=EPS)
    initial = _initial(layer)
    x = _data(shape, seed=1).requires_grad_()
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    out = layer(x)
    out.backward(dy)
    assert layer.last_transport == "local"
    _check_clip([out.detach()], [x.grad], [x.detach()], [dy], layer, initial, f"local {shape}")


def test_clip_mode_without_running_statistics_applies_in_one_process(clip_mode: None) -> None:
    """track_running_stats=False, one process, no peer: "clip" still normalizes by sqrt(max(var, eps)), as it does
    with tracking and over any number of peers (it used to fall back to var + eps here, 3.8e-2 away)."""
    layer = SynchronizedBatchNorm2d(4, eps=EPS, track_running_stats=False)
    initial = _initial(layer)
    x = _data((5, 4, 3, 2), seed=1).requires_grad_()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    out = layer(x)
    out.backward(dy)
    weight = initial["weight"].double().requires_grad_()
    bias = initial["bias"].double().requires_grad_()
    x64 = x.detach().double().requires_grad_()
    ref, _ = _clip_reference(x64, weight, bias, EPS)
    ref.backward(dy.double())
    # float32 data and arithmetic on O(1) values (the clipped channel's x - mean is ~1e-3): float32 rounding.
    torch.testing.assert_close(out.detach().double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)
    # Sums over the batch of O(1) products: float32 sums.
    torch.testing.assert_close(layer.weight.grad.double(), weight.grad, rtol=1e-4, atol=1e-4)


def test_clip_mode_differs_from_plus_where_the_variance_is_below_eps() -> None:
    """The per-layer attribute overrides the global default, and the modes really differ on a clipped channel."""
    x = _data((6, 4, 3), seed=3)
    plus, clip = SynchronizedBatchNorm1d(4, eps=EPS), SynchronizedBatchNorm1d(4, eps=EPS)
    clip.eps_mode = "clamp"  # the classic library's spelling
    y_plus, y_clip = plus(x), clip(x)
    # Channel 0 (variance ~1e-6 < eps): sqrt(var + eps) vs sqrt(eps) differ by ~0.05 %; others agree to rounding.
    assert not torch.allclose(y_plus[:, 0], y_clip[:, 0], rtol=1e-5, atol=0)
    torch.testing.assert_close(y_plus[:, 1:], y_clip[:, 1:], rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(y_plus, nn.functional.batch_norm(x, None, None, plus.weight, plus.bias, True, 0.1, EPS))


def test_set_sbn_eps_mode_rejects_unknown_modes() -> None:
    with pytest.raises(ValueError, match="expected eps mode 'plus', 'clip' or 'clamp'"):
        set_sbn_eps_mode("max")
    layer = SynchronizedBatchNorm1d(3)
    layer.eps_mode = "sqrt"
    with pytest.raises(ValueError, match="got 'sqrt'"):
        layer(torch.randn(4, 3))


def test_clip_mode_dataparallel_matches_hand_written_float64(clip_mode: None, one_intra_op_thread: None) -> None:
    layer = SynchronizedBatchNorm2d(4, eps=EPS)
    initial = _initial(layer)
    model = DataParallelWithCallback(layer, cpu_replicas=2)
    x = _data((5, 4, 3, 2), seed=4).requires_grad_()
    dy = torch.randn(5, 4, 3, 2, generator=torch.Generator().manual_seed(5))
    out = model(x)
    out.backward(dy)
    assert layer.last_transport == "dataparallel"
    _check_clip([out.detach()], [x.grad], [x.detach()], [dy], layer, initial, "dataparallel")


# Measured with torch 2.13 CPU, (4, 8, 3, 3) float32, world size 2 over gloo: 184 (the module's Python and
# torch.distributed's group lookups included); 187 before the eager compiled kernels were retired (the kernel switch
# was read on every call), 169 before every collective carried its tag (syncbn_dist.comm.tags: the tags' lookup and
# verification). Before each layer kept its transport until the groups change
# (syncbn_dist.comm.distributed.cached_distributed_transport) and asked is_compiling once per forward: 227; before the
# eager path read the kernel switch first and called is_compiling once per direction: 342; with torch's own
# Function.apply, which binds the arguments with inspect on every call (syncbn_dist.layer.exchange_functions._apply),
# 513.
PYTHON_CALL_BUDGET = 190

# ---------------------------------------------------------------------------------------------------------
# gloo: the op budget, and "clip" over a process group.
# ---------------------------------------------------------------------------------------------------------


def _count_layer(
    shape: tuple[int, ...], rank: int, channels_last: bool
) -> tuple[OpCounter, BytesCounter, tuple[int, int]]:
    """The ops and bytes of one steady-state forward + backward, and the ops of each direction."""
    layer = syncbn_dist.convert_model(nn.BatchNorm2d(shape[1]) if len(shape) == 4 else nn.BatchNorm1d(shape[1]))
    gen = torch.Generator().manual_seed(rank)
    leaf = torch.randn(shape, generator=gen)
    dy = torch.randn(shape, generator=gen)
    if channels_last:
        leaf, dy = leaf.contiguous(memory_format=torch.channels_last), dy.contiguous(memory_format=torch.channels_last)
    leaf.requires_grad_()
    params = [layer.weight, layer.bias]
    for _ in range(2):  # the first call also runs the one-time agreement check
        count_layer(layer, leaf, dy, params)
    counters = count_layer(layer, leaf, dy, params)
    x = leaf * 1.0  # as count_layer: a non-leaf input
    with OpCounter() as forward:
        y = layer(x)
    with OpCounter() as backward:
        torch.autograd.grad(y, [x, *params], dy)
    assert layer.last_transport == "distributed"
    return (*counters, (forward.total, backward.total))


def _python_calls_per_step(rank: int) -> int:
    """Python function calls of one steady-state forward + backward of a synchronized layer."""
    layer = SynchronizedBatchNorm2d(8)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 8, 3, 3, generator=gen).requires_grad_()
    dy = torch.randn(x.shape, generator=gen)
    for _ in range(3):  # the first call also runs the agreement check
        layer(x).backward(dy)
    profiler = cProfile.Profile()
    profiler.enable()
    layer(x).backward(dy)
    profiler.disable()
    assert layer.last_transport == "distributed"
    return pstats.Stats(profiler).total_calls


def _worker_lean(rank: int, world_size: int) -> dict[str, object]:
    budgets = {"python calls": _python_calls_per_step(rank)}
    for shape, channels_last in _SMALL_SHAPES + _LEAN_SHAPES:
        counter, traffic, directions = _count_layer(shape, rank, channels_last)
        numel, channels = torch.Size(shape).numel(), shape[1]
        lean = (shape, channels_last) in _LEAN_SHAPES
        assert lean == (numel >= LEAN_MIN_NUMEL), f"{shape}: on the wrong side of LEAN_MIN_NUMEL for this test"
        if not lean:
            op_budget, per_element, per_channel = OP_BUDGET, BYTES_PER_ELEMENT, PER_CHANNEL_BYTES
        else:
            op_budget, per_channel = LEAN_OP_BUDGET, LEAN_PER_CHANNEL_BYTES
            per_element = LEAN_BYTES_PER_ELEMENT["contiguous" if len(shape) == 4 and not channels_last else "other"]
        budgets[f"{shape}{' channels_last' if channels_last else ''}"] = (
            counter.total,
            op_budget,
            sum(counter.collectives.values()),
            counter.histogram(),
            traffic.total,
            per_element * numel + per_channel * channels,
            traffic.per_element(numel),
            None if lean else directions,
        )
    # "clip" over the process group: rank r holds rows [2r, 2r + 2 + r) of one global batch (uneven).
    set_sbn_eps_mode("clip")
    try:
        layer = SynchronizedBatchNorm2d(4, eps=EPS)
        initial = _initial(layer)
        sizes = [2 + r for r in range(world_size)]
        x_global = _data((sum(sizes), 4, 3, 2), seed=6)
        dy_global = torch.randn(x_global.shape, generator=torch.Generator().manual_seed(7))
        start = sum(sizes[:rank])
        x = x_global[start : start + sizes[rank]].clone().requires_grad_()
        out = layer(x)
        out.backward(dy_global[start : start + sizes[rank]])
        assert layer.last_transport == "distributed"
        gathered: list[tuple[Tensor, Tensor]] = [None] * world_size  # type: ignore[list-item]
        torch.distributed.all_gather_object(gathered, (out.detach(), x.grad))  # uneven sizes: gloo needs equal
        outputs, grads = [o for o, _ in gathered], [g for _, g in gathered]
        # Parameter gradients are local sums; their sum over ranks is the global one (what DDP averages).
        for p in (layer.weight, layer.bias):
            torch.distributed.all_reduce(p.grad)
        inputs = [x_global[sum(sizes[:r]) : sum(sizes[: r + 1])] for r in range(world_size)]
        dys = [dy_global[sum(sizes[:r]) : sum(sizes[: r + 1])] for r in range(world_size)]
        _check_clip(outputs, grads, inputs, dys, layer, initial, f"distributed rank {rank}")
    finally:
        set_sbn_eps_mode("plus")
    return budgets


@pytest.mark.distributed
@pytest.mark.slow
def test_op_and_byte_budgets_and_clip_mode_over_gloo() -> None:
    """FORWARD_OPS + BACKWARD_OPS ops on the op-lean path (at most LEAN_OP_BUDGET on the memory-lean one), the byte
    budget and PYTHON_CALL_BUDGET Python calls per synchronized layer, forward + backward; one all_reduce each way
    (world size 2)."""
    results = run_distributed(_worker_lean, 2, timeout=240)
    for budgets in results:
        calls = budgets.pop("python calls")
        assert calls <= PYTHON_CALL_BUDGET, f"{calls} Python calls per step > budget {PYTHON_CALL_BUDGET}"
        for shape, (total, op_budget, collectives, histogram, moved, byte_budget, by_op, directions) in budgets.items():
            assert collectives == 2, f"{shape}: {collectives} all_reduces, expected 1 forward + 1 backward"
            assert total <= op_budget, f"{shape}: {total} ops > budget {op_budget}:\n{histogram}"
            if directions is not None:  # the op-lean path: exactly its forward and backward counts
                assert directions == (FORWARD_OPS, BACKWARD_OPS), f"{shape}: (forward, backward) ops {directions}"
            assert moved <= byte_budget, f"{shape}: {moved} bytes > budget {byte_budget}, per element by op: {by_op}"


def test_bytes_counter_counts_the_storage_each_op_reads_and_writes() -> None:
    """Dense tensors count numel * element_size whatever their layout, expanded views their real extent, views
    nothing, and an in-place op its mutated tensor twice (read and written)."""
    x = torch.randn(4, 3, 5, 2).contiguous(memory_format=torch.channels_last)
    scale = torch.randn(3)
    with BytesCounter() as traffic:
        y = x * scale.view(1, 3, 1, 1).expand_as(x)  # reads x (480 B) and 3 floats, writes y (480 B)
        y.add_(x)  # reads y and x, writes y
        y.permute(0, 2, 3, 1).view(-1)  # views move nothing
    assert dict(traffic.by_op) == {"aten.mul": 480 + 12 + 480, "aten.add_": 3 * 480}
    assert traffic.total == 2412 and traffic.per_element(x.numel()) == {"aten.add_": 12.0, "aten.mul": 8.1}
