"""Tests of syncbn_dist.lightning: SyncBatchNormPlugin under a real Lightning Trainer with strategy="ddp" on CPU; and
Lightning's own ``sync_batchnorm=True`` (torch.nn.SyncBatchNorm) under ``python -m syncbn_dist.run``.

Lightning's DDP strategy starts the other ranks by re-running ``sys.argv``, so the Trainer runs in
``tests/lightning_ddp.py``, started here as a subprocess (its own session, killed whole on timeout), once per
installed package: ``pytorch_lightning`` and the unified ``lightning`` (``lightning.pytorch``), whose ``LayerSync``
classes differ. Skipped, with the reason, when neither imports (the dev extra installs both).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import syncbn_dist
from tests.sessions import run_in_session

HERE = Path(__file__).resolve().parent
LIGHTNING = [name for name in ("pytorch_lightning", "lightning") if importlib.util.find_spec(name) is not None]
# The Trainer packages: pytorch_lightning, and lightning.pytorch of the unified `lightning` package.
TRAINER_PACKAGES = ["pytorch_lightning" if name == "pytorch_lightning" else "lightning.pytorch" for name in LIGHTNING]
needs_lightning = pytest.mark.skipif(not LIGHTNING, reason="neither pytorch_lightning nor lightning is installed")


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``python args`` in a new session; on timeout kill the whole session (Lightning's rank 1 too)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    return run_in_session([sys.executable, *args], env=env, timeout=timeout)


def test_core_does_not_import_lightning() -> None:
    probe = "import sys, syncbn_dist; print(sorted(m for m in sys.modules if 'lightning' in m))"
    result = _run(["-c", probe], timeout=120)
    assert result.returncode == 0, result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"


@needs_lightning
def test_plugin_is_a_layer_sync_of_each_installed_package() -> None:
    from syncbn_dist.integrations.lightning import SyncBatchNormPlugin

    plugin = SyncBatchNormPlugin()
    for package in TRAINER_PACKAGES:
        layer_sync = importlib.import_module(f"{package}.plugins").LayerSync
        assert isinstance(plugin, layer_sync), package
    model = nn.Sequential(nn.BatchNorm2d(3), nn.BatchNorm1d(2))
    assert plugin.apply(model) is model and type(model[0]) is syncbn_dist.SynchronizedBatchNorm2d
    assert plugin.revert(model) is model and type(model[0]) is nn.BatchNorm2d

    class Doubled(nn.BatchNorm2d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    with pytest.raises(TypeError, match="Doubled"):
        plugin.apply(nn.Sequential(Doubled(3)))
    with pytest.warns(UserWarning, match="Doubled"):
        SyncBatchNormPlugin(strict=False).apply(nn.Sequential(Doubled(3)))


@needs_lightning
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("package", TRAINER_PACKAGES)
@pytest.mark.parametrize("sync", ["plugin", "torch"])
def test_trainer_ddp_on_cpu_gives_global_batch_statistics(tmp_path: Path, package: str, sync: str) -> None:
    """``plugin``: ``plugins=[SyncBatchNormPlugin()]``. ``torch``: ``sync_batchnorm=True`` under ``python -m
    syncbn_dist.run``, whose patch rank 1 (started by Lightning re-running the command) must inherit."""
    sys.path.insert(0, str(HERE))
    try:
        from lightning_ddp import LR, ROWS, build, global_batch, loss_of
    finally:
        sys.path.remove(str(HERE))
    script = [str(HERE / "lightning_ddp.py"), str(tmp_path), package]
    command = script if sync == "plugin" else ["-m", "syncbn_dist.run", *script, "torch"]
    result = _run(command, timeout=240)
    assert result.returncode == 0, result.stdout[-6000:]

    reference = build()  # nn.BatchNorm in one process on the global batch, one SGD step of the global mean loss
    x, y = global_batch()
    loss_of(reference(x), y, world_size=1).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= LR * p.grad
    for rank in range(len(ROWS)):
        report = torch.load(tmp_path / f"rank{rank}.pt")
        assert report["trainer_module"].startswith(f"{package}."), report["trainer_module"]
        assert report["seen"]["transports"][1::4] == ["distributed", "distributed"], rank
        if sync == "plugin":
            assert report["seen"]["classes"][1::4] == ["SynchronizedBatchNorm2d", "SynchronizedBatchNorm1d"], rank
            assert report["after_fit"][1::4] == ["BatchNorm2d", "BatchNorm1d"]
            assert all(report["after_fit_types_are_torch"])
        else:
            assert report["forward_module"] == "syncbn_dist.integrations.torch_patch", rank
            assert report["seen"]["classes"][1::4] == ["SyncBatchNorm", "SyncBatchNorm"], rank
            assert report["after_fit"][1::4] == ["_BatchNormXd", "_BatchNormXd"]  # Lightning's revert
        for key, value in reference.state_dict().items():
            # float64; the global sums are merged from two ranks' partial sums: rounding only.
            torch.testing.assert_close(report["state"][key], value, rtol=1e-10, atol=1e-12, msg=f"rank {rank} {key}")
