"""A converted ResNet-style network trains like single-process float64 BatchNorm on the global batch.

The network is ``tests/resnet.py`` (BasicBlock and Bottleneck, BatchNorm in the downsampling shortcut, last BN of
each block zero-initialised), converted with ``syncbn_dist.convert_model`` and trained for ``STEPS`` steps of SGD
with momentum under:

- DistributedDataParallel over gloo (world sizes 2 and 3);
- FSDP2, ``fully_shard`` on every residual block and at the root (world sizes 2 and 3), parameters compared
  through ``DTensor.full_tensor()``;
- ``DataParallelWithCallback`` with CPU thread replicas, in one process;
- processes x replicas: DistributedDataParallel around ``DataParallelWithCallback(cpu_replicas=2)`` on 2 ranks.

The global batch is split unevenly. Each rank's loss is its rows' summed cross-entropy times world_size / global
batch, so the gradient DDP and FSDP2 average over ranks is the gradient of the global mean loss. The reference is
the same network with ``nn.BatchNorm2d`` in float64 on the whole batch, the same float32-rounded data and initial
weights. After every step: the loss, every parameter, every running_mean / running_var and num_batches_tracked.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import WORLD_SIZES
from resnet import resnet
from torch import Tensor, nn

import syncbn_dist
from launch.common.spawn import run_distributed
from syncbn_dist import DataParallelWithCallback, SyncBatchNorm

STEPS = 3
LR = 0.1
MOMENTUM = 0.9
NUM_CLASSES = 5
# Global batch sizes per world size; rows split unevenly across ranks.
SPLITS = {1: [10], 2: [6, 4], 3: [4, 3, 5]}
# A float32 network of ~10 layers against float64 over three SGD-with-momentum steps: the float32 rounding of
# the forward and backward (a few ulps of O(1) values per layer) reaches the parameters through lr * (1 + 0.9 +
# 0.81) times the gradients, which stays below 1e-5 for O(1) parameters; BN weights and running statistics are
# O(1) as well.
RTOL, ATOL = 1e-4, 1e-5


def _data(step: int, batch: int) -> tuple[Tensor, Tensor]:
    """Float32-representable float64 images (N, 3, 16, 16) with per-channel offsets, and class labels."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(batch, 3, 16, 16, generator=gen, dtype=torch.float64) + torch.tensor([0.5, -1.0, 2.0]).view(
        1, 3, 1, 1
    )
    return x.float().double(), torch.randint(0, NUM_CLASSES, (batch,), generator=gen)


def _reference(global_batch: int) -> list[tuple[Tensor, dict[str, Tensor]]]:
    """(global mean loss, state_dict) after each step of the float64 nn.BatchNorm network on the whole batch."""
    model = resnet(seed=0, num_classes=NUM_CLASSES).double()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    history = []
    for step in range(STEPS):
        x, y = _data(step, global_batch)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append((loss.detach(), {k: v.detach().clone() for k, v in model.state_dict().items()}))
    return history


def _full(value: Tensor) -> Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _assert_matches(
    where: str, step: int, loss: Tensor, state: dict[str, Tensor], expected: tuple[Tensor, dict[str, Tensor]]
) -> None:
    loss_ref, state_ref = expected
    torch.testing.assert_close(loss.double(), loss_ref, rtol=RTOL, atol=ATOL, msg=f"{where} step {step}: loss")
    assert state.keys() == state_ref.keys()
    for key, value in state.items():
        value = _full(value).detach()
        if key.endswith("num_batches_tracked"):
            assert value.item() == state_ref[key].item() == step + 1, f"{where} {key}"
        else:
            msg = f"{where} step {step}: {key}"
            torch.testing.assert_close(value.double(), state_ref[key], rtol=RTOL, atol=ATOL, msg=msg)


def _train(where: str, model: nn.Module, state_of: nn.Module, rows: slice, world_size: int, global_batch: int) -> None:
    """STEPS steps on this rank's rows; compares with the float64 reference after each one."""
    expected = _reference(global_batch)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        x, y = _data(step, global_batch)
        local = F.cross_entropy(model(x[rows].float()), y[rows], reduction="sum") * (world_size / global_batch)
        opt.zero_grad()
        local.backward()
        opt.step()
        # The global mean loss, for the comparison only.
        loss = local.detach().double() / world_size
        if world_size > 1:
            dist.all_reduce(loss)
        _assert_matches(where, step, loss, state_of.state_dict(), expected[step])
    # stem 1 + BasicBlock 2 + strided BasicBlock 2 + shortcut 1 + Bottleneck 3 + shortcut 1: all converted.
    assert sum(isinstance(m, SyncBatchNorm) for m in state_of.modules()) == 10


def _converted() -> nn.Module:
    return syncbn_dist.convert_model(resnet(seed=0, num_classes=NUM_CLASSES))


def _rows(rank: int, world_size: int) -> slice:
    sizes = SPLITS[world_size]
    return slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))


def _worker(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import fully_shard

    global_batch = sum(SPLITS[world_size])
    rows = _rows(rank, world_size)

    model = _converted()
    _train("DDP", nn.parallel.DistributedDataParallel(model), model, rows, world_size, global_batch)

    model = _converted()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    _train("FSDP2", model, model, rows, world_size, global_batch)
    assert all(hasattr(p, "full_tensor") for p in model.parameters())  # really sharded
    layers = [m for m in model.modules() if isinstance(m, SyncBatchNorm)]
    assert {m.last_transport for m in layers} == {"distributed"}

    if world_size == 2:
        model = _converted()
        parallel = DataParallelWithCallback(model, cpu_replicas=2)
        _train("DDP x replicas", nn.parallel.DistributedDataParallel(parallel), model, rows, world_size, global_batch)
        assert {m.last_transport for m in model.modules() if isinstance(m, SyncBatchNorm)} == {"dataparallel"}


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_resnet_under_ddp_fsdp2_and_processes_times_replicas_equals_float64_batchnorm(world_size: int) -> None:
    run_distributed(_worker, world_size, timeout=240)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("one_intra_op_thread")
@pytest.mark.parametrize("cpu_replicas", [3])
def test_resnet_under_data_parallel_cpu_replicas_equals_float64_batchnorm(cpu_replicas: int) -> None:
    model = _converted()
    parallel = DataParallelWithCallback(model, cpu_replicas=cpu_replicas)
    # World size 1: the whole batch of 10 rows, scattered by DataParallel into chunks of 4, 4 and 2.
    _train("DataParallel", parallel, model, slice(None), 1, sum(SPLITS[1]))
    assert {m.last_transport for m in model.modules() if isinstance(m, SyncBatchNorm)} == {"dataparallel"}
