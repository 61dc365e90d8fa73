"""The CUDA path against float64 BatchNorm: the synchronized Function on CUDA tensors, over NCCL at world size 1.

Every test here is marked ``gpu`` and skips without CUDA (CI has none). The synchronized path is forced with a
:class:`syncbn_dist.comm.DistributedTransport` on a one-member NCCL group (the module itself would skip the
collective for one member), so the payload really goes through ``all_reduce`` on the GPU. The reference is
``F.batch_norm`` in training mode on a float64 CPU copy of the batch.

CUDA graphs (converted layers forced onto that group with launch.bench.resnet50_step's ``force_sync``):
``torch.compile(mode="reduce-overhead")`` of a converted ResNet against plain BatchNorm, and a ``torch.cuda.graph``
capture of a whole DDP training step replayed against the same step run eagerly. Across ranks on one GPU: two gloo
processes with CUDA tensors on GPU 0 (NCCL refuses two ranks on one device) run DDP with uneven and empty shards,
eagerly and compiled, through convert_model, patch_sync_batchnorm and torch's patched nn.SyncBatchNorm, against float64
BatchNorm on the concatenated batch.

The README's quick start, as pasted, with one process per GPU (tests/readme_blocks.py).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import conv_bn_model
import pytest
import test_join
import torch
import torch.distributed as dist
import torch.nn.functional as F
from closeness import assert_close
from readme_blocks import readme_blocks, run_blocks
from resnet import resnet
from torch.nn.parallel import DistributedDataParallel

import syncbn_dist
from launch.bench.resnet50_step import force_sync
from launch.common.spawn import run_distributed
from syncbn_dist import SyncBatchNorm
from syncbn_dist.comm import DistributedTransport
from syncbn_dist.layer.functions import sync_batch_norm

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
    nccl_world_of_one: None, shape: tuple[int, ...], channels_last: bool, dtype: torch.dtype
) -> None:
    """The native CUDA kernels on every layout and dtype."""
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


@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_sync_path_is_exact_at_a_large_mean(
    nccl_world_of_one: None, channels_last: bool
) -> None:
    """|mean| / std = 1e4 on CUDA: the statistics are float64 over the float32 values, so the
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


# ------------------------------------------------------------------------------------------------------------
# CUDA graphs: torch.compile(mode="reduce-overhead") and a torch.cuda.graph capture of a DDP training step, with the
# layers forced through their synchronized path on the one-member NCCL group (launch.bench.resnet50_step.force_sync).
# ------------------------------------------------------------------------------------------------------------


def _resnet_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(8, 3, 16, 16) float32 images (channels_last, mean 0.5, std 2) and (8,) targets of 5 classes, on GPU 0."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 3, 16, 16, generator=gen) * 2 + 0.5
    y = torch.randint(5, (8,), generator=gen)
    return x.cuda().contiguous(memory_format=torch.channels_last), y.cuda()


def _sgd_step(
    forward: Callable[[torch.Tensor], torch.Tensor], optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One training step; copies of its (8, 5) logits and its loss (a CUDA graph's outputs are overwritten later)."""
    optimizer.zero_grad(set_to_none=True)
    logits = forward(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    optimizer.step()
    return logits.detach().clone(), loss.detach().clone()


def _synchronized_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """syncbn_dist's layers and torch.nn.SyncBatchNorm's below ``model``."""
    return [m for m in model.modules() if isinstance(m, (SyncBatchNorm, torch.nn.SyncBatchNorm))]


def test_reduce_overhead_runs_the_synchronized_model_in_cuda_graphs(
    nccl_world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.compile(mode="reduce-overhead") of a converted ResNet (tests/resnet.py: 8 BatchNorm2d), its layers forced
    onto the NCCL group: inductor keeps the whole step in CUDA graphs (no cudagraph skip, collectives inside), and
    six SGD steps (warm-up, recording, then replays) give plain nn.BatchNorm2d's logits, losses and weights."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # float32 convolutions on both sides
    reference = resnet(seed=5).cuda().to(memory_format=torch.channels_last)
    model = force_sync(syncbn_dist.convert_model(copy.deepcopy(reference)))
    compiled = torch.compile(model, mode="reduce-overhead")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    torch._dynamo.utils.counters.clear()
    try:
        for step in range(6):
            x, y = _resnet_batch(step)
            torch.compiler.cudagraph_mark_step_begin()
            logits, loss = _sgd_step(compiled, optimizer, x, y)
            ref_logits, ref_loss = _sgd_step(reference, ref_optimizer, x, y)
            # Over a group of one the layer is plain BatchNorm: float32 rounding only (float64 statistics against
            # cuDNN's float32 ones, inductor's fused sums), O(1) values, carried through at most six steps.
            assert_close(logits.cpu(), ref_logits.cpu(), f"step {step} logits", rtol=1e-4, atol=1e-5)
            assert_close(loss.cpu(), ref_loss.cpu(), f"step {step} loss", rtol=1e-5, atol=0.0)
        skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
        assert skips == 0, "inductor left the step out of CUDA graphs (see its 'skipping cudagraphs' warning)"
        assert all(layer.last_transport == "distributed" for layer in _synchronized_layers(model))
        state, ref_state = model.state_dict(), reference.state_dict()
        assert state.keys() == ref_state.keys()
        for key, value in state.items():  # weights after six SGD steps and the running statistics: as above
            assert_close(value.cpu(), ref_state[key].cpu(), key, rtol=1e-4, atol=1e-5)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_users_compiled_model_on_cuda_equals_its_eager_path_and_plain_batchnorm(
    nccl_world_of_one: None, mode: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A converted ResNet (tests/resnet.py) compiled as a user compiles it, ``torch.compile(model, mode=mode)``, its
    layers forced onto the one-member NCCL group, over six SGD steps on six different batches: the logits and losses of
    every step, then the weights and running statistics, equal the same converted model run eagerly (the layer's own
    eager path), which equals plain BatchNorm. The control: plain BatchNorm under the same ``torch.compile`` against
    plain BatchNorm eager, so that an effect of CUDA graphs or inductor is told from the layer's.

    Different batches at every step: a compiled step that normalized with another step's statistics (a collective
    whose consumers do not wait for it) would pass with the same batch every time."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    plain = resnet(seed=7).to(device="cuda", dtype=dtype, memory_format=torch.channels_last)
    models = {
        "plain": plain,
        "plain compiled": copy.deepcopy(plain),
        "ours": force_sync(syncbn_dist.convert_model(copy.deepcopy(plain))),
        "ours compiled": force_sync(syncbn_dist.convert_model(copy.deepcopy(plain))),
    }
    forwards = {
        name: torch.compile(model, mode=mode) if name.endswith("compiled") else model for name, model in models.items()
    }
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for name, m in models.items()}
    # float64: inductor reorders float64 sums, a few ulps carried through six steps; float32: as in the test above.
    tol = {"rtol": 1e-9, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    pairs = [("ours compiled", "ours"), ("ours", "plain"), ("plain compiled", "plain")]
    try:
        for step in range(6):
            x, y = _resnet_batch(step)
            x = x.to(dtype)
            results = {}
            for name, forward in forwards.items():
                if name.endswith("compiled"):
                    torch.compiler.cudagraph_mark_step_begin()
                results[name] = _sgd_step(forward, optimizers[name], x, y)
            for got, expected in pairs:
                for what, a, b in zip(("logits", "loss"), results[got], results[expected]):
                    assert_close(a.cpu(), b.cpu(), f"{mode} {dtype} step {step} {what}: {got} vs {expected}", **tol)
        assert all(layer.last_transport == "distributed" for layer in _synchronized_layers(models["ours compiled"]))
        for got, expected in pairs:
            state, expected_state = models[got].state_dict(), models[expected].state_dict()
            assert state.keys() == expected_state.keys()
            for key, value in state.items():
                what = f"{mode} {dtype} {got} vs {expected}: {key}"
                assert_close(value.cpu(), expected_state[key].cpu(), what, **tol)
    finally:
        torch._dynamo.reset()


def test_cuda_graph_capture_of_a_ddp_step_replays_the_eager_step(
    nccl_world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch.cuda.graph capture of a whole DDP training step (forward, loss, backward with DDP's gradient
    all_reduce, SGD step) of a converted ResNet with its layers forced onto the NCCL group:
    each replay on a new batch gives what the same step run eagerly gives (loss, then weights, running statistics
    and num_batches_tracked). torch's recipe for DDP (docs, "CUDA Graphs", "Usage with DistributedDataParallel"):
    DDP constructed on a side stream, 11 eager warm-up iterations on it before the capture."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)  # the same convolution sums on both sides
    base = resnet(seed=6).cuda().to(memory_format=torch.channels_last)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        captured = DistributedDataParallel(force_sync(syncbn_dist.convert_model(copy.deepcopy(base))), device_ids=[0])
    eager = DistributedDataParallel(force_sync(syncbn_dist.convert_model(copy.deepcopy(base))), device_ids=[0])
    optimizer = torch.optim.SGD(captured.parameters(), lr=0.1, momentum=0.9)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    static_x, static_y = _resnet_batch(0)
    with torch.cuda.stream(side):
        for step in range(11):
            x, y = _resnet_batch(step)
            static_x.copy_(x)
            static_y.copy_(y)
            _sgd_step(captured, optimizer, static_x, static_y)
            _sgd_step(eager, eager_optimizer, x, y)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = F.cross_entropy(captured(static_x), static_y)
        static_loss.backward()
        optimizer.step()
    losses = []
    for step in range(11, 14):
        x, y = _resnet_batch(step)
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        _, loss = _sgd_step(eager, eager_optimizer, x, y)
        # The same kernels on the same values: equal to float32 rounding (cuBLAS may choose another algorithm
        # inside a capture, whose workspace differs), O(1) values.
        assert_close(static_loss.cpu(), loss.cpu(), f"replay {step} loss", rtol=1e-5, atol=1e-6)
        losses.append(static_loss.item())
    assert len(set(losses)) == len(losses), losses  # each replay computed its own batch
    assert all(layer.last_transport == "distributed" for layer in _synchronized_layers(captured.module))
    state, eager_state = captured.module.state_dict(), eager.module.state_dict()
    for key, value in state.items():  # weights after 14 SGD steps, running statistics, num_batches_tracked: as above
        assert_close(value.cpu(), eager_state[key].cpu(), key, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------------------
# Across ranks on one GPU: NCCL refuses two ranks on one device, gloo reduces CUDA tensors. Two ranks, CUDA tensors on
# GPU 0, DDP, uneven and empty shards, syncbn_dist's layers and torch's patched class.
# ------------------------------------------------------------------------------------------------------------

# splits[step][rank]: the rows of the global batch each rank holds at that step, uneven and empty ones included.
GLOO_CUDA_SPLITS = [[5, 3], [6, 0], [0, 4], [2, 7]]


def _gloo_cuda_model(how: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """tests/conv_bn_model.py's network (conv - BatchNorm2d - ReLU - Linear - BatchNorm1d) synchronized ``how``, in
    float32 on GPU 0, and the same weights in float64 on the CPU with plain BatchNorm (the reference)."""
    reference = conv_bn_model.build().float().double()  # float32 values, which the model holds exactly
    if how == "convert_model":
        model = syncbn_dist.convert_model(copy.deepcopy(reference))
    elif how == "patch_sync_batchnorm":
        with syncbn_dist.patch_sync_batchnorm():  # nn.BatchNorm2d/1d construct syncbn_dist's classes
            model = conv_bn_model.build()
    else:  # "patch_torch_sync_batchnorm": torch's own class and converter, synchronizing through syncbn_dist
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(reference))
        assert type(model[1]) is torch.nn.SyncBatchNorm
    assert len(_synchronized_layers(model)) == 2, how
    return model.float().cuda(), reference


def _check_gloo_cuda_ddp(rank: int, world_size: int, how: str) -> int:
    """DDP over ``how``'s model for every step of :data:`GLOO_CUDA_SPLITS` against the reference on the whole batch:
    this rank's outputs and input gradients, the parameter gradients (DDP's average) and the running statistics.
    Returns the number of steps compared."""
    model, reference = _gloo_cuda_model(how)
    ddp = DistributedDataParallel(model, device_ids=[0])
    for step, split in enumerate(GLOO_CUDA_SPLITS):
        x, weights = conv_bn_model.batch(sum(split))
        x, weights = (x + 0.25 * step).float().double(), weights.float().double()  # a new batch; float32 values
        rows = slice(sum(split[:rank]), sum(split[: rank + 1]))
        x_rank = x[rows].float().cuda().requires_grad_()
        out = ddp(x_rank)
        # x world_size: DDP averages the parameter gradients, so they are those of the global sum.
        (out * weights[rows].float().cuda()).sum().mul(world_size).backward()
        x_all = x.clone().requires_grad_()
        expected = reference(x_all)
        (expected * weights).sum().backward()

        where = f"{how}, step {step}, split {split}"
        assert out.device.type == "cuda" and out.dtype == torch.float32, where
        # float32 on the GPU (TF32 off) against float64: O(1) values through a 1x1 convolution, BatchNorm2d, a Linear
        # of 16 inputs and BatchNorm1d, float32 rounding only. The same check on CPU tensors measured 4e-7 for outputs,
        # input gradients and running statistics, and 7e-6 for parameter gradients, which sum up to 36 products of
        # O(1-10) values per rank: allowed 1e-5 and 1e-4.
        tol = {"rtol": 1e-4, "atol": 1e-5}
        assert_close(out.detach().cpu(), expected[rows], f"{where}: output", **tol)
        assert_close(x_rank.grad.cpu() / world_size, x_all.grad[rows], f"{where}: grad_input", **tol)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert_close(p.grad.cpu(), q.grad, f"{where}: grad {name}", rtol=1e-4, atol=1e-4)
        for (name, b), c in zip(model.named_buffers(), reference.buffers()):
            assert_close(b.cpu(), c, f"{where}: {name}", **tol)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    assert [layer.last_transport for layer in _synchronized_layers(model)] == ["distributed"] * 2, how
    return len(GLOO_CUDA_SPLITS)


def _check_gloo_cuda_compiled_ddp(rank: int, world_size: int) -> int:
    """``torch.compile`` of the DDP model (inductor, Triton) on the non-empty steps of :data:`GLOO_CUDA_SPLITS`
    (inductor's convolution backward fails on an empty batch, with plain BatchNorm as well), against the reference as
    :func:`_check_gloo_cuda_ddp` checks it. Returns the number of steps compared."""
    model, reference = _gloo_cuda_model("convert_model")
    compiled = torch.compile(DistributedDataParallel(model, device_ids=[0]))
    splits = [split for split in GLOO_CUDA_SPLITS if 0 not in split]
    for step, split in enumerate(splits):
        x, weights = conv_bn_model.batch(sum(split))
        x, weights = (x + 0.25 * step).float().double(), weights.float().double()
        rows = slice(sum(split[:rank]), sum(split[: rank + 1]))
        x_rank = x[rows].float().cuda().requires_grad_()
        out = compiled(x_rank)
        (out * weights[rows].float().cuda()).sum().mul(world_size).backward()
        x_all = x.clone().requires_grad_()
        expected = reference(x_all)
        (expected * weights).sum().backward()
        where = f"compiled DDP, step {step}, split {split}"
        tol = {"rtol": 1e-4, "atol": 1e-5}  # as in _check_gloo_cuda_ddp
        assert_close(out.detach().cpu(), expected[rows], f"{where}: output", **tol)
        assert_close(x_rank.grad.cpu() / world_size, x_all.grad[rows], f"{where}: grad_input", **tol)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert_close(p.grad.cpu(), q.grad, f"{where}: grad {name}", rtol=1e-4, atol=1e-4)
        for (name, b), c in zip(model.named_buffers(), reference.buffers()):
            assert_close(b.cpu(), c, f"{where}: {name}", **tol)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    return len(splits)


def _worker_gloo_cuda(rank: int, world_size: int) -> dict[str, int]:
    assert dist.get_backend() == "gloo"
    torch.cuda.set_device(0)  # both ranks on one GPU: what gloo allows and NCCL refuses
    torch.backends.cudnn.allow_tf32 = False  # float32 convolutions and matmuls, compared with float64
    torch.backends.cuda.matmul.allow_tf32 = False
    done = {}
    for how in ("convert_model", "patch_sync_batchnorm"):
        done[how] = _check_gloo_cuda_ddp(rank, world_size, how)
    with syncbn_dist.patch_torch_sync_batchnorm():  # DDP too is built under the patch
        how = "patch_torch_sync_batchnorm"
        done[how] = _check_gloo_cuda_ddp(rank, world_size, how)
    done["compiled DDP"] = _check_gloo_cuda_compiled_ddp(rank, world_size)
    return done


@pytest.mark.distributed
def test_two_ranks_over_gloo_with_cuda_tensors_match_float64_batchnorm() -> None:
    """Two processes on GPU 0 over gloo: DDP with uneven and empty shards, through convert_model, the
    patch_sync_batchnorm block and torch's patched nn.SyncBatchNorm, each equal to float64 BatchNorm on the
    concatenated batch, then a user's compiled DDP model (Triton kernels, tens of seconds)."""
    # Fresh ranks: CUDA state (contexts, compiled Triton kernels) stays out of the pooled CPU worlds.
    results = run_distributed(
        _worker_gloo_cuda, 2, timeout=420, collective_timeout=180, backend="gloo", fresh=True
    )
    expected = {
        how: len(GLOO_CUDA_SPLITS) for how in ("convert_model", "patch_sync_batchnorm", "patch_torch_sync_batchnorm")
    }
    expected["compiled DDP"] = sum(0 not in split for split in GLOO_CUDA_SPLITS)
    assert results == [expected, expected]


def _worker_join_cuda(rank: int, world_size: int, counts: list[int], setup: dict[str, Any]) -> dict[str, Any]:
    torch.cuda.set_device(0)
    torch.backends.cudnn.allow_tf32 = False
    return test_join._train_uneven(rank, world_size, counts, {**setup, "device": "cuda"})


@pytest.mark.distributed
@pytest.mark.parametrize("counts", [[3, 5], [2, 0]])
def test_uneven_batch_counts_under_join_over_gloo_with_cuda_tensors(counts: list[int]) -> None:
    """tests/test_join.py's uneven epoch under ``Join([ddp_model])`` on CUDA tensors (two gloo processes on GPU 0), a
    rank with no batch included: every step equals float64 BatchNorm on the active ranks' union."""
    setup = {"ddp": True, "ddp_alone": True}
    results = run_distributed(_worker_join_cuda, 2, counts, setup, timeout=240, backend="gloo", fresh=True)
    test_join._assert_matches_reference(results, 2, counts, setup)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_readme_quick_start_runs_as_pasted_on_the_gpus(tmp_path: Path) -> None:
    """The README's quick start with one process per GPU, as its text says (nccl): on one GPU a world of one, whose
    layers have nothing to synchronize with ("local"); on several, NCCL across them ("distributed")."""
    blocks = readme_blocks()
    quick_start = blocks[: [block.kind for block in blocks].index("output") + 1]
    gpus = torch.cuda.device_count()
    launch, printed = quick_start[-2], quick_start[-1]
    assert "--nproc_per_node=2 " in launch.text and "2 processes, BatchNorm: distributed" in printed.text
    expected = f"{gpus} processes, BatchNorm: {'distributed' if gpus > 1 else 'local'}"
    quick_start[-2:] = [
        dataclasses.replace(launch, text=launch.text.replace("--nproc_per_node=2 ", f"--nproc_per_node={gpus} ")),
        dataclasses.replace(printed, text=printed.text.replace("2 processes, BatchNorm: distributed", expected)),
    ]
    (ran,) = run_blocks(quick_start, tmp_path, Path(sys.executable).parent, timeout=240)  # checks the output block
    assert f"on {expected}" in ran[1]


# ------------------------------------------------------------------------------------------------------------
# The collective tags on CUDA: checked on the device, read back later, never a host synchronization per layer
# ------------------------------------------------------------------------------------------------------------


def test_a_training_step_checks_its_tags_without_a_host_synchronization(nccl_world_of_one: None) -> None:
    """A converted ResNet forced onto the NCCL group (every layer tagged and checked, forward and backward): after two
    warm-up steps (the group's first-step gathers read the device), a training step under
    torch.cuda.set_sync_debug_mode("error") makes no synchronizing call, and the device-side check found nothing."""
    from syncbn_dist.comm.tags import _MONITORS, raise_pending_mismatch

    model = force_sync(syncbn_dist.convert_model(resnet(seed=3))).cuda().to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    for step in range(2):
        _sgd_step(model, optimizer, *_resnet_batch(step))
    x, y = _resnet_batch(2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.device("cuda", 0) in _MONITORS  # the tags were checked on the device
    raise_pending_mismatch()  # and every check so far passed


def test_a_tag_mismatch_on_cuda_is_raised_once_the_device_reports_it(nccl_world_of_one: None) -> None:
    """The sums of two members that sent different tags, as a CUDA collective leaves them: nothing is raised at the
    collective; raise_pending_mismatch (a later synchronized call, once the device has run it) names the tag."""
    from syncbn_dist.comm.tags import raise_pending_mismatch, tag_for

    mine, theirs = tag_for("heads.a", "forward", "layer 'heads.a'"), tag_for("heads.b", "forward", "layer 'heads.b'")
    summed = torch.tensor(mine.values, dtype=torch.float64) + torch.tensor(theirs.values, dtype=torch.float64)
    mine.verify(summed.cuda())
    with pytest.raises(syncbn_dist.LayerMismatchError, match="layer 'heads.a': forward"):
        raise_pending_mismatch()
    raise_pending_mismatch()  # reported once: the slots are cleared
