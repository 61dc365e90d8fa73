"""The digits data: a seeded stratified split of scikit-learn's 1,797 8x8 images, and the loaders."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from launch.digits.config import DataConfig, DigitsConfig
from launch.digits.runtime import Runtime


def load_data(cfg: DataConfig) -> tuple[TensorDataset, TensorDataset]:
    """The digits as (N, 1, 8, 8) float32 images and int64 labels: a seeded stratified train/test split.

    Pixels (0..16) are standardized with the mean and std of the training images only.
    """
    # Imported here: scikit-learn (and SciPy) take seconds to import, which a bad config should not wait for.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.from_numpy(digits.images).float().unsqueeze(1)
    labels = torch.from_numpy(digits.target).long()
    train_idx, test_idx = train_test_split(
        torch.arange(len(labels)).numpy(),
        test_size=cfg.test_fraction,
        stratify=digits.target,
        random_state=cfg.split_seed,
    )
    train_idx, test_idx = torch.from_numpy(train_idx), torch.from_numpy(test_idx)
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    return TensorDataset(images[train_idx], labels[train_idx]), TensorDataset(images[test_idx], labels[test_idx])


def build_loaders(
    cfg: DigitsConfig, runtime: Runtime, replicas: int
) -> tuple[DataLoader, DataLoader, DistributedSampler]:
    """The training loader (this rank's shard), the test loader (the full test set) and the sampler.

    A :class:`DistributedSampler` (one replica when there is one process) gives every rank a disjoint
    shard of equal size (``drop_last=True`` drops the few samples that do not divide evenly instead of
    repeating some), so every rank runs the same number of steps, which synchronized BatchNorm requires.
    The order is a function of ``(seed, epoch)`` alone (call ``sampler.set_epoch`` before each epoch), so
    a resumed run sees the same batches; the union of the W ranks' k-th batches is the one-process run's
    k-th batch at W times the batch size. Training batches are ``batch_size * replicas`` (split across
    DataParallel replicas) and incomplete ones are dropped, so no BatchNorm ever sees a tiny last batch.
    """
    train_set, test_set = load_data(cfg.data)
    sampler = DistributedSampler(
        train_set, runtime.world_size, runtime.rank, shuffle=True, seed=cfg.seed, drop_last=True
    )
    train_loader = DataLoader(
        train_set,
        batch_size=cfg.data.batch_size * replicas,
        sampler=sampler,
        # The loader draws a (here unused) worker base seed per epoch from its generator; a private one
        # keeps that draw out of the global generator, which then serves dropout alone.
        generator=torch.Generator().manual_seed(cfg.seed),
        drop_last=True,
    )
    test_loader = DataLoader(test_set, batch_size=cfg.data.eval_batch_size, shuffle=False)
    return train_loader, test_loader, sampler


# ---------------------------------------------------------------------------------------------------------
# Model.
# ---------------------------------------------------------------------------------------------------------
