"""The native kernels: the synchronized layer's per-element work as torch's own batch-norm ops.

Every eager synchronized call runs them (a user's ``torch.compile`` traces :mod:`.compiled` instead): CPU's
inference-mode batch norm and its backward, CUDA's ``torch.nn.SyncBatchNorm`` kernels. Its two regimes:
docs/design.md, "Bytes per activation element".
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .statistics import COMBINE_DTYPE, invstd_and_scale, payload_of
from .tracing import is_compiling

# CPU's batch-norm backward: the overload's C++ callable where torch exposes it (no OpOverload.__call__ frame).
_overload = torch.ops.aten.native_batch_norm_backward.default
_NATIVE_BATCH_NORM_BACKWARD = getattr(_overload, "_op", _overload)


# The memory-lean path's threshold (_lean_regime), a measured crossover: docs/design.md, "Bytes per activation element".
LEAN_MIN_NUMEL = 1 << 18


def local_payload(input: Tensor) -> Tensor:
    """The ``[sum (C), sum of squares (C), count]`` of one shard, as a (2C + 1,) float64 tensor.

    From the native statistics kernel on a float64 copy of ``input``, exact to float64 rounding (contiguous float32
    (N, C, *spatial) inputs in the memory-lean regime skip the copy: :func:`_copy_free_payload`).

    Args:
        input: (N, C, *) floating tensor, any memory format; N may be 0.

    Returns:
        (2C + 1,) float64 tensor on the input's device; zeros for an empty shard.
    """
    return _local_payload(input, is_compiling())


def _local_payload(input: Tensor, compiling: bool, tag: Optional[Any] = None) -> Tensor:
    """:func:`local_payload` (``compiling``: the caller's :func:`is_compiling`); with ``tag`` (a
    :class:`~syncbn_dist.comm.tags.CollectiveTag`), ``[sum (C), sum of squares (C), count, tag (5)]``."""
    num_features = input.size(1)
    count = input.numel() // num_features if num_features else 0
    if count == 0:
        # Zeros made from the input: torch.compile would merge equal constant payloads into one collective (CSE).
        zeros = input.new_zeros(2 * num_features + (1 if tag is None else 0), dtype=COMBINE_DTYPE)
        return zeros if tag is None else torch.cat([zeros, tag.tail(input.device, 0.0)])
    if not compiling:
        return _eager_payload(input, count, tag)
    # batch_norm_update_stats has no fake-tensor kernel for dynamic shapes; var_mean traces everywhere.
    var, mean = torch.var_mean(input.to(COMBINE_DTYPE), [0, *range(2, input.dim())], correction=0)
    payload = payload_of(mean, var, count)
    return payload if tag is None else torch.cat([payload, tag.tail(input.device, None)])


def _eager_payload(input: Tensor, count: int, tag: Optional[Any]) -> Tensor:
    """:func:`local_payload` of a non-empty shard in eager mode (``count`` values per channel)."""
    if _lean_regime(input) and input.dtype == torch.float32 and input.is_contiguous() and input.dim() > 2:
        return _copy_free_payload(input, count, tag)
    mean, var = torch.batch_norm_update_stats(input.to(COMBINE_DTYPE), None, None, 0.0)
    if tag is not None:  # [mean, mean of squares, 1, tag], its first 2C + 1 values scaled by the count: three ops
        payload = torch.cat([mean, torch.addcmul(var, mean, mean), tag.tail(input.device, 1.0)])
        payload.narrow(0, 0, 2 * mean.numel() + 1).mul_(count)
        return payload
    return torch.constant_pad_nd(torch.cat([mean, torch.addcmul(var, mean, mean)]), (0, 1), 1.0).mul_(count)


def _lean_regime(input: Tensor) -> bool:
    """Whether the layer takes the memory-lean path: eager CPU float32/float64 activations of ``LEAN_MIN_NUMEL``
    elements or more (a graph must not depend on the size; docs/design.md, "Bytes per activation element")."""
    return (  # the cheapest test first: this runs on every eager call
        input.numel() >= LEAN_MIN_NUMEL
        and not input.is_cuda
        and input.dtype not in (torch.float16, torch.bfloat16)
        and not is_compiling()
    )


def _copy_free_payload(input: Tensor, count: int, tag: Optional[Any] = None) -> Tensor:
    """:func:`_local_payload` of a contiguous float32 CPU (N, C, *spatial) shard without a float64 copy (Chan et al.
    1979; the derivation: docs/design.md, "Bytes per activation element")."""
    mean, var = torch.batch_norm_update_stats(input, None, None, 0.0)
    one = input.new_ones(())
    _, offset, _ = torch.ops.aten.native_batch_norm_backward(
        one.expand(input.shape), input, None, mean, one.expand(input.size(1)), None, None, False, 0.0,
        [False, True, False],
    )
    mean = mean.to(COMBINE_DTYPE)
    sums = torch.add(offset.to(COMBINE_DTYPE), mean, alpha=count)
    squares = torch.addcmul(var.to(COMBINE_DTYPE) * count, mean, sums + offset)
    if tag is not None:
        return torch.cat([sums, squares, sums.new_full((1,), float(count)), tag.tail(input.device, None)])
    return torch.constant_pad_nd(torch.cat([sums, squares]), (0, 1), float(count))


def _like_input(grad_output: Tensor, input: Tensor) -> Tensor:
    """``grad_output`` in the input's memory format: the CPU batch-norm backward mis-reduces a channels_last input
    with a non-canonical batch stride (N == 1: strides like (3, 1, 6, 3)) and a grad_output in another layout."""
    if not input.is_contiguous():
        if input.dim() == 4 and input.is_contiguous(memory_format=torch.channels_last):
            return grad_output.contiguous(memory_format=torch.channels_last)
        if input.dim() == 5 and input.is_contiguous(memory_format=torch.channels_last_3d):
            return grad_output.contiguous(memory_format=torch.channels_last_3d)
    return grad_output.contiguous()


def _normalizing_var(var: Tensor, eps: float, eps_mode: str) -> Tensor:
    """The variance the native kernels see, so that their ``rsqrt(var + eps)`` is the mode's invstd."""
    if eps_mode == "clip":
        # max(var, eps) = (max(var, eps) - eps) + eps; in backward the kernels treat it as a constant per channel,
        # which is right where var < eps (the variance no longer depends on x) and is corrected below elsewhere.
        return var.clamp(min=eps) - eps
    return var


def _local_reductions(
    grad_output: Tensor, input: Tensor, weight: Optional[Tensor], mean: Tensor, var: Tensor, eps: float,
    invstd: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """This shard's ``sum(dy)`` and ``sum(dy * x_hat)``, each (C,) in the statistics dtype, from the inference-mode
    backward (CPU) or ``batch_norm_backward_reduce`` (CUDA; ``invstd = rsqrt(var + eps)`` is computed if None)."""
    if input.numel() == 0:  # the native kernel divides by the count; an empty shard sums to zero
        # A sum of grad_output, not a constant, which torch.compile would hoist into the forward (docs/compile.md).
        zeros = grad_output.sum(dim=[0] + list(range(2, grad_output.dim()))).to(mean.dtype)
        return zeros, zeros
    if input.is_cuda:
        # On CUDA the inference-mode backward wants saved statistics; with a weight, grad_weight is sum(dy * x_hat).
        if invstd is None:
            invstd = torch.rsqrt(var + eps)
        if _rounds_each_product(input):
            grad_output, input = grad_output.float(), input.float()
        stat_weight = weight if weight is None or weight.dtype == mean.dtype else weight.to(mean.dtype)
        affine = stat_weight is not None
        sum_dy, sum_dy_xmu, sum_dy_xhat, _ = torch.batch_norm_backward_reduce(
            grad_output, input, mean, invstd, stat_weight, True, affine, False
        )
        return sum_dy, sum_dy_xhat if affine else sum_dy_xmu * invstd
    if weight is not None and weight.dtype != mean.dtype:  # (_as_stat, inline: this runs on every backward)
        weight = weight.to(mean.dtype)
    _, sum_dy_xhat, sum_dy = _NATIVE_BATCH_NORM_BACKWARD(
        grad_output, input, weight, mean, var, None, None, False, eps, [False, True, True]
    )
    return sum_dy, sum_dy_xhat


def _rounds_each_product(input: Tensor) -> bool:
    """Whether torch's CUDA ``batch_norm_backward_reduce`` would round each ``dy * (x - mean)`` to the input dtype
    before summing: float16/bfloat16 in (N, C, *) layouts (how far off: docs/design.md, "Mixed precision")."""
    channels_last_kernel = input.dim() == 2 or input.is_contiguous(memory_format=torch.channels_last)
    return input.dtype in (torch.float16, torch.bfloat16) and not channels_last_kernel


def _grad_input(
    grad_output: Tensor,
    input: Tensor,
    weight: Optional[Tensor],
    mean: Tensor,
    var: Tensor,
    count: Tensor,
    reductions: Tensor,
    eps: float,
    clipped: Optional[Tensor],
    invstd: Optional[Tensor] = None,
) -> Tensor:
    """The exact global-batch ``grad_input`` of this shard (Ioffe & Szegedy 2015, arXiv:1502.03167).

    ``mean``, ``var`` (:func:`_normalizing_var`): the (C,) global statistics in the kernels' dtype; ``count``: the (1,)
    float64 global count; ``reductions``: the summed float64 ``[sum(dy), sum(dy * x_hat)]``, any tag after; ``clipped``:
    the (C,) bool channels whose variance was clipped to eps, or None; ``invstd`` (CUDA): computed if not given.
    """
    if input.numel() == 0:
        # Made from grad_output, not a constant, so that under torch.compile what follows stays in backward.
        return torch.zeros_like(grad_output)
    if input.is_cuda:
        # torch.nn.SyncBatchNorm's kernel: it divides by the int32 count it is given, and takes sum(dy * (x - mean)).
        sum_dy, sum_dy_xhat = _two_sums(reductions.to(mean.dtype), input.size(1))
        if clipped is not None:  # a clipped channel's invstd does not depend on x: its x_hat term vanishes
            sum_dy_xhat = sum_dy_xhat.masked_fill(clipped, 0.0)
        if invstd is None:
            invstd = torch.rsqrt(var + eps)
        return torch.batch_norm_backward_elemt(
            grad_output, input, mean, invstd, _as_stat(weight, mean), sum_dy, sum_dy_xhat / invstd,
            count.to(torch.int32),
        )
    mean_dy, mean_dy_xhat = _two_sums((reductions / count).to(mean.dtype), input.size(1))
    if clipped is not None:
        mean_dy_xhat = mean_dy_xhat.masked_fill(clipped, 0.0)
    if input.numel() >= LEAN_MIN_NUMEL and _lean_regime(input):  # (the first test is _lean_regime's own, inline)
        # dy * scale - scale * (mean_dy + x_hat * mean_dy_xhat): one inference batch norm and one addcmul_.
        _, scale = invstd_and_scale(var, eps, weight)
        correction = _batch_norm_inference(input, mean_dy_xhat * -scale, mean_dy * -scale, mean, var, eps)
        return correction.addcmul_(grad_output, scale.view([1, -1] + [1] * (input.dim() - 2)))
    # dy less an inference batch norm of x (called directly: x is not empty), scaled by the inference-mode backward.
    centred = grad_output - torch._native_batch_norm_legit_no_training(
        input, mean_dy_xhat, mean_dy, mean, var, 0.0, eps
    )[0]
    if weight is None:
        weight = torch.ones_like(mean)
    elif weight.dtype != mean.dtype:
        weight = weight.to(mean.dtype)
    grad_input, _, _ = _NATIVE_BATCH_NORM_BACKWARD(
        centred, input, weight, mean, var, None, None, False, eps, [True, False, False]
    )
    return grad_input


def _two_sums(reductions: Tensor, num_features: int) -> tuple[Tensor, Tensor]:
    """The two (C,) sums at the start of ``reductions`` (one op: a split, or a chunk where nothing follows them)."""
    if reductions.numel() == 2 * num_features:
        return reductions.chunk(2)  # type: ignore[return-value]
    rest = reductions.numel() - 2 * num_features
    sums, sums_xhat, _ = reductions.split_with_sizes([num_features, num_features, rest])
    return sums, sums_xhat


def _scaled_grad_and_reductions(
    grad_output: Tensor, input: Tensor, weight: Optional[Tensor], mean: Tensor, var: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``weight * invstd * dy`` in the input's dtype and memory format, with this shard's ``sum(dy)`` and
    ``sum(dy * x_hat)`` (each (C,) in the statistics dtype): the native inference-mode backward."""
    if input.numel() == 0:
        sum_dy, sum_dy_xhat = _local_reductions(grad_output, input, weight, mean, var, eps)
        return torch.empty_like(grad_output), sum_dy, sum_dy_xhat
    if input.is_cuda:  # the CUDA kernels of torch.nn.SyncBatchNorm, with zero corrections for the scaled dy
        sum_dy, sum_dy_xhat = _local_reductions(grad_output, input, weight, mean, var, eps)
        zeros = torch.zeros_like(mean)
        scaled = torch.batch_norm_backward_elemt(
            grad_output, input, mean, torch.rsqrt(var + eps), _as_stat(weight, mean), zeros, zeros,
            torch.ones(1, dtype=torch.int32, device=input.device),
        )
        return scaled, sum_dy, sum_dy_xhat
    weight = torch.ones_like(mean) if weight is None else weight.to(mean.dtype)
    scaled, sum_dy_xhat, sum_dy = _NATIVE_BATCH_NORM_BACKWARD(
        grad_output, input, weight, mean, var, None, None, False, eps, [True, True, True]
    )
    return scaled, sum_dy, sum_dy_xhat


def _batch_norm_inference(
    input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor, var: Tensor, eps: float
) -> Tensor:
    """``(input - mean) * rsqrt(var + eps) * weight + bias`` per channel: one native kernel, any memory format (the
    aten op: ``F.batch_norm`` allocates a reserve buffer first)."""
    if input.numel() == 0:  # the kernel would lay an empty output out contiguously; keep the input's format
        return torch.empty_like(input)
    return torch._native_batch_norm_legit_no_training(input, weight, bias, mean, var, 0.0, eps)[0]


def _as_stat(param: Optional[Tensor], stat: Tensor) -> Optional[Tensor]:
    """An affine parameter in the statistics' dtype: native kernels need them to match (C-sized cast)."""
    return param if param is None or param.dtype == stat.dtype else param.to(stat.dtype)
