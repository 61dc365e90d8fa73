"""Real timm models through timm's ``convert_sync_batchnorm`` with ``patch_torch_sync_batchnorm``, DDP on gloo.

Run by ``make frameworks`` in ``.venv-frameworks`` (torch, torchvision and timm from the registry; not part of
``make test``: timm needs a torchvision that matches its torch). For each model and both import orders (timm
imported before the patch, so its ``SyncBatchNormAct`` was defined against torch's class, and after it), two gloo
ranks with shards of 3 and 5 images train two SGD steps in float64; parameters and running statistics must equal
one process training the unconverted model on the concatenated batch.

    python tests/frameworks/real_timm.py [MODEL ...]
"""

from __future__ import annotations

import copy
import importlib
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from launch.common.spawn import run_distributed

SHARDS = [3, 5]
MODELS = ["resnet10t", "mobilenetv3_small_050", "efficientnet_b0"]


def _steps(model: torch.nn.Module, parts: list[torch.Tensor], world_size: int) -> None:
    """Two SGD steps on the mean square of the logits over the global batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for x in parts:
        optimizer.zero_grad()
        # DDP averages over ranks: x world_size / global batch gives the global mean's gradient on every rank.
        (model(x).pow(2).sum() * world_size / sum(SHARDS)).backward()
        optimizer.step()


def _worker(rank: int, world_size: int, name: str, order: str) -> float:
    import syncbn_dist

    if order == "patch-first":
        syncbn_dist.patch_torch_sync_batchnorm()
    timm = importlib.import_module("timm")
    if order == "timm-first":
        syncbn_dist.patch_torch_sync_batchnorm()
    torch.manual_seed(0)
    reference = timm.create_model(name, num_classes=4).double()
    model = timm.layers.convert_sync_batchnorm(copy.deepcopy(reference))
    kinds = {type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.SyncBatchNorm)}
    assert kinds, f"{name}: timm's converter built no SyncBatchNorm"
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(sum(SHARDS), 3, 32, 32, generator=gen, dtype=torch.float64) for _ in range(2)]
    start = sum(SHARDS[:rank])
    _steps(DistributedDataParallel(model), [b[start : start + SHARDS[rank]] for b in batches], world_size)
    _steps(reference, batches, 1)
    state, expected = model.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys()
    # Relative to each tensor's scale (running variances of deep layers reach 1e3 and more).
    differences = [
        ((state[k].double() - expected[k].double()).abs().max() / (1.0 + expected[k].double().abs().max())).item()
        for k in state
        if state[k].numel()
    ]
    layers = [m for m in model.modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    assert {m.last_transport for m in layers} == {"distributed"}, name
    dist.barrier()
    return max(differences)


def main(names: list[str]) -> int:
    failed = 0
    for name in names:
        for order in ("timm-first", "patch-first"):
            difference = max(run_distributed(_worker, len(SHARDS), name, order, timeout=600))
            ok = difference < 1e-9  # float64 rounding, amplified where the deepest layers normalize 8 values at 1x1
            failed += not ok
            verdict = "ok" if ok else "FAIL"
            print(f"{name:24s} {order:12s} max |state - global batch| / (1 + max |state|) = {difference:.2e} {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or MODELS))
