"""Single-process tests of syncbn_dist.layer.functions: the per-channel moments and the synchronized batch-norm math.

The reference is always float64: ``torch.var_mean`` / sums on the data cast to float64 for the moments, and
``F.batch_norm`` in training mode on the float64 copy of the input for ``sync_batch_norm``. The transport used
here is :class:`_SoloTransport`, a one-member implementation of our own ``Transport`` protocol (not
torch.distributed), so the whole forward/backward path, including the backward through the transport, runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from moments import combine_moments, local_moments
from torch import Tensor

from syncbn_dist.kernels.native import LEAN_MIN_NUMEL
from syncbn_dist.layer.functions import sync_batch_norm

SHAPES = [(6, 3), (5, 3, 4), (4, 3, 3, 2), (3, 2, 2, 3, 2)]


class _SoloTransport:
    """A group of one: the sum over the members is the tensor itself (new tensors, differentiable)."""

    name = "solo"

    def __init__(self) -> None:
        self.calls = 0

    def all_reduce(self, tensors: Sequence[Tensor], tags: Any = None) -> list[Tensor]:
        self.calls += 1
        return [t.clone() for t in tensors]


def _data(shape: Sequence[int], *, mean: float = 0.0, std: float = 1.0, seed: int = 0) -> Tensor:
    """Float64 data with a different mean per channel (sign alternating) around ``mean``."""
    gen = torch.Generator().manual_seed(seed)
    channels = shape[1]
    offsets = torch.tensor([mean * (1.0 + 0.1 * c) * (-1) ** c for c in range(channels)], dtype=torch.float64)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64) * std
    return x + offsets.view([1, -1] + [1] * (len(shape) - 2))


def _reduce_dims(x: Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


# ------------------------------------------------------------------------------------------------------------
# local_moments / combine_moments
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, memory_format",
    [(s, torch.contiguous_format) for s in SHAPES]
    + [((4, 3, 3, 2), torch.channels_last), ((3, 2, 2, 3, 2), torch.channels_last_3d)],
)
def test_local_moments_match_float64(shape: tuple[int, ...], memory_format: torch.memory_format) -> None:
    x = _data(shape, mean=2.0, seed=1).float().contiguous(memory_format=memory_format)
    count, moments = local_moments(x)
    x64 = x.double()
    dims = _reduce_dims(x64)
    assert count.dtype == torch.float64 and count.shape == (1,)
    assert moments.dtype == torch.float64 and moments.shape == (2 * shape[1],)
    assert count.item() == x.numel() // shape[1]
    sums, sumsqs = moments.chunk(2)
    # Near zero mean (here |mean|/std <= 2.2) the CPU path may take the native kernel's float32 mean: the sum
    # is then good to float32 rounding of the mean, ~6e-8 relative (the exact float64 path covers large offsets).
    torch.testing.assert_close(sums, x64.sum(dims), rtol=2e-7, atol=1e-9 * x.numel())
    # The sum of squares is rebuilt from a float32-stable variance and mean: ~1e-7 relative to the variance
    # and mean terms (mean 2, std 1 here), so 1e-6 relative on sumsq is ample.
    torch.testing.assert_close(sumsqs, (x64 * x64).sum(dims), rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("shape", [(0, 3), (0, 3, 4), (0, 2, 3, 3)])
def test_local_moments_empty_input(shape: tuple[int, ...]) -> None:
    count, moments = local_moments(torch.randn(shape))
    assert count.dtype == torch.float64 and moments.dtype == torch.float64
    torch.testing.assert_close(count, torch.zeros(1, dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(moments, torch.zeros(2 * shape[1], dtype=torch.float64), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 3), (4, 3, 5, 5)])
def test_local_moments_reduced_precision_payload(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = _data(shape, mean=1.0, seed=2).to(dtype)
    count, moments = local_moments(x)
    count32, moments32 = local_moments(x.float())
    # Same payload layout as float32 input: float64, (1,) and (2C,).
    assert count.dtype == moments.dtype == torch.float64
    assert count.shape == count32.shape and moments.shape == moments32.shape
    x64 = x.double()
    sums, sumsqs = moments.chunk(2)
    # Half values upcast exactly, statistics accumulated in float32: the mean is good to ~1e-7 of |mean| + std.
    count_per_channel = x.numel() // shape[1]
    torch.testing.assert_close(sums, x64.sum(_reduce_dims(x64)), rtol=2e-7, atol=2e-7 * count_per_channel)
    # The variance is computed in float32 from the upcast values (not in half): float32-level accuracy.
    torch.testing.assert_close(sumsqs, (x64 * x64).sum(_reduce_dims(x64)), rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("shape", SHAPES)
def test_combine_moments_over_uneven_shards(shape: tuple[int, ...]) -> None:
    n = 11
    x = _data((n,) + tuple(shape[1:]), mean=3.0, seed=3).float()
    shards = x.split([4, 0, 1, 6])  # uneven, one empty, one single sample
    count = torch.zeros(1, dtype=torch.float64)
    moments = torch.zeros(2 * shape[1], dtype=torch.float64)
    for shard in shards:
        c, m = local_moments(shard)
        count, moments = count + c, moments + m
    mean, var = combine_moments(count, moments)
    ref_var, ref_mean = torch.var_mean(x.double(), dim=_reduce_dims(x), correction=0)
    assert count.item() == x.numel() // shape[1]
    assert mean.dtype == var.dtype == torch.float64
    # Float64 combination of shard statistics that are exact to float32 accumulation (std is 1 here): the mean
    # to ~1e-7 of the std, the variance to ~1e-7 relative; 1e-6 leaves margin.
    torch.testing.assert_close(mean, ref_mean, rtol=0.0, atol=1e-6)
    torch.testing.assert_close(var, ref_var, rtol=1e-6, atol=0.0)


def test_combine_moments_zero_count() -> None:
    mean, var = combine_moments(torch.zeros(1, dtype=torch.float64), torch.zeros(6, dtype=torch.float64))
    torch.testing.assert_close(mean, torch.zeros(3, dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(var, torch.zeros(3, dtype=torch.float64), rtol=0, atol=0)


@pytest.mark.parametrize("ratio", [1e3, 1e4])
@pytest.mark.parametrize("layout", ["2d", "4d", "channels_last"])
def test_variance_precision_far_from_zero_mean(ratio: float, layout: str) -> None:
    shape = (512, 4) if layout == "2d" else (16, 4, 6, 5)
    x = _data(shape, mean=ratio, std=1.0, seed=4).float()
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
        assert not x.is_contiguous()
    count = torch.zeros(1, dtype=torch.float64)
    moments = torch.zeros(2 * shape[1], dtype=torch.float64)
    sizes = [5, 0, 3]
    for shard in x.split(sizes + [shape[0] - sum(sizes)]):  # uneven shards with an empty one, as across ranks
        c, m = local_moments(shard)
        count, moments = count + c, moments + m
    _, var = combine_moments(count, moments)
    ref_var = torch.var(x.double(), dim=_reduce_dims(x), correction=0)
    # The whole point of the float64, stable-variance payload: 1e-6 relative at |mean|/std = 1e4 (the naive
    # float32 E[x^2] - E[x]^2 would have no correct digits here).
    torch.testing.assert_close(var, ref_var, rtol=1e-6, atol=0.0)


# ------------------------------------------------------------------------------------------------------------
# sync_batch_norm through a one-member transport
# ------------------------------------------------------------------------------------------------------------


def _param(c: int, seed: int, dtype: torch.dtype, offset: float) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (offset + 0.5 * torch.randn(c, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("track_running_stats", [True, False])
@pytest.mark.parametrize("momentum", [0.1, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sync_batch_norm_matches_f_batch_norm(
    shape: tuple[int, ...], affine: bool, track_running_stats: bool, momentum: float, dtype: torch.dtype
) -> None:
    c = shape[1]
    eps = 1e-5
    x64 = _data(shape, mean=1.5, std=2.0, seed=5)
    x = x64.to(dtype).requires_grad_()
    x_ref = x.detach().double().requires_grad_()
    weight = _param(c, 6, dtype, 1.0) if affine else None
    bias = _param(c, 7, dtype, 0.0) if affine else None
    w_ref = weight.detach().double().requires_grad_() if affine else None
    b_ref = bias.detach().double().requires_grad_() if affine else None
    running_mean = torch.linspace(-1, 1, c, dtype=dtype) if track_running_stats else None
    running_var = torch.linspace(0.5, 2, c, dtype=dtype) if track_running_stats else None
    rm_ref = running_mean.double() if track_running_stats else None
    rv_ref = running_var.double() if track_running_stats else None

    transport = _SoloTransport()
    out = sync_batch_norm(x, weight, bias, running_mean, running_var, momentum, eps, transport)
    ref = F.batch_norm(x_ref, rm_ref, rv_ref, w_ref, b_ref, True, momentum, eps)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    out.backward(grad_out.to(dtype))
    ref.backward(grad_out)

    assert out.dtype == dtype and out.shape == x.shape
    assert transport.calls == 1  # one collective in forward; the backward runs through its autograd graph
    # float32: O(1) values after a few float32 roundings; float64: only float64 rounding.
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(x.grad.double(), x_ref.grad, **tol)
    if affine:
        # Sums over N * spatial values of O(1) products: scale the absolute tolerance by the count.
        n = x.numel() // c
        grad_tol = {"rtol": tol["rtol"], "atol": tol["atol"] * n}
        torch.testing.assert_close(weight.grad.double(), w_ref.grad, **grad_tol)
        torch.testing.assert_close(bias.grad.double(), b_ref.grad, **grad_tol)
    if track_running_stats:
        torch.testing.assert_close(running_mean.double(), rm_ref, **tol)
        torch.testing.assert_close(running_var.double(), rv_ref, **tol)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(3, 2), (3, 2, 2), (2, 2, 2, 1)])
def test_sync_batch_norm_gradcheck(affine: bool, shape: tuple[int, ...]) -> None:
    x = _data(shape, mean=0.5, seed=9).requires_grad_()
    weight = _param(shape[1], 10, torch.float64, 1.0) if affine else None
    bias = _param(shape[1], 11, torch.float64, 0.0) if affine else None

    def fn(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
        return sync_batch_norm(x, weight, bias, None, None, 0.0, 1e-5, _SoloTransport())

    assert torch.autograd.gradcheck(fn, (x, weight, bias))


@pytest.mark.parametrize("ndim", [4, 5])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("grad_channels_last", [True, False])
def test_channels_last_in_channels_last_out(ndim: int, batch: int, grad_channels_last: bool) -> None:
    # batch 1 with a contiguous grad_output once hit a CPU kernel bug (wrong sum(dy), sum(dy * x_hat)).
    fmt = torch.channels_last if ndim == 4 else torch.channels_last_3d
    shape = (batch, 4, 3, 2) if ndim == 4 else (batch, 4, 2, 3, 2)
    x = _data(shape, mean=1.0, seed=12).float().contiguous(memory_format=fmt).requires_grad_()
    weight, bias = _param(4, 13, torch.float32, 1.0), _param(4, 14, torch.float32, 0.0)
    out = sync_batch_norm(x, weight, bias, None, None, 0.0, 1e-5, _SoloTransport())
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(15))
    if grad_channels_last:
        grad_out = grad_out.contiguous(memory_format=fmt)
    out.backward(grad_out)
    assert out.is_contiguous(memory_format=fmt)
    assert x.grad.is_contiguous(memory_format=fmt)

    x_ref = x.detach().double().contiguous().requires_grad_()
    ref = F.batch_norm(x_ref, None, None, weight.detach().double(), bias.detach().double(), True, 0.0, 1e-5)
    ref.backward(grad_out.double())
    # O(1) values with a few float32 roundings.
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x_ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sync_batch_norm_reduced_precision(dtype: torch.dtype) -> None:
    x = _data((6, 3, 2, 2), mean=2.0, seed=16).to(dtype).requires_grad_()
    running_mean, running_var = torch.zeros(3), torch.ones(3)
    out = sync_batch_norm(x, None, None, running_mean, running_var, 0.1, 1e-5, _SoloTransport())
    out.sum().backward()
    assert out.dtype == dtype and x.grad.dtype == dtype
    rm_ref, rv_ref = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    ref = F.batch_norm(x.detach().double(), rm_ref, rv_ref, None, None, True, 0.1, 1e-5)
    # The output is rounded to the input dtype once: half an ulp of O(1) values (bf16: 2^-8, fp16: 2^-11).
    tol = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    # Statistics are float64 from exact half values, the running buffers float32: float32 rounding only.
    torch.testing.assert_close(running_mean.double(), rm_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(running_var.double(), rv_ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape", [(1, 3), (1, 3, 1), (1, 2, 1, 1)])
def test_global_count_of_one_raises(shape: tuple[int, ...]) -> None:
    running_mean, running_var = torch.zeros(shape[1]), torch.ones(shape[1])
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        sync_batch_norm(torch.randn(shape), None, None, running_mean, running_var, 0.1, 1e-5, _SoloTransport())
    # Nothing was folded into the running statistics.
    assert torch.equal(running_mean, torch.zeros(shape[1])) and torch.equal(running_var, torch.ones(shape[1]))


def test_empty_input_gives_empty_output_and_leaves_running_stats() -> None:
    x = torch.randn(0, 3, 2, requires_grad=True)
    weight, bias = _param(3, 17, torch.float32, 1.0), _param(3, 18, torch.float32, 0.0)
    running_mean, running_var = torch.full((3,), 0.25), torch.full((3,), 2.0)
    out = sync_batch_norm(x, weight, bias, running_mean, running_var, 0.1, 1e-5, _SoloTransport())
    out.sum().backward()
    assert out.shape == x.shape and x.grad.shape == x.shape
    # As nn.BatchNorm on an empty batch: running statistics untouched, zero parameter gradients.
    assert torch.equal(running_mean, torch.full((3,), 0.25)) and torch.equal(running_var, torch.full((3,), 2.0))
    assert torch.equal(weight.grad, torch.zeros(3)) and torch.equal(bias.grad, torch.zeros(3))


# ------------------------------------------------------------------------------------------------------------
# The memory-lean regime (activations of at least LEAN_MIN_NUMEL elements)
# ------------------------------------------------------------------------------------------------------------

# Just above the threshold, so that these stay fast: (N, C, H, W) and (N, C) with C = 8.
_LEAN_4D = (20, 8, 48, 44)
_LEAN_2D = (LEAN_MIN_NUMEL // 8 + 7, 8)


@pytest.mark.parametrize("ratio", [1e3, 1e4])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "2d"])
def test_lean_regime_variance_precision_far_from_zero_mean(ratio: float, layout: str) -> None:
    shape = _LEAN_2D if layout == "2d" else _LEAN_4D
    x = _data(shape, mean=ratio, std=1.0, seed=9).float()
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    count = torch.zeros(1, dtype=torch.float64)
    moments = torch.zeros(2 * shape[1], dtype=torch.float64)
    sizes = [3, 0, 1]
    shards = x.split(sizes + [shape[0] - sum(sizes)])  # uneven, one empty; only the largest is in the lean regime
    assert shards[-1].numel() >= LEAN_MIN_NUMEL
    for shard in shards:
        c, m = local_moments(shard)
        count, moments = count + c, moments + m
    mean, var = combine_moments(count, moments)
    ref_var, ref_mean = torch.var_mean(x.double(), dim=_reduce_dims(x), correction=0)
    torch.testing.assert_close(mean, ref_mean, rtol=0.0, atol=1e-6)
    torch.testing.assert_close(var, ref_var, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("eps_mode", ["plus", "clip"])
def test_lean_regime_matches_f_batch_norm(
    memory_format: torch.memory_format, affine: bool, eps_mode: str
) -> None:
    c, eps, momentum = _LEAN_4D[1], 1e-5, 0.1
    x64 = _data(_LEAN_4D, mean=1.5, std=2.0, seed=10)
    x64[:, 0] *= 1e-3  # variance ~4e-6 < eps: "clip" clips this channel
    x = x64.float().contiguous(memory_format=memory_format).requires_grad_()
    assert x.numel() >= LEAN_MIN_NUMEL
    weight = _param(c, 6, torch.float32, 1.0) if affine else None
    bias = _param(c, 7, torch.float32, 0.0) if affine else None
    running_mean, running_var = torch.zeros(c), torch.ones(c)
    grad_out = torch.randn(_LEAN_4D, generator=torch.Generator().manual_seed(8), dtype=torch.float64)

    out = sync_batch_norm(x, weight, bias, running_mean, running_var, momentum, eps, _SoloTransport(), eps_mode)
    out.backward(grad_out.float())

    x_ref = x.detach().double().requires_grad_()
    params = [p.detach().double().requires_grad_() for p in (weight, bias)] if affine else [None, None]
    rm, rv = torch.zeros(c, dtype=torch.float64), torch.ones(c, dtype=torch.float64)
    ref = F.batch_norm(x_ref, rm, rv, params[0], params[1], True, momentum, eps)
    if eps_mode == "clip":
        # sqrt(max(var, eps)) written out (running statistics as F.batch_norm): the clamp has no gradient.
        dims, view = _reduce_dims(x_ref), (1, -1, 1, 1)
        var, mean = torch.var_mean(x_ref, dims, correction=0)
        ref = (x_ref - mean.view(view)) * torch.rsqrt(var.clamp(min=eps)).view(view)
        if affine:
            ref = ref * params[0].view(view) + params[1].view(view)
    ref.backward(grad_out)

    tol = {"rtol": 1e-5, "atol": 1e-5}
    grad_tol = {"rtol": 1e-5, "atol": 1e-5 * (x.numel() // c)}
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(x.grad.double(), x_ref.grad, **tol)
    if affine:
        torch.testing.assert_close(weight.grad.double(), params[0].grad, **grad_tol)
        torch.testing.assert_close(bias.grad.double(), params[1].grad, **grad_tol)
    torch.testing.assert_close(running_mean.double(), rm, **tol)
    torch.testing.assert_close(running_var.double(), rv, **tol)
