"""syncbn_dist: exact synchronized BatchNorm over torch.distributed, nn.DataParallel replicas, or both."""

from importlib.metadata import PackageNotFoundError, version

from .comm import LayerMismatchError, ReplicaSyncError, new_sync_groups
from .integrations.convert import convert_model, revert_model
from .integrations.data_parallel import (
    DataParallelWithCallback,
    execute_replication_callbacks,
    patch_replication_callback,
)
from .integrations.registry import register_conversion
from .integrations.running_stats import sync_running_stats
from .integrations.torch_join import SyncBatchNormJoinable, join_layers
from .integrations.torch_patch import (
    is_torch_sync_batchnorm_patched,
    patch_torch_sync_batchnorm,
    unpatch_torch_sync_batchnorm,
)
from .layer.batchnorm import (
    SyncBatchNorm,
    SynchronizedBatchNorm1d,
    SynchronizedBatchNorm2d,
    SynchronizedBatchNorm3d,
    patch_sync_batchnorm,
)
from .settings import get_kernels, is_debug_enabled, set_debug, set_kernels, set_sbn_eps_mode

try:
    __version__: str = version("syncbn_dist")
except PackageNotFoundError:  # the source tree on sys.path without installing it: no metadata to read
    __version__ = "0+unknown"
del PackageNotFoundError, version

__all__ = [
    "DataParallelWithCallback",
    "LayerMismatchError",
    "ReplicaSyncError",
    "SyncBatchNorm",
    "SynchronizedBatchNorm1d",
    "SynchronizedBatchNorm2d",
    "SyncBatchNormJoinable",
    "SynchronizedBatchNorm3d",
    "convert_model",
    "execute_replication_callbacks",
    "get_kernels",
    "is_debug_enabled",
    "is_torch_sync_batchnorm_patched",
    "join_layers",
    "new_sync_groups",
    "patch_replication_callback",
    "patch_sync_batchnorm",
    "patch_torch_sync_batchnorm",
    "register_conversion",
    "revert_model",
    "set_debug",
    "set_kernels",
    "set_sbn_eps_mode",
    "sync_running_stats",
    "unpatch_torch_sync_batchnorm",
]
