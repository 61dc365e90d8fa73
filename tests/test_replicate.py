"""Tests of the DataParallel path (syncbn_dist.integrations.data_parallel, syncbn_dist.comm.replica): replicas
synchronized by the master/slave exchange.

On CPU the replicas run in threads: either built by hand with ``_replicate_on_cpu`` (shallow copies that alias
the original parameters and buffers, as nn.DataParallel's do), so that each replica's share of the batch is an
exact split we choose (uneven and empty included), or through the public ``DataParallelWithCallback(...,
cpu_replicas=N)``. The reference is always ``nn.BatchNorm`` in float64 on the concatenated batch (the same
float32-rounded values, promoted): outputs, input gradients, parameter gradients, running statistics and
num_batches_tracked after several steps. The hierarchical case (processes x thread replicas) uses real gloo
process groups; GPU tests run the real nn.DataParallel replicate/parallel_apply over CUDA devices.

Tests that must end through the abort path give the replicas a 600 s exchange timeout (``LONG``), far beyond
their pytest-timeout, so only a working abort lets them finish.
"""

from __future__ import annotations

import copy
import functools
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import syncbn_dist
from launch.common.spawn import run_distributed
from syncbn_dist import (
    DataParallelWithCallback,
    SyncBatchNorm,
    SynchronizedBatchNorm1d,
    SynchronizedBatchNorm2d,
    SynchronizedBatchNorm3d,
    convert_model,
    execute_replication_callbacks,
    patch_replication_callback,
)
from syncbn_dist.comm import run_replicas_in_threads
from syncbn_dist.integrations.data_parallel import _abort_exchanges, _replicate_on_cpu

# An exchange timeout that only an abort can beat within a test's pytest-timeout.
LONG = 600.0
C = 3

# name -> (synchronized class, reference class, input shape after (N, C))
LAYOUTS: dict[str, tuple[type[SyncBatchNorm], type[nn.Module], tuple[int, ...]]] = {
    "1d-2D": (SynchronizedBatchNorm1d, nn.BatchNorm1d, ()),
    "1d-3D": (SynchronizedBatchNorm1d, nn.BatchNorm1d, (4,)),
    "2d": (SynchronizedBatchNorm2d, nn.BatchNorm2d, (3, 2)),
    "3d": (SynchronizedBatchNorm3d, nn.BatchNorm3d, (2, 2, 2)),
}

# Per-replica batch sizes; replica 0 is the master.
SPLITS: dict[str, list[int]] = {
    "2-even": [4, 4],
    "2-uneven": [5, 2],
    "3-uneven": [3, 5, 2],
    "3-empty-slave": [4, 0, 3],
    "3-empty-master": [0, 3, 4],
    "4-even": [2, 2, 2, 2],
    "4-uneven-empty": [1, 3, 0, 4],
}

CONFIGS: dict[str, dict[str, Any]] = {
    "default": dict(affine=True, track_running_stats=True, momentum=0.1),
    "no-affine": dict(affine=False, track_running_stats=True, momentum=0.1),
    "no-running-stats": dict(affine=True, track_running_stats=False, momentum=0.1),
    "cumulative": dict(affine=True, track_running_stats=True, momentum=None),
}

F32_ULP = 2.0**-24


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _data(batch: int, tail: Sequence[int], *, mean: float = 0.0, seed: int = 0) -> Tensor:
    """Float32 data (std 1, per-channel means around ``mean`` with alternating sign), as float64 values.

    The values are rounded to float32 once, so the float32 module and the float64 reference see the same data.
    """
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([mean * (1.0 + 0.1 * c) * (-1) ** c for c in range(C)], dtype=torch.float64)
    x = torch.randn(batch, C, *tail, generator=gen, dtype=torch.float64) + offsets.view(1, C, *[1] * len(tail))
    return x.float().double()


def _pair(layout: str, **config: Any) -> tuple[SyncBatchNorm, nn.Module]:
    """A float32 synchronized layer and a float64 reference with equal parameters and running stats."""
    sync_cls, ref_cls, _ = LAYOUTS[layout]
    sync = sync_cls(C, **config)
    sync.replica_timeout = LONG
    ref = ref_cls(C, dtype=torch.float64, **config)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        if sync.affine:
            sync.weight.copy_(torch.rand(C, generator=gen) + 0.5)
            sync.bias.copy_(torch.randn(C, generator=gen))
            ref.weight.copy_(sync.weight)
            ref.bias.copy_(sync.bias)
        if sync.track_running_stats:
            sync.running_mean.copy_(torch.randn(C, generator=gen))
            sync.running_var.copy_(torch.rand(C, generator=gen) + 0.5)
            ref.running_mean.copy_(sync.running_mean)
            ref.running_var.copy_(sync.running_var)
    return sync, ref


def _replicas(module: nn.Module, num_replicas: int) -> list[nn.Module]:
    replicas = _replicate_on_cpu(module, num_replicas)
    execute_replication_callbacks(replicas)
    return replicas


def _run_replicas(replicas: Sequence[nn.Module], parts: Sequence[Tensor]) -> list[Any]:
    """Run replica i on parts[i] in threads, waking the peers if one raises (as DataParallelWithCallback does)."""
    return run_replicas_in_threads(
        replicas, [(p,) for p in parts], [{}] * len(parts), functools.partial(_abort_exchanges, replicas)
    )


def _assert_state_close(sync: nn.Module, ref: nn.Module, *, rtol: float, atol: float) -> None:
    """Running statistics and num_batches_tracked of every layer (float32 buffers vs float64 reference)."""
    sync_state, ref_state = sync.state_dict(), ref.state_dict()
    assert sync_state.keys() == ref_state.keys()
    for key, value in sync_state.items():
        if key.endswith("num_batches_tracked"):
            assert value.item() == ref_state[key].item(), key
        elif "running" in key:
            torch.testing.assert_close(value.double().cpu(), ref_state[key].cpu(), rtol=rtol, atol=atol, msg=key)


def _live_threads_since(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.is_alive()]


# ------------------------------------------------------------------------------------------------------------
# execute_replication_callbacks
# ------------------------------------------------------------------------------------------------------------


class _CallbackLog(nn.Module):
    """Logs (its position tag, ctx, copy_id) of every replication callback into a list shared by all copies."""

    def __init__(self, tag: str, log: list[tuple[str, Any, int]]) -> None:
        super().__init__()
        self.tag = tag
        self.log = log

    def __data_parallel_replicate__(self, ctx: Any, copy_id: int) -> None:
        self.log.append((self.tag, ctx, copy_id))


def test_execute_replication_callbacks_shares_one_context_per_position_master_first() -> None:
    log: list[tuple[str, Any, int]] = []
    model = nn.Sequential(_CallbackLog("a", log), nn.Sequential(nn.ReLU(), _CallbackLog("b", log)))
    execute_replication_callbacks(_replicate_on_cpu(model, 3))
    assert [(tag, copy_id) for tag, _, copy_id in log] == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    contexts = {tag: {id(ctx) for t, ctx, _ in log if t == tag} for tag in "ab"}
    assert len(contexts["a"]) == len(contexts["b"]) == 1 and contexts["a"] != contexts["b"]
    execute_replication_callbacks([])  # nothing to do


def test_execute_replication_callbacks_rejects_structurally_different_replicas() -> None:
    with pytest.raises(ValueError, match=r"structurally identical replicas \(got submodule counts \[2, 3\]\)"):
        execute_replication_callbacks([nn.Sequential(nn.ReLU()), nn.Sequential(nn.ReLU(), nn.ReLU())])


# ------------------------------------------------------------------------------------------------------------
# Hand-built replicas with exact splits
# ------------------------------------------------------------------------------------------------------------


def _check_replica_steps(
    sync: SyncBatchNorm,
    ref: nn.Module,
    splits: Sequence[int],
    tail: Sequence[int],
    *,
    steps: int,
    mean: float = 0.0,
    data_scale: float = 1.0,
) -> None:
    """Train ``steps`` steps through replicas split as ``splits`` and compare each one with ``ref``.

    ``data_scale`` is |mean| / std: float32 rounding of the data limits outputs and gradients to about
    ``data_scale * 2**-24`` absolute, so their tolerances scale with it (1 for ordinary data).
    """
    ulp = max(data_scale, 1.0) * F32_ULP
    for step in range(steps):
        x = _data(sum(splits), tail, mean=mean, seed=step)
        grad = _data(sum(splits), tail, seed=100 + step)
        parts = [p.float().requires_grad_() for p in x.split(list(splits))]
        sync.zero_grad(set_to_none=True)
        out = torch.cat(_run_replicas(_replicas(sync, len(splits)), parts))
        out.backward(grad.float())

        x_ref = x.clone().requires_grad_()
        ref.zero_grad(set_to_none=True)
        out_ref = ref(x_ref)
        out_ref.backward(grad)

        assert sync.last_transport == "dataparallel"  # read on the original module
        # Outputs and input grads are O(1): float32 rounding of a few operations, scaled by |mean| / std.
        torch.testing.assert_close(out.double(), out_ref.detach(), rtol=1e-5, atol=16 * ulp + 1e-6)
        grad_input = torch.cat([p.grad for p in parts])
        torch.testing.assert_close(grad_input.double(), x_ref.grad, rtol=1e-5, atol=16 * ulp + 1e-6)
        if sync.affine:
            # Sums of `count` O(1) terms, each off by float32 rounding: a random walk of sqrt(count) steps.
            count = x.numel() // C
            atol = 16 * count**0.5 * ulp + 1e-6
            # The gradients landed in the ORIGINAL parameters (replicas alias them), summed over replicas.
            torch.testing.assert_close(sync.weight.grad.double(), ref.weight.grad, rtol=1e-5, atol=atol)
            torch.testing.assert_close(sync.bias.grad.double(), ref.bias.grad, rtol=1e-5, atol=atol)
        if sync.track_running_stats:
            # Running stats live in the original's float32 buffers: float32 rounding of each update. At
            # |mean| / std = 1e4 the variance must still be right to 1e-6 relative (statistics in float64).
            torch.testing.assert_close(sync.running_mean.double(), ref.running_mean, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(sync.running_var.double(), ref.running_var, rtol=1e-6, atol=0.0)
            # Updated once per forward (by the master only), not once per replica.
            assert sync.num_batches_tracked.item() == ref.num_batches_tracked.item() == step + 1
        else:
            assert sync.running_mean is None and sync.running_var is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("splits", list(SPLITS))
def test_replicas_match_batchnorm_on_the_concatenated_batch(
    splits: str, layout: str, config: str
) -> None:
    sync, ref = _pair(layout, **CONFIGS[config])
    _check_replica_steps(sync, ref, SPLITS[splits], LAYOUTS[layout][2], steps=3, mean=0.5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("data_scale", [1e3, 1e4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("splits", ["3-uneven", "4-uneven-empty"])
def test_replicas_large_mean_keep_running_var_to_1e_6(
    splits: str, layout: str, data_scale: float, momentum: float | None
) -> None:
    sync, ref = _pair(layout, momentum=momentum)
    _check_replica_steps(sync, ref, SPLITS[splits], LAYOUTS[layout][2], steps=2, mean=data_scale, data_scale=data_scale)


def test_a_single_replica_is_local_and_matches_batchnorm() -> None:
    sync, ref = _pair("2d")
    x = _data(5, (3, 2))
    (out,) = _run_replicas(_replicas(sync, 1), [x.float()])
    assert sync.last_transport == "local"  # no peers, no exchange
    # Plain float32 batch norm on O(1) data.
    torch.testing.assert_close(out.double(), ref(x).detach(), rtol=1e-5, atol=1e-5)
    _assert_state_close(sync, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("splits", [[1, 0], [0, 1], [1, 0, 0], [0, 0, 1]])
@pytest.mark.parametrize("layout", ["1d-2D", "1d-3D"])
def test_global_count_of_one_raises_value_error_in_the_caller(splits: list[int], layout: str) -> None:
    tail = (1,) if layout == "1d-3D" else ()  # one value per channel in total
    sync, _ = _pair(layout)
    parts = [p.float() for p in _data(sum(splits), tail).split(splits)]
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        _run_replicas(_replicas(sync, len(splits)), parts)
    assert not _live_threads_since(before)


# ------------------------------------------------------------------------------------------------------------
# Eval mode: no exchange at all
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("absent", [0, 2])
@pytest.mark.parametrize("track_running_stats", [True, False])
def test_eval_mode_never_exchanges(track_running_stats: bool, absent: int) -> None:
    sync, ref = _pair("2d", track_running_stats=track_running_stats)
    if track_running_stats:
        _check_replica_steps(sync, ref, [3, 4, 2], (3, 2), steps=1)  # non-trivial running statistics
    sync.eval()
    ref.eval()
    # A wrongly synchronizing eval would wait for the absent replica and fail with ReplicaSyncError after this.
    sync.replica_timeout = 5.0
    replicas = _replicas(sync, 3)
    present = [i for i in range(3) if i != absent]  # one replica never runs
    x = _data(7, (3, 2), mean=0.5, seed=7)
    parts = [p.float() for p in x.split([4, 3])]
    outputs = _run_replicas([replicas[i] for i in present], parts)
    assert sync.last_transport == "local"
    for out, part in zip(outputs, parts):
        # nn.BatchNorm in eval: running statistics, or with track_running_stats=False this replica's own batch.
        torch.testing.assert_close(out.double(), ref(part.double()).detach(), rtol=1e-5, atol=1e-5)
    if track_running_stats:
        assert sync.num_batches_tracked.item() == 1  # eval does not count batches


# ------------------------------------------------------------------------------------------------------------
# A failing replica: the caller gets the error at once and no thread stays blocked
# ------------------------------------------------------------------------------------------------------------


class _FailOnCopy(nn.Module):
    """Identity, except on the replica whose copy_id (learned from the replication callback) is ``fail_on``."""

    def __init__(self, fail_on: int | None) -> None:
        super().__init__()
        self.fail_on = fail_on
        self.copy_id: int | None = None

    def __data_parallel_replicate__(self, ctx: Any, copy_id: int) -> None:
        self.copy_id = copy_id

    def forward(self, x: Tensor) -> Tensor:
        if self.copy_id is not None and self.copy_id == self.fail_on:
            raise RuntimeError(f"replica {self.copy_id} failed on purpose")
        return x


def _failing_model(where: str, fail_on: int) -> nn.Sequential:
    """A model whose replica ``fail_on`` raises before every synchronized layer, or between two of them."""
    if where == "before":
        model = nn.Sequential(_FailOnCopy(fail_on), SynchronizedBatchNorm2d(C))
    else:
        model = nn.Sequential(SynchronizedBatchNorm2d(C), _FailOnCopy(fail_on), SynchronizedBatchNorm2d(C))
    for module in model.modules():
        if isinstance(module, SyncBatchNorm):
            module.replica_timeout = LONG
    return model


def _reference_of(model: nn.Module) -> nn.Module:
    """A float64 copy of ``model`` with plain BatchNorm layers (same parameters and running stats)."""
    return syncbn_dist.revert_model(copy.deepcopy(model)).double()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fail_on", [0, 1, 2])
@pytest.mark.parametrize("where", ["before", "between"])
def test_failing_replica_raises_in_the_caller_and_wakes_the_peers(where: str, fail_on: int) -> None:
    model = _failing_model(where, fail_on)
    x = _data(9, (2, 2), mean=0.5)
    parts = [p.float() for p in x.split([3, 4, 2])]
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match=f"replica {fail_on} failed on purpose"):
        _run_replicas(_replicas(model, 3), parts)  # the root cause, not a peer's ReplicaSyncError
    assert not _live_threads_since(before)

    # The next replication starts clean.
    model[-2 if where == "between" else 0].fail_on = None
    reference = _reference_of(model)
    out = torch.cat(_run_replicas(_replicas(model, 3), parts))
    # O(1) float32 outputs through one or two normalizations.
    torch.testing.assert_close(out.double(), reference(x).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [0, 1])
def test_bad_input_shape_on_one_replica_raises_in_the_caller(bad: int) -> None:
    model = nn.Sequential(SynchronizedBatchNorm2d(C), nn.ReLU(), SynchronizedBatchNorm2d(C))
    for module in model.modules():
        if isinstance(module, SyncBatchNorm):
            module.replica_timeout = LONG
    parts = [p.float() for p in _data(6, (2, 2)).split([3, 3])]
    parts[bad] = torch.randn(3, C + 1, 2, 2)
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match=f"expected input with {C} channels"):
        _run_replicas(_replicas(model, 2), parts)
    assert not _live_threads_since(before)


# ------------------------------------------------------------------------------------------------------------
# DataParallelWithCallback(cpu_replicas=N): the public CPU path
# ------------------------------------------------------------------------------------------------------------


class _CopyRecorder(nn.Module):
    """Identity that logs (copy_id, batch size along ``dim``) of every replica that runs (list shared by copies)."""

    def __init__(self, dim: int = 0) -> None:
        super().__init__()
        self.dim = dim
        self.log: list[tuple[int | None, int]] = []
        self.copy_id: int | None = None

    def __data_parallel_replicate__(self, ctx: Any, copy_id: int) -> None:
        self.copy_id = copy_id

    def forward(self, x: Tensor) -> Tensor:
        self.log.append((self.copy_id, x.shape[self.dim]))
        return x


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 4), nn.BatchNorm1d(4))


def _convnet() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4, momentum=None),
        nn.ReLU(),
        nn.Conv2d(4, 3, 1),
        nn.BatchNorm2d(3),
        nn.Flatten(),
        nn.Linear(3 * 3 * 3, 2),
    )


def _sync_and_reference(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(convert_model of a float32 copy, float64 copy with nn.BatchNorm): equal parameters and buffers."""
    reference = copy.deepcopy(model).double()
    sync = convert_model(copy.deepcopy(model))
    for module in sync.modules():
        if isinstance(module, SyncBatchNorm):
            module.replica_timeout = LONG
    return sync, reference


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cpu_replicas", [2, 3, 4])
@pytest.mark.parametrize("net", ["mlp", "convnet"])
def test_data_parallel_with_callback_sgd_steps_equal_single_process_batchnorm(
    net: str, cpu_replicas: int
) -> None:
    model = _mlp() if net == "mlp" else _convnet()
    in_shape = (5,) if net == "mlp" else (2, 3, 3)
    sync, reference = _sync_and_reference(model)
    parallel = DataParallelWithCallback(sync, cpu_replicas=cpu_replicas)
    opt = torch.optim.SGD(sync.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        batch = 9 + step  # 9, 10, 11 rows: uneven chunks (and 4 replicas of 9 rows use only 3)
        x = torch.randn(batch, *in_shape, generator=gen)
        target = torch.randn(batch, model[-1].weight.shape[0], generator=gen)
        loss = nn.functional.mse_loss(parallel(x), target)
        loss_ref = nn.functional.mse_loss(reference(x.double()), target.double())
        opt.zero_grad()
        opt_ref.zero_grad()
        loss.backward()
        loss_ref.backward()
        opt.step()
        opt_ref.step()
        # Float32 training of a small net for a few steps: a few float32 ulps of O(1) values.
        torch.testing.assert_close(loss.double(), loss_ref.detach(), rtol=1e-5, atol=1e-6)
        for (name, param), param_ref in zip(sync.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.double(), param_ref.detach(), rtol=1e-5, atol=1e-5, msg=name)
        _assert_state_close(sync, reference, rtol=1e-5, atol=1e-5)
    layers = [m for m in sync.modules() if isinstance(m, SyncBatchNorm)]
    assert [m.last_transport for m in layers] == ["dataparallel"] * len(layers)


@pytest.mark.timeout(60)
def test_data_parallel_with_callback_scatters_along_dim_1() -> None:
    class BatchSecond(nn.Module):
        """(L, N, C) sequence-first input, normalized over N and L."""

        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(C)

        def forward(self, x: Tensor) -> Tensor:
            return self.bn(x.permute(1, 2, 0)).permute(2, 0, 1)

    sync, reference = _sync_and_reference(BatchSecond())
    recorder = _CopyRecorder(dim=1)
    parallel = DataParallelWithCallback(nn.Sequential(recorder, sync), dim=1, cpu_replicas=3)
    x = _data(7, (4,), mean=0.5).permute(2, 0, 1).contiguous()  # (L=4, N=7, C)
    out = parallel(x.float())
    # O(1) float32 outputs of one normalization.
    torch.testing.assert_close(out.double(), reference(x).detach(), rtol=1e-5, atol=1e-5)
    assert sorted(recorder.log) == [(0, 3), (1, 3), (2, 1)]  # chunks of dim 1, as nn.DataParallel's scatter
    assert sync.bn.last_transport == "dataparallel"
    _assert_state_close(sync, reference, rtol=1e-6, atol=1e-6)


class _KwargsAndTuple(nn.Module):
    """forward(x, shift=..., factor=...) -> (normalized, {"mean": per-row mean}): kwargs in, a tuple out."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(C)

    def forward(self, x: Tensor, shift: Tensor | None = None, factor: float = 1.0) -> tuple[Tensor, dict[str, Tensor]]:
        y = self.bn(x if shift is None else x + shift) * factor
        return y, {"mean": y.mean(dim=(1, 2, 3))}


@pytest.mark.timeout(60)
def test_data_parallel_with_callback_kwargs_and_tuple_outputs() -> None:
    sync, reference = _sync_and_reference(_KwargsAndTuple())
    parallel = DataParallelWithCallback(sync, cpu_replicas=3)
    x = _data(8, (2, 2), mean=0.5)
    shift = _data(8, (2, 2), seed=3)  # a tensor kwarg is scattered with the input; a float is repeated
    y, extra = parallel(x.float(), shift=shift.float(), factor=2.5)
    y_ref, extra_ref = reference(x, shift=shift, factor=2.5)
    assert isinstance(extra, dict) and list(extra) == ["mean"]
    # O(1) float32 outputs of one normalization times 2.5.
    torch.testing.assert_close(y.double(), y_ref.detach(), rtol=1e-5, atol=3e-5)
    torch.testing.assert_close(extra["mean"].double(), extra_ref["mean"].detach(), rtol=1e-5, atol=3e-5)
    assert sync.bn.last_transport == "dataparallel"


class _LossNet(nn.Module):
    """Returns a scalar per call (a loss), which DataParallel gathers into one entry per replica."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(C)

    def forward(self, x: Tensor, target: Tensor) -> Tensor:
        return ((self.bn(x) - target) ** 2).sum()


@pytest.mark.timeout(60)
def test_data_parallel_with_callback_gathers_scalar_outputs_into_a_vector() -> None:
    sync, reference = _sync_and_reference(_LossNet())
    parallel = DataParallelWithCallback(sync, cpu_replicas=3)
    x, target = _data(8, (), mean=0.5), _data(8, (), seed=4)
    losses = parallel(x.float(), target.float())
    assert losses.shape == (3,)  # chunks of 3, 3, 2 rows
    normalized = reference.bn(x)  # the global batch statistics
    expected = torch.stack([((n - t) ** 2).sum() for n, t in zip(normalized.split(3), target.split(3))])
    # Sums of a few O(1) float32 squares.
    torch.testing.assert_close(losses.double(), expected.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch, used", [(3, [0, 1, 2]), (2, [0, 1]), (1, [0])])
def test_data_parallel_with_callback_batch_smaller_than_cpu_replicas(batch: int, used: list[int]) -> None:
    sync, reference = _sync_and_reference(nn.BatchNorm2d(C))
    recorder = _CopyRecorder()
    parallel = DataParallelWithCallback(nn.Sequential(recorder, sync), cpu_replicas=4)
    x = _data(batch, (2, 2), mean=0.5)
    out = parallel(x.float())
    assert sorted(recorder.log) == [(copy_id, 1) for copy_id in used]  # one row per replica used
    assert sync.last_transport == ("dataparallel" if len(used) > 1 else "local")
    # O(1) float32 outputs of one normalization.
    torch.testing.assert_close(out.double(), reference(x).detach(), rtol=1e-5, atol=1e-5)
    _assert_state_close(sync, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("track_running_stats", [True, False])
def test_data_parallel_with_callback_eval_equals_batchnorm_eval(track_running_stats: bool) -> None:
    sync, reference = _sync_and_reference(nn.BatchNorm2d(C, track_running_stats=track_running_stats))
    parallel = DataParallelWithCallback(sync, cpu_replicas=3)
    parallel(_data(8, (2, 2), mean=0.5).float())  # one training step first
    reference(_data(8, (2, 2), mean=0.5))
    parallel.eval()
    reference.eval()
    x = _data(8, (2, 2), mean=0.5, seed=9)
    out = parallel(x.float())
    assert sync.last_transport == "local"
    # Eval normalizes with the running stats; without them, each replica with its own chunk's statistics.
    expected = reference(x) if track_running_stats else torch.cat([reference(p) for p in x.chunk(3)])
    # O(1) float32 outputs of one normalization.
    torch.testing.assert_close(out.double(), expected.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fail_on", [0, 1, 2])
def test_data_parallel_with_callback_failing_replica_raises_and_recovers(fail_on: int) -> None:
    model = _failing_model("between", fail_on)
    parallel = DataParallelWithCallback(model, cpu_replicas=3)
    x = _data(9, (2, 2), mean=0.5)
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match=f"replica {fail_on} failed on purpose"):
        parallel(x.float())
    assert not _live_threads_since(before)
    model[1].fail_on = None
    reference = _reference_of(model)
    out = parallel(x.float())
    # O(1) float32 outputs through two normalizations.
    torch.testing.assert_close(out.double(), reference(x).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cpu_replicas", [0, -1, 2.0, "2"])
def test_data_parallel_with_callback_rejects_bad_cpu_replicas(cpu_replicas: Any) -> None:
    with pytest.raises(ValueError, match="expected cpu_replicas to be a positive integer"):
        DataParallelWithCallback(SynchronizedBatchNorm1d(C), cpu_replicas=cpu_replicas)


def test_data_parallel_with_callback_cpu_replicas_rejects_a_module_off_the_cpu() -> None:
    parallel = DataParallelWithCallback(SynchronizedBatchNorm1d(C, device="meta"), cpu_replicas=2)
    with pytest.raises(ValueError, match="cpu_replicas needs a module on the CPU"):
        parallel(torch.randn(4, C))


# ------------------------------------------------------------------------------------------------------------
# patch_replication_callback and convert_model on nn.DataParallel
# ------------------------------------------------------------------------------------------------------------


class _CpuDataParallel(nn.DataParallel):
    """An ``nn.DataParallel`` that runs nn.DataParallel's scatter -> replicate -> parallel_apply -> gather on CPU.

    CPU-only torch cannot run nn.DataParallel's own ``replicate`` (a CUDA broadcast) or ``parallel_apply`` (it
    needs an accelerator), so this subclass supplies CPU versions of exactly those two steps, without
    replication callbacks and without waking peers on failure: whatever synchronizes the replicas or aborts
    their exchange has to come from ``patch_replication_callback``'s wrappers, as on a CUDA nn.DataParallel.
    """

    def __init__(self, module: nn.Module, num_replicas: int, dim: int = 0) -> None:
        # What nn.DataParallel.__init__ does without CUDA (with CUDA it would move the module to a GPU).
        nn.Module.__init__(self)
        self.module = module
        self.device_ids: list[int] = []
        self.num_replicas = num_replicas
        self.dim = dim

    def replicate(self, module: nn.Module, device_ids: Sequence[Any]) -> list[nn.Module]:
        return _replicate_on_cpu(module, len(device_ids))

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        return run_replicas_in_threads(replicas, inputs, kwargs, lambda error: None)

    def forward(self, x: Tensor) -> Tensor:
        parts = x.chunk(self.num_replicas, self.dim)
        replicas = self.replicate(self.module, list(range(len(parts))))
        outputs = self.parallel_apply(replicas, [(p,) for p in parts], [{}] * len(parts))
        return torch.cat(outputs, self.dim)


@pytest.mark.timeout(60)
def test_patch_replication_callback_synchronizes_an_existing_data_parallel() -> None:
    sync, reference = _sync_and_reference(_convnet())
    parallel = _CpuDataParallel(sync, num_replicas=3)
    x = torch.randn(8, 2, 3, 3)
    layers = [m for m in sync.modules() if isinstance(m, SyncBatchNorm)]

    with torch.no_grad():
        parallel(x)  # unpatched: the replicas never meet
    assert [m.last_transport for m in layers] == ["local"] * len(layers)

    sync, reference = _sync_and_reference(_convnet())
    parallel = _CpuDataParallel(sync, num_replicas=3)
    patch_replication_callback(parallel)
    replicate, parallel_apply = parallel.replicate, parallel.parallel_apply
    patch_replication_callback(parallel)  # idempotent: the slaves must not be registered twice
    assert parallel.replicate is replicate and parallel.parallel_apply is parallel_apply
    layers = [m for m in sync.modules() if isinstance(m, SyncBatchNorm)]
    for _ in range(2):
        out = parallel(x)
        out_ref = reference(x.double())
        out.sum().backward()
        out_ref.sum().backward()
        assert [m.last_transport for m in layers] == ["dataparallel"] * len(layers)
        # A small float32 conv net: O(1) outputs; grads are sums over the batch of O(1) terms.
        torch.testing.assert_close(out.double(), out_ref.detach(), rtol=1e-5, atol=1e-5)
        for (name, param), param_ref in zip(sync.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad.double(), param_ref.grad, rtol=1e-5, atol=1e-4, msg=name)
        _assert_state_close(sync, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fail_on", [0, 1])
def test_patched_data_parallel_wakes_the_peers_of_a_failing_replica(fail_on: int) -> None:
    parallel = _CpuDataParallel(_failing_model("between", fail_on), num_replicas=3)
    patch_replication_callback(parallel)
    before = set(threading.enumerate())
    # The subclass's parallel_apply aborts nothing: only the patch's wrapper can wake the blocked peers.
    with pytest.raises(RuntimeError, match=f"replica {fail_on} failed on purpose"):
        parallel(_data(9, (2, 2)).float())
    assert not _live_threads_since(before)


def test_patch_replication_callback_on_a_plain_data_parallel_wraps_its_methods() -> None:
    parallel = nn.DataParallel(SynchronizedBatchNorm1d(C))
    patch_replication_callback(parallel)
    # The instance now has wrappers around nn.DataParallel's own replicate and parallel_apply.
    assert parallel.replicate.__wrapped__ == nn.DataParallel.replicate.__get__(parallel)
    assert parallel.parallel_apply.__wrapped__ == nn.DataParallel.parallel_apply.__get__(parallel)
    wrapped = parallel.replicate
    patch_replication_callback(parallel)
    assert parallel.replicate is wrapped

    with_callback = DataParallelWithCallback(SynchronizedBatchNorm1d(C), cpu_replicas=2)
    patch_replication_callback(with_callback)  # already runs the callbacks: left alone
    assert "replicate" not in vars(with_callback) and "parallel_apply" not in vars(with_callback)
    with pytest.raises(TypeError, match="expected an nn.DataParallel"):
        patch_replication_callback(SynchronizedBatchNorm1d(C))


@pytest.mark.parametrize("dim", [0, 1])
def test_convert_model_of_a_data_parallel_returns_data_parallel_with_callback(dim: int) -> None:
    net = _mlp()
    weight = net[1].weight
    converted = convert_model(_CpuDataParallel(net, num_replicas=2, dim=dim))
    assert type(converted) is DataParallelWithCallback
    assert converted.dim == dim
    assert converted.module is net and isinstance(net[1], SynchronizedBatchNorm1d) and net[1].weight is weight

    # A plain nn.DataParallel (CPU-only torch keeps no dim on it; the default is 0).
    plain = convert_model(nn.DataParallel(_mlp()))
    assert type(plain) is DataParallelWithCallback and plain.dim == 0
    assert isinstance(plain.module[4], SynchronizedBatchNorm1d)

    again = convert_model(DataParallelWithCallback(_mlp(), dim=dim, cpu_replicas=3))
    assert (type(again), again.dim, again.cpu_replicas) == (DataParallelWithCallback, dim, 3)
    assert isinstance(again.module[1], SynchronizedBatchNorm1d)


# ------------------------------------------------------------------------------------------------------------
# Hierarchical: processes x thread replicas over gloo
# ------------------------------------------------------------------------------------------------------------

# Per-rank replica splits of the global batch (rank 0's replicas first): uneven, empty replicas, a rank whose
# replicas are all empty, and a rank with a single replica (plain distributed) next to one with three.
HIERARCHICAL_CASES: dict[str, list[list[int]]] = {
    "2x2-even": [[2, 2], [2, 2]],
    "2x2-uneven": [[3, 2], [1, 4]],
    "2x2-empty-replica": [[4, 0], [0, 3]],
    "2x2-empty-rank": [[0, 0], [3, 2]],
    "3+1": [[2, 3, 1], [3]],
}


def _hierarchical_worker(rank: int, world_size: int) -> None:
    for name, per_rank in HIERARCHICAL_CASES.items():
        for layout in ("1d-2D", "2d"):
            for config in ("default", "cumulative", "no-affine"):
                try:
                    _check_hierarchical_case(rank, per_rank, layout, CONFIGS[config])
                except Exception as error:
                    raise AssertionError(f"case {name} / {layout} / {config} failed on rank {rank}") from error
    _check_hierarchical_data_parallel_with_callback(rank)


def _check_hierarchical_case(rank: int, per_rank: list[list[int]], layout: str, config: dict[str, Any]) -> None:
    tail = LAYOUTS[layout][2]
    sync, ref = _pair(layout, **config)
    splits = per_rank[rank]
    flat = [n for splits_of_rank in per_rank for n in splits_of_rank]
    start = sum(sum(s) for s in per_rank[:rank])
    for step in range(2):
        x = _data(sum(flat), tail, mean=0.5, seed=step)
        grad = _data(sum(flat), tail, seed=100 + step)
        mine = slice(start, start + sum(splits))
        parts = [p.float().requires_grad_() for p in x[mine].split(splits)]
        sync.zero_grad(set_to_none=True)
        out = torch.cat(_run_replicas(_replicas(sync, len(splits)), parts))
        out.backward(grad[mine].float())
        assert sync.last_transport == ("dataparallel" if len(splits) > 1 else "distributed")

        x_ref = x.clone().requires_grad_()
        ref.zero_grad(set_to_none=True)
        out_ref = ref(x_ref)
        out_ref.backward(grad)
        # O(1) values through float32 normalization.
        torch.testing.assert_close(out.double(), out_ref[mine].detach(), rtol=1e-5, atol=1e-5)
        grad_input = torch.cat([p.grad for p in parts])
        torch.testing.assert_close(grad_input.double(), x_ref.grad[mine], rtol=1e-5, atol=1e-5)
        if sync.affine:
            for param, param_ref in ((sync.weight, ref.weight), (sync.bias, ref.bias)):
                total = param.grad.double()
                dist.all_reduce(total)  # DDP's job: the per-process grads summed over processes
                # Sums of up to ~50 O(1) float32 terms.
                torch.testing.assert_close(total, param_ref.grad, rtol=1e-5, atol=1e-4)
        # Every process's master updated its buffers with the global statistics (float32 buffers).
        _assert_state_close(sync, ref, rtol=1e-6, atol=1e-6)


def _check_hierarchical_data_parallel_with_callback(rank: int) -> None:
    sync, reference = _sync_and_reference(_mlp())
    parallel = DataParallelWithCallback(sync, cpu_replicas=2)
    gen = torch.Generator().manual_seed(11)
    sizes = [5, 3]
    for _ in range(2):
        x = torch.randn(sum(sizes), 5, generator=gen).double()
        mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        out = parallel(x[mine].float())
        out_ref = reference(x)
        # O(1) outputs of a small float32 net.
        torch.testing.assert_close(out.double(), out_ref[mine].detach(), rtol=1e-5, atol=1e-5)
        _assert_state_close(sync, reference, rtol=1e-6, atol=1e-6)
    assert sync[1].last_transport == "dataparallel"


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_hierarchical_processes_times_thread_replicas_over_gloo() -> None:
    run_distributed(_hierarchical_worker, 2, timeout=200)


# ------------------------------------------------------------------------------------------------------------
# CUDA: the real nn.DataParallel replicate / parallel_apply
# ------------------------------------------------------------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
requires_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def _cuda_steps(parallel: nn.Module, sync: nn.Module, reference: nn.Module, batch: int, dim: int = 0) -> None:
    """Two training steps on CUDA compared with the float64 reference on the CPU."""
    layers = [m for m in sync.modules() if isinstance(m, SyncBatchNorm)]
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(batch, 2, 3, 3, generator=gen).double() + 0.5
        x_cuda = x.float().cuda().requires_grad_()
        out = parallel(x_cuda)
        out.sum().backward()
        x_ref = x.clone().requires_grad_()
        out_ref = reference(x_ref)
        out_ref.sum().backward()
        # O(1) outputs of a small float32 net (TF32 off below); grads are sums over the batch.
        torch.testing.assert_close(out.double().cpu(), out_ref.detach(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(x_cuda.grad.double().cpu(), x_ref.grad, rtol=1e-4, atol=1e-4)
        for (name, param), param_ref in zip(sync.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad.double().cpu(), param_ref.grad, rtol=1e-4, atol=1e-3, msg=name)
        _assert_state_close(sync, reference, rtol=1e-5, atol=1e-5)
    expected = "dataparallel" if len(parallel.device_ids) > 1 else "local"
    assert [m.last_transport for m in layers] == [expected] * len(layers)


@pytest.fixture
def no_tf32() -> Any:
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.mark.gpu
@requires_cuda
@pytest.mark.timeout(120)
def test_data_parallel_with_callback_on_cuda_devices(no_tf32: Any) -> None:
    sync, reference = _sync_and_reference(_convnet())
    device_ids = list(range(torch.cuda.device_count()))  # one device still runs, with one replica
    parallel = DataParallelWithCallback(sync.cuda(), device_ids=device_ids)
    _cuda_steps(parallel, sync, reference, batch=4 * len(device_ids) + 1)


@pytest.mark.gpu
@requires_two_gpus
@pytest.mark.timeout(120)
def test_patched_nn_data_parallel_on_cuda_devices(no_tf32: Any) -> None:
    sync, reference = _sync_and_reference(_convnet())
    parallel = nn.DataParallel(sync.cuda(), device_ids=list(range(torch.cuda.device_count())))
    patch_replication_callback(parallel)
    _cuda_steps(parallel, sync, reference, batch=4 * len(parallel.device_ids) + 1)


@pytest.mark.gpu
@requires_cuda
def test_cpu_replicas_keep_the_module_on_the_cpu_when_cuda_is_visible() -> None:
    sync, reference = _sync_and_reference(nn.BatchNorm2d(C))
    parallel = DataParallelWithCallback(sync, cpu_replicas=2)  # nn.DataParallel would move it to a single GPU
    assert {t.device.type for t in sync.state_dict().values()} == {"cpu"}
    x = _data(6, (2, 2), mean=0.5)
    out = parallel(x.float())
    assert out.device.type == "cpu" and sync.last_transport == "dataparallel"
    # O(1) float32 outputs of one normalization.
    torch.testing.assert_close(out.double(), reference(x).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@requires_cuda
def test_convert_model_keeps_data_parallel_settings_on_cuda() -> None:
    device_ids = list(range(torch.cuda.device_count()))
    parallel = nn.DataParallel(_mlp().cuda(), device_ids=device_ids, output_device=device_ids[-1], dim=1)
    converted = convert_model(parallel)
    assert type(converted) is DataParallelWithCallback
    assert (converted.device_ids, converted.output_device, converted.dim) == (device_ids, device_ids[-1], 1)
    assert isinstance(converted.module[1], SynchronizedBatchNorm1d)


def _late_peer_worker(rank: int, world_size: int, replica_timeout: float) -> None:
    """2 processes x 2 replicas; rank 0 arrives 2.5 x replica_timeout late (saving a checkpoint, say): rank 1's
    replicas wait in the master's all_reduce, past their timeout, and the step is exact."""
    sync, ref = _pair("2d")
    sync.replica_timeout = replica_timeout
    per_rank = [[3, 2], [1, 4]]
    flat = [n for splits in per_rank for n in splits]
    start = sum(sum(s) for s in per_rank[:rank])
    mine = slice(start, start + sum(per_rank[rank]))
    x, grad = _data(sum(flat), (3, 2), mean=0.5, seed=1), _data(sum(flat), (3, 2), seed=2)
    parts = [p.float().requires_grad_() for p in x[mine].split(per_rank[rank])]
    if rank == 0:
        time.sleep(2.5 * replica_timeout)
    out = torch.cat(_run_replicas(_replicas(sync, 2), parts))
    out.backward(grad[mine].float())
    x_ref = x.clone().requires_grad_()
    out_ref = ref(x_ref)
    out_ref.backward(grad)
    # O(1) values through float32 normalization.
    torch.testing.assert_close(out.double(), out_ref[mine].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([p.grad for p in parts]).double(), x_ref.grad[mine], rtol=1e-5, atol=1e-5)
    _assert_state_close(sync, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.distributed
def test_a_late_peer_process_is_waited_for_past_the_replica_timeout() -> None:
    """replica_timeout bounds the wait for this process's replicas; the master's collective over processes follows
    the process group's timeout (60 s here), so a peer process late by more than replica_timeout is no failure."""
    run_distributed(_late_peer_worker, 2, 1.0, timeout=60, collective_timeout=60)
