"""The kernel switch and the compiled kernels (syncbn_dist.kernels).

- The switch: ``set_kernels`` and ``SYNCBN_DIST_KERNELS`` accept only the three modes; "auto" without a C++
  compiler warns once, names why, and runs the native kernels (bit for bit); "compiled" raises instead.
- Threads meeting a new signature together compile it once, and their results are exact; DataParallel replicas run
  the native kernels in every mode.
- The default kernels are native: a DDP training step with nothing set compiles nothing (docs/compile.md, "The
  default kernels").
- Compilation does not grow with the layers or the batch: a DDP model (whose forward the kernels' first compilation
  runs in) and ResNet-50's 53 BatchNorm layers over three batch sizes, over gloo, compile one graph per direction,
  and every output and gradient equals float64 ``nn.BatchNorm`` on the global batch; under a user's
  ``torch.compile`` the kernels are not called.
- An inplace activation after the layer trains as on the native kernels (the output is not a view).
- eps is a constant of its compiled graph: a second eps compiles a second graph, the first is reused.

Exactness on every path is also asserted by the existing suites, parametrized over both kernel sets with the
``kernel_mode`` fixture (tests/conftest.py).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from closeness import assert_close
from torch import Tensor, nn

from launch.bench.micro import compiled_bytes_per_element
from launch.common.spawn import run_distributed
from syncbn_dist import (
    DataParallelWithCallback,
    SyncBatchNorm,
    SynchronizedBatchNorm2d,
    SynchronizedBatchNorm3d,
    convert_model,
    get_kernels,
    set_kernels,
    settings,
)
from syncbn_dist.comm.tags import layer_tags
from syncbn_dist.kernels import compiled as kernels

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture
def fresh_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """New compiled-kernel objects (nothing compiled yet in this process) and the mode taken from the environment."""
    monkeypatch.setattr(settings, "_mode", None)
    fresh = []
    for name, kernel in vars(kernels).copy().items():
        if isinstance(kernel, kernels._CompiledKernel):
            fresh.append(kernels._CompiledKernel(kernel.fn))
            monkeypatch.setattr(kernels, name, fresh[-1])
    monkeypatch.setattr(kernels, "COMPILED_KERNELS", tuple(fresh))


@pytest.mark.parametrize("bad", ["fast", "", None, "Compiled"])
def test_set_kernels_rejects_unknown_modes(bad: Any) -> None:
    with pytest.raises(ValueError, match="set_kernels: expected one of 'auto', 'compiled', 'native'"):
        set_kernels(bad)


def test_environment_selects_the_mode_and_set_kernels_overrides_it(
    monkeypatch: pytest.MonkeyPatch, fresh_kernels: None
) -> None:
    monkeypatch.setenv(kernels.KERNELS_ENV, "compiled")
    assert get_kernels() == "compiled"
    monkeypatch.setenv(kernels.KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="SYNCBN_DIST_KERNELS: expected one of"):
        get_kernels()
    set_kernels("native")
    assert get_kernels() == "native"


def test_auto_compiles_for_cpu_tensors_only(monkeypatch: pytest.MonkeyPatch, fresh_kernels: None) -> None:
    """"auto" takes the compiled kernels for a CPU tensor (a compiler is installed here) and the native ones, with no
    warning, for any other device (CUDA measured faster on native); "compiled" still refuses where inductor has no
    kernels for the device."""
    monkeypatch.setenv(kernels.KERNELS_ENV, "auto")
    assert kernels.use_compiled(torch.empty(4, 3, 2))
    meta = torch.empty(4, 3, 2, device="meta")  # a non-CPU device that exists on every machine
    with warnings_as_errors():
        assert not kernels.use_compiled(meta)
    set_kernels("compiled")
    with pytest.raises(RuntimeError, match="not built for meta tensors"):
        kernels.use_compiled(meta)


def _clip_layer_step(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One training step of a clip-mode layer with no peers: the compiled path's region with no collective."""
    layer = SyncBatchNorm(x.size(1))
    layer.eps_mode = "clip"
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(torch.linspace(-1.0, 1.0, out.numel()).view_as(out))
    return out.detach(), x.grad, layer.running_var


def test_auto_without_a_compiler_warns_once_and_runs_native(
    monkeypatch: pytest.MonkeyPatch, fresh_kernels: None
) -> None:
    x = torch.randn(6, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    monkeypatch.setenv(kernels.KERNELS_ENV, "native")
    native = _clip_layer_step(x)
    # inductor's own compiler search finds nothing: the real detection path, not a stub of it.
    no_compiler = torch._inductor.config.patch({"cpp.cxx": ("syncbn-dist-no-such-c++",)})
    no_compiler.__enter__()
    kernels._missing_compiler.cache_clear()
    kernels._warn_fallback.cache_clear()
    try:
        monkeypatch.setenv(kernels.KERNELS_ENV, "auto")
        with pytest.warns(RuntimeWarning, match="compiled batch-norm kernels unavailable .*no C\\+\\+ compiler"):
            fallback = _clip_layer_step(x)
        with warnings_as_errors():  # once per process, not once per call
            again = _clip_layer_step(x)
        for a, b, c in zip(native, fallback, again):
            assert torch.equal(a, b) and torch.equal(a, c)
        assert all(kernel.graphs() == 0 for kernel in kernels.COMPILED_KERNELS)  # the fixture's fresh ones
        monkeypatch.setenv(kernels.KERNELS_ENV, "compiled")
        with pytest.raises(RuntimeError, match="set_kernels\\('compiled'\\): inductor finds no C\\+\\+ compiler"):
            _clip_layer_step(x)
    finally:
        no_compiler.__exit__(None, None, None)
        kernels._missing_compiler.cache_clear()
        kernels._warn_fallback.cache_clear()


class warnings_as_errors:
    """``warnings.catch_warnings`` turning every warning into an error (a second fallback warning would fail)."""

    def __enter__(self) -> None:
        import warnings

        self._context = warnings.catch_warnings()
        self._context.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc: Any) -> None:
        self._context.__exit__(*exc)


_TAG = layer_tags("test", "test layer")[0]


def _statistics(x: Tensor, eps: float = 1e-5) -> tuple[Tensor, Tensor, Tensor]:
    """The compiled forward region of ``x`` alone (a group of one): its output, mean and biased variance."""
    out, mean, _, var, _, _ = kernels.layer_forward(x, None, None, eps, False, None, _TAG)
    return out, mean, var


def test_threads_compile_a_new_signature_once_and_agree(
    monkeypatch: pytest.MonkeyPatch, fresh_kernels: None
) -> None:
    """Four threads call the forward region on a new signature at once (a barrier releases them together)."""
    monkeypatch.setenv(kernels.KERNELS_ENV, "compiled")
    gen = torch.Generator().manual_seed(3)
    shards = [torch.randn(n, 5, 7, generator=gen) * 0.5 + 1e4 for n in (3, 2, 4, 5)]
    barrier = threading.Barrier(len(shards))
    results: list[Any] = [None] * len(shards)

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = _statistics(shards[i])
        except BaseException as error:  # noqa: BLE001 - reported below, with the thread's own traceback
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(shards))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    assert kernels._forward_region.graphs() == 1
    for shard, (_, mean, var) in zip(shards, results):
        x = shard.double()
        # float64 sums of float32 values about a shift, rounded once to float32 statistics.
        assert_close(mean, x.mean([0, 2]), "mean", rtol=1e-7, atol=0.0)
        assert_close(var, x.var([0, 2], correction=0), "variance", rtol=1e-6, atol=0.0)


def test_an_inplace_activation_after_the_layer_trains_as_on_the_native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled output is a tensor of its own, not a view (autograd forbids modifying a view made inside a custom
    Function in place): conv -> layer -> ReLU(inplace=True), on the region path (clip mode, no peers), equals the
    native kernels' step."""
    results = []
    for mode in ("native", "compiled"):
        monkeypatch.setenv(kernels.KERNELS_ENV, mode)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), SyncBatchNorm(4), nn.ReLU(inplace=True))
        model[1].eps_mode = "clip"
        x = torch.randn(6, 3, 7, 7, generator=torch.Generator().manual_seed(1))
        model(x).square().sum().backward()
        results.append([model[0].weight.grad, model[1].weight.grad, model[1].running_var])
    for native, compiled, what in zip(*results, ["conv weight grad", "layer weight grad", "running_var"]):
        # Two float32 kernel sets summing in different orders: the conv weight gradient sums 150 products of O(1)
        # terms per element, a few ulps of which reach 1e-5; the running variance is float64 sums rounded once.
        assert_close(compiled, native, what, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ndim", [4, 5])
def test_replicas_in_compiled_mode_compile_nothing_keep_channels_last_and_equal_float64_batchnorm(
    ndim: int, monkeypatch: pytest.MonkeyPatch, fresh_kernels: None
) -> None:
    """DataParallel replicas run the native kernels in every mode (no step figure justified compiled ones there):
    nothing compiles, outputs and input gradients keep the channels-last layout, with global-batch values."""
    monkeypatch.setenv(kernels.KERNELS_ENV, "compiled")
    fmt = torch.channels_last if ndim == 4 else torch.channels_last_3d
    layer = (SynchronizedBatchNorm2d if ndim == 4 else SynchronizedBatchNorm3d)(3)
    reference = (nn.BatchNorm2d if ndim == 4 else nn.BatchNorm3d)(3, dtype=torch.float64)
    gen = torch.Generator().manual_seed(5)
    x_global = (torch.randn(7, 3, *[4] * (ndim - 2), generator=gen) * 3.0 + 1e3).double()
    dy_global = torch.randn(x_global.shape, generator=gen, dtype=torch.float64)
    parallel = DataParallelWithCallback(layer, cpu_replicas=2)
    x = x_global.float().contiguous(memory_format=fmt).requires_grad_()
    out = parallel(x)
    out.backward(dy_global.float().contiguous(memory_format=fmt))
    x_ref = x_global.clone().requires_grad_()
    reference(x_ref).backward(dy_global)
    assert all(kernel.graphs() == 0 for kernel in kernels.COMPILED_KERNELS)  # the fixture's fresh ones
    assert out.is_contiguous(memory_format=fmt) and x.grad.is_contiguous(memory_format=fmt)
    # |x| / std ~ 330: the float32 input and mean are 2^-24 * 330 off in normalized units, times a few roundings.
    assert_close(out, F.batch_norm(x_global, None, None, training=True), "output", rtol=0.0, atol=1e-4)
    assert_close(x.grad, x_ref.grad, "grad_input", rtol=0.0, atol=1e-4)
    assert_close(layer.running_var, reference.running_var, "running_var", rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_compiled_kernels_access_each_activation_element_8_times(dtype: torch.dtype, channels_last: bool) -> None:
    """Inductor's count of the bytes one layer's forward + backward kernels access (a fresh compilation, the same
    function make bench reports as K3), per element: 8 accesses of activation-sized buffers (x; x, y; dy, x; dy, x,
    dx), plus the per-channel tensors, which at (16, 32, 32, 32) are under 1% of it.

    Two fusions keep it at 8. The shift x[0, :, 0] is a graph output (channels_last's second stage of the sums
    reloaded it from x, which inductor counts as a pass: 9); sum(dy) is taken of dy * ones for bfloat16 (alone,
    inductor flattened it to (N * C, L) and read dy twice: 10)."""
    x = torch.randn(16, 32, 32, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    accessed = compiled_bytes_per_element(x)
    assert accessed.activation == 8 * x.element_size(), accessed
    assert accessed.activation < accessed.total <= 1.01 * accessed.activation, accessed


def test_half_precision_statistics_are_float32_exact_at_a_large_mean_and_a_long_row(
    fresh_kernels: None,
) -> None:
    """float16/bfloat16 input sums each sample's values in float32 and the samples in float64: at L = 2**19 values
    per sample and |mean| / std = 100 the mean and variance stay within 1e-6 of float64, far inside the input's own
    rounding (2**-11 for float16)."""
    gen = torch.Generator().manual_seed(6)
    for dtype in (torch.float16, torch.bfloat16):
        x = (torch.randn(3, 2, 1 << 19, generator=gen) + 100.0).to(dtype)
        _, mean, var = _statistics(x)
        exact = x.double()
        assert_close(mean, exact.mean([0, 2]), f"{dtype} mean", rtol=1e-6, atol=0.0)
        # var is 1e-4 of mean**2: the float64 subtraction keeps it; the float32 row sums give ~1e-7 of it.
        assert_close(var, exact.var([0, 2], correction=0), f"{dtype} variance", rtol=1e-6, atol=0.0)


def test_sizes_equal_at_the_first_call_do_not_recompile_later_ones(
    monkeypatch: pytest.MonkeyPatch, fresh_kernels: None
) -> None:
    """A first call whose batch equals its channels (N = C = 3): without its own symbol for each size, every later
    batch size would recompile the graph, until Dynamo's recompile limit (8) fails the call."""
    monkeypatch.setenv(kernels.KERNELS_ENV, "compiled")
    gen = torch.Generator().manual_seed(4)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for batch in [3, *range(4, 16)]:
        x = torch.randn(batch, 3, 5, generator=gen)
        # float64 sums of float32 values about a shift, rounded once to the float32 mean.
        assert_close(_statistics(x)[1], x.double().mean([0, 2]), f"mean, batch {batch}", rtol=0.0, atol=1e-7)
    assert kernels._forward_region.graphs() == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1


def test_eps_is_a_constant_of_its_graph(monkeypatch: pytest.MonkeyPatch, fresh_kernels: None) -> None:
    """eps is compiled into the graph rather than passed as a symbolic float (a tensor made every call): a layer with
    another eps gets a graph of its own, the first eps's graph is reused, and each normalizes by its own eps."""
    monkeypatch.setenv(kernels.KERNELS_ENV, "compiled")
    x = torch.randn(6, 3, 5, generator=torch.Generator().manual_seed(5)) * 0.01  # var ~ 1e-4: eps shows
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for eps in (1e-5, 1e-3, 1e-5):
        expected = F.batch_norm(x.double(), None, None, training=True, eps=eps)
        assert_close(_statistics(x, eps)[0], expected, f"eps {eps}", rtol=0.0, atol=1e-5)
    assert kernels._forward_region.graphs() == 2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2


# ResNet-50's BatchNorm layers (torchvision's resnet50: the stem, then 3, 4, 6, 3 bottlenecks of
# (width, width, 4 * width) with a downsample BatchNorm in each stage's first block) at a 64 x 64 input.
def _resnet50_batchnorm_shapes() -> list[tuple[int, int]]:
    shapes = [(64, 32)]
    for blocks, width, size in [(3, 64, 16), (4, 128, 8), (6, 256, 4), (3, 512, 2)]:
        for block in range(blocks):
            shapes += [(width, size), (width, size), (4 * width, size)]
            if block == 0:
                shapes.append((4 * width, size))
    return shapes


_BATCHES = [[2, 3], [3, 0], [4, 5]]  # per rank, three global batch sizes, one with an empty rank


def _first_compile_inside_ddp(rank: int) -> None:
    """The kernels' first compilation happens inside a DistributedDataParallel forward (small buckets, as a real
    model's), which Dynamo would otherwise take for the DDP model's own and split at the buckets."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), SynchronizedBatchNorm2d(8), nn.Conv2d(8, 8, 3), SynchronizedBatchNorm2d(8)
    )
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
    ddp(torch.randn(3 + rank, 3, 9, 9)).sum().backward()


def _default_first_step(rank: int) -> dict[str, Any]:
    """One DDP training step of a converted model with nothing set (``SYNCBN_DIST_KERNELS`` unset, no set_kernels):
    the mode in force, what compiled (syncbn_dist's kernels, Dynamo frames, on any thread) and the transport."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 7 * 7, 3))
    ddp = nn.parallel.DistributedDataParallel(convert_model(model))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    F.cross_entropy(ddp(torch.randn(4, 3, 9, 9, generator=gen)), torch.randint(0, 3, (4,), generator=gen)).backward()
    optimizer.step()
    return {
        "mode": get_kernels(),
        "graphs": sum(kernel.graphs() for kernel in kernels.COMPILED_KERNELS),
        "frames": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "transport": ddp.module[1].last_transport,
    }


def _worker_resnet50_compile_count(rank: int, world_size: int) -> dict[str, Any]:
    default = _default_first_step(rank)
    set_kernels("compiled")
    _first_compile_inside_ddp(rank)
    before = {kernel.fn.__name__: kernel.graphs() for kernel in kernels.COMPILED_KERNELS}
    assert before["forward_region"] == 1 and before["backward_region"] == 1, before
    shapes = _resnet50_batchnorm_shapes()
    layers = [SynchronizedBatchNorm2d(c) for c, _ in shapes]
    references = [nn.BatchNorm2d(c, dtype=torch.float64) for c, _ in shapes]
    worst = 0.0
    for step, split in enumerate(_BATCHES):
        for index, ((c, size), layer, reference) in enumerate(zip(shapes, layers, references)):
            gen = torch.Generator().manual_seed(1000 * step + index)
            x_global = (torch.randn(sum(split), c, size, size, generator=gen) * 2.0 + 3.0).double()
            dy_global = torch.randn(x_global.shape, generator=gen, dtype=torch.float64)
            rows = slice(sum(split[:rank]), sum(split[: rank + 1]))
            x = x_global[rows].float().requires_grad_()
            out = layer(x)
            out.backward(dy_global[rows].float())
            x_ref = x_global.clone().requires_grad_()
            reference(x_ref).backward(dy_global)
            expected_out = F.batch_norm(x_global, None, None, training=True)
            # float32 rounding of centred data with |x|/std ~ 4: a few units of 2^-24 in the normalized values.
            assert_close(out, expected_out[rows], f"layer {index} output", rtol=0.0, atol=1e-5)
            assert_close(x.grad, x_ref.grad[rows], f"layer {index} grad_input", rtol=0.0, atol=1e-5)
            assert_close(layer.running_var, reference.running_var, f"layer {index} running_var", rtol=1e-6, atol=0.0)
            worst = max(worst, (out.double() - expected_out[rows]).abs().max().item() if out.numel() else 0.0)
    graphs = {kernel.fn.__name__: kernel.graphs() for kernel in kernels.COMPILED_KERNELS}
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    # Under a user's torch.compile the layer's ops are traced into the user's graph: the kernels are not called.
    model = torch.compile(nn.Sequential(nn.Conv2d(3, 4, 3), SynchronizedBatchNorm2d(4)), backend="aot_eager")
    model(torch.randn(3, 3, 6, 6)).sum().backward()
    after = {kernel.fn.__name__: kernel.graphs() for kernel in kernels.COMPILED_KERNELS}
    return {
        "layers": len(shapes), "graphs": graphs, "frames": frames, "after_user_compile": after, "worst": worst,
        "default": default,
    }


@pytest.mark.slow
def test_resnet50_layers_over_three_batch_sizes_compile_one_graph_per_direction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A training step with the default kernels compiles nothing; then, on the compiled kernels, the first graphs are
    compiled inside a DDP forward and the 53 layers at 3 batch sizes reuse them."""
    # Fresh ranks: the first compilations of a process, and its Dynamo frame count, are what is counted. They start
    # with SYNCBN_DIST_KERNELS unset (the suite sets it to native): the default a user gets.
    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    results = run_distributed(_worker_resnet50_compile_count, 2, timeout=300, fresh=True)
    for result in results:
        # The default is native: a short job's first step pays no compilation, on this thread or any other.
        assert result["default"] == {"mode": "native", "graphs": 0, "frames": 0, "transport": "distributed"}
        assert result["layers"] == 53
        assert result["graphs"] == {"forward_region": 1, "backward_region": 1}
        assert result["frames"] == 2  # Dynamo compiled two frames in all: no recompilation either
        assert result["after_user_compile"] == result["graphs"]
