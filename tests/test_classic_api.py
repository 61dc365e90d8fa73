"""The classic Synchronized-BatchNorm-PyTorch API as a drop-in, and failing replicas that wake their peers.

- Every public name of the classic ``sync_batchnorm`` package exists here with the classic call signature
  (the expected parameters are copied from vacancy/Synchronized-BatchNorm-PyTorch at commit 7553990), and its
  README's usage runs unchanged with ``import syncbn_dist as sync_batchnorm``.
- ``patch_sync_batchnorm()`` builds the synchronized classes inside the block and restores ``nn.BatchNorm*d`` on
  exit, also when the block raises.
- A DataParallel replica that fails inside a synchronized layer (a wrong channel count before the exchange, or an
  error after it) wakes every peer replica, blocked at the same or a later layer, with ``ReplicaSyncError``
  naming the failing replica, when the replicas run in plain ``threading.Thread``s or in
  ``torch.nn.parallel.parallel_apply``: nothing of syncbn_dist's own runner is involved. The layers get a 30 s
  ``replica_timeout`` and the peers must wake within ``WAKE_LIMIT`` seconds, so only the layer's own report can
  wake them in time.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn

import syncbn_dist
from syncbn_dist import ReplicaSyncError, SyncBatchNorm, SynchronizedBatchNorm2d, execute_replication_callbacks
from syncbn_dist.integrations.data_parallel import _replicate_on_cpu

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

C = 3
# Replicas wait up to this long for a peer; a peer woken only by this timeout fails the test.
REPLICA_TIMEOUT = 30.0
# A woken peer must raise within this many seconds of the failure: well below REPLICA_TIMEOUT, and generous for
# two shared cores and for a first call that compiles the kernels (the wake-up itself is a condition-variable
# notify, measured in milliseconds; with SYNCBN_DIST_KERNELS=compiled on CUDA one case took 5.9 s with Triton's
# compilation in it).
WAKE_LIMIT = 15.0

# ---------------------------------------------------------------------------------------------------------
# The classic public names and signatures
# ---------------------------------------------------------------------------------------------------------

# (name, the classic parameters in order with their defaults; inspect.Parameter.empty for required ones).
_E = inspect.Parameter.empty
CLASSIC_SIGNATURES: dict[str, list[tuple[str, Any]]] = {
    "SynchronizedBatchNorm1d": [
        ("num_features", _E), ("eps", 1e-5), ("momentum", 0.1), ("affine", True), ("track_running_stats", True)
    ],
    "SynchronizedBatchNorm2d": [
        ("num_features", _E), ("eps", 1e-5), ("momentum", 0.1), ("affine", True), ("track_running_stats", True)
    ],
    "SynchronizedBatchNorm3d": [
        ("num_features", _E), ("eps", 1e-5), ("momentum", 0.1), ("affine", True), ("track_running_stats", True)
    ],
    "DataParallelWithCallback": [("module", _E), ("device_ids", None), ("output_device", None), ("dim", 0)],
    "patch_replication_callback": [("data_parallel", _E)],
    "convert_model": [("module", _E)],
    "patch_sync_batchnorm": [],
    "set_sbn_eps_mode": [("mode", _E)],
}


@pytest.mark.parametrize("name", sorted(CLASSIC_SIGNATURES))
def test_classic_public_names_keep_their_signatures(name: str) -> None:
    assert name in syncbn_dist.__all__
    params = list(inspect.signature(getattr(syncbn_dist, name)).parameters.values())
    classic = CLASSIC_SIGNATURES[name]
    # The classic parameters come first, in order, with the classic defaults; anything added after them is
    # optional, so every classic call (positional or keyword) binds the same way.
    assert [(p.name, p.default) for p in params[: len(classic)]] == classic
    assert all(p.default is not _E for p in params[len(classic) :])


def test_classic_readme_usage_runs_unchanged() -> None:
    sync_batchnorm = syncbn_dist  # the classic README's `from sync_batchnorm import ...`, renamed
    torch.manual_seed(0)

    # "Usage": convert a DataParallel model (on CPU-only torch nn.DataParallel keeps no devices and runs locally).
    net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4, affine=False))
    model = sync_batchnorm.convert_model(nn.DataParallel(net))
    assert isinstance(model, sync_batchnorm.DataParallelWithCallback)
    assert [type(m) for m in net if isinstance(m, nn.modules.batchnorm._BatchNorm)] == [SynchronizedBatchNorm2d] * 2

    # "Usage": build the layers yourself, then wrap or patch a DataParallel.
    sync_bn = sync_batchnorm.SynchronizedBatchNorm1d(10, eps=1e-5, affine=False)
    sync_bn = sync_batchnorm.DataParallelWithCallback(sync_bn, device_ids=None)
    plain = nn.DataParallel(sync_batchnorm.SynchronizedBatchNorm1d(10, 1e-5, 0.1, False, True))
    sync_batchnorm.patch_replication_callback(plain)
    x = torch.randn(6, 10)
    expected = nn.functional.batch_norm(x, None, None, training=True, eps=1e-5)
    for module in (sync_bn, plain):
        # One device: both are nn.BatchNorm1d(affine=False) on the whole batch, to float32 rounding of O(1) values.
        torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-5)

    # "Usage": the third way in, and the classic eps mode (its spelling "clamp" too).
    with sync_batchnorm.patch_sync_batchnorm():
        layer = nn.BatchNorm3d(5)
    assert type(layer) is sync_batchnorm.SynchronizedBatchNorm3d
    sync_batchnorm.set_sbn_eps_mode("clamp")
    try:
        assert layer._eps_mode() == "clip"
    finally:
        sync_batchnorm.set_sbn_eps_mode("plus")
    assert layer._eps_mode() == "plus"


# ---------------------------------------------------------------------------------------------------------
# patch_sync_batchnorm
# ---------------------------------------------------------------------------------------------------------


def _originals() -> tuple[type[nn.Module], ...]:
    batchnorm = torch.nn.modules.batchnorm
    return batchnorm.BatchNorm1d, batchnorm.BatchNorm2d, batchnorm.BatchNorm3d


def test_patch_sync_batchnorm_builds_synchronized_layers_with_the_same_arguments() -> None:
    with syncbn_dist.patch_sync_batchnorm():
        layers = [
            nn.BatchNorm1d(4, 1e-3, 0.2, False, False),
            nn.BatchNorm2d(5, eps=1e-4, momentum=None, dtype=torch.float64),
            torch.nn.BatchNorm3d(6, track_running_stats=True, device="cpu"),
        ]
    expected = [
        (syncbn_dist.SynchronizedBatchNorm1d, 4, 1e-3, 0.2, False, False, torch.float32),
        (syncbn_dist.SynchronizedBatchNorm2d, 5, 1e-4, None, True, True, torch.float64),
        (syncbn_dist.SynchronizedBatchNorm3d, 6, 1e-5, 0.1, True, True, torch.float32),
    ]
    for layer, (cls, num_features, eps, momentum, affine, track, dtype) in zip(layers, expected):
        assert type(layer) is cls
        assert (layer.num_features, layer.eps, layer.momentum) == (num_features, eps, momentum)
        assert (layer.affine, layer.track_running_stats) == (affine, track)
        tensors = list(layer.parameters()) + [b for b in layer.buffers() if b.is_floating_point()]
        assert all(t.dtype == dtype for t in tensors)
    assert (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d) == _originals()
    assert type(nn.BatchNorm2d(3)) is torch.nn.modules.batchnorm.BatchNorm2d


def test_patch_sync_batchnorm_restores_the_originals_when_the_block_raises_and_nests() -> None:
    with pytest.raises(KeyError, match="model code failed"):
        with syncbn_dist.patch_sync_batchnorm():
            with syncbn_dist.patch_sync_batchnorm():
                assert nn.BatchNorm2d is SynchronizedBatchNorm2d
            assert nn.BatchNorm2d is SynchronizedBatchNorm2d  # the inner exit restores the outer patch
            raise KeyError("model code failed")
    assert (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d) == _originals()


# ---------------------------------------------------------------------------------------------------------
# A failing replica wakes its peers from inside the layer
# ---------------------------------------------------------------------------------------------------------


class _FailAfterExchange(SynchronizedBatchNorm2d):
    """Raises on replica ``fail_on`` after its exchange completed, i.e. between the exchange and the return."""

    fail_on: int | None = None

    def __data_parallel_replicate__(self, ctx: Any, copy_id: int) -> None:
        super().__data_parallel_replicate__(ctx, copy_id)
        self.copy_id = copy_id

    def _sync_forward(self, input: Tensor, transport: Any, compiling: bool, recomputing: bool = False) -> Tensor:
        out = super()._sync_forward(input, transport, compiling, recomputing)
        if self.copy_id == self.fail_on:
            raise MemoryError(f"replica {self.copy_id} ran out of memory after the exchange")
        return out


def _model(fail_after_exchange_on: int | None = None) -> nn.Sequential:
    """Three synchronized layers; the first may fail after its exchange on one replica."""
    first = _FailAfterExchange(C)
    first.fail_on = fail_after_exchange_on
    model = nn.Sequential(first, nn.ReLU(), SynchronizedBatchNorm2d(C), nn.ReLU(), SynchronizedBatchNorm2d(C))
    model = syncbn_dist.convert_model(model)  # gives the layers their qualified names for messages
    for module in model.modules():
        if isinstance(module, SyncBatchNorm):
            module.replica_timeout = REPLICA_TIMEOUT
    return model


# case -> (replica that fails, how: "channels" = a wrong channel count at layer "0", "after" = after layer 0's
# exchange, so that the peers wait at layer "2"; the expected root-cause error and its message)
FAILURES: dict[str, tuple[int, str, type[BaseException], str]] = {
    "master-channels": (0, "channels", ValueError, f"expected input with {C} channels"),
    "slave-channels": (1, "channels", ValueError, f"expected input with {C} channels"),
    "last-slave-channels": (2, "channels", ValueError, f"expected input with {C} channels"),
    "master-after-exchange": (0, "after", MemoryError, "ran out of memory after the exchange"),
    "slave-after-exchange": (2, "after", MemoryError, "ran out of memory after the exchange"),
}


def _failing_replication(
    case: str, num_replicas: int = 3, device: str = "cpu"
) -> tuple[list[nn.Module], list[Tensor]]:
    """Replicas (shallow copies aliasing one model, as nn.DataParallel's) with callbacks run, and their inputs."""
    failing, how, _, _ = FAILURES[case]
    model = _model(failing if how == "after" else None).to(device)
    replicas = _replicate_on_cpu(model, num_replicas)  # plain Python copies: any device
    execute_replication_callbacks(replicas)
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(3, C, 4, 4, generator=gen) for _ in range(num_replicas)]
    if how == "channels":
        parts[failing] = torch.randn(3, C + 1, 4, 4, generator=gen)
    return replicas, [p.to(device) for p in parts]


def _run_in_plain_threads(
    replicas: Sequence[nn.Module], parts: Sequence[Tensor]
) -> tuple[list[BaseException | None], list[float]]:
    """Run each replica in its own threading.Thread; return each one's error (or None) and when it ended."""
    errors: list[BaseException | None] = [None] * len(replicas)
    ended = [0.0] * len(replicas)

    def run(i: int) -> None:
        try:
            replicas[i](parts[i])
        except BaseException as error:  # noqa: B036 - inspected by the test
            errors[i] = error
        ended[i] = time.monotonic()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(replicas))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(REPLICA_TIMEOUT + 10)
    assert not any(thread.is_alive() for thread in threads), "a replica is still blocked"
    return errors, ended


def wake_up_delays(case: str) -> list[float]:
    """Seconds from the failing replica's error to each peer's ReplicaSyncError, with plain threads."""
    replicas, parts = _failing_replication(case)
    errors, ended = _run_in_plain_threads(replicas, parts)
    failing = FAILURES[case][0]
    assert all(isinstance(errors[i], ReplicaSyncError) for i in range(len(errors)) if i != failing), errors
    return [ended[i] - ended[failing] for i in range(len(errors)) if i != failing]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(FAILURES))
def test_a_failing_replica_wakes_its_peers_in_plain_threads(case: str) -> None:
    failing, _, root_type, root_message = FAILURES[case]
    replicas, parts = _failing_replication(case)
    errors, ended = _run_in_plain_threads(replicas, parts)

    root = errors[failing]
    assert type(root) is root_type and root_message in str(root)  # the failing thread sees its own error
    for i, error in enumerate(errors):
        if i == failing:
            continue
        assert isinstance(error, ReplicaSyncError), (i, error)
        named = f"replica {failing}" + (" (the master)" if failing == 0 else "")
        assert f"{named} failed in layer '0'" in str(error), str(error)  # both kinds of failure are at layer 0
        assert root_message in str(error) and error.__cause__ is root
        # Woken by the failing layer's report, not by the 30 s replica_timeout.
        assert ended[i] - ended[failing] < WAKE_LIMIT


@pytest.mark.timeout(60)
def test_a_replication_that_failed_keeps_failing_and_a_new_one_works() -> None:
    replicas, parts = _failing_replication("slave-after-exchange")
    _run_in_plain_threads(replicas, parts)
    # The failed replication fails at once on every replica (its exchanges are aborted, none waits 30 s) ...
    started = time.monotonic()
    errors, _ = _run_in_plain_threads(replicas, [torch.randn(2, C, 4, 4) for _ in replicas])
    assert all(isinstance(error, ReplicaSyncError) for error in errors)
    assert time.monotonic() - started < WAKE_LIMIT
    # ... and replicating again starts clean: equal to nn.BatchNorm on the concatenated batch.
    model = _model()
    replicas = _replicate_on_cpu(model, 3)
    execute_replication_callbacks(replicas)
    x = torch.randn(7, C, 4, 4, dtype=torch.float64).float()
    parts = list(x.split([3, 0, 4]))
    outputs: list[Tensor] = [torch.empty(0)] * 3
    threads = [threading.Thread(target=lambda i=i: outputs.__setitem__(i, replicas[i](parts[i]))) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(REPLICA_TIMEOUT)
    reference = syncbn_dist.revert_model(_model()).double()
    # Three float32 normalizations of O(1) values.
    torch.testing.assert_close(torch.cat(outputs).double(), reference(x.double()).detach(), rtol=1e-5, atol=1e-5)


# torch.nn.parallel.parallel_apply ------------------------------------------------------------------------


@contextlib.contextmanager
def _cpu_as_accelerator(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Let torch's own parallel_apply run CPU replicas.

    On CPU-only torch 2.13, ``parallel_apply`` stops before starting a thread: ``torch.accelerator.current_stream``
    raises "Cannot access accelerator device when none is available" (and ``devices=["cpu"]`` raises "Expected a
    cuda device"). Only those device/stream queries are answered here (device index -1, a no-op stream); its
    threads, ExceptionWrapper and re-raise order are torch's own code, unchanged.
    """
    module = sys.modules["torch.nn.parallel.parallel_apply"]
    monkeypatch.setattr(module, "_get_device_index", lambda device, optional=False: -1)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cpu"))
    monkeypatch.setattr(torch.accelerator, "device_index", lambda device: contextlib.nullcontext())
    yield


def _parallel_apply(replicas: Sequence[nn.Module], parts: Sequence[Tensor], devices: Any = None) -> list[Any]:
    return torch.nn.parallel.parallel_apply(list(replicas), [(p,) for p in parts], devices=devices)


def _check_parallel_apply(case: str, run: Callable[[list[nn.Module], list[Tensor]], list[Any]], device: str) -> None:
    failing, _, root_type, root_message = FAILURES[case]
    replicas, parts = _failing_replication(case, device=device)
    started = time.monotonic()
    with pytest.raises(Exception) as raised:
        run(replicas, parts)
    # The 30 s replica_timeout was not what ended it.
    assert time.monotonic() - started < WAKE_LIMIT
    # parallel_apply re-raises the first replica's error, with its original traceback (root cause chained) in the
    # message: the root cause itself when the master failed, a peer's ReplicaSyncError naming the failure otherwise.
    message = str(raised.value)
    if failing == 0:
        assert isinstance(raised.value, root_type)
    else:
        assert isinstance(raised.value, ReplicaSyncError)
        assert f"replica {failing} failed in layer '0'" in message
    assert root_message in message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["master-channels", "slave-channels", "slave-after-exchange"])
def test_a_failing_replica_wakes_its_peers_in_torch_parallel_apply(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with _cpu_as_accelerator(monkeypatch):
        _check_parallel_apply(case, _parallel_apply, "cpu")


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["master-channels", "slave-channels", "slave-after-exchange"])
def test_a_failing_replica_wakes_its_peers_in_torch_parallel_apply_on_cuda(case: str) -> None:
    def run(replicas: list[nn.Module], parts: list[Tensor]) -> list[Any]:
        return _parallel_apply(replicas, parts, devices=[0] * len(replicas))  # all three on device 0

    _check_parallel_apply(case, run, "cuda")
