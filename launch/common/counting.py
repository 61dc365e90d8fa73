"""Two instruments that count what a piece of code does; both only observe (the real ops and collectives run).

:class:`OpCounter` counts the ops a piece of code dispatches (views and collectives included): the host cost of
a layer, and the collectives it sends. On a GPU every dispatched op is a kernel launch or a host-side bookkeeping
step, so the count is the deterministic stand-in for a timing that CI (no GPU) cannot take. Every eager
``torch.distributed`` collective, whichever Python function called it, dispatches one ``c10d`` op
(``dist.all_reduce`` -> ``c10d.allreduce_``, ``dist.all_gather`` -> ``c10d.allgather_``, ``dist.broadcast`` ->
``c10d.broadcast_``, ``dist.barrier`` -> ``c10d.barrier``), so :attr:`OpCounter.collectives` counts what a rank
puts on the wire and :attr:`OpCounter.payloads` lists them in order with their sizes. So do the collectives C++
sends through the dispatcher: under DDP, its buffer broadcasts in forward and its gradient-bucket all_reduces in
backward.

Dispatch modes are thread-local: a counter sees the ops of the thread that entered it (DataParallel replicas
run in threads of their own, so enter one counter in each), and the backward of a CPU graph, which runs on
the thread that called ``backward``.

:class:`CollectiveCounter` is the other instrument: it wraps the Python ``torch.distributed`` collectives and
records each call with the phase the caller set (forward, backward), its payload bytes, dtype and group. It does
not see DDP's collectives (sent from C++), so under DDP it isolates what the model's own layers send: the
benchmark's per-variant collective table.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched while active, by overload packet name (``aten.add``, ``c10d.allreduce_``, ...).

    Ops that a composite op decomposes into above the dispatch mode are counted one by one; an op's own kernel
    internals are not.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        # (op, numel, dtype) of each c10d op, in call order; numel and dtype are of its first flat list of tensors
        # (the payload of allreduce_ and broadcast_, the input of allgather_; 0 and None for barrier).
        self.payloads: list[tuple[str, int, torch.dtype | None]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        self.counts[name] += 1
        if name.startswith("c10d."):
            tensors = next((a for a in args if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)), [])
            dtype = tensors[0].dtype if tensors else None
            self.payloads.append((name, sum(t.numel() for t in tensors), dtype))
        return func(*args, **(kwargs or {}))

    @property
    def collectives(self) -> Counter[str]:
        """The ``c10d`` ops among the counts, e.g. ``Counter({"c10d.allreduce_": 2, "c10d.allgather_": 1})``."""
        return Counter(name for name, _, _ in self.payloads)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def histogram(self) -> str:
        """One ``name: count`` per line, most frequent first."""
        return "\n".join(f"  {name}: {n}" for name, n in self.counts.most_common())


# Collectives whose calls the counter records. DDP's gradient buckets are reduced from C++ and are not seen.
_COUNTED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "all_to_all",
)
# Positional index of the tensor each collective sends, where it is not the first argument.
_SENT_ARG = {"all_gather": 1, "all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}


def _sent_bytes(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    index = _SENT_ARG.get(name, 0)
    tensor = args[index] if len(args) > index else kwargs.get("tensor", kwargs.get("input_tensor"))
    if isinstance(tensor, Tensor):
        return tensor.numel() * tensor.element_size()
    if isinstance(tensor, (list, tuple)):  # all_to_all and friends take lists
        return sum(t.numel() * t.element_size() for t in tensor if isinstance(t, Tensor))
    return 0


def _group_of(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[Any]:
    if "group" in kwargs:
        return kwargs["group"]
    positions = {"all_reduce": 2, "broadcast": 2, "all_gather": 2, "all_gather_into_tensor": 2}
    index = positions.get(name)
    return args[index] if index is not None and len(args) > index else None


class CollectiveCounter:
    """Records every counted collective called through ``torch.distributed`` while the context is active.

    Each record is ``{"op", "phase", "bytes", "dtype", "group"}``: ``phase`` is whatever the caller last set
    on :attr:`phase` (e.g. "forward", "backward"), ``bytes`` the payload sent by this rank, ``group`` "world"
    for the default group or "other". Wrapping is observation only: the real collective runs unchanged.
    Code that bound a collective by name at import time (``from torch.distributed import all_reduce``) or
    calls it from C++ (DDP's gradient buckets) is not seen.
    """

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.phase = "forward"
        self._originals: dict[str, Callable[..., Any]] = {}

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            group = _group_of(name, args, kwargs)
            sent = args[_SENT_ARG.get(name, 0)] if len(args) > _SENT_ARG.get(name, 0) else None
            self.calls.append(
                {
                    "op": name,
                    "phase": self.phase,
                    "bytes": _sent_bytes(name, args, kwargs),
                    "dtype": str(sent.dtype).replace("torch.", "") if isinstance(sent, Tensor) else None,
                    "group": "world" if group is None or group is dist.group.WORLD else "other",
                }
            )
            return original(*args, **kwargs)

        return counted

    def __enter__(self) -> CollectiveCounter:
        for name in _COUNTED:
            if hasattr(dist, name):
                self._originals[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._originals[name]))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()
