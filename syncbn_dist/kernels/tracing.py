"""Whether the running code is being traced by ``torch.compile``, per thread.

:func:`is_compiling` is False in a replica's eager forward (:func:`eager_replica_thread`): Dynamo's flag is
process-wide, so a replica thread whose forward compiles (a user's compiled submodule) would send the others down
traced branches (docs/design.md, "Replica threads"). Also asked here: forward-mode AD or a ``torch.func`` transform
(:func:`_forward_ad_level_active`), functorch-wrapped tensors (``_is_functorch_wrapped``), a checkpoint recomputation
(:func:`is_recomputing`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.autograd import forward_ad

from ..compiler_marks import when_dynamo_loads

__all__ = ["eager_replica_thread", "is_compiling", "is_recomputing"]

_thread = threading.local()


def is_recomputing() -> bool:
    """True while autograd runs a backward pass, where a module forward is a checkpoint recomputation."""
    return torch._C._current_graph_task_id() != -1


def is_compiling() -> bool:
    """``torch.compiler.is_compiling()``, except in a DataParallel replica thread's eager forward (always False).

    Only :func:`_in_eager_replica` is ``assume_constant_result`` (a tracing thread is never in a replica's eager
    forward): torch 2.11 runs such a function outside the trace, where ``is_compiling()`` is False (docs/compat.md).
    """
    return torch.compiler.is_compiling() and not _in_eager_replica()


def _in_eager_replica() -> bool:
    return getattr(_thread, "eager_replica", False)


when_dynamo_loads(lambda: torch.compiler.assume_constant_result(_in_eager_replica))


@contextlib.contextmanager
def eager_replica_thread() -> Iterator[None]:
    """Mark this thread as running a replica's eager forward, for the duration of the block (re-entrant)."""
    previous = getattr(_thread, "eager_replica", False)
    _thread.eager_replica = True
    try:
        yield
    finally:
        _thread.eager_replica = previous


def _forward_ad_level_active() -> bool:
    """Whether a ``torch.autograd.forward_ad.dual_level`` or a ``torch.func`` transform is active (asked by a caller
    that knows it is not being traced)."""
    return forward_ad._current_level >= 0 or torch._C._functorch.peek_interpreter_stack() is not None


_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor

