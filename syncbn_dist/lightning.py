"""The Lightning plugin at its public path (imports Lightning); code: :mod:`syncbn_dist.integrations.lightning`."""

from .integrations.lightning import SyncBatchNormPlugin

__all__ = ["SyncBatchNormPlugin"]
