"""The step-by-step equivalence check, and whether the runs of a point see the same global batches.

The claim checked: *synchronized BatchNorm on W ranks x b images trains exactly as BatchNorm in one process on
the W*b images*. :func:`equivalence_steps` trains the digits job's DDP model and, on rank 0, the one-process model
on the union of the ranks' batches, and compares them after every SGD step; :func:`global_batches` draws those
batches as the job's ``DistributedSampler`` does. :func:`same_global_batches` checks on the job's own loaders
that the sweep's rank runs and one-process runs see the same global batches.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DistributedSampler

from launch.digits.config import DigitsConfig
from launch.digits.data import build_loaders
from launch.digits.loop import sgd_step
from launch.digits.model import build_model
from launch.digits.optim import build_optimizer
from launch.digits.runtime import Runtime

DTYPES = (torch.float32, torch.float64)  # the check's dtypes: as trained, and to show what is rounding


def _batch_rows(images: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """The batch as a multiset: its distinct (label, pixels) rows, sorted, and their counts."""
    rows = torch.cat([labels.unsqueeze(1).to(images.dtype), images.flatten(1)], dim=1)
    return torch.unique(rows, dim=0, return_counts=True)


def same_global_batches(ranks_cfg: DigitsConfig, single_cfg: DigitsConfig, world_size: int, epochs: int = 2) -> bool:
    """Whether the digits job gives one process with ``single_cfg``, at every step of the first ``epochs``
    epochs, the same samples as the union of the batches of ``world_size`` ranks with ``ranks_cfg``; the order
    inside a batch does not matter.

    Runs the job's ``build_loaders`` for each rank and for one process, as its epoch loop does
    (``sampler.set_epoch(epoch)`` from epoch 1). No process group is needed.
    """
    cpu = torch.device("cpu")
    ranks = [build_loaders(ranks_cfg, Runtime(r, world_size, cpu, False), 1) for r in range(world_size)]
    single_loader, _, single_sampler = build_loaders(single_cfg, Runtime(0, 1, cpu, False), 1)
    for epoch in range(1, epochs + 1):
        for _, _, sampler in ranks:
            sampler.set_epoch(epoch)
        single_sampler.set_epoch(epoch)
        rank_batches = [list(loader) for loader, _, _ in ranks]
        single_batches = list(single_loader)
        if any(len(b) != len(single_batches) for b in rank_batches):
            return False
        for step, (images, labels) in enumerate(single_batches):
            union_images = torch.cat([batches[step][0] for batches in rank_batches])
            union_labels = torch.cat([batches[step][1] for batches in rank_batches])
            (rows, counts), (union_rows, union_counts) = (
                _batch_rows(images, labels),
                _batch_rows(union_images, union_labels),
            )
            if rows.shape != union_rows.shape or not (
                torch.equal(rows, union_rows) and torch.equal(counts, union_counts)
            ):
                return False
    return True


def global_batches(num_samples: int, world_size: int, batch_size: int, steps: int, seed: int) -> list[list[Tensor]]:
    """Per step, every rank's indices, drawn exactly as the digits job's DistributedSampler draws them.

    Returns:
        ``steps`` lists of ``world_size`` int64 index tensors of ``batch_size`` each: rank r's batch at
        that step. DistributedSampler gives rank r the positions r, r + W, r + 2W, ... of a permutation, so
        the union at step k is the contiguous chunk ``perm[k*W*b : (k+1)*W*b]``: what a one-replica
        DistributedSampler (a per-epoch seeded shuffle) gives one process at batch W*b.
    """
    out: list[list[Tensor]] = []
    epoch = 0
    while len(out) < steps:
        epoch += 1
        per_rank = []
        for rank in range(world_size):
            sampler = DistributedSampler(range(num_samples), world_size, rank, shuffle=True, seed=seed, drop_last=True)
            sampler.set_epoch(epoch)
            per_rank.append(torch.tensor(list(sampler)).split(batch_size))
        full = len(per_rank[0]) - (len(per_rank[0][-1]) < batch_size)  # the loader drops an incomplete batch
        out.extend([per_rank[r][k] for r in range(world_size)] for k in range(full))
    return out[:steps]


def _flat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def _max_abs(a: Tensor, b: Tensor) -> float:
    return (a - b).abs().max().item()


_STATS = ("running_mean", "running_var")


def state_differences(a: dict[str, Tensor], b: dict[str, Tensor]) -> dict[str, float]:
    """Max absolute difference of the parameters and of the running statistics of two state_dicts of one model
    (plain and synchronized BatchNorm have the same keys); ``num_batches_tracked`` is compared for equality."""
    stats = [k for k in a if k.endswith(_STATS)]
    params = [k for k in a if not k.endswith((*_STATS, "num_batches_tracked"))]
    tracked = [k for k in a if k.endswith("num_batches_tracked")]
    return {
        "params": _max_abs(_flat([a[k] for k in params]), _flat([b[k] for k in params])),
        "running_stats": _max_abs(_flat([a[k] for k in stats]), _flat([b[k] for k in stats])),
        "num_batches_tracked_equal": all(torch.equal(a[k], b[k]) for k in tracked),
    }


def _accuracy(logits: Tensor, labels: Tensor) -> float:
    return (logits.argmax(1) == labels).double().mean().item()


def equivalence_steps(
    cfg: DigitsConfig,
    runtime: Runtime,
    train_set: tuple[Tensor, Tensor],
    test_set: tuple[Tensor, Tensor],
    steps: int,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any] | None:
    """Train the digits job's DDP model on this rank's shard and, on rank 0, the one-process model on the union.

    Every rank builds ``build_model(cfg, runtime)`` (synchronized BatchNorm when ``cfg.model.sync_bn``,
    plain per-rank BatchNorm otherwise, in DistributedDataParallel) and trains it on its ``cfg.data.batch_size``
    images per step. Rank 0 also builds the one-process model (plain ``nn.BatchNorm``, same seed and optimizer)
    and trains it on the concatenation of all ranks' batches, comparing the two after every step. As a yardstick
    for rounding it trains a second one-process model on the same batches with the images in reverse order:
    mathematically the same step, in floating point a different order of summation.

    Args:
        cfg: the digits config (``parallel: ddp``); dropout should be 0 (see
            :class:`launch.compare.config.CompareConfig`).
        runtime: this process's ``Runtime`` inside an initialized process group.
        train_set, test_set: (images (N, 1, 8, 8) float32, labels (N,) int64), the same on every rank.
        steps: SGD steps; batches are drawn as the job's DistributedSampler draws them.
        dtype: of the models and the images (the job trains in float32; float64 shows what is rounding).

    Returns:
        On rank 0, per step: the global mean loss of the ranks' and the one-process model (``loss_ranks``,
        ``loss_single``); the max absolute difference of the loss, the parameters and the running statistics
        between them (``loss``, ``params``, ``running_stats``) and between the two one-process models
        (``control_*``); whether ``num_batches_tracked`` agrees. At the end: both models' test accuracy and the
        max absolute difference of their test logits. None on the other ranks.
    """
    device, world_size, rank = runtime.device, runtime.world_size, runtime.rank
    images, labels = train_set[0].to(device, dtype), train_set[1].to(device)
    batches = global_batches(len(labels), world_size, cfg.data.batch_size, steps, cfg.seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build the models in dtype: DDP must wrap parameters of their final dtype
    try:
        torch.manual_seed(cfg.seed)
        model, net, _ = build_model(cfg, runtime)
        singles = []
        if rank == 0:
            for _ in range(2):  # the one-process model and its reversed-order twin
                torch.manual_seed(cfg.seed)
                singles.append(build_model(cfg, Runtime(0, 1, device, False))[0])
    finally:
        torch.set_default_dtype(default_dtype)
    # The job's optimizer at a constant learning rate: its cosine schedule steps once per epoch.
    optimizer = build_optimizer(net, cfg.train)
    single_opts = [build_optimizer(single, cfg.train) for single in singles]
    keys = ("loss_ranks", "loss_single", "loss", "params", "running_stats", "num_batches_tracked_equal")
    keys += ("control_loss", "control_params", "control_running_stats")
    record: dict[str, list[Any]] = {k: [] for k in keys}
    for m in (model, *singles):
        m.train()
    for batch in batches:
        mine = batch[rank]
        _, loss = sgd_step(model, optimizer, images[mine], labels[mine])
        total = torch.tensor([loss.item() * len(mine), len(mine)], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        if rank != 0:
            continue
        everything = torch.cat(batch)
        single_loss, control_loss = (
            sgd_step(m, opt, images[order], labels[order])[1].item()
            for m, opt, order in zip(singles, single_opts, (everything, everything.flip(0)))
        )
        loss_ranks = (total[0] / total[1]).item()
        diffs = state_differences(net.state_dict(), singles[0].state_dict())
        control = state_differences(singles[1].state_dict(), singles[0].state_dict())
        for key, value in (
            ("loss_ranks", loss_ranks),
            ("loss_single", single_loss),
            ("loss", abs(loss_ranks - single_loss)),
            ("params", diffs["params"]),
            ("running_stats", diffs["running_stats"]),
            ("num_batches_tracked_equal", diffs["num_batches_tracked_equal"]),
            ("control_loss", abs(control_loss - single_loss)),
            ("control_params", control["params"]),
            ("control_running_stats", control["running_stats"]),
        ):
            record[key].append(value)
    if rank != 0:
        return None
    test_images, test_labels = test_set[0].to(device, dtype), test_set[1].to(device)
    net.eval()
    singles[0].eval()
    with torch.no_grad():
        logits, single_logits = net(test_images), singles[0](test_images)
    return {
        "world_size": world_size,
        "batch_size": cfg.data.batch_size,
        "steps": steps,
        "sync_bn": cfg.model.sync_bn,
        "dtype": str(dtype).replace("torch.", ""),
        **record,
        "test_acc_ranks": _accuracy(logits, test_labels),
        "test_acc_single": _accuracy(single_logits, test_labels),
        "test_logits": _max_abs(logits.double(), single_logits.double()),
    }
