r"""Synchronized batch-norm math: the autograd Functions and the per-channel statistics they share.

The forward pass of one synchronized layer is

    input --_LocalMoments--> (count, moments) --transport.all_reduce--> global (count, moments)
          \--------------------------- alias --------------------------> _Normalize --> output

``moments`` packs the per-channel sum and sum of squares, so one flat float64 payload
``[count, sum(C), sumsq(C)]`` crosses the transport in forward. In backward ``_Normalize`` sends the
local per-channel reductions ``[sum(dy), sum(dy * x_hat)]`` back through the same transport edge
(one collective of 2C values), and ``_LocalMoments`` turns the global reductions and ``dy`` into the
exact global-batch ``grad_input``. The transport only ever sees flat tensors: the math does not know
whether it runs over ``torch.distributed``, DataParallel replicas, or both.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function

__all__ = ["Transport", "sync_batch_norm", "combine_moments", "local_moments"]

# Statistics are combined in float64: the sum of squares of data with |mean|/std = 1e4 carries 1e8 times more
# magnitude than the variance, which float32 cannot resolve (E[x^2] - E[x]^2 cancels catastrophically).
_COMBINE_DTYPE = torch.float64

# Channels with |mean| above this many standard deviations get an exact second pass on CPU (see _cpu_mean_var),
# which forms the deviations from the mean this many values at a time.
_SHIFT_RATIO = 2.0
_SHIFT_CHUNK = 1 << 20

# Values per channel in one float32 accumulation of the CPU kernel for float16/bfloat16 input. Its serial float32
# sums lose accuracy with the count (biased variance off by ~2e-4 relative at 2^20 values per channel and ~3e-2
# at 2^24), so larger shards are split into chunks of at most this many values, merged in float64 (~1e-6).
_REDUCED_PRECISION_CHUNK = 1 << 14


class Transport(Protocol):
    """Sums tensors over every member of a group (processes, replicas, or both).

    ``all_reduce`` must run one collective for the whole list, return new tensors, and be differentiable:
    the gradients of the outputs are summed over the members into the gradients of the inputs that require
    grad, again with one collective.
    """

    name: str

    def all_reduce(self, tensors: Sequence[Tensor]) -> list[Tensor]: ...

    def verify_agreement(self, key: str, description: str, verified: set[Any]) -> None: ...


def _channel_view(stat: Tensor, input: Tensor) -> Tensor:
    """Reshape a per-channel vector (C,) to broadcast against ``input`` of shape (N, C, *)."""
    return stat.view([1, -1] + [1] * (input.dim() - 2))


def local_moments(input: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel count, sum and sum of squares of one shard of the batch, in float64.

    The sum of squares is rebuilt as ``count * (var + mean**2)`` from a numerically stable mean and biased
    variance, never summed raw in the input dtype, and the shard mean is carried in float64 where its
    float32 rounding would matter: at |mean|/std = 1e4 that rounding alone would cost the combined variance
    ~1e-5 relative accuracy. See :func:`_cpu_mean_var` for the CPU strategy.

    Args:
        input: (N, C, *) floating tensor, any memory format; N may be 0.

    Returns:
        ``count`` of shape (1,) and ``moments`` of shape (2C,) = [sum(C), sumsq(C)], both float64 on the
        input's device. An empty input gives zeros of the same shapes and dtype.
    """
    num_features = input.size(1)
    count = input.numel() // num_features if num_features else 0
    device = input.device
    count_tensor = torch.full((1,), float(count), dtype=_COMBINE_DTYPE, device=device)
    if count == 0:
        return count_tensor, torch.zeros(2 * num_features, dtype=_COMBINE_DTYPE, device=device)
    dims = [0] + list(range(2, input.dim()))
    if device.type == "cpu":
        mean, var = _cpu_mean_var(input, dims, count)
        sums = mean * count
    else:
        # Accelerator reductions convert on load: a float64 sum is one read and no copy. The variance comes
        # from the native Welford kernel.
        sums = torch.sum(input, dim=dims, dtype=_COMBINE_DTYPE)
        var = _native_mean_var(input)[1].to(_COMBINE_DTYPE)
    return count_tensor, torch.cat([sums, var * count + sums * sums / count])


def _native_mean_var(input: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel mean and biased variance from the native batch-norm statistics kernel (one pass or two).

    Returned in float32 for reduced-precision input (float32 accumulation, no float32 copy of the input),
    else in the input's dtype.
    """
    num_features = input.size(1)
    # Scratch buffers in the statistics dtype select that output dtype (the kernel rejects float32 buffers
    # with float64 input); momentum 0 leaves them untouched.
    stat_dtype = _stat_dtype(input)
    scratch_mean = torch.zeros(num_features, dtype=stat_dtype, device=input.device)
    scratch_var = torch.ones(num_features, dtype=stat_dtype, device=input.device)
    return torch.batch_norm_update_stats(input, scratch_mean, scratch_var, 0.0)


def _cpu_mean_var(input: Tensor, dims: list[int], count: int) -> tuple[Tensor, Tensor]:
    """Per-channel mean and biased variance on CPU, in float64, accurate to ~1e-7 relative.

    - (N, C, *) contiguous float32/float64 input: deviations from a float32 mean, summed exactly in
      bounded chunks (:func:`_shifted_mean_var`). Exact at any |mean|/std, and faster than the native
      statistics kernel on this layout.
    - channels_last, (N, C), float16/bfloat16: the native kernel, which is fast here but rounds its mean to
      float32 and, for these layouts, accumulates E[x^2] - E[x]^2. Reading its result on the host is free on
      CPU, so if any channel has |mean| > ``_SHIFT_RATIO`` * std, the exact pass runs as well.
    - Float16/bfloat16 shards with more than ``_REDUCED_PRECISION_CHUNK`` values per channel are reduced in
      chunks, since the kernel's float32 sums drift with the count there.
    """
    reduced_precision = input.dtype in (torch.float16, torch.bfloat16)
    if not reduced_precision and input.dim() > 2 and input.is_contiguous():
        return _shifted_mean_var(input, dims, input.sum(dim=dims).to(_COMBINE_DTYPE) / count)
    if reduced_precision and count > _REDUCED_PRECISION_CHUNK:
        mean, var = _chunked_mean_var(input, count)
    else:
        mean, var = (stat.to(_COMBINE_DTYPE) for stat in _native_mean_var(input))
    if bool((mean.abs() > _SHIFT_RATIO * var.sqrt()).any()):
        return _shifted_mean_var(input, dims, mean)
    return mean, var


def _shifted_mean_var(input: Tensor, dims: list[int], shift: Tensor) -> tuple[Tensor, Tensor]:
    """Exact per-channel mean and biased variance of ``input`` from its deviations around ``shift``.

    The deviations are of the order of the standard deviation, so their sums carry no cancellation; the
    mean is ``shift + mean(deviation)`` in float64. The deviations are formed ``_SHIFT_CHUNK`` values at a
    time along dim 0, so the temporary memory stays small whatever the activation size.
    """
    stat_dtype = _stat_dtype(input)
    shift = shift.to(stat_dtype)
    unit = torch.ones_like(shift)
    count = input.numel() // input.size(1)
    rows = max(1, _SHIFT_CHUNK // max(1, input[:1].numel()))
    sums = torch.zeros(input.size(1), dtype=_COMBINE_DTYPE, device=input.device)
    squares = torch.zeros_like(sums)
    for part in input.split(rows, dim=0):
        if part.dtype == stat_dtype:
            # x - shift exactly (unit variance, eps 0), with the native kernel: faster than a broadcast sub.
            deviations = F.batch_norm(part, shift, unit, None, None, False, 0.0, 0.0)
        else:
            deviations = part.to(stat_dtype) - _channel_view(shift, part)
        sums += deviations.sum(dim=dims)
        squares += deviations.square_().sum(dim=dims)
    offset = sums / count
    # The shift was rounded to stat_dtype before subtracting: add back exactly what was subtracted.
    mean = shift.to(_COMBINE_DTYPE) + offset
    return mean, (squares / count - offset * offset).clamp_(min=0.0)


def _chunked_mean_var(input: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """Per-channel mean and biased variance from chunks of at most ``_REDUCED_PRECISION_CHUNK`` values.

    Each chunk (a view: no copy) gets the native kernel's float32 statistics; they are merged in float64
    with the parallel-variance formula of Chan, Golub & LeVeque (1979).
    """
    chunks = _split_values_per_channel(input, _REDUCED_PRECISION_CHUNK)
    counts = torch.tensor([c.numel() // c.size(1) for c in chunks], dtype=_COMBINE_DTYPE, device=input.device)
    counts = counts.unsqueeze(1)
    stats = [_native_mean_var(c) for c in chunks]
    chunk_means = torch.stack([m for m, _ in stats]).to(_COMBINE_DTYPE)
    chunk_vars = torch.stack([v for _, v in stats]).to(_COMBINE_DTYPE)
    mean = (counts * chunk_means).sum(0) / count
    deviations = chunk_means - mean
    var = (counts * chunk_vars).sum(0) / count + (counts * deviations * deviations).sum(0) / count
    return mean, var


def _split_values_per_channel(input: Tensor, limit: int) -> list[Tensor]:
    """Views of ``input`` with at most ``limit`` values per channel each, split along dim 0, then spatial dims.

    A chunk keeps the input's memory format where the split allows; otherwise the kernel takes its strided path.
    """
    per_channel = input.numel() // input.size(1)
    if per_channel <= limit:
        return [input]
    for dim in [0] + list(range(2, input.dim())):
        size = input.size(dim)
        if size > 1:
            step = max(1, limit // (per_channel // size))
            return [chunk for part in input.split(step, dim) for chunk in _split_values_per_channel(part, limit)]
    return [input]


def combine_moments(count: Tensor, moments: Tensor) -> tuple[Tensor, Tensor]:
    """Global mean and biased variance from summed counts and moments.

    The sums were formed from stable per-shard means and variances and are combined in float64, which is
    the parallel-variance combination of Chan, Golub & LeVeque (1979) expressed as sums.

    Args:
        count: (1,) float64, the total number of values per channel (may be 0).
        moments: (2C,) float64, [sum(C), sumsq(C)] summed over every shard.

    Returns:
        ``mean`` and ``var`` of shape (C,), float64. With a zero count both are zeros.
    """
    total = count.clamp(min=1.0)
    sums, sumsqs = moments.chunk(2)
    mean = sums / total
    var = (sumsqs / total - mean * mean).clamp_(min=0.0)
    return mean, var


class _BackwardLink:
    """Global per-channel statistics: :func:`sync_batch_norm` fills them after the forward collective and
    ``_LocalMoments.backward`` reads them (they are known only after ``_LocalMoments.forward`` ran)."""

    __slots__ = ("count", "mean", "invstd", "weight")

    def __init__(self) -> None:
        self.count: Optional[Tensor] = None
        self.mean: Optional[Tensor] = None
        self.invstd: Optional[Tensor] = None
        self.weight: Optional[Tensor] = None


class _LocalMoments(Function):
    """input -> (count, moments, alias of input). Backward produces the exact global ``grad_input``.

    In backward ``grad_moments`` holds the global ``[sum(dy), sum(dy * x_hat)]`` (summed by the transport's
    backward) and ``grad_alias`` holds ``dy`` passed through by ``_Normalize``; with them

        grad_input = weight * invstd * (dy - sum(dy) / N - x_hat * sum(dy * x_hat) / N)

    where N is the global count (Ioffe & Szegedy 2015, arXiv:1502.03167, eq. for dl/dx_i).
    """

    @staticmethod
    def forward(ctx: Any, input: Tensor, link: _BackwardLink) -> tuple[Tensor, Tensor, Tensor]:
        count, moments = local_moments(input)
        ctx.mark_non_differentiable(count)
        ctx.save_for_backward(input)
        ctx.link = link
        return count, moments, input.view_as(input)

    @staticmethod
    def backward(ctx: Any, _grad_count: Tensor, grad_moments: Tensor, grad_alias: Tensor) -> tuple[Any, ...]:
        (input,) = ctx.saved_tensors
        link: _BackwardLink = ctx.link
        if input.numel() == 0:
            return torch.zeros_like(input), None
        sum_dy, sum_dy_xhat = grad_moments.chunk(2)
        total = link.count.clamp(min=1.0)
        scale = link.invstd if link.weight is None else link.invstd * link.weight.to(_COMBINE_DTYPE)
        # grad_input = a * dy + b * x + c with per-channel a, b, c (float64 here, cast once below).
        coef_x = -scale * link.invstd * sum_dy_xhat / total
        coef_const = -scale * sum_dy / total - coef_x * link.mean
        grad_input = _affine_channels(input, coef_x, coef_const)
        grad_input.addcmul_(grad_alias, _channel_view(scale.to(grad_input.dtype), input))
        return grad_input, None


def _affine_channels(input: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """``input * scale + shift`` per channel in one native pass, in the input's dtype and memory format.

    ``F.batch_norm`` in inference mode with zero mean, unit variance and eps 0 is exactly that affine map
    (computed in float32 for reduced-precision input); its kernel is several times faster on CPU than a
    broadcasting ``addcmul`` for (N, C, H, W) input with small H * W.
    """
    stat_dtype = _stat_dtype(input)
    zeros = torch.zeros_like(scale, dtype=stat_dtype)
    ones = torch.ones_like(scale, dtype=stat_dtype)
    return F.batch_norm(input, zeros, ones, scale.to(stat_dtype), shift.to(stat_dtype), False, 0.0, 0.0)


class _Normalize(Function):
    """(alias of input, weight, bias, global moments) -> output, normalized with the global statistics.

    ``moments`` is an input only so that backward can send the local ``[sum(dy), sum(dy * x_hat)]`` through
    the transport's differentiable all_reduce; ``dy`` itself goes to ``_LocalMoments`` through the alias.
    Weight and bias gradients are the local sums: DistributedDataParallel averages parameter gradients
    over ranks, as with ``torch.nn.SyncBatchNorm``, and DataParallel sums the replicas' gradients.
    """

    @staticmethod
    def forward(
        ctx: Any,
        input: Tensor,
        weight: Optional[Tensor],
        bias: Optional[Tensor],
        moments: Tensor,
        mean: Tensor,
        var: Tensor,
        eps: float,
    ) -> Tensor:
        ctx.eps = eps
        ctx.save_for_backward(input, weight, mean, var)
        return F.batch_norm(input, mean, var, _as_stat(weight, mean), _as_stat(bias, mean), False, 0.0, eps)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Any, ...]:
        input, weight, mean, var = ctx.saved_tensors
        # Native inference-mode backward with our statistics as "running" ones gives exactly
        # grad_weight = sum(dy * x_hat) and grad_bias = sum(dy); grad_input is not needed from it.
        if input.numel() == 0:  # the native kernel divides by the count; an empty shard sums to zero
            sum_dy_xhat, sum_dy = torch.zeros_like(mean), torch.zeros_like(mean)
        else:
            ones = torch.ones_like(mean) if weight is None else _as_stat(weight, mean)
            # The CPU kernel mis-reduces a channels_last input whose batch stride is not the canonical one
            # (N == 1: the alias gets strides like (3, 1, 6, 3)) with a grad_output in another layout, so the
            # grad_output is laid out like the input (a no-op when they already match).
            grad_output_like_input = grad_output.contiguous(memory_format=_memory_format(input))
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                grad_output_like_input, input, ones, mean, var, None, None, False, ctx.eps, [False, True, True]
            )
        grad_weight = sum_dy_xhat.to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight.dtype) if ctx.needs_input_grad[2] else None
        grad_moments = None
        if ctx.needs_input_grad[3]:
            grad_moments = torch.cat([sum_dy, sum_dy_xhat]).to(_COMBINE_DTYPE)
        return grad_output, grad_weight, grad_bias, grad_moments, None, None, None


def _as_stat(param: Optional[Tensor], stat: Tensor) -> Optional[Tensor]:
    """An affine parameter in the statistics' dtype: native kernels need them to match (C-sized cast)."""
    return None if param is None else param.to(stat.dtype)


def sync_batch_norm(
    input: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    momentum: float,
    eps: float,
    transport: Transport,
) -> Tensor:
    """Batch norm in training mode with statistics summed over every member of ``transport``.

    Equals ``F.batch_norm(cat(inputs of all members), ..., training=True)`` restricted to this member's
    rows: outputs, input gradients and running statistics (Ioffe & Szegedy 2015, arXiv:1502.03167).

    Args:
        input: (N, C, *) floating tensor; N may differ across members and may be 0.
        weight, bias: (C,) affine parameters or None.
        running_mean, running_var: (C,) buffers updated in place with ``momentum`` and the unbiased global
            variance, or None to leave no trace (DataParallel slaves, track_running_stats=False).
        momentum: the exponential average factor already resolved by the module (1/num_batches_tracked for
            a cumulative average).
        eps: added to the variance before the square root.
        transport: sums the payload over the members; see :class:`Transport`.

    Returns:
        Tensor of the input's shape, dtype and memory format.

    Raises:
        ValueError: if the global count per channel is 1 (raised on every member, which all see that count).
    """
    link = _BackwardLink()
    count, moments, alias = _LocalMoments.apply(input, link)
    count, moments = transport.all_reduce([count, moments])

    update_running_stats = running_mean is not None
    local_count = input.numel() // max(input.size(1), 1)
    if local_count <= 1:
        # Only shards of 0 or 1 values can be part of a global count below 2, so every member that could
        # see such a count reads it, and all of them agree; larger shards never wait on the device.
        global_count = int(count.item())
        if global_count == 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got a global batch of 1 value per "
                f"channel (local input size {list(input.shape)})"
            )
        update_running_stats = update_running_stats and global_count > 0

    with torch.no_grad():
        mean, var = combine_moments(count, moments)
        if update_running_stats:
            unbiased_var = var * (count / (count - 1).clamp(min=1.0))
            # The same update as nn.BatchNorm: running = (1 - momentum) * running + momentum * batch.
            running_mean.mul_(1.0 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1.0 - momentum).add_(unbiased_var.to(running_var.dtype), alpha=momentum)
        link.count = count.detach()
        link.mean = mean
        link.invstd = torch.rsqrt(var + eps)
        link.weight = None if weight is None else weight.detach()
        stat_dtype = _stat_dtype(input)
    return _Normalize.apply(alias, weight, bias, moments, mean.to(stat_dtype), var.to(stat_dtype), eps)


def _memory_format(input: Tensor) -> torch.memory_format:
    """channels_last(_3d) for a channels-last input that is not also plain contiguous, else contiguous_format."""
    if not input.is_contiguous():
        if input.dim() == 4 and input.is_contiguous(memory_format=torch.channels_last):
            return torch.channels_last
        if input.dim() == 5 and input.is_contiguous(memory_format=torch.channels_last_3d):
            return torch.channels_last_3d
    return torch.contiguous_format


def _stat_dtype(input: Tensor) -> torch.dtype:
    """Dtype of the statistics handed to the native kernels: float32 for reduced precision input."""
    return torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
