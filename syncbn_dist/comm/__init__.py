"""Transports: the only part of the package that touches ``torch.distributed`` or threads.

A transport sums a list of tensors over the members of a group with one collective, differentiably (see
:mod:`syncbn_dist.comm.transport`), and knows nothing about batch norm:

- :mod:`.distributed`: :class:`DistributedTransport`, one ``all_reduce`` over a process group (gloo, nccl).
- :mod:`.agreement`: the check that every member is at the same layer (:class:`LayerMismatchError`, debug mode).
- :mod:`.replica`: :class:`DataParallelTransport`, the in-process master/slave exchange between DataParallel
  replicas (:class:`SyncMaster`, :class:`SlavePipe`, :class:`FutureResult`), optionally followed on the master
  by a :class:`DistributedTransport` over processes, so that the replicas of all processes are synchronized.
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

