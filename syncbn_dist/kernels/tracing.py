"""Whether the running code is being traced by ``torch.compile``, per thread.

``torch.compiler.is_compiling()`` reads one process-wide flag that Dynamo holds for the whole of a compilation. A
DataParallel replica thread that compiles (a user's compiled submodule, a new shape) therefore makes it True in the
other replica threads, which are running the layer eagerly at the same time, and would send them down the
traced-graph branches (agreement checks at trace time, in-graph assertions). :func:`is_compiling` is the flag for
the layer's own code: False in a thread that runs a replica's eager forward (:func:`eager_replica_thread`), whose
code ``torch.compile`` never traces, and the flag elsewhere.

The other transforms that change how the layer must run are asked about here too: a forward-mode AD level or a
``torch.func`` transform (:func:`_forward_ad_active`), functorch-wrapped tensors (``_is_functorch_wrapped``) and a
checkpoint recomputation (:func:`is_recomputing`).
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

    Dynamo reads ``torch.compiler.is_compiling()`` as True while it traces, and :func:`_in_eager_replica` once
    (``assume_constant_result``: the tracing thread is never inside a replica's eager forward) instead of tracing
    the thread-local read. The whole function is not ``assume_constant_result``: torch 2.11 evaluates such a
    function outside the trace, where ``torch.compiler.is_compiling()`` is False, so every traced branch would take
    the eager path (host reads, graph breaks).
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


def _forward_ad_active() -> bool:
    """Whether a ``torch.autograd.forward_ad.dual_level`` or a ``torch.func`` transform is active (eager only)."""
    return not is_compiling() and _forward_ad_level_active()


def _forward_ad_level_active() -> bool:
    """:func:`_forward_ad_active` for a caller that knows it is not being traced."""
    return forward_ad._current_level >= 0 or torch._C._functorch.peek_interpreter_stack() is not None


_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor

