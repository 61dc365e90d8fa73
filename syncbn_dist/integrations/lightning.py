"""A Lightning ``LayerSync`` plugin over syncbn_dist: synchronized BatchNorm in ``Trainer(plugins=[...])``, CPU and GPU.

Importing it imports Lightning (``pip install "syncbn_dist[lightning]"``); ``import syncbn_dist`` does not. The plugin
subclasses the ``LayerSync`` of ``pytorch_lightning`` and/or ``lightning.pytorch``, so either ``Trainer`` accepts it.
"""

from __future__ import annotations

import importlib

from torch import nn

from .convert import convert_model, revert_model

__all__ = ["SyncBatchNormPlugin"]


def _layer_sync_bases() -> tuple[type, ...]:
    bases = []
    for path in ("pytorch_lightning.plugins.layer_sync", "lightning.pytorch.plugins.layer_sync"):
        try:
            bases.append(importlib.import_module(path).LayerSync)
        except ImportError:
            continue
    if not bases:
        raise ImportError(
            "syncbn_dist.lightning needs pytorch_lightning or lightning (neither imports): "
            'pip install "syncbn_dist[lightning]"'
        )
    return tuple(bases)


class SyncBatchNormPlugin(*_layer_sync_bases()):  # type: ignore[misc]
    """A Lightning ``LayerSync`` whose ``apply`` is :func:`~syncbn_dist.convert_model`, ``revert`` :func:`revert_model`.

    Where Lightning's ``Trainer(sync_batchnorm=True)`` builds ``torch.nn.SyncBatchNorm`` (GPU only, timm's activations
    dropped), this plugin synchronizes on gloo and nccl, keeps what each layer computes, and returns every layer to its
    original class after ``fit``: the DDP and FSDP strategies call ``apply`` before wrapping the model and ``revert``
    when fitting ends. Pass it instead of ``sync_batchnorm=True`` (Lightning refuses both)::

        from syncbn_dist.lightning import SyncBatchNormPlugin
        trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[SyncBatchNormPlugin()])

    Args:
        strict: passed to :func:`~syncbn_dist.convert_model` and :func:`~syncbn_dist.revert_model`: True refuses
            unknown BatchNorm subclasses with ``TypeError``; False leaves them with a warning. Default: ``True``

    Raises:
        ImportError: at import of this module, if neither ``pytorch_lightning`` nor ``lightning`` imports.
    """

    def __init__(self, strict: bool = True) -> None:
        self.strict = strict

    def apply(self, model: nn.Module) -> nn.Module:
        """Convert ``model``'s BatchNorm layers in place to synchronized ones over the world process group."""
        return convert_model(model, strict=self.strict)

    def revert(self, model: nn.Module) -> nn.Module:
        """Return ``model``'s synchronized layers in place to their original classes, with the same tensors."""
        return revert_model(model, strict=self.strict)
