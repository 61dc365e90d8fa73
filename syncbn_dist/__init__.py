"""syncbn_dist: exact synchronized BatchNorm over torch.distributed, nn.DataParallel replicas, or both."""

from .batchnorm import SyncBatchNorm, SynchronizedBatchNorm1d, SynchronizedBatchNorm2d, SynchronizedBatchNorm3d
from .comm import ReplicaSyncError
from .convert import convert_model, revert_model
from .replicate import DataParallelWithCallback, execute_replication_callbacks, patch_replication_callback

__all__ = [
    "DataParallelWithCallback",
    "ReplicaSyncError",
    "SyncBatchNorm",
    "SynchronizedBatchNorm1d",
    "SynchronizedBatchNorm2d",
    "SynchronizedBatchNorm3d",
    "convert_model",
    "execute_replication_callbacks",
    "patch_replication_callback",
    "revert_model",
]
