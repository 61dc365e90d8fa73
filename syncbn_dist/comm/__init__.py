"""Transports (:mod:`syncbn_dist.comm.transport`): the only part of the package that touches ``torch.distributed`` or
threads. Process groups: :mod:`.distributed`; DataParallel replicas: :mod:`.replica`; ``Join``: :mod:`.join_session`;
the checks that members agree: :mod:`.tags`, :mod:`.agreement`. docs/design.md, "Transports".
"""

from __future__ import annotations

from ..settings import DEFAULT_REPLICA_TIMEOUT, is_debug_enabled, set_debug
from .agreement import LayerMismatchError
from .distributed import (
    DistributedTransport,
    all_reduce_mean_,
    broadcast_from_first_,
    distributed_transport,
    group_needs_sync,
    new_sync_groups,
)
from .replica import (
    DataParallelTransport,
    FutureResult,
    ReplicaSyncError,
    Replication,
    SlavePipe,
    SyncMaster,
    new_sync_master,
    run_replicas_in_threads,
    sum_replica_messages,
)

__all__ = [
    "DEFAULT_REPLICA_TIMEOUT",
    "DataParallelTransport",
    "DistributedTransport",
    "FutureResult",
    "LayerMismatchError",
    "ReplicaSyncError",
    "Replication",
    "SlavePipe",
    "SyncMaster",
    "all_reduce_mean_",
    "broadcast_from_first_",
    "distributed_transport",
    "group_needs_sync",
    "is_debug_enabled",
    "new_sync_groups",
    "new_sync_master",
    "run_replicas_in_threads",
    "set_debug",
    "sum_replica_messages",
]

