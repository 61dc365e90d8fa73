"""The Lightning plugin at its public path (importing it imports Lightning); the code is
:mod:`syncbn_dist.integrations.lightning`."""

from .integrations.lightning import SyncBatchNormPlugin

__all__ = ["SyncBatchNormPlugin"]
