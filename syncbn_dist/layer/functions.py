r"""The process-group autograd Function and :func:`sync_batch_norm`, the entry point of every synchronized forward.

One float64 collective per direction: forward ``[sum(x), sum(x**2), count, tag]``, backward ``[sum(dy), sum(dy *
x_hat), 0, tag]`` (2C + 6 values each), on the native ops, or traced into a user's ``torch.compile``. A differentiable
exchange (DataParallel replicas) takes :mod:`syncbn_dist.layer.exchange_functions` instead. docs/design.md, "The
statistics" and "Higher-order derivatives".
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch.autograd import Function

from ..comm.tags import RECORDED_ADJOINT, RECORDED_BACKWARD, TANGENT, layer_tags
from ..comm.transport import UNREACHABLE, Transport
from ..kernels import compiled as kernels
from ..kernels.compiled import NATIVE, _channel_shape, _reduced_dims, _stat_dtype
from ..kernels.native import (
    _as_stat,
    _batch_norm_inference,
    _grad_input,
    _like_input,
    _local_payload,
    _local_reductions,
    _normalizing_var,
)
from ..kernels.statistics import COMBINE_DTYPE, moments_of_total
from ..kernels.tracing import _forward_ad_level_active, _is_functorch_wrapped, is_compiling
from .exchange_functions import _sync_batch_norm_differentiable
from .statistics import _checked_count, _global_statistics_as, update_running_stats

__all__ = ["Transport", "sync_batch_norm"]


class _SyncBatchNormFunction(Function):
    """input -> output with global statistics, one collective per direction (the ``sum_`` transports).

    Forward returns the output, then (non-differentiable) the mean, the unbiased variance, the normalizing variance
    and the (1,) float64 global count. Weight and bias gradients are the local sums (DDP averages them, as with
    ``torch.nn.SyncBatchNorm``). ``tags``: each direction's tag (:mod:`syncbn_dist.comm.tags`). ``setup_context``
    lets the ``torch.func`` transforms run it.
    """

    @staticmethod
    def forward(
        input: Tensor,
        weight: Optional[Tensor],
        bias: Optional[Tensor],
        eps: float,
        eps_mode: str,
        transport: Any,
        group_name: Any,
        tags: tuple[Any, Any],
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        tag = tags[0]
        if group_name is not NATIVE:  # payload, all_reduce and normalize, traced into the user's graph
            transport.check(tag)
            output, mean, unbiased_var, var, count = kernels.layer_forward(
                input, weight, bias, eps, eps_mode == "clip", group_name, tag
            )
            _checked_count(count, input)
            return output, mean, unbiased_var, var, count
        total = transport.sum_(_local_payload(input, is_compiling(), tag), tag)
        mean, var, unbiased_var, count = _global_statistics_as(total, _stat_dtype(input), input.size(1))
        _checked_count(count, input)
        if eps_mode != "plus":
            var = _normalizing_var(var, eps, eps_mode)
        if (weight is not None and weight.dtype != mean.dtype) or (bias is not None and bias.dtype != mean.dtype):
            weight, bias = _as_stat(weight, mean), _as_stat(bias, mean)  # (tested inline: this runs every forward)
        output = _batch_norm_inference(input, weight, bias, mean, var, eps)
        return output, mean, unbiased_var, var, count

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
        input, weight, _, eps, eps_mode, transport, group_name, tags = inputs
        _, mean, unbiased_var, var, count = output
        ctx.eps, ctx.eps_mode, ctx.transport, ctx.group_name, ctx.tags = eps, eps_mode, transport, group_name, tags
        # "clip": a channel whose variance was below eps normalizes by eps, eps - eps = 0 as the kernels see it.
        ctx.clipped = None if eps_mode == "plus" else var == 0.0
        ctx.save_for_backward(input, weight, mean, var, count)
        ctx.mark_non_differentiable(mean, unbiased_var, var, count)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor, *_: None) -> tuple[Any, ...]:
        input, weight, mean, var, count = ctx.saved_tensors
        if torch.is_grad_enabled():  # backward(create_graph=True): record a graph that can be differentiated again
            return (*_recorded_backward(ctx, grad_output, input, weight, mean, count), None, None, None, None, None)
        grad_output = _like_input(grad_output, input)
        needs = ctx.needs_input_grad
        tag = ctx.tags[1]
        if ctx.group_name is not NATIVE:  # reductions, all_reduce and grad_input, traced into the user's graph
            ctx.transport.check(tag)
            grad_input, sum_dy_xhat, sum_dy = kernels.layer_backward(
                grad_output, input, weight, mean, var, count, ctx.eps, ctx.eps_mode == "clip", ctx.group_name, needs[0],
                tag,
            )
            param_dtype = mean.dtype if weight is None else weight.dtype
            grad_weight = sum_dy_xhat.to(param_dtype) if needs[1] else None
            grad_bias = sum_dy.to(param_dtype) if needs[2] else None
            return grad_input, grad_weight, grad_bias, None, None, None, None, None
        invstd = torch.rsqrt(var + ctx.eps) if input.is_cuda else None  # the CUDA kernels take it, computed once
        sum_dy, sum_dy_xhat = _local_reductions(grad_output, input, weight, mean, var, ctx.eps, invstd)
        # One collective of the forward's size, 2C + 6 float64 values [sum(dy), sum(dy * x_hat), 0, tag] (the float64
        # tail makes the cat's result float64); weight and bias keep the local sums (DDP averages them).
        reductions = ctx.transport.sum_(torch.cat([sum_dy, sum_dy_xhat, tag.tail(input.device, 0.0)]), tag)
        grad_input = None
        if needs[0]:
            grad_input = _grad_input(
                grad_output, input, weight, mean, var, count, reductions, ctx.eps, ctx.clipped, invstd
            )
        param_dtype = mean.dtype if weight is None else weight.dtype
        if param_dtype != mean.dtype:  # e.g. float32 statistics of float16 activations with float16 parameters
            sum_dy_xhat, sum_dy = sum_dy_xhat.to(param_dtype), sum_dy.to(param_dtype)
        grads = sum_dy_xhat if needs[1] else None, sum_dy if needs[2] else None
        return grad_input, *grads, None, None, None, None, None


def _kernel_choice(transport: Any, compiling: bool) -> Any:
    """The kernels of one call, both directions: under a user's ``torch.compile``, the group name the traced regions
    reduce over (None: a group of one); else, or for a group they cannot reach, the native kernels
    (:data:`~syncbn_dist.kernels.compiled.NATIVE`)."""
    if not compiling or transport.group_name is UNREACHABLE:
        return NATIVE
    return transport.group_name


class _SyncBatchNormForwardAD(_SyncBatchNormFunction):
    """:class:`_SyncBatchNormFunction` with forward-mode AD (``torch.autograd.forward_ad``, ``torch.func``): a class
    of its own, taken only under those, because Dynamo refuses to trace a Function that defines ``jvp``."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
        _SyncBatchNormFunction.setup_context(ctx, inputs, output)
        _, mean, _, var, count = output
        ctx.save_for_forward(inputs[0], inputs[1], mean, var, count)

    @staticmethod
    def jvp(ctx: Any, input_tangent: Optional[Tensor], weight_tangent: Optional[Tensor],
            bias_tangent: Optional[Tensor], *_: Any) -> tuple[Optional[Tensor], None, None, None, None]:
        """The output's tangent over the global batch, with one tagged collective of 2C + 6 float64 values.

        The input Jacobian ``weight * invstd * (I - 1 1^T / N - x_hat x_hat^T / N)`` is symmetric per channel, so the
        tangent of ``dx`` is the backward's ``grad_input`` of ``dy = dx``; weight and bias add ``dw * x_hat + db``.
        """
        input, weight, mean, var, count = ctx.saved_tensors
        tangent = None
        if input_tangent is not None:
            input_tangent = _like_input(input_tangent, input)
            sums = _local_reductions(input_tangent, input, None, mean, var, ctx.eps)
            tag = ctx.tags[0].sibling(TANGENT)
            reductions = ctx.transport.sum_(torch.cat([*sums, tag.tail(input.device, 0.0)]), tag)
            tangent = _grad_input(input_tangent, input, weight, mean, var, count, reductions, ctx.eps, ctx.clipped)
        if weight_tangent is not None or bias_tangent is not None:
            affine = _batch_norm_inference(
                input,
                torch.zeros_like(mean) if weight_tangent is None else weight_tangent.to(mean.dtype),
                None if bias_tangent is None else bias_tangent.to(mean.dtype),
                mean, var, ctx.eps,
            )
            tangent = affine if tangent is None else tangent + affine
        return tangent, None, None, None, None  # one per output


def _recorded_backward(
    ctx: Any, grad_output: Tensor, input: Tensor, weight: Optional[Tensor], mean: Tensor, count: Tensor
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``_SyncBatchNormFunction``'s backward as a recorded graph, for ``backward(create_graph=True)``: autograd's
    gradients of :func:`_differentiable_normalize`, whose graph reaches every member's input through the transport's
    differentiable ``all_reduce`` (two tagged collectives). docs/design.md, "Higher-order derivatives".
    """
    needs = ctx.needs_input_grad
    grads: list[Optional[Tensor]] = [None, None, None]
    wrt = [t for t, need in zip((input, weight), needs[:2]) if need]
    if wrt:
        output = _differentiable_normalize(input, weight, mean, count, ctx.eps, ctx.eps_mode, ctx.transport, ctx.tags)
        found = iter(torch.autograd.grad(output, wrt, grad_output.to(output.dtype), create_graph=True))
        grads[:2] = [next(found) if need else None for need in needs[:2]]
    if needs[2]:
        grads[2] = grad_output.sum(_reduced_dims(input)).to(mean.dtype if weight is None else weight.dtype)
    return grads[0], grads[1], grads[2]


def _differentiable_normalize(
    input: Tensor, weight: Optional[Tensor], shift: Tensor, count: Tensor, eps: float, eps_mode: str, transport: Any,
    tags: tuple[Any, Any],
) -> Tensor:
    """``(x - mean) / sqrt(var + eps) * weight`` over the global batch in plain float64 ops (no bias: a constant),
    the sums taken about ``shift`` (the forward's global mean: no cancellation) and summed by ``transport.all_reduce``.
    """
    shape = _channel_shape(input)
    centred = input.to(COMBINE_DTYPE) - shift.to(COMBINE_DTYPE).view(shape)
    dims = _reduced_dims(input)
    tag, adjoint = tags[0].sibling(RECORDED_BACKWARD), tags[0].sibling(RECORDED_ADJOINT)
    payload = torch.cat([centred.sum(dims), centred.square().sum(dims), tag.tail(input.device, 0.0)])
    (total,) = transport.all_reduce([payload], tags=(tag, adjoint, True))
    offset, var, _, _, _ = moments_of_total(torch.cat([total.narrow(0, 0, 2 * input.size(1)), count]))
    var = _normalizing_var(var, eps, eps_mode)
    output = (centred - offset.view(shape)) * torch.rsqrt(var + eps).view(shape)
    return output if weight is None else output * weight.to(COMBINE_DTYPE).view(shape)


def sync_batch_norm(
    input: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    momentum: Union[float, Tensor],
    eps: float,
    transport: Transport,
    eps_mode: str = "plus",
    tags: Optional[tuple[Any, Any]] = None,
    compiling: Optional[bool] = None,
) -> Tensor:
    """Batch norm in training mode with statistics summed over every member of ``transport``.

    Equals ``F.batch_norm(cat(inputs of all members), ..., training=True)`` restricted to this member's rows:
    outputs, input gradients and running statistics (Ioffe & Szegedy 2015, arXiv:1502.03167).

    Args:
        input: (N, C, *) floating tensor; N may differ across members and may be 0.
        weight, bias: (C,) affine parameters or None.
        running_mean, running_var: (C,) buffers updated in place with ``momentum`` and the unbiased global
            variance, or None to leave no trace (DataParallel slaves, track_running_stats=False).
        momentum: the exponential average factor already resolved by the module (1/num_batches_tracked for a
            cumulative average).
        eps: the numerical-stability term of the variance.
        transport: sums the payload over the members; see :mod:`syncbn_dist.comm.transport`.
        eps_mode: ``"plus"`` normalizes by ``sqrt(var + eps)`` (nn.BatchNorm), ``"clip"`` by
            ``sqrt(max(var, eps))`` (the classic Synchronized-BatchNorm-PyTorch default).
        tags: the :class:`~syncbn_dist.comm.tags.CollectiveTag` of the forward and backward collectives, which every
            member must send alike (a layer's: :func:`syncbn_dist.comm.tags.layer_tags`); None: those of a
            functional call, the same for every call.
        compiling: whether ``torch.compile`` traces this call (None: asked here; the layer asks once per forward).

    Returns:
        Tensor of the input's shape, dtype and memory format.

    Raises:
        ValueError: if the global count per channel is 1 (raised on every member, which all see that count).
        LayerMismatchError: if the members sent collectives of different tags (on every member).
    """
    if tags is None:
        tags = layer_tags("sync_batch_norm", "sync_batch_norm")
    if compiling is None:
        compiling = is_compiling()
    if getattr(transport, "differentiable_exchange", True):
        output, mean, unbiased_var = _sync_batch_norm_differentiable(
            input, weight, bias, eps, eps_mode, transport, tags
        )
    else:
        args = (input, weight, bias, eps, eps_mode, transport, _kernel_choice(transport, compiling), tags)
        if compiling:
            output, mean, unbiased_var, *_ = _SyncBatchNormFunction.apply(*args)
        elif _forward_ad_level_active():  # a dual level or a torch.func transform: Function.apply handles both
            output, mean, unbiased_var, *_ = _SyncBatchNormForwardAD.apply(*args)
        elif _is_functorch_wrapped(input) or (weight is not None and _is_functorch_wrapped(weight)) or (
            bias is not None and _is_functorch_wrapped(bias)
        ):
            output, mean, unbiased_var, *_ = _SyncBatchNormFunction.apply(*args)
        else:
            # Every argument given and no functorch-wrapped tensor: the C++ apply directly. torch's Function.apply binds
            # the arguments to forward's signature with inspect and walks them with pytree on every call, here with
            # nothing to do (25-30 us a call, a tenth of a small layer's step; the Python-call budget of
            # tests/test_lean_path.py holds this path).
            output, mean, unbiased_var, *_ = super(Function, _SyncBatchNormFunction).apply(*args)
    if running_mean is not None and running_var is not None:
        # No grad mode to set: the statistics are non-differentiable outputs (or made under no_grad), the buffers
        # never require grad.
        if input.numel() <= input.size(1):  # <= 1 value per channel: the global batch may be empty (buffers kept)
            if compiling:  # no host read inside a graph: select per channel instead
                empty = mean.isnan()
                mean = torch.where(empty, running_mean, mean)
                unbiased_var = torch.where(empty, running_var, unbiased_var)
            elif mean.numel() and bool(mean[0].isnan()):
                return output
        update_running_stats(running_mean, running_var, mean, unbiased_var, momentum)
    return output
