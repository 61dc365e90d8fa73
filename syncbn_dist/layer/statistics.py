"""The statistics of the synchronized layer: one shard's payload, and the global statistics of the summed payloads.

One synchronized layer's forward sums ``[sum(x) (C), sum(x**2) (C), count]`` of every member's shard (the payload,
float64) and forms the global mean and variances from the total: the parallel-variance combination of Chan, Golub &
LeVeque (1979), expressed as sums of exact per-shard moments. This module holds that math for the native kernels
(:func:`local_payload`, computed by torch's statistics kernel on a float64 copy) and the check every member makes of
the global count; :mod:`syncbn_dist.kernels` holds the same payload as one compiled pass.

The native payload is taken from a float64 copy of the activation by the native statistics kernel: one pass that
is exact at any |mean|/std (the sums of a float32 shard in float64 carry no cancellation at the 1e4 ratios the
tests use) and on every layout and dtype, float16/bfloat16 included. That trades one activation-sized float64
temporary for the handful of per-channel float32 corrections an exact float32 pass would need.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.tracing import is_compiling

__all__ = ["LEAN_MIN_NUMEL", "combine_moments", "global_statistics", "local_moments", "local_payload"]

# Statistics are combined in float64: the sum of squares of data with |mean|/std = 1e4 carries 1e8 times more
# magnitude than the variance, which float32 cannot resolve (E[x^2] - E[x]^2 cancels catastrophically).
_COMBINE_DTYPE = torch.float64

# Eager CPU float32/float64 activations of at least this many elements (1 MiB of float32) take the memory-lean
# path (44 B/elem on contiguous NCHW float32 at 42 ops per layer, 56 B/elem at 34 ops elsewhere) and the rest the
# op-lean path (68 B/elem, 27 ops): latency, not bandwidth, bounds a small layer. The measured crossover (1 thread,
# both paths interleaved in one process, other work on the machine): lean / op-lean time 1.07 at 100,352 elements,
# 0.82 at 200,704, 0.89-0.90 from 401,408 to 1,605,632 (contiguous NCHW, C = 64). See docs/design.md.
LEAN_MIN_NUMEL = 1 << 18


def local_payload(input: Tensor) -> Tensor:
    """The ``[sum (C), sum of squares (C), count]`` of one shard, as a (2C + 1,) float64 tensor.

    Computed as ``count * [mean, var + mean**2, 1]`` from the native statistics kernel
    (``torch.batch_norm_update_stats``; ``torch.var_mean`` inside a ``torch.compile`` graph) on a float64 copy
    of ``input``: the mean and the biased variance come out in float64 for every layout and dtype, so the
    payload is exact to float64 rounding. Contiguous float32 (N, C, *spatial) inputs in the memory-lean regime
    skip the copy (:func:`_copy_free_payload`, as exact).

    Args:
        input: (N, C, *) floating tensor, any memory format; N may be 0.

    Returns:
        (2C + 1,) float64 tensor on the input's device; zeros for an empty shard.
    """
    return _local_payload(input, is_compiling())


def _local_payload(input: Tensor, compiling: bool) -> Tensor:
    """:func:`local_payload`, ``compiling`` being the caller's :func:`is_compiling`."""
    num_features = input.size(1)
    count = input.numel() // num_features if num_features else 0
    if count == 0:
        # Zeros made from the input, not a constant: under torch.compile two constant payloads of equal size would
        # be merged into one collective (common-subexpression elimination), leaving this rank a collective short.
        return input.new_zeros(2 * num_features + 1, dtype=_COMBINE_DTYPE)
    if not compiling:
        return _eager_payload(input, count)
    # batch_norm_update_stats has no fake-tensor kernel for dynamic shapes; var_mean traces everywhere.
    var, mean = torch.var_mean(input.to(_COMBINE_DTYPE), [0, *range(2, input.dim())], correction=0)
    return _payload_of(mean, var, count)


def _eager_payload(input: Tensor, count: int) -> Tensor:
    """:func:`local_payload` of a non-empty shard in eager mode (``count`` values per channel): six ops on the
    op-lean path (the float64 copy, its statistics, and :func:`_payload_of`'s four, written out here)."""
    if _lean_regime(input) and input.dtype == torch.float32 and input.is_contiguous() and input.dim() > 2:
        return _copy_free_payload(input, count)
    mean, var = torch.batch_norm_update_stats(input.to(_COMBINE_DTYPE), None, None, 0.0)
    return torch.constant_pad_nd(torch.cat([mean, torch.addcmul(var, mean, mean)]), (0, 1), 1.0).mul_(count)


def _payload_of(mean: Tensor, var: Tensor, count: int) -> Tensor:
    """``count * [mean, var + mean**2, 1]`` from a shard's float64 mean and biased variance, in four ops: the 1 is
    padded in as a value, not a constant tensor of its own (``count`` may be symbolic in a graph)."""
    moments = torch.cat([mean, torch.addcmul(var, mean, mean)])
    return torch.constant_pad_nd(moments, (0, 1), 1.0).mul_(count)


def _lean_regime(input: Tensor) -> bool:
    """Whether the layer takes the memory-lean path: eager CPU float32/float64 activations of at least
    ``LEAN_MIN_NUMEL`` elements.

    ``torch.compile`` graphs keep the op-lean path, so that the compiled graph does not depend on the size. float16
    and bfloat16 keep it too: the lean ``grad_input``'s ``addcmul_`` with a float32 scale made their layer slower
    (measured 1.25x contiguous, 1.65x channels_last at (32, 64, 28, 28) bfloat16).
    """
    return (  # the cheapest test first: this runs on every eager call
        input.numel() >= LEAN_MIN_NUMEL
        and not input.is_cuda
        and input.dtype not in (torch.float16, torch.bfloat16)
        and not is_compiling()
    )


def _copy_free_payload(input: Tensor, count: int) -> Tensor:
    """:func:`local_payload` of a contiguous float32 CPU (N, C, *spatial) shard without a float64 copy.

    ``torch.batch_norm_update_stats`` gives the float32 mean ``m`` and the variance ``v`` about ``m`` (accumulated
    in double on this layout); the eval-mode ``native_batch_norm_backward`` with an expanded ones as ``dy`` gives
    ``D = sum(x - m)`` (float32 products accumulated in double: exact for the float32 differences). In float64,
    ``S = n m + D`` and ``sum(x**2) = sum((x - m)**2) + 2 m D + n m**2 = n v + m (S + D)``, so the variance about
    the exact mean is not lost to the rounding of ``m`` (the combination is Chan et al. 1979, as sums).
    """
    mean, var = torch.batch_norm_update_stats(input, None, None, 0.0)
    one = input.new_ones(())
    _, offset, _ = torch.ops.aten.native_batch_norm_backward(
        one.expand(input.shape), input, None, mean, one.expand(input.size(1)), None, None, False, 0.0,
        [False, True, False],
    )
    mean = mean.to(_COMBINE_DTYPE)
    sums = torch.add(offset.to(_COMBINE_DTYPE), mean, alpha=count)
    squares = torch.addcmul(var.to(_COMBINE_DTYPE) * count, mean, sums + offset)
    return torch.constant_pad_nd(torch.cat([sums, squares]), (0, 1), float(count))


def global_statistics(total: Tensor) -> tuple[Tensor, Tensor]:
    """Global mean, biased and unbiased variance per channel from a summed payload (Chan et al. 1979, as sums).

    Args:
        total: (2C + 1,) float64, the :func:`local_payload` summed over every member.

    Returns:
        ``stats``, a (3, C) float64 tensor with rows ``[mean, var, unbiased var]``, and ``count``, the (1,) global
        count (a view of ``total``). The statistics are only meaningful for a global count of at least 2 (the
        callers check it); a zero count gives NaNs.
    """
    num_features = total.numel() // 2
    sums, squares, count = total.split([num_features, num_features, 1])
    mean = sums / count
    # M2 = sum((x - mean)**2) = sum(x**2) - sum(x) * mean, combined in float64 from exact per-shard sums.
    m2 = torch.addcmul(squares, sums, mean, value=-1.0)
    return torch.stack([sums, m2, m2]) / torch.stack([count, count, count - 1.0]), count


def _global_statistics_as(total: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`global_statistics` as the layer uses them: ``(mean, var, unbiased_var, count, empty)``, the three
    statistics (C,) in ``dtype``, the (1,) float64 count and an empty float64 view, all from ``total``.

    Five ops for float64 statistics (the split, the mean, M2 and one ``_foreach_div`` for both variances), eight
    otherwise (one stacked cast and its unbind): the same float64 values as :func:`global_statistics`, in fewer
    dispatches. ``empty`` costs nothing (a fourth piece of the split): a ``torch.cat`` that includes it promotes
    to float64, the backward payload's cast without an op of its own.
    """
    num_features = total.numel() // 2
    sums, squares, count, empty = total.split_with_sizes([num_features, num_features, 1, 0])
    mean = sums / count
    m2 = torch.addcmul(squares, sums, mean, value=-1.0)
    var, unbiased_var = torch._foreach_div([m2, m2], [count, count - 1.0])
    if dtype != total.dtype:
        mean, var, unbiased_var = torch.stack([mean, var, unbiased_var]).to(dtype).unbind()
    return mean, var, unbiased_var, count, empty


def local_moments(input: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel count, sum and sum of squares of one shard of the batch, in float64.

    Args:
        input: (N, C, *) floating tensor, any memory format; N may be 0.

    Returns:
        ``count`` of shape (1,) and ``moments`` of shape (2C,) = [sum(C), sumsq(C)], both float64 on the
        input's device. An empty input gives zeros of the same shapes and dtype.
    """
    payload = local_payload(input)
    return payload[-1:], payload[:-1]


def combine_moments(count: Tensor, moments: Tensor) -> tuple[Tensor, Tensor]:
    """Global mean and biased variance from summed counts and moments.

    The sums were formed from exact per-shard means and variances and are combined in float64: the
    parallel-variance combination of Chan, Golub & LeVeque (1979) expressed as sums.

    Args:
        count: (1,) float64, the total number of values per channel (may be 0).
        moments: (2C,) float64, [sum(C), sumsq(C)] summed over every shard.

    Returns:
        ``mean`` and ``var`` of shape (C,), float64. With a zero count both are zeros.
    """
    stats, _ = global_statistics(torch.cat([moments, count.clamp(min=1.0)]))
    return stats[0], stats[1].clamp(min=0.0)


def _checked_count(total: Tensor, input: Tensor) -> None:
    """Raise on every member if the global count per channel is 1; look only where it can be below 2.

    Only shards of 0 or 1 values per channel can be part of a global count below 2, so every member that could
    see such a count reads it, and all of them agree; larger shards never wait on the device. Under
    ``torch.compile`` the check is an in-graph assertion (``torch._assert_async``), which raises RuntimeError
    with the same message instead of ValueError: the count cannot be read on the host inside a graph.

    Args:
        total: the summed payload, or the (1,) global count (its last value is the count).
        input: this member's (N, C, *) shard.

    Raises:
        ValueError: if the global count per channel is 1 (raised on every member, which all see that count).
    """
    if input.numel() > input.size(1):  # more than one value per channel (numel is a multiple of C)
        return
    message = (
        "Expected more than 1 value per channel when training, got a global batch of 1 value per channel "
        f"(local input size {list(input.shape)})"
    )
    if is_compiling():
        torch._assert_async(total[-1] != 1.0, message)
    elif int(total[-1].item()) == 1:
        raise ValueError(message)
