"""A function compiled by ``torch.compile`` once per signature, whose later calls run its inductor graph directly
(:class:`_CompiledKernel`), and what compiling inside a DDP forward or a thread needs.
"""

from __future__ import annotations

import threading
import types
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from .. import torch_changes
from ..comm.replica import install_placeholder_cuda_guard
from ..compiler_marks import never_traced
from .direct_call import DirectCall, GraphCallRecorder, recording_backend


def _outside_ddp_forward(compiled: Callable[..., Any], *args: Any) -> Any:
    """Call ``compiled`` with DistributedDataParallel's active module cleared: inside a DDP forward, Dynamo would split
    a kernel's graph at DDP's gradient buckets, which fails ("First bucket should be smaller/equal to other buckets";
    docs/design.md, "Private torch APIs")."""
    if DistributedDataParallel._active_ddp_module is None:
        return compiled(*args)
    with torch_changes.temporarily(DistributedDataParallel, "_active_ddp_module", None):
        return compiled(*args)


# Held for the first call of every signature: one compilation at a time, under the config patch above it.
_FIRST_CALL_LOCK = threading.Lock()
# Whether a signature's later calls run its inductor graph directly where they can (read at its first compile).
DIRECT_CALLS = True


class _CompiledKernel:
    """``torch.compile(fn, dynamic=True, fullgraph=True)`` per signature, built on first use under a lock.

    A signature is the first tensor's device, dtype, layout and sizes of one, and the arguments that are not tensors
    (``eps``, ``clip``, the group name, ...), constants of its graph; each compiles a copy of ``fn``'s code object, with
    its own Dynamo cache. Later calls run the inductor graph directly where Dynamo's guards would pass them
    (:class:`~syncbn_dist.kernels.direct_call.DirectCall`). Why: docs/design.md, "Compiled kernels".
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.compiled: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self.direct: dict[tuple[Any, ...], Optional[DirectCall]] = {}

    # Never traced (marked below): where a user's torch.compile runs the layer eagerly in a frame it skips (past its
    # recompile limit), Dynamo would trace into a direct call's code, whose in-place all_reduce it cannot compile.
    def __call__(self, x: Tensor, *args: Any) -> Any:
        # Sizes of 0 and 1 are specialized by Dynamo even with dynamic shapes: N, C and L of one are signatures.
        sizes_of_one = (x.size(0) == 1, x.size(1) == 1, x.size(2) == 1)
        constants = tuple(arg for arg in args if not isinstance(arg, Tensor))
        signature = (x.device, x.dtype, x.stride(1) == 1, *sizes_of_one, *constants)
        direct = self.direct.get(signature)
        if direct is not None:
            result = direct((x, *args))
            if result is not None:
                return result
        compiled = self.compiled.get(signature)
        if compiled is not None:
            return _outside_ddp_forward(compiled, x, *args)
        # No duck sizing: equal first sizes (N == C) would share a symbol, recompiling until the limit fails a call.
        from torch._dynamo import config as dynamo_config  # (loaded on first use: syncbn_dist.compiler_marks)
        from torch.fx.experimental import _config as fx_config

        install_placeholder_cuda_guard()
        with _FIRST_CALL_LOCK, fx_config.patch(use_duck_shape=False), dynamo_config.patch(specialize_float=True):
            compiled = self.compiled.get(signature)
            if compiled is not None:  # another thread compiled it while this one waited
                return _outside_ddp_forward(compiled, x, *args)
            fn, record = self.fn, {}
            copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)
            copy.__kwdefaults__ = fn.__kwdefaults__
            compiled = torch.compile(copy, backend=recording_backend(record), dynamic=True, fullgraph=True)
            with GraphCallRecorder() as recorder:
                result = _outside_ddp_forward(compiled, x, *args)
            self.compiled[signature] = compiled
            if DIRECT_CALLS:
                self.direct[signature] = DirectCall.build(
                    fn, record.get("sources"), recorder.calls, (x, *args), result
                )
            return result

    def graphs(self) -> int:
        """How many signatures this kernel compiled in this process."""
        return len(self.compiled)


never_traced(_CompiledKernel, "__call__")
