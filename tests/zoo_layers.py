"""Stand-ins for model zoos' BatchNorm subclasses, with their semantics and their import paths, for the tests.

timm imports torchvision, whose registry wheel does not load with the CPU build of torch these tests run on, and
mmengine and detectron2 are not dependencies. So the classes here reproduce what syncbn_dist.families must keep:

- ``BatchNormAct2d``, ``SyncBatchNormAct`` and ``convert_sync_batchnorm``: timm 1.0's ``timm/layers/norm_act.py``,
  with the constructor options that change the forward (``apply_act``, ``act_layer``, ``act_kwargs``, ``inplace``,
  ``drop_layer``);
- ``_BatchNormXd``: mmengine's ``mmengine/model/utils.py`` (``_BatchNorm`` without the input rank check);
- ``NaiveSyncBatchNorm``: detectron2's ``detectron2/layers/batch_norm.py`` in one process (``stats_mode`` kept; the
  multi-process path, which these tests never run, raises).

Each class's ``__module__`` is the real package's, so syncbn_dist matches it by import path, as it would the real
class, through ``__module__ + "." + __qualname__``: nothing is registered by object and no fake package is put in
``sys.modules``. :func:`norm_act_class` builds the same ``BatchNormAct2d`` under another path, which must be refused.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

TIMM = "timm.layers.norm_act"


def _create_act(
    act_layer: Optional[type[nn.Module]], act_kwargs: Optional[dict[str, Any]], inplace: bool, apply_act: bool
) -> nn.Module:
    """timm 1.0's ``_create_act``: ``act_kwargs`` with ``inplace`` by default, Identity when not applied."""
    act_kwargs = dict(act_kwargs or {})
    act_kwargs.setdefault("inplace", inplace)
    if act_layer is None or not apply_act:
        return nn.Identity()
    try:
        return act_layer(**act_kwargs)
    except TypeError:  # timm's create_act_layer drops `inplace` for activations without it (PReLU, ...)
        act_kwargs.pop("inplace")
        return act_layer(**act_kwargs)


def norm_act_class(module: str) -> type[nn.BatchNorm2d]:
    """timm 1.0's ``BatchNormAct2d`` with ``__module__`` = ``module``."""

    class BatchNormAct2d(nn.BatchNorm2d):
        def __init__(
            self,
            num_features: int,
            eps: float = 1e-5,
            momentum: Optional[float] = 0.1,
            affine: bool = True,
            track_running_stats: bool = True,
            apply_act: bool = True,
            act_layer: Optional[type[nn.Module]] = nn.ReLU,
            act_kwargs: Optional[dict[str, Any]] = None,
            inplace: bool = True,
            drop_layer: Optional[type[nn.Module]] = None,
            device: Any = None,
            dtype: Any = None,
        ) -> None:
            super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
            self.drop = drop_layer() if drop_layer is not None else nn.Identity()
            self.act = _create_act(act_layer, act_kwargs, inplace, apply_act)

        def forward(self, x: Tensor) -> Tensor:
            # timm's copy of nn.BatchNorm2d.forward, then drop and act.
            assert x.ndim == 4, f"expected 4D input (got {x.ndim}D input)"
            factor = 0.0 if self.momentum is None else self.momentum
            if self.training and self.track_running_stats and self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
                factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            bn_training = self.training or (self.running_mean is None and self.running_var is None)
            track = not self.training or self.track_running_stats
            x = F.batch_norm(
                x,
                self.running_mean if track else None,
                self.running_var if track else None,
                self.weight,
                self.bias,
                bn_training,
                factor,
                self.eps,
            )
            x = self.drop(x)
            x = self.act(x)
            return x

    BatchNormAct2d.__module__ = module
    BatchNormAct2d.__qualname__ = "BatchNormAct2d"
    return BatchNormAct2d


BatchNormAct2d = norm_act_class(TIMM)


class SyncBatchNormAct(nn.SyncBatchNorm):
    """timm 1.0's ``SyncBatchNormAct``: ``timm.layers.convert_sync_batchnorm`` sets ``act`` and ``drop`` on it."""

    __module__ = TIMM

    def forward(self, x: Tensor) -> Tensor:
        x = super().forward(x)
        if hasattr(self, "drop"):
            x = self.drop(x)
        if hasattr(self, "act"):
            x = self.act(x)
        return x


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """timm 1.0's ``timm.layers.convert_sync_batchnorm`` (what ``train.py --sync-bn`` calls), line for line.

    ``BatchNormAct2d`` becomes ``SyncBatchNormAct`` with the same ``act`` and ``drop``; any other ``_BatchNorm`` a plain
    ``torch.nn.SyncBatchNorm``; tensors are shared, as timm's.
    """
    module_output = module
    if isinstance(module, _BatchNorm):
        if isinstance(module, BatchNormAct2d):
            module_output = SyncBatchNormAct(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                process_group=process_group,
            )
            module_output.act = module.act
            module_output.drop = module.drop
        else:
            module_output = nn.SyncBatchNorm(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                process_group,
            )
        if module.affine:
            with torch.no_grad():
                module_output.weight = module.weight
                module_output.bias = module.bias
        module_output.running_mean = module.running_mean
        module_output.running_var = module.running_var
        module_output.num_batches_tracked = module.num_batches_tracked
        if hasattr(module, "qconfig"):
            module_output.qconfig = module.qconfig
    for name, child in module.named_children():
        module_output.add_module(name, convert_sync_batchnorm(child, process_group))
    del module
    return module_output


class _BatchNormXd(_BatchNorm):
    """mmengine's ``_BatchNormXd``: a BatchNorm for any input rank."""

    __module__ = "mmengine.model.utils"

    def _check_input_dim(self, input: Tensor) -> None:
        return


class NaiveSyncBatchNorm(nn.BatchNorm2d):
    """detectron2's ``NaiveSyncBatchNorm`` where it is ``nn.BatchNorm2d``: one process, or eval mode."""

    __module__ = "detectron2.layers.batch_norm"

    def __init__(self, *args: Any, stats_mode: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        assert stats_mode in ["", "N"]
        self._stats_mode = stats_mode

    def forward(self, input: Tensor) -> Tensor:
        if not dist.is_initialized() or dist.get_world_size() == 1 or not self.training:
            return super().forward(input)
        raise NotImplementedError("the stand-in covers NaiveSyncBatchNorm in one process only")
