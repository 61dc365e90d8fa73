"""Tests of syncbn_dist.integrations.registry: register_conversion teaches convert_model a BatchNorm subclass, by
class or path."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import syncbn_dist
from syncbn_dist import SynchronizedBatchNorm2d, convert_model, register_conversion, revert_model


class BatchNormSquare2d(nn.BatchNorm2d):
    """A user's norm layer with its own forward and a setting of its own."""

    def __init__(self, num_features: int, power: float = 2.0) -> None:
        super().__init__(num_features)
        self.power = power

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).abs().pow(self.power)


class SyncBatchNormSquare2d(SynchronizedBatchNorm2d):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).abs().pow(self.power)  # `power` comes over from the original layer


class ByPath(nn.BatchNorm1d):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + 1


class SyncByPath(syncbn_dist.SynchronizedBatchNorm1d):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + 1


def test_registered_class_converts_to_the_same_function_and_back() -> None:
    original = nn.Sequential(nn.Conv2d(2, 3, 1), BatchNormSquare2d(3, power=3.0))
    with pytest.raises(TypeError, match="BatchNormSquare2d defines its own forward"):
        convert_model(copy.deepcopy(original))
    register_conversion(BatchNormSquare2d, to_sync=SyncBatchNormSquare2d)
    model = convert_model(copy.deepcopy(original))
    assert type(model[1]) is SyncBatchNormSquare2d and model[1].power == 3.0
    x = torch.randn(5, 2, 3, 3)
    torch.testing.assert_close(model(x), original(x), rtol=0, atol=0)  # local path: the same kernels
    torch.testing.assert_close(model[1].running_var, original[1].running_var, rtol=0, atol=0)
    assert type(revert_model(model)[1]) is BatchNormSquare2d and model[1].power == 3.0


def test_register_by_import_path_without_the_class() -> None:
    register_conversion(f"{__name__}.ByPath", to_sync=SyncByPath)
    model = convert_model(nn.Sequential(ByPath(4)))
    assert type(model[0]) is SyncByPath
    assert type(revert_model(model)[0]) is ByPath


def test_register_conversion_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="expected to_sync to be a subclass of syncbn_dist.SyncBatchNorm"):
        register_conversion(BatchNormSquare2d, to_sync=nn.BatchNorm2d)
    with pytest.raises(TypeError, match="expected cls to be a subclass of"):
        register_conversion(nn.LayerNorm, to_sync=SyncBatchNormSquare2d)
    with pytest.raises(TypeError, match="expected cls as 'package.module.QualName'"):
        register_conversion("BatchNormSquare2d", to_sync=SyncBatchNormSquare2d)
    with pytest.raises(TypeError, match="already a syncbn_dist synchronized class"):
        register_conversion(SynchronizedBatchNorm2d, to_sync=SyncBatchNormSquare2d)
