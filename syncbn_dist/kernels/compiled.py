r"""The synchronized layer's per-element work as the one Python source a user's ``torch.compile`` traces.

Four passes (:func:`shard_payload`, :func:`normalize`, :func:`grad_reductions`, :func:`grad_input`), one function per
direction over a process group (:func:`layer_forward`, :func:`layer_backward`), entered from the layer's Function
while Dynamo traces it; inductor fuses them into the user's graph as it fuses plain BatchNorm. Eager calls never come
here: they run :mod:`syncbn_dist.kernels.native`. Design, exactness (Chan et al. 1979) and measurements:
docs/design.md, "The traced path"; docs/compile.md.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ..comm.distributed import all_reduce_sum
from ..comm.tags import TAG_SIZE, checked_in_graph
from .statistics import invstd_and_scale, moments_of_total

__all__ = ["NATIVE", "layer_backward", "layer_forward"]

_F64 = torch.float64


class _Native:
    def __repr__(self) -> str:
        return "NATIVE"


#: The kernel choice of an eager call, which runs the native kernels (a traced call's: its process group's name).
NATIVE: Any = _Native()


def _values_per_channel(input: Tensor) -> int:
    """Values per channel of an (N, C, *) shard: N * prod(*) (0 when C is 0)."""
    return input.numel() // max(input.size(1), 1)


def _channel_shape(x: Tensor) -> list[int]:
    """The shape that broadcasts a (C,) tensor over ``x``: (1, C, 1, ...)."""
    return [1, -1] + [1] * (x.dim() - 2)


def _reduced_dims(input: Tensor) -> list[int]:
    """The dimensions a per-channel statistic reduces over: all but dim 1."""
    return [0, *range(2, input.dim())]


def _sum_per_channel(t: Tensor) -> Tensor:
    """Sum a (N, C, *) tensor over all but C into (C,) float64, in one reduction (docs/compile.md)."""
    return t.sum(_reduced_dims(t)).to(_F64)


def _stat_dtype(x: Tensor) -> torch.dtype:
    """Dtype of the per-channel statistics and coefficients: float32 for reduced precision input, else the input's."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _term_dtype(x: Tensor) -> torch.dtype:
    """Dtype of the per-element terms the reductions sum: float32 for float16/bfloat16 input, else float64 (exact
    for the difference of two values of the input's dtype)."""
    stat = _stat_dtype(x)
    return _F64 if stat == x.dtype else stat


# The one source: plain torch ops on a user's graph's (N, C, *) tensors, which may be empty.


def shard_payload(x: Tensor, tag: Optional[Tensor] = None) -> Tensor:
    """``[sum(x) (C), sum(x**2) (C), count, tag (5)]`` of one shard as (2C + 6,) float64, from one pass over ``x``;
    ``tag`` is the collective's tag (:mod:`syncbn_dist.comm.tags`), five float64 values (None: no tag, 2C + 1 values).
    The sums are taken about the first value per channel (Chan et al. 1979, as sums; docs/design.md, "The traced
    path")."""
    count = _values_per_channel(x)
    terms = _term_dtype(x)
    if count == 0:  # an empty shard: its sums, zeros made from x, not constants
        shift = x.new_zeros(x.size(1), dtype=terms)
    else:
        shift = _first_value_per_channel(x).to(terms)
    centred = x.to(terms) - shift.view(_channel_shape(x))
    sums, squares = _sum_per_channel(centred), _sum_per_channel(centred.square())
    shift_64 = shift.to(_F64)
    absolute_sums = sums + count * shift_64
    absolute_squares = squares + shift_64 * (2.0 * sums + count * shift_64)
    tail = sums.new_full((1,), count) if tag is None else _with_lead(tag, count)
    return torch.cat([absolute_sums, absolute_squares, tail])


def _with_lead(tag: Tensor, lead: Any) -> Tensor:
    """``[lead, *tag]``: the payload's constant tail as pointwise ops, which a compiler writes with one loop (``lead``
    a number, or the symbolic count of a dynamic shape: written by ``select_scatter``, never as ``pad``'s value)."""
    return torch.nn.functional.pad(tag, (1, 0)).select_scatter(tag.new_full((), lead), 0, 0)


def _first_value_per_channel(x: Tensor) -> Tensor:
    """``x[0, :, 0, ..., 0]`` as (C,), by ``select`` (fake CUDA tensors on a CPU build trace it, not indexing)."""
    first = x.select(0, 0)
    for _ in range(x.dim() - 2):
        first = first.select(1, 0)
    return first


def _stored(t: Tensor) -> Tensor:
    """``t`` (a per-channel coefficient) as a buffer inductor stores, not inlined into every element: an identity
    ``as_strided`` needs its input realized (docs/compile.md, "One source on every device"; C4 holds it)."""
    return t.as_strided(t.size(), t.stride())


def normalize(
    x: Tensor, total: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, clip: bool
) -> tuple[Tensor, ...]:
    """The output normalized with the global statistics of ``total`` (the summed tagged payloads), and those statistics.

    Returns ``(y, mean, unbiased_var, var, count)``: ``y`` in ``x``'s dtype; ``mean``, the unbiased variance and the
    normalizing variance (``max(var, eps) - eps`` when ``clip``) in the statistics dtype; the (1,) float64 count.
    ``mean`` and ``scale = weight * invstd`` are stored once per channel, not recomputed per element.
    """
    mean, var, unbiased_var, count, _ = moments_of_total(total, x.size(1))
    if clip:
        var = var.clamp(min=eps) - eps
    _, scale = invstd_and_scale(var, eps, weight)
    dtype, shape = _stat_dtype(x), _channel_shape(x)
    mean_s, scale_s = _stored(mean.to(dtype)), _stored(scale.to(dtype))
    y = (x.to(dtype) - mean_s.view(shape)) * scale_s.view(shape)
    if bias is not None:
        y = y + bias.to(dtype).view(shape)
    # count as a tensor of its own, not a view of the summed payload (C1-C4 count the graph with this copy).
    return y.to(x.dtype), mean_s, unbiased_var.to(dtype), var.to(dtype), count.clone()


def grad_reductions(dy: Tensor, x: Tensor, mean: Tensor, var: Tensor, eps: float) -> Tensor:
    """This shard's ``[sum(dy) (C), sum(dy * x_hat) (C)]`` as (2C,) float64, from one pass over ``dy`` and ``x``."""
    terms, shape = _term_dtype(x), _channel_shape(x)
    grad = dy.to(terms)
    centred = x.to(terms) - mean.to(terms).view(shape)
    invstd = torch.rsqrt(var.to(_F64) + eps)
    return torch.cat([_sum_per_channel(grad), _sum_per_channel(grad * centred) * invstd])


def grad_input(
    dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, var: Tensor, count: Tensor, reductions: Tensor,
    eps: float, clip: bool,
) -> Tensor:
    """The global-batch ``grad_input`` (Ioffe & Szegedy 2015, arXiv:1502.03167), from the summed ``reductions``:

        dx = weight * invstd * (dy - sum(dy) / N - x_hat * sum(dy * x_hat) / N)

    as ``dy * a + (x - mean) * b + c`` in the statistics dtype, with ``a``, ``b``, ``c`` stored per channel. With
    ``clip``, a channel whose variance was clipped (``var == 0`` as the normalizing variance) drops the ``x_hat``
    term.
    """
    invstd, scale = invstd_and_scale(var.to(_F64), eps, weight)
    num_features = x.size(1)
    mean_dy, mean_dy_xhat, _ = (reductions / count).split_with_sizes(
        [num_features, num_features, reductions.numel() - 2 * num_features]
    )
    if clip:
        mean_dy_xhat = torch.where(var == 0.0, 0.0, mean_dy_xhat)
    dtype, shape = _stat_dtype(x), _channel_shape(x)
    a, b, c = (_stored(t.to(dtype)) for t in (scale, -scale * invstd * mean_dy_xhat, -scale * mean_dy))
    dx = dy.to(dtype) * a.view(shape) + (x.to(dtype) - mean.view(shape)) * b.view(shape) + c.view(shape)
    return dx.to(x.dtype)


def layer_forward(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, clip: bool, group_name: Optional[str],
    tag: Any = None,
) -> tuple[Tensor, ...]:
    """One layer's training forward over the process group ``group_name`` (None: a group of one), traced into a
    user's graph: payload, all_reduce, normalize.

    Returns :func:`normalize`'s ``(y, mean, unbiased_var, var, count)``: ``y`` in ``x``'s shape, dtype and memory
    format. ``tag`` (the call's :class:`~syncbn_dist.comm.tags.CollectiveTag` or ``TracedTag``) ends the payload and
    is checked in the graph (:func:`_traced_check`); None: a payload of 2C + 1 values, nothing checked.
    """
    tag_values, verify = _traced_check(tag, x, group_name)
    total = all_reduce_sum(shard_payload(x, tag_values), group_name)
    if verify is not None:
        total = verify(total)
    return normalize(x, total, weight, bias, eps, clip)


def layer_backward(
    dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, var: Tensor, count: Tensor, eps: float, clip: bool,
    group_name: Optional[str], need_input: bool, tag: Any = None,
) -> tuple[Optional[Tensor], ...]:
    """The backward of :func:`layer_forward`, traced into a user's graph: local reductions, all_reduce, grad_input.

    Returns ``(grad_input or None, sum(dy * x_hat), sum(dy))``, the (C,) sums local (DDP averages the parameter
    gradients, as with ``torch.nn.SyncBatchNorm``), in the statistics dtype; ``dy`` in ``x``'s memory format. The
    payload has the forward's size (docs/design.md, "The statistics"); ``tag`` as :func:`layer_forward`'s.
    """
    tag_values, verify = _traced_check(tag, x, group_name, backward=True)
    local = grad_reductions(dy, x, mean, var, eps)
    # In the statistics dtype here, right after the reductions, so that the compiler converts them there too.
    sum_dy, sum_dy_xhat = local.to(_stat_dtype(x)).chunk(2)
    # The collective runs whether or not grad_input is needed: every member sends the same collectives.
    payload = local if tag_values is None else torch.cat([local, _with_lead(tag_values, 0.0)])
    total = all_reduce_sum(payload, group_name)
    if verify is not None:
        total = verify(total)
    dx = grad_input(dy, x, weight, mean, var, count, total, eps, clip) if need_input else None
    return dx, sum_dy_xhat, sum_dy


def _traced_check(
    tag: Any, x: Tensor, group_name: Optional[str], backward: bool = False
) -> tuple[Optional[Tensor], Optional[Callable[[Tensor], Tensor]]]:
    """The tag's values as a constant of the traced graph (None without ``tag``), and what checks a summed payload
    there (:func:`~syncbn_dist.comm.tags.checked_in_graph`; None without peers or for ``NO_TAG``)."""
    if tag is None:
        return None, None
    # Padded to nine values: inductor inlines a constant of at most eight into the kernel's source, which would make
    # every layer's kernels distinct; a larger one is a buffer argument, so layers of one shape share their kernels.
    values = torch.tensor((*tag.values, 0.0, 0.0, 0.0, 0.0), dtype=_F64, device=x.device)[:TAG_SIZE]
    if tag.index < 0 or group_name is None:
        return values, None
    return values, functools.partial(checked_in_graph, tag=tag, group_name=group_name, backward=backward)
