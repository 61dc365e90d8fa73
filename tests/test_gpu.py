"""The CUDA path against float64 BatchNorm: the synchronized Function on CUDA tensors, over NCCL at world size 1.

Every test here is marked ``gpu`` and skips without CUDA (CI has none). The synchronized path is forced with a
:class:`syncbn_dist.comm.DistributedTransport` on a one-member NCCL group (the module itself would skip the
collective for one member), so the payload really goes through ``all_reduce`` on the GPU. The reference is
``F.batch_norm`` in training mode on a float64 CPU copy of the batch.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from closeness import assert_close

import syncbn_dist
from launch.bench.micro import compiled_bytes_per_element
from syncbn_dist import kernels
from syncbn_dist.comm import DistributedTransport
from syncbn_dist.functions import sync_batch_norm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MOMENTUM = 0.1
EPS = 1e-5


@pytest.fixture(scope="module")
def nccl_world_of_one() -> Iterator[None]:
    """The default process group: NCCL, one member (this process), on GPU 0."""
    if not dist.is_nccl_available():
        pytest.skip("needs NCCL")
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'rdzv')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, channels_last", [((8, 16, 7, 5), False), ((8, 16, 7, 5), True), ((64, 32), False)])
def test_cuda_sync_path_over_nccl_matches_float64_batchnorm(
    nccl_world_of_one: None, kernel_mode: str, shape: tuple[int, ...], channels_last: bool, dtype: torch.dtype
) -> None:
    """Both kernel sets (native CUDA ops; the compiled ones as Triton kernels, NCCL's functional all_reduce inside
    their regions) on every layout."""
    gen = torch.Generator().manual_seed(0)
    channels = shape[1]
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    x64 = torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 2
    dy64 = torch.randn(shape, generator=gen, dtype=torch.float64)
    w64 = torch.rand(channels, generator=gen, dtype=torch.float64) + 0.5
    b64 = torch.randn(channels, generator=gen, dtype=torch.float64)

    x = x64.to("cuda", dtype).contiguous(memory_format=memory_format).requires_grad_()
    weight = w64.to("cuda", dtype).requires_grad_()
    bias = b64.to("cuda", dtype).requires_grad_()
    running_mean = torch.zeros(channels, device="cuda", dtype=dtype)
    running_var = torch.ones(channels, device="cuda", dtype=dtype)
    out = sync_batch_norm(x, weight, bias, running_mean, running_var, MOMENTUM, EPS, DistributedTransport(None))
    out.backward(dy64.to("cuda", dtype).contiguous(memory_format=memory_format))
    assert out.is_contiguous(memory_format=memory_format) and x.grad.is_contiguous(memory_format=memory_format)

    # The reference sees the values the CUDA path saw (the float64 data rounded to ``dtype``), in float64.
    x_ref = x.detach().double().cpu().requires_grad_()
    w_ref = weight.detach().double().cpu().requires_grad_()
    b_ref = bias.detach().double().cpu().requires_grad_()
    dy_ref = dy64.to(dtype).double()
    rm_ref = torch.zeros(channels, dtype=torch.float64)
    rv_ref = torch.ones(channels, dtype=torch.float64)
    ref = F.batch_norm(x_ref, rm_ref, rv_ref, w_ref, b_ref, True, MOMENTUM, EPS)
    ref.backward(dy_ref)

    # float32: O(1) values to a few float32 ulps after two passes; bfloat16 and float16 outputs and gradients are
    # rounded to 8 and 11 significant bits (relative 4e-3 and 5e-4), the statistics stay float64 (float32 per
    # sample for half input) so nothing else is lost.
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    pairs = {
        "output": (out, ref),
        "grad input": (x.grad, x_ref.grad),
        "grad weight": (weight.grad, w_ref.grad),
        "grad bias": (bias.grad, b_ref.grad),
        "running_mean": (running_mean, rm_ref),
        "running_var": (running_var, rv_ref),
    }
    for what, (got, expected) in pairs.items():
        assert got.device.type == "cuda", what
        assert got.dtype == dtype, what
        torch.testing.assert_close(got.double().cpu(), expected, **tol, msg=lambda m, w=what: f"{w}: {m}")


def test_auto_keeps_cuda_layers_on_the_native_kernels(
    nccl_world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default mode compiles nothing for CUDA tensors: the native kernels measured faster there."""
    monkeypatch.setenv(kernels.KERNELS_ENV, "auto")
    before = [kernel.graphs() for kernel in kernels.COMPILED_KERNELS]
    x = torch.randn(8, 5, 3, 3, device="cuda", requires_grad=True)
    sync_batch_norm(x, None, None, None, None, MOMENTUM, EPS, DistributedTransport(None)).sum().backward()
    assert [kernel.graphs() for kernel in kernels.COMPILED_KERNELS] == before
    assert not kernels.use_compiled(x)


@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_sync_path_is_exact_at_a_large_mean(
    nccl_world_of_one: None, kernel_mode: str, channels_last: bool
) -> None:
    """|mean| / std = 1e4 on CUDA: the statistics are float64 over the float32 values on both kernel sets, so the
    variance is right to 1e-6 relative, where E[x^2] - E[x]^2 in float32 would lose it entirely."""
    gen = torch.Generator().manual_seed(2)
    shape = (16, 8, 9, 7)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    x32 = (torch.randn(shape, generator=gen, dtype=torch.float64) + 1e4).float()
    dy64 = torch.randn(shape, generator=gen, dtype=torch.float64)
    x = x32.cuda().contiguous(memory_format=memory_format).requires_grad_()
    running_mean = torch.zeros(shape[1], device="cuda")
    running_var = torch.ones(shape[1], device="cuda")
    out = sync_batch_norm(x, None, None, running_mean, running_var, MOMENTUM, EPS, DistributedTransport(None))
    out.backward(dy64.float().cuda().contiguous(memory_format=memory_format))

    x_ref = x32.double().requires_grad_()
    rm_ref, rv_ref = torch.zeros(shape[1], dtype=torch.float64), torch.ones(shape[1], dtype=torch.float64)
    ref = F.batch_norm(x_ref, rm_ref, rv_ref, None, None, True, MOMENTUM, EPS)
    ref.backward(dy64.float().double())
    # The float32 mean and input are 2^-24 * 1e4 off in normalized units (reach 1e4), times a few roundings; the
    # input gradient scales that by invstd * |dy| (invstd ~ 1, |dy| < 5).
    reach = 16 * 2**-24 * 1.1e4
    assert_close(out.cpu(), ref, "output", rtol=0.0, atol=reach)
    assert_close(x.grad.cpu(), x_ref.grad, "grad_input", rtol=0.0, atol=5 * reach)
    assert_close(running_var.cpu(), rv_ref, "running_var", rtol=1e-6, atol=0.0)
    assert_close(running_mean.cpu(), rm_ref, "running_mean", rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_triton_kernels_access_each_activation_element_8_times(dtype: torch.dtype) -> None:
    """K3 on CUDA: inductor's count of the bytes the compiled forward + backward Triton kernels access, per element.
    The kernels pass over the activation 8 times, as torch.nn.SyncBatchNorm's CUDA kernels do (x; x, y; dy, x; dy,
    x, dx: read from their Triton code on an H200). Before the shift x[0, :, 0] became a graph output, inductor's
    estimate counted 9, taking a kernel's load of the shift for another read of x (not yet run on a GPU since). The
    per-channel terms are under 1% at this shape."""
    x = torch.randn(16, 32, 32, 32, generator=torch.Generator().manual_seed(0)).to("cuda", dtype)
    accessed = compiled_bytes_per_element(x)
    assert accessed.activation == 8 * x.element_size(), accessed
    assert accessed.activation < accessed.total <= 1.01 * accessed.activation, accessed


def test_converted_module_on_cuda_matches_float64_batchnorm(nccl_world_of_one: None) -> None:
    """The module on CUDA (world size 1: the local path) equals nn.BatchNorm2d in float64, eval included."""
    gen = torch.Generator().manual_seed(1)
    x64 = torch.randn(6, 8, 5, 5, generator=gen, dtype=torch.float64)
    reference = torch.nn.BatchNorm2d(8).double()
    layer = syncbn_dist.convert_model(torch.nn.BatchNorm2d(8)).cuda()
    for step in range(2):
        x = (x64 + step).float().cuda()
        out = layer(x)
        ref = reference(x.double().cpu())
        # float32 rounding of O(1) normalized values.
        torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.running_var.double().cpu(), reference.running_var, rtol=1e-5, atol=1e-6)
    assert int(layer.num_batches_tracked) == 2
    layer.eval()
    reference.eval()
    # Eval uses the running statistics just compared; same float32 rounding.
    torch.testing.assert_close(layer(x64.float().cuda()).double().cpu(), reference(x64), rtol=1e-5, atol=1e-5)
