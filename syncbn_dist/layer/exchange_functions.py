"""The synchronized layer's two autograd Functions around a differentiable exchange (DataParallel replicas).

``_LocalPayload`` -> ``transport.all_reduce`` -> ``_Normalize``: every replica's backward runs in one autograd thread,
where no exchange could happen, so the exchange's sum is itself an autograd edge and each Function has the true
vector-Jacobian product of its forward (docs/design.md, "Higher-order derivatives"). This path runs the native kernels,
and stays eager under a user's ``torch.compile``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function

from ..comm.tags import TAG_SIZE
from ..comm.transport import Transport
from ..kernels.compiled import _channel_shape, _reduced_dims, _stat_dtype
from ..kernels.native import (
    _as_stat,
    _batch_norm_inference,
    _like_input,
    _local_payload,
    _normalizing_var,
    _scaled_grad_and_reductions,
)
from ..kernels.statistics import COMBINE_DTYPE, invstd_and_scale, moments_of_total
from .statistics import _checked_count, _global_statistics_as

__all__: list[str] = []


class _BackwardLink:
    """What the call's two Functions share: the tags (forward, backward), the transport, and the global statistics,
    filled in after the exchange for ``_LocalPayload.backward``."""

    __slots__ = ("tags", "transport", "mean", "var", "eps")

    def __init__(self, tags: tuple[Any, Any], transport: Any) -> None:
        self.tags, self.transport = tags, transport
        self.mean: Optional[Tensor] = None
        self.var: Optional[Tensor] = None
        self.eps = 0.0


class _LocalPayload(Function):
    """input -> (tagged payload ``[sum(x), sum(x**2), count, tag]``, alias of input), with its exact vector-Jacobian
    product ``grad_alias + g_sum + 2 x g_sumsq``, evaluated about the global mean (no cancellation of a large mean) by
    one native inference batch norm. The tag's gradient slot carries the summed backward tags, verified here.
    """

    @staticmethod
    def forward(input: Tensor, link: _BackwardLink) -> tuple[Tensor, Tensor]:
        return _local_payload(input, False, link.tags[0]), input.view_as(input)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, _BackwardLink], output: tuple[Tensor, Tensor]) -> None:
        ctx.link = inputs[1]
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def jvp(ctx: Any, input_tangent: Optional[Tensor], _: None) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """The payload's tangent ``[sum(dx), 2 sum(x dx), 0, 0 (tag)]`` in float64, and ``dx`` for the alias."""
        if input_tangent is None:
            return None, None
        (input,) = ctx.saved_tensors
        dims = _reduced_dims(input)
        tangent = input_tangent.to(COMBINE_DTYPE)
        sums = torch.cat([tangent.sum(dims), 2.0 * (input.to(COMBINE_DTYPE) * tangent).sum(dims)])
        return F.pad(sums, (0, 1 + TAG_SIZE)), input_tangent.view_as(input_tangent)

    @staticmethod
    def backward(ctx: Any, grad_payload: Tensor, grad_alias: Tensor) -> tuple[Any, ...]:
        (input,) = ctx.saved_tensors
        link: _BackwardLink = ctx.link
        link.tags[1].verify(grad_payload.detach(), link.transport)  # the backward tags, summed over every member
        grad_sum, grad_sumsq, _, _ = grad_payload.split([input.size(1), input.size(1), 1, TAG_SIZE])
        shape = _channel_shape(input)
        if torch.is_grad_enabled():  # backward(create_graph=True): the same product, in recorded ops
            through_payload = grad_sum.view(shape) + 2.0 * input.to(COMBINE_DTYPE) * grad_sumsq.view(shape)
            return grad_alias + through_payload.to(grad_alias.dtype), None
        if input.numel() == 0:
            return grad_alias, None
        mean, var = link.mean, link.var
        # (x - mean) * rsqrt(var + eps) * W + B with W = 2 g_sumsq sqrt(var + eps) and B = g_sum + 2 mean g_sumsq.
        weight = (2.0 * grad_sumsq * torch.sqrt(var.to(COMBINE_DTYPE) + link.eps)).to(mean.dtype)
        bias = torch.addcmul(grad_sum, mean.to(COMBINE_DTYPE), grad_sumsq, value=2.0).to(mean.dtype)
        return _batch_norm_inference(input, weight, bias, mean, var, link.eps).add_(grad_alias), None


class _Normalize(Function):
    """(alias of input, weight, bias, global payload) -> output normalized with the payload's statistics, with its
    exact vector-Jacobian product.

    ``mean = S / N`` and ``var = Q / N - mean**2`` are functions of ``total``, so backward sends ``total`` their
    gradient ``[g_S, g_Q, 0]`` (from this member's ``sum(dy)``, ``sum(dy * x_hat)``), then the backward's tag in the
    forward tag's slot; the exchange sums it and ``_LocalPayload`` makes the global ``grad_input``. Weight and bias get
    the local sums (DataParallel sums the replicas' gradients).
    """

    @staticmethod
    def forward(
        input: Tensor,
        weight: Optional[Tensor],
        bias: Optional[Tensor],
        total: Tensor,
        mean: Tensor,
        var: Tensor,
        eps: float,
        clipped: Optional[Tensor],
        link: _BackwardLink,
    ) -> Tensor:
        return _batch_norm_inference(input, _as_stat(weight, mean), _as_stat(bias, mean), mean, var, eps)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        input, weight, bias, total, mean, var, eps, clipped, link = inputs
        ctx.eps, ctx.clipped, ctx.link = eps, clipped, link
        ctx.param_dtype = mean.dtype if weight is None else weight.dtype
        ctx.save_for_backward(input, weight, bias, total, mean, var)
        ctx.save_for_forward(input, weight, total, mean, var)

    @staticmethod
    def jvp(
        ctx: Any,
        input_tangent: Optional[Tensor],
        weight_tangent: Optional[Tensor],
        bias_tangent: Optional[Tensor],
        total_tangent: Optional[Tensor],
        *_: None,
    ) -> Optional[Tensor]:
        """``dx * weight * invstd + x_hat * (dw + weight * dinvstd / invstd) + db - weight * invstd * dmean``, with
        ``dmean = dS / N`` and ``dvar = dQ / N - 2 mean dmean`` from the payload's tangent (the exchange summed it)."""
        input, weight, total, mean, var = ctx.saved_tensors
        invstd, scale = invstd_and_scale(var.to(COMBINE_DTYPE), ctx.eps, weight)
        coefficient = torch.zeros_like(invstd) if weight_tangent is None else weight_tangent.to(COMBINE_DTYPE)
        shift = torch.zeros_like(invstd) if bias_tangent is None else bias_tangent.to(COMBINE_DTYPE)
        if total_tangent is not None:
            num_features = input.size(1)
            count = total.narrow(0, 2 * num_features, 1)
            sums, squares, _, _ = (total_tangent / count).split([num_features, num_features, 1, TAG_SIZE])
            mean_tangent = sums
            var_tangent = torch.addcmul(squares, mean.to(COMBINE_DTYPE), sums, value=-2.0)
            if ctx.clipped is not None:
                var_tangent = var_tangent.masked_fill(ctx.clipped, 0.0)
            coefficient = coefficient - 0.5 * scale * invstd * var_tangent
            shift = shift - scale * mean_tangent
        tangent = _batch_norm_inference(input, coefficient.to(mean.dtype), shift.to(mean.dtype), mean, var, ctx.eps)
        if input_tangent is not None:
            tangent = tangent + input_tangent * scale.to(mean.dtype).view(_channel_shape(input))
        return tangent.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Any, ...]:
        input, weight, bias, total, mean, var = ctx.saved_tensors
        if torch.is_grad_enabled():  # backward(create_graph=True): autograd's product of the forward in plain ops
            return (*_recorded_normalize_backward(ctx, grad_output), None, None, None, None, None)
        grad_output = _like_input(grad_output, input)
        eps = ctx.eps
        scaled, sum_dy, sum_dy_xhat = _scaled_grad_and_reductions(grad_output, input, weight, mean, var, eps)
        grad_weight = sum_dy_xhat.to(ctx.param_dtype) if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(ctx.param_dtype) if ctx.needs_input_grad[2] else None
        grad_total = None
        if ctx.needs_input_grad[3]:
            # dL/dmean = -weight invstd sum(dy); dL/dvar = -weight invstd**2 sum(dy x_hat) / 2 (0 where clipped).
            invstd, scale = invstd_and_scale(var.to(COMBINE_DTYPE), eps, weight)
            grad_mean = -scale * sum_dy.to(COMBINE_DTYPE)
            grad_var = (-0.5 * scale * invstd) * sum_dy_xhat.to(COMBINE_DTYPE)
            if ctx.clipped is not None:  # a clipped channel normalizes by eps, whatever its variance
                grad_var = grad_var.masked_fill(ctx.clipped, 0.0)
            count = total.narrow(0, 2 * input.size(1), 1)
            grad_sum = torch.addcmul(grad_mean, mean.to(COMBINE_DTYPE), grad_var, value=-2.0) / count
            tail = ctx.link.tags[1].tail(total.device, 0.0)  # [0 (the count's), the backward's tag]
            grad_total = torch.cat([grad_sum, grad_var / count, tail])
        return scaled, grad_weight, grad_bias, grad_total, None, None, None, None, None


def _recorded_normalize_backward(ctx: Any, grad_output: Tensor) -> list[Optional[Tensor]]:
    """``_Normalize``'s gradients, recorded: autograd's own of its forward in plain ops of ``total``, the statistics
    valued as the forward's exact ``mean`` and ``var`` with the derivatives of ``S / N`` and ``Q / N - (S / N)**2``
    (``c + (f - f.detach())``; none on a clipped channel). The gradient of ``total`` carries the backward's tag.
    """
    input, weight, bias, total, mean, var = ctx.saved_tensors
    with torch.enable_grad():
        batch_mean, var_change, _, _, _ = moments_of_total(total, input.size(1))
        var_change = var_change - var_change.detach()
        if ctx.clipped is not None:
            var_change = var_change.masked_fill(ctx.clipped, 0.0)
        exact_mean = mean.to(COMBINE_DTYPE) + (batch_mean - batch_mean.detach())
        invstd = torch.rsqrt(var.to(COMBINE_DTYPE) + var_change + ctx.eps)
        shape = _channel_shape(input)
        output = (input.to(COMBINE_DTYPE) - exact_mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            output = output * weight.to(COMBINE_DTYPE).view(shape)
        if bias is not None:
            output = output + bias.to(COMBINE_DTYPE).view(shape)
        candidates = (input, weight, bias, total)
        wrt = [t for t, need in zip(candidates, ctx.needs_input_grad[:4]) if need]
        found = iter(torch.autograd.grad(output, wrt, grad_output.to(output.dtype), create_graph=True))
        grads = [next(found) if need else None for need in ctx.needs_input_grad[:4]]
        if grads[3] is not None:
            tail = ctx.link.tags[1].tail(total.device, 0.0)
            grads[3] = torch.cat([grads[3].narrow(0, 0, grads[3].numel() - tail.numel()), tail])
    return grads


def _sync_batch_norm_differentiable(
    input: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
    eps_mode: str,
    transport: Transport,
    tags: tuple[Any, Any],
) -> tuple[Tensor, Tensor, Tensor]:
    """The two-Function path around a differentiable transport edge (DataParallel replicas); ``tags``: the forward's
    and backward's :class:`~syncbn_dist.comm.tags.CollectiveTag`, verified on every total."""
    link = _BackwardLink(tags, transport)
    payload, alias = _LocalPayload.apply(input, link)
    (total,) = transport.all_reduce([payload], tags=(*tags, False))
    with torch.no_grad():
        tags[0].verify(total, transport)
        mean, var, unbiased_var, count = _global_statistics_as(total, _stat_dtype(input), input.size(1))
        _checked_count(count, input)
        clipped = None if eps_mode == "plus" else var < eps
        var = _normalizing_var(var, eps, eps_mode)
        link.mean, link.var, link.eps = mean, var, eps
    output = _Normalize.apply(alias, weight, bias, total, mean, var, eps, clipped, link)
    return output, mean, unbiased_var
