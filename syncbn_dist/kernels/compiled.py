r"""The synchronized layer's per-element work as one Python source that ``torch.compile`` (inductor) fuses.

Four passes, 8 activation accesses per element (:func:`shard_payload`, :func:`normalize`, :func:`grad_reductions`,
:func:`grad_input`), one compiled region per direction over a process group (:func:`forward_region`,
:func:`backward_region`), traced by a user's ``torch.compile`` too (:func:`layer_forward`, :func:`layer_backward`).
Design, exactness (Chan et al. 1979) and measurements: docs/design.md, "Compiled kernels"; docs/compile.md.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..comm.distributed import all_reduce_sum
from ..comm.tags import TAG_SIZE, checked_in_graph
from ..settings import KERNELS_ENV, get_kernels
from .compiled_kernel import _CompiledKernel
from .statistics import invstd_and_scale, moments_of_total
from .tracing import _forward_ad_active, is_compiling

__all__ = ["COMPILED_KERNELS", "NATIVE", "layer_backward", "layer_forward", "takes_compiled_kernels", "use_compiled"]

_F64 = torch.float64


class _Native:
    def __repr__(self) -> str:
        return "NATIVE"


#: The kernel choice of a call that runs the native kernels (the process-group Function's: else a group name).
NATIVE: Any = _Native()


def takes_compiled_kernels(input: Tensor, compiling: bool) -> bool:
    """Whether a synchronized call runs this module's source: always under a user's ``torch.compile``
    (``compiling``), else as :func:`use_compiled` says, but never in forward-mode AD (its ``jvp``s are native ops)."""
    return compiling or (use_compiled(input) and not _forward_ad_active())


def use_compiled(input: Tensor) -> bool:
    """Whether this eager training call takes the compiled kernels (the caller has ruled out forward-mode AD).

    Raises:
        RuntimeError: in ``"compiled"`` mode, where inductor cannot build kernels for the input's device.
    """
    mode = get_kernels()  # first: with the native kernels nothing else is looked up
    # "auto" compiles for CPU only: on CUDA the two sets measured even (docs/design.md, "Compiled kernels", CUDA).
    if mode == "native" or (mode == "auto" and input.device.type != "cpu"):
        return False
    # A shard of <= 1 value per channel needs the native count check (a host read); torch.compile cannot run under
    # a TorchDispatchMode (an op counter, FlopCounterMode).
    if is_compiling() or input.size(1) == 0 or _values_per_channel(input) < 2 or _dispatch_mode_active():
        return False
    missing = _missing_compiler(input.device.type)
    if missing is None:
        return True
    if mode == "compiled":
        raise RuntimeError(f"syncbn_dist.set_kernels('compiled'): {missing}; use 'auto' or 'native'")
    _warn_fallback(missing)
    return False


def _dispatch_mode_active() -> bool:
    return _get_current_dispatch_mode() is not None


@functools.cache
def _missing_compiler(device_type: str) -> Optional[str]:
    """Why inductor cannot build kernels for ``device_type``, or None when it can."""
    if device_type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:  # inductor's own search (config.cpp.cxx, then g++ / clang++ / the CXX environment variable)
            get_cpp_compiler()
        except Exception as error:  # noqa: BLE001 - any failure means no compiler; its text is the reason
            return f"inductor finds no C++ compiler for CPU kernels ({error})"
        return None
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed, which inductor's CUDA kernels need"
    return f"inductor kernels are not built for {device_type} tensors here"


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(
        f"syncbn_dist: compiled batch-norm kernels unavailable ({reason}); using the native kernels "
        f"(set {KERNELS_ENV}=native or syncbn_dist.set_kernels('native') to silence this)",
        RuntimeWarning,
        stacklevel=3,
    )


def _values_per_channel(input: Tensor) -> int:
    """Values per channel of an (N, C, *) shard: N * prod(*) (0 when C is 0)."""
    return input.numel() // max(input.size(1), 1)


def _channel_shape(x: Tensor) -> list[int]:
    """The shape that broadcasts a (C,) tensor over ``x``: (1, C, 1, ...)."""
    return [1, -1] + [1] * (x.dim() - 2)


def _reduced_dims(input: Tensor) -> list[int]:
    """The dimensions a per-channel statistic reduces over: all but dim 1."""
    return [0, *range(2, input.dim())]


def _sum_per_channel(t: Tensor, staged: bool = True) -> Tensor:
    """Sum a (N, C, *) tensor over all but C into (C,) float64: in one reduction unless ``staged`` (eager), which sums
    channels-innermost or float32 terms per sample first (docs/design.md, "Compiled kernels"; docs/compile.md)."""
    if not staged:
        return t.sum([0, *range(2, t.dim())]).to(_F64)
    if t.dim() != 3:
        t = t.unsqueeze(2) if t.dim() == 2 else t.flatten(2)
    if t.dtype != _F64:
        return t.sum(2).to(_F64).sum(0)
    if t.stride(1) == 1 and t.size(2) > 1:
        return t.sum(2).sum(0)
    return t.sum([0, 2])


def _stat_dtype(x: Tensor) -> torch.dtype:
    """Dtype of the per-channel statistics and coefficients: float32 for reduced precision input, else the input's."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _term_dtype(x: Tensor) -> torch.dtype:
    """Dtype of the per-element terms the reductions sum: float32 for float16/bfloat16 input, else float64 (exact
    for the difference of two values of the input's dtype)."""
    stat = _stat_dtype(x)
    return _F64 if stat == x.dtype else stat


# The one source: plain torch ops on eager (N, C, L) views with N * L >= 2, or a user's graph's (maybe empty) tensors.


def shard_payload(x: Tensor, tag: Optional[Tensor] = None, *, staged: bool = True) -> tuple[Tensor, Tensor]:
    """``[sum(x) (C), sum(x**2) (C), count, tag (5)]`` of one shard as (2C + 6,) float64, from one pass over ``x``;
    ``tag`` is the collective's tag (:mod:`syncbn_dist.comm.tags`), five float64 values (None: no tag, 2C + 1 values).
    Returns ``(payload, s)``: the sums are taken about ``s`` (C,), the first value per channel, and ``s`` is an output
    so that inductor stores it (Chan et al. 1979, as sums; docs/design.md, "Compiled kernels")."""
    count = _values_per_channel(x)
    terms = _term_dtype(x)
    if count == 0:  # an empty shard (only under a user's torch.compile): its sums, zeros made from x, not constants
        shift = x.new_zeros(x.size(1), dtype=terms)
    else:
        shift = _first_value_per_channel(x).to(terms)
    centred = x.to(terms) - shift.view(_channel_shape(x))
    sums, squares = _sum_per_channel(centred, staged), _sum_per_channel(centred.square(), staged)
    shift_64 = shift.to(_F64)
    absolute_sums = sums + count * shift_64
    absolute_squares = squares + shift_64 * (2.0 * sums + count * shift_64)
    tail = sums.new_full((1,), count) if tag is None else _with_lead(tag, count)
    return torch.cat([absolute_sums, absolute_squares, tail]), shift


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

    Returns ``(y, mean, unbiased_var, var, count, scale)``: ``y`` in ``x``'s dtype; ``mean``, the unbiased variance
    and the normalizing variance (``max(var, eps) - eps`` when ``clip``) in the statistics dtype; the (1,) float64
    count; ``scale = weight * invstd`` (stored once per channel).
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
    # count as a copy: AOTAutograd rebuilds a view of an input outside the graph, which rules out a direct call.
    return y.to(x.dtype), mean_s, unbiased_var.to(dtype), var.to(dtype), count.clone(), scale_s


def grad_reductions(
    dy: Tensor, x: Tensor, mean: Tensor, var: Tensor, ones: Optional[Tensor], eps: float, *, staged: bool = True
) -> Tensor:
    """This shard's ``[sum(dy) (C), sum(dy * x_hat) (C)]`` as (2C,) float64, from one pass over ``dy`` and ``x``;
    ``ones``: :func:`channel_ones`."""
    terms, shape = _term_dtype(x), _channel_shape(x)
    grad = dy.to(terms)
    centred = x.to(terms) - mean.to(terms).view(shape)
    invstd = torch.rsqrt(var.to(_F64) + eps)
    per_channel_grad = grad if ones is None else grad * ones.view(shape)
    return torch.cat([_sum_per_channel(per_channel_grad, staged), _sum_per_channel(grad * centred, staged) * invstd])


def grad_input(
    dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, var: Tensor, count: Tensor, reductions: Tensor,
    eps: float, clip: bool,
) -> tuple[Tensor, ...]:
    """The global-batch ``grad_input`` (Ioffe & Szegedy 2015, arXiv:1502.03167), from the summed ``reductions``:

        dx = weight * invstd * (dy - sum(dy) / N - x_hat * sum(dy * x_hat) / N)

    as ``dy * a + (x - mean) * b + c`` in the statistics dtype. Returns ``(dx, a, b, c)``. With ``clip``, a channel
    whose variance was clipped (``var == 0`` as the normalizing variance) drops the ``x_hat`` term.
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
    return dx.to(x.dtype), a, b, c


def forward_region(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, clip: bool, group_name: Optional[str],
    tag: Optional[Tensor] = None, *, staged: bool = True, verify: Optional[Callable[[Tensor], Tensor]] = None,
) -> tuple[Tensor, ...]:
    """One layer's training forward over a process group: payload, all_reduce, normalize. Returns :func:`normalize`'s
    ``(y, mean, unbiased_var, var, count)``, the summed tag (None without ``tag``; eager callers verify it), then
    ``scale`` and the shift (outputs so they are stored). ``staged``: :func:`_sum_per_channel`; ``verify``: checks the
    summed payload inside a traced graph (:func:`syncbn_dist.comm.tags.checked_in_graph`)."""
    payload, shift = shard_payload(x, tag, staged=staged)
    total = all_reduce_sum(payload, group_name)
    if verify is not None:
        total = verify(total)
    y, mean, unbiased_var, var, count, scale = normalize(x, total, weight, bias, eps, clip)
    return y, mean, unbiased_var, var, count, _summed_tag(total, tag), scale, shift


def _summed_tag(total: Tensor, tag: Optional[Tensor]) -> Optional[Tensor]:
    """The summed tags at the end of ``total`` as a copy (a region returns no view of its intermediates), or None."""
    return None if tag is None else total.narrow(0, total.numel() - TAG_SIZE, TAG_SIZE).clone()


def backward_region(
    dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, var: Tensor, count: Tensor, ones: Optional[Tensor],
    eps: float, clip: bool, group_name: Optional[str], need_input: bool, tag: Optional[Tensor] = None, *,
    staged: bool = True, verify: Optional[Callable[[Tensor], Tensor]] = None,
) -> tuple[Optional[Tensor], ...]:
    """One layer's backward over a process group: local reductions, all_reduce, grad_input. Returns ``(grad_input or
    None, sum(dy * x_hat), sum(dy), summed tag, *coefficients)``, the sums local (DDP averages the parameter gradients,
    as with ``torch.nn.SyncBatchNorm``), in the statistics dtype. The payload has the forward's size (docs/design.md,
    "The statistics"). ``staged``, ``verify``: as :func:`forward_region`'s."""
    local = grad_reductions(dy, x, mean, var, ones, eps, staged=staged)
    # In the statistics dtype here, right after the reductions, so that the compiler converts them there too.
    sum_dy, sum_dy_xhat = local.to(_stat_dtype(x)).chunk(2)
    # The collective runs whether or not grad_input is needed: every member sends the same collectives.
    total = all_reduce_sum(local if tag is None else torch.cat([local, _with_lead(tag, 0.0)]), group_name)
    if verify is not None:
        total = verify(total)
    if not need_input:
        return None, sum_dy_xhat, sum_dy, _summed_tag(total, tag)
    dx, *coefficients = grad_input(dy, x, weight, mean, var, count, total, eps, clip)
    return (dx, sum_dy_xhat, sum_dy, _summed_tag(total, tag), *coefficients)


_forward_region = _CompiledKernel(forward_region)
_backward_region = _CompiledKernel(backward_region)
COMPILED_KERNELS = (_forward_region, _backward_region)


def _as_3d(t: Tensor) -> Tensor:
    """``t`` (N, C, *) as a detached (N, C, L) view, how the entry points below pass tensors to a region."""
    t = t.detach()
    return t.unsqueeze(2) if t.dim() == 2 else t.flatten(2)


def channel_ones(x: Tensor) -> Optional[Tensor]:
    """(C,) ones in the reductions' term dtype where they sum in two stages over contiguous (float16/bfloat16) input,
    else None: ``sum(dy * ones)`` then fuses with ``sum(dy * x_hat)`` (docs/design.md, "Compiled kernels")."""
    terms = _term_dtype(x)
    return None if terms == _F64 or x.stride(1) == 1 else x.new_ones(x.size(1), dtype=terms)


def _in_shape_of(t: Tensor, input: Tensor) -> Tensor:
    """``t`` (N, C, L) in ``input``'s shape, as a tensor of its own on the same storage rather than a view: autograd
    forbids modifying a view made inside a custom Function in place (an inplace ReLU after the layer)."""
    view = t.view(input.shape)
    return t.new_empty(0).set_(t.untyped_storage(), view.storage_offset(), view.shape, view.stride())


def _affine(param: Optional[Tensor], x: Tensor, fill: float) -> Tensor:
    """The parameter as a plain tensor in the statistics dtype (Dynamo would guard a Parameter's type and shape)."""
    dtype = _stat_dtype(x)
    return x.new_full((x.size(1),), fill, dtype=dtype) if param is None else param.detach().to(dtype)


def layer_forward(
    input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, clip: bool,
    group_name: Optional[str], tag: Any,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The training forward over the process group ``group_name`` (None: a group of one) in one compiled region.

    Returns ``(output, mean, unbiased_var, var, count, summed_tag)``: the output in the input's shape, dtype and
    memory format; the statistics in the statistics dtype (``var`` the normalizing variance); the (1,) float64 global
    count; the summed tags, which the caller verifies (``tag``: its :class:`~syncbn_dist.comm.tags.CollectiveTag`).
    Under a user's ``torch.compile``, traced into its graph on the input, with a ``TracedTag`` checked in the graph.
    """
    if is_compiling():
        tag_values, verify = _traced_check(tag, input, group_name)
        return forward_region(input, weight, bias, eps, clip, group_name, tag_values, staged=False, verify=verify)[:6]
    x = _as_3d(input)
    y, mean, unbiased_var, var, count, summed_tag, *_ = _forward_region(
        x, _affine(weight, x, 1.0), _affine(bias, x, 0.0), eps, clip, group_name, tag.tail(x.device, None)
    )
    return _in_shape_of(y, input), mean, unbiased_var, var, count, summed_tag


def _traced_check(
    tag: Any, input: Tensor, group_name: Optional[str], backward: bool = False
) -> tuple[Tensor, Optional[Callable[[Tensor], Tensor]]]:
    """The tag's values as a constant of the traced graph, and what checks a summed payload there
    (:func:`~syncbn_dist.comm.tags.checked_in_graph`; None without peers or for ``NO_TAG``)."""
    # Padded to nine values: inductor inlines a constant of at most eight into the kernel's source, which would make
    # every layer's kernels distinct; a larger one is a buffer argument, so layers of one shape share their kernels.
    values = torch.tensor((*tag.values, 0.0, 0.0, 0.0, 0.0), dtype=_F64, device=input.device)[:TAG_SIZE]
    if tag.index < 0 or group_name is None:
        return values, None
    return values, functools.partial(checked_in_graph, tag=tag, group_name=group_name, backward=backward)


def layer_backward(
    grad_output: Tensor, input: Tensor, weight: Optional[Tensor], mean: Tensor, var: Tensor, count: Tensor,
    eps: float, clip: bool, group_name: Optional[str], need_input: bool, tag: Any,
) -> tuple[Optional[Tensor], Tensor, Tensor, Tensor]:
    """The backward of :func:`layer_forward` in one compiled region; ``grad_output`` in the input's memory format.
    Returns ``(grad_input or None, sum(dy * x_hat), sum(dy), summed_tag)``, the (C,) local sums in the statistics
    dtype; traced into a user's graph as :func:`layer_forward` is."""
    if is_compiling():
        tag_values, verify = _traced_check(tag, input, group_name, backward=True)
        return backward_region(
            grad_output, input, weight, mean, var, count, None, eps, clip, group_name, need_input, tag_values,
            staged=False, verify=verify,
        )[:4]
    x = _as_3d(input)
    dx, sum_dy_xhat, sum_dy, summed_tag, *_ = _backward_region(
        _as_3d(grad_output), x, _affine(weight, x, 1.0), mean, var, count, channel_ones(x), eps, clip, group_name,
        need_input, tag.tail(x.device, None),
    )
    return None if dx is None else _in_shape_of(dx, input), sum_dy_xhat, sum_dy, summed_tag
