"""The check that tests/test_packaging.py runs with the Python of a fresh venv holding only torch and the built wheel.

Run from a directory outside the source tree, it imports only the installed distribution: it asserts that
``syncbn_dist`` (every subpackage, ``py.typed``, ``__version__``) comes from that venv, then runs two gloo
processes whose ``SynchronizedBatchNorm2d`` must equal ``nn.BatchNorm2d`` in float64 on the concatenated global
batch. The two are forked from this process, after the check, so they run the very modules it checked (spawned,
each would import torch and syncbn_dist again: seconds of CPU each). It imports nothing from the repository (neither
``tests`` nor ``launch``), since neither is installed.

Usage: ``python -I installed_check.py SOURCE_ROOT EXPECTED_VERSION``; exits non-zero on any failure.
"""

from __future__ import annotations

import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

SHARDS = (3, 5)  # uneven: images per rank of the global batch of 8
CHANNELS = 4


def _global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(sum(SHARDS), CHANNELS, 3, 2, dtype=torch.float64, generator=generator) * 3 + 1
    weights = torch.randn(images.shape, dtype=torch.float64, generator=generator)  # the loss is sum(out * weights)
    return images, weights


def _worker(rank: int, init_file: str) -> None:
    import syncbn_dist

    init = f"file://{init_file}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=len(SHARDS), timeout=timedelta(seconds=60))
    try:
        images, weights = _global_batch()
        reference = nn.BatchNorm2d(CHANNELS).double()
        layer = syncbn_dist.convert_model(nn.BatchNorm2d(CHANNELS).double())
        for module in (reference, layer):
            with torch.no_grad():
                module.weight.copy_(torch.linspace(0.5, 2.0, CHANNELS))
                module.bias.copy_(torch.linspace(-1.0, 1.0, CHANNELS))
        start = sum(SHARDS[:rank])
        local = slice(start, start + SHARDS[rank])

        x_ref = images.clone().requires_grad_()
        expected = reference(x_ref)
        (expected * weights).sum().backward()
        x = images[local].clone().requires_grad_()
        out = layer(x)
        (out * weights[local]).sum().backward()
        assert layer.last_transport == "distributed", layer.last_transport

        grads = torch.cat([layer.weight.grad, layer.bias.grad])
        dist.all_reduce(grads)  # parameter gradients stay local (DDP would average them): their sum is the reference's
        # float64 throughout; the tolerance is a few ulps of reduction order between the shards and one batch.
        close = {"rtol": 1e-10, "atol": 1e-12}
        torch.testing.assert_close(out, expected[local].detach(), **close)
        torch.testing.assert_close(x.grad, x_ref.grad[local], **close)
        torch.testing.assert_close(grads, torch.cat([reference.weight.grad, reference.bias.grad]), **close)
        torch.testing.assert_close(layer.running_mean, reference.running_mean, **close)
        torch.testing.assert_close(layer.running_var, reference.running_var, **close)
        assert layer.num_batches_tracked.item() == 1
    finally:
        dist.destroy_process_group()


def _check_installed(source_root: Path, expected_version: str) -> None:
    import syncbn_dist
    import syncbn_dist.comm

    package = Path(syncbn_dist.__file__).resolve().parent
    site_packages = Path(sys.prefix).resolve()
    assert site_packages in package.parents, f"syncbn_dist imported from {package}, not from the venv {sys.prefix}"
    assert source_root not in package.parents, f"syncbn_dist imported from the source tree: {package}"
    resolved = [Path(entry).resolve() for entry in sys.path if entry]
    inside = [str(path) for path in resolved if path == source_root or source_root in path.parents]
    assert not inside, f"sys.path reaches into the source tree: {inside}"
    assert (package / "py.typed").is_file(), "py.typed is missing from the installed package"
    assert Path(syncbn_dist.comm.__file__).resolve().parent == package / "comm"
    assert syncbn_dist.__version__ == expected_version, (syncbn_dist.__version__, expected_version)


def main() -> int:
    source_root, expected_version = Path(sys.argv[1]).resolve(), sys.argv[2]
    assert source_root not in Path.cwd().resolve().parents and Path.cwd().resolve() != source_root
    _check_installed(source_root, expected_version)
    with tempfile.TemporaryDirectory() as tmp:
        # Forked: no process group, thread pool or tensor work exists here yet for the ranks to inherit.
        mp.start_processes(_worker, args=(os.path.join(tmp, "init"),), nprocs=len(SHARDS), start_method="fork")
    print(f"installed syncbn_dist {expected_version}: imports from {sys.prefix}, 2-rank gloo parity ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
