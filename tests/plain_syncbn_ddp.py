"""A plain training step with ``torch.nn.SyncBatchNorm`` under DDP on CPU, the way users write it: no syncbn_dist.

Run by tests/test_run.py as ``torchrun --standalone --nproc_per_node=2 -m syncbn_dist.run tests/plain_syncbn_ddp.py
OUT_DIR``. Without syncbn_dist.run, DDP refuses the CPU module ("SyncBatchNorm layers only work with GPU modules").
Each rank takes its rows of the global batch (``ROWS``, uneven), runs one forward/backward and SGD step, and writes
``OUT_DIR/rank{r}.pt``: its output rows, input gradient, parameter gradients and the state_dict after the step.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from conv_bn_model import batch, build
from torch import Tensor, nn

ROWS = (3, 5)
LR = 0.5


def global_batch() -> tuple[Tensor, Tensor]:
    return batch(sum(ROWS))


def train_step(rank: int, world_size: int) -> dict:
    """One DDP step on this rank's rows; what the test compares. DDP lives only here: torch's gloo process group
    can deadlock at exit when the last DDP reference outlives destroy_process_group (its worker thread needs the GIL
    to free a finished work while the main thread joins it), so it is gone before the group is destroyed."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(build())
    ddp = nn.parallel.DistributedDataParallel(model)
    x, weights = global_batch()
    rows = slice(sum(ROWS[:rank]), sum(ROWS[: rank + 1]))
    x_rank = x[rows].clone().requires_grad_()
    out = ddp(x_rank)
    (out * weights[rows]).sum().mul(world_size).backward()  # DDP averages: the global sum's gradients
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return {
        "out": out.detach(),
        "x_grad": x_rank.grad / world_size,
        "grads": grads,
        "state": model.state_dict(),
        "classes": [type(m).__name__ for m in model],
        "forward_module": nn.SyncBatchNorm.forward.__module__,
    }


def main(out_dir: str) -> int:
    dist.init_process_group("gloo")
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        torch.save(train_step(rank, world_size), f"{out_dir}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
