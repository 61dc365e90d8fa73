"""Compiled regions called directly after their first call (syncbn_dist.kernels.direct_call).

- After a signature's first call, its inductor graph is called directly, and gives what the torch.compile path
  gives, bit for bit, at a new batch size too (sizes are read from the arguments), on both layouts and with the
  backward's view of the statistics (a storage offset Dynamo left symbolic).
- Every check Dynamo's guards would have made sends the call down the torch.compile path, which still gives the
  right result: grad mode on, a tensor that requires grad, a layout or storage offset the graph was not built for,
  a tensor subclass.
- DIRECT_CALLS off keeps every call on the torch.compile path.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import Tensor

from launch.common.spawn import run_distributed
from syncbn_dist.kernels import compiled as kernels
from syncbn_dist.kernels import compiled_kernel
from syncbn_dist.kernels.direct_call import DirectCall

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

_EPS = 1e-5


@pytest.fixture(autouse=True)
def _grad_mode_off() -> Any:
    """As inside the layer's autograd Function, where the regions run."""
    with torch.no_grad():
        yield


# A collective tag's five values, as the layer passes them to each region (syncbn_dist.comm.tags).
_TAG = torch.tensor([1.0, 3.0, 9.0, 5.0, 25.0], dtype=torch.float64)


def _forward_args(x: Tensor) -> tuple[Any, ...]:
    x3 = kernels._as_3d(x)
    weight = torch.linspace(0.5, 1.5, x.size(1))
    return (x3, weight, torch.linspace(-1.0, 1.0, x.size(1)), _EPS, False, None, _TAG)


def _backward_args(x: Tensor, dy: Tensor) -> tuple[Any, ...]:
    x3, weight, bias, *_ = _forward_args(x)
    _, mean, _, var, count, *_ = kernels.forward_region(x3, weight, bias, _EPS, False, None, _TAG)
    return (
        kernels._as_3d(dy), x3, weight, mean, var, count, kernels.channel_ones(x3), _EPS, False, None, True, _TAG
    )


def _signature(kernel: kernels._CompiledKernel) -> Any:
    (signature,) = kernel.compiled
    return signature


def _assert_same(first: tuple[Any, ...], second: tuple[Any, ...]) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            assert torch.equal(a, b)


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("region", [kernels.forward_region, kernels.backward_region], ids=["forward", "backward"])
def test_later_calls_run_the_inductor_graph_directly_and_match_the_compiled_path(
    region: Callable[..., Any], channels_last: bool
) -> None:
    gen = torch.Generator().manual_seed(0)
    kernel = kernels._CompiledKernel(region)

    def args_for(batch: int) -> tuple[Any, ...]:
        x = torch.randn(batch, 6, 5, 3, generator=gen) * 3 + 100
        dy = torch.randn(batch, 6, 5, 3, generator=gen)
        if channels_last:
            x, dy = x.contiguous(memory_format=torch.channels_last), dy.contiguous(memory_format=torch.channels_last)
        return _forward_args(x) if region is kernels.forward_region else _backward_args(x, dy)

    kernel(*args_for(4))  # the first call compiles and records
    direct = kernel.direct[_signature(kernel)]
    assert isinstance(direct, DirectCall)
    for batch in (4, 7):  # a batch size the graph was not first called with: its sizes are read from the arguments
        args = args_for(batch)
        result = direct(args)
        assert result is not None
        _assert_same(result, kernel.compiled[_signature(kernel)](*args))
        _assert_same(kernel(*args), result)


@pytest.mark.parametrize("clip", [False, True], ids=["plus", "clip"])
def test_a_backward_without_grad_input_maps_its_absent_output(clip: bool) -> None:
    """need_input=False: the region returns None for grad_input, which the graph does not compute."""
    gen = torch.Generator().manual_seed(2)
    kernel = kernels._CompiledKernel(kernels.backward_region)
    x, dy = torch.randn(4, 6, 5, generator=gen), torch.randn(4, 6, 5, generator=gen)
    args = list(_backward_args(x, dy))
    args[-4], args[-2] = clip, False
    kernel(*args)
    direct = kernel.direct[_signature(kernel)]
    result = direct(tuple(args))
    assert result is not None and result[0] is None and len(result) == 4  # (None, two sums, the summed tag)
    _assert_same(result, kernel.compiled[_signature(kernel)](*args))


def test_calls_dynamos_guards_would_treat_differently_take_the_compiled_path() -> None:
    """Each case makes DirectCall decline (None), and the kernel's answer is still the torch.compile path's."""
    gen = torch.Generator().manual_seed(1)
    kernel = kernels._CompiledKernel(kernels.forward_region)
    args = _forward_args(torch.randn(4, 6, 5, 3, generator=gen))
    kernel(*args)
    direct = kernel.direct[_signature(kernel)]
    assert direct(args) is not None

    x3, weight, bias, *constants = args
    wide = torch.randn(4, 6, 30, generator=gen)
    declined = {
        "a tensor that requires grad": (x3, weight.clone().requires_grad_(), bias, *constants),
        "a non-contiguous weight": (x3, torch.randn(12, generator=gen)[::2], bias, *constants),
        "a strided activation": (wide[:, :, ::2], weight, bias, *constants),
        "a storage offset": (torch.randn(5, 6, 15, generator=gen)[1:], weight, bias, *constants),
    }
    for case, changed in declined.items():
        assert direct(changed) is None, case
        for compiled, eager in zip(kernel(*changed), kernels.forward_region(*changed)):
            torch.testing.assert_close(compiled, eager, msg=case)
    with torch.enable_grad():
        assert direct(args) is None, "grad mode on"


def test_direct_calls_off_keeps_the_torch_compile_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled_kernel, "DIRECT_CALLS", False)
    kernel = kernels._CompiledKernel(kernels.forward_region)
    args = _forward_args(torch.randn(4, 6, 5, 3))
    kernel(*args)
    assert kernel.direct == {}
    _assert_same(kernel(*args), kernel.compiled[_signature(kernel)](*args))


def _eager_under_dynamo_worker(rank: int, world_size: int) -> bool:
    import torch.distributed as dist

    kernel = kernels._CompiledKernel(kernels.forward_region)
    x = torch.randn(4, 6, 5, 3, generator=torch.Generator().manual_seed(rank))
    x3, weight, bias, eps, clip, _, tag = _forward_args(x)
    args = (x3, weight, bias, eps, clip, dist.group.WORLD.group_name, tag)
    with torch.no_grad():
        expected = kernel(*args)  # compiled, and its direct call recorded

        @torch.compiler.disable(recursive=False)  # runs eagerly; the calls it makes are still offered to Dynamo
        def eager_frame(*args: Any) -> Any:
            return kernel(*args)

        @torch.compile(backend="inductor")
        def user_step(*args: Any) -> Any:
            return eager_frame(*args)

        _assert_same(user_step(*args), expected)
    return True


@pytest.mark.distributed
def test_a_region_called_eagerly_under_an_active_dynamo_callback_is_not_traced() -> None:
    """A user's torch.compile can run the layer eagerly while Dynamo still intercepts new frames (a frame it skips,
    e.g. past its recompile limit, offers every call below it to Dynamo). The region must then run as in eager
    mode: traced, inductor's generated code failed to compile (its in-place functional all_reduce), a make bench
    ResNet run with the user's model compiled."""
    assert run_distributed(_eager_under_dynamo_worker, 2, timeout=240) == [True, True]
