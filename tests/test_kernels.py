"""The kernel switch (syncbn_dist.set_kernels, get_kernels, SYNCBN_DIST_KERNELS) after the eager compiled kernels'
retirement: one eager kernel set, the native one.

- ``set_kernels`` and ``SYNCBN_DIST_KERNELS`` accept only the three modes; ``"native"`` silently, ``"compiled"`` and
  ``"auto"`` with one DeprecationWarning per mode and process; an unknown value raises, at import for the variable.
- No eager path compiles anything: in every mode a DDP step over gloo, DataParallel replicas inside it and a
  clip-mode layer run the native kernels (bit for bit what the native mode gives) and Dynamo compiles no frame.

What a user's ``torch.compile`` traces (syncbn_dist.kernels.compiled) is tests/test_compile.py's and
tests/test_compiled_graph.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from launch.common.spawn import run_distributed
from syncbn_dist import DataParallelWithCallback, convert_model, get_kernels, set_kernels, settings

_RETIRED = ("compiled", "auto")


@pytest.fixture
def fresh_warnings() -> Iterator[None]:
    """The once-per-process deprecation warnings not yet given, before and after the test."""
    settings._warn_retired.cache_clear()
    yield
    settings._warn_retired.cache_clear()


@pytest.mark.parametrize("bad", ["fast", "", None, "Compiled"])
def test_set_kernels_rejects_unknown_modes(bad: Any) -> None:
    with pytest.raises(ValueError, match="set_kernels: expected one of 'auto', 'compiled', 'native'"):
        set_kernels(bad)


def test_native_is_accepted_silently_and_is_the_kernel_set_in_force(
    monkeypatch: pytest.MonkeyPatch, fresh_warnings: None
) -> None:
    monkeypatch.setenv(settings.KERNELS_ENV, "native")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        set_kernels("native")
        assert get_kernels() == "native"
    monkeypatch.setenv(settings.KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="SYNCBN_DIST_KERNELS: expected one of 'auto', 'compiled', 'native'"):
        get_kernels()


@pytest.mark.parametrize("mode", _RETIRED)
def test_retired_modes_warn_once_per_mode_and_run_native(
    mode: str, monkeypatch: pytest.MonkeyPatch, fresh_warnings: None
) -> None:
    """The warning names the mode, the release that retired it and the one that refuses it, and points at the
    caller's line; a second call warns no more. The environment variable warns likewise (its own source)."""
    with pytest.warns(DeprecationWarning, match=f"set_kernels: the '{mode}' kernels were retired in syncbn_dist "
                                                f"0.2.0; the native kernels run instead, and '{mode}' is refused "
                                                "from 0.3.0") as caught:
        set_kernels(mode)
    assert [w.filename for w in caught] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        set_kernels(mode)
    assert get_kernels() == "native"
    monkeypatch.setenv(settings.KERNELS_ENV, mode)
    with pytest.warns(DeprecationWarning, match=f"SYNCBN_DIST_KERNELS: the '{mode}' kernels were retired"):
        assert get_kernels() == "native"


def _import_with(value: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, settings.KERNELS_ENV: value}
    return subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", "import syncbn_dist"],
        env=env, capture_output=True, text=True, timeout=120,
    )


def test_the_environment_is_checked_at_import() -> None:
    """No call reads the variable any more, so ``import syncbn_dist`` checks it: a retired mode warns (an error under
    ``-W error``), an unknown one raises, naming the variable; ``native`` imports cleanly."""
    assert _import_with("native").returncode == 0
    retired = _import_with("compiled")
    assert retired.returncode != 0 and "DeprecationWarning: SYNCBN_DIST_KERNELS: the 'compiled' kernels were " \
        "retired" in retired.stderr, retired.stderr
    unknown = _import_with("fast")
    assert unknown.returncode != 0 and "ValueError: SYNCBN_DIST_KERNELS: expected one of" in unknown.stderr, \
        unknown.stderr


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 7 * 7, 3),
                         nn.BatchNorm1d(3))


def _step(model: nn.Module, rank: int) -> list[Tensor]:
    """One training step's loss, input gradient and every parameter gradient and buffer of ``model``."""
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(4 + rank, 3, 9, 9, generator=gen).requires_grad_()
    loss = F.cross_entropy(model(x), torch.randint(0, 3, (4 + rank,), generator=gen))
    loss.backward()
    module = getattr(model, "module", model)
    return [loss.detach(), x.grad, *(p.grad for p in module.parameters()), *module.buffers()]


def _worker_every_mode_runs_native(rank: int, world_size: int) -> dict[str, Any]:
    """In each mode: a DDP step of a converted model, the same model as DataParallel replicas under DDP, and a
    clip-mode layer; what each gives, and what Dynamo compiled in the whole process."""
    results: dict[str, list[list[Tensor]]] = {}
    for mode in ("native", *_RETIRED):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            set_kernels(mode)
        ddp = nn.parallel.DistributedDataParallel(convert_model(_net()))
        hybrid = nn.parallel.DistributedDataParallel(DataParallelWithCallback(convert_model(_net()), cpu_replicas=2))
        clip = convert_model(_net())
        for layer in (clip[1], clip[5]):
            layer.eps_mode = "clip"
        results[mode] = [_step(ddp, rank), _step(hybrid, rank), _step(nn.parallel.DistributedDataParallel(clip), rank)]
        transports = {m.last_transport for m in hybrid.module.module.modules() if hasattr(m, "last_transport")}
        assert transports == {"dataparallel"}, transports
    set_kernels("native")
    compiled_frames = 0
    if "torch._dynamo" in sys.modules:
        compiled_frames = sys.modules["torch._dynamo"].utils.counters["stats"]["unique_graphs"]
    return {"results": results, "frames": compiled_frames}


@pytest.mark.distributed
def test_no_eager_path_compiles_anything_in_any_mode() -> None:
    """Fresh ranks (what compiles in a process is what is counted), with every mode of the switch."""
    for rank, result in enumerate(run_distributed(_worker_every_mode_runs_native, 2, timeout=180, fresh=True)):
        assert result["frames"] == 0, f"rank {rank}: Dynamo compiled {result['frames']} frames"
        native = result["results"]["native"]
        for mode in _RETIRED:
            for path, expected, got in zip(("ddp", "ddp x replicas", "clip"), native, result["results"][mode]):
                assert len(expected) == len(got)
                for index, (a, b) in enumerate(zip(expected, got)):
                    assert torch.equal(a, b), f"rank {rank}, {mode}, {path}: tensor {index} differs from native"
