"""Instruments that count what a piece of code does; all only observe (the real ops and collectives run).

:class:`OpCounter` counts the ops a piece of code dispatches (views and collectives included): the host cost of
a layer, and the collectives it sends. On a GPU every dispatched op is a kernel launch or a host-side bookkeeping
step, so the count is the deterministic stand-in for a timing that CI (no GPU) cannot take. Every eager
``torch.distributed`` collective, whichever Python function called it, dispatches one ``c10d`` op, or one
functional op (``_c10d_functional.all_reduce``, syncbn_dist's layers' collective) then its ``wait_tensor``
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

:class:`BytesCounter` adds up the bytes at the op interface: what each dispatched op reads and writes, by the
definition in its docstring. BatchNorm is memory-bound, so bytes per activation element is the deterministic
stand-in for its time on a GPU (and on CPU for any real activation size).
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


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
        if _is_collective(name):
            first = next((a for a in args if isinstance(a, (list, Tensor))), [])
            tensors = [first] if isinstance(first, Tensor) else [t for t in first if isinstance(t, Tensor)]
            dtype = tensors[0].dtype if tensors else None
            self.payloads.append((name, sum(t.numel() for t in tensors), dtype))
        return func(*args, **(kwargs or {}))

    @property
    def collectives(self) -> Counter[str]:
        """The collective ops among the counts, e.g. ``Counter({"c10d.allreduce_": 2, "c10d.allgather_": 1})``;
        torch's functional collectives count as theirs (``_c10d_functional.all_reduce``), not their
        ``wait_tensor``."""
        return Counter(name for name, _, _ in self.payloads)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def histogram(self) -> str:
        """One ``name: count`` per line, most frequent first."""
        return "\n".join(f"  {name}: {n}" for name, n in self.counts.most_common())


def _is_collective(name: str) -> bool:
    """Whether the op named ``name`` (an overload packet's) sends a collective: a ``c10d`` op, or a functional one
    (``_c10d_functional.all_reduce`` ...) other than ``wait_tensor``, which only waits for one."""
    return name.startswith("c10d.") or (name.startswith("_c10d_functional.") and not name.endswith(".wait_tensor"))


# Ops that allocate without writing: their (uninitialized) result moves no bytes.
_UNINITIALIZED = {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided"}


def spanned_bytes(tensor: Tensor) -> int:
    """Bytes of storage one tensor view spans: ``(1 + sum((size - 1) * |stride|)) * element_size``, 0 if empty.

    A dense tensor spans its ``numel * element_size`` bytes whatever its memory format; an expanded (stride 0)
    view spans only the storage it reads, e.g. a (C,) vector broadcast to (N, C, H, W) spans C elements.
    """
    if tensor.numel() == 0:
        return 0
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    return extent * tensor.element_size()


class BytesCounter(TorchDispatchMode):
    """Bytes at the op interface: per dispatched op, the :func:`spanned_bytes` of every tensor argument (read) and
    result (written), summed over the ops dispatched while active (thread-local, as :class:`OpCounter`).

    - A view or alias op (``aten.view``, ``aten.expand``, ``aten.t``, ...: ``OpOverload.is_view``) counts 0 bytes:
      it moves no data.
    - An op that allocates without writing (``aten.empty_like`` ...) counts 0 bytes; one that fills a new tensor
      (``aten.new_ones``, ``aten.zeros_like`` ...) counts only what it writes: its tensor argument gives the dtype
      and device, its data is not read.
    - An in-place op counts its mutated argument twice, read and written (``t.addcmul_(a, b)``: t, a, b, and t).
    - Bytes an op's kernel moves internally are not seen: a kernel that reads its input twice (CPU
      ``native_batch_norm`` in training computes the statistics, then normalizes) counts it once, and an op that
      casts its input to another dtype inside (``torch.sum(x, dtype=torch.float64)`` on CPU makes a float64 copy)
      counts only its interface. :attr:`by_op` shows which ops carry the bytes, to judge them by.

    :attr:`total` is in bytes; divide by the activation's ``numel`` for bytes per element.
    """

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if not func.is_view and name not in _UNINITIALIZED:
            # new_ones(self, ...), zeros_like(self) ...: self gives the dtype and device, its data is not read.
            metadata_only = name.startswith("aten.new_") or name.endswith("_like")
            touched = result if metadata_only else (args, kwargs, result)
            tensors = [t for t in tree_leaves(touched) if isinstance(t, Tensor)]
            self.by_op[name] += sum(spanned_bytes(t) for t in tensors)
        return result

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def per_element(self, numel: int) -> dict[str, float]:
        """Bytes per activation element of each op, largest first (for reports and failure messages)."""
        return {name: b / numel for name, b in self.by_op.most_common()}


def count_layer(
    layer: Callable[[Tensor], Tensor], leaf: Tensor, grad_output: Tensor, params: list[Tensor]
) -> tuple[OpCounter, BytesCounter]:
    """The ops and bytes of one forward + backward of ``layer``, as inside a network.

    The input is a non-leaf (``leaf * 1.0``, made outside the counters, so no AccumulateGrad runs for it) and
    ``torch.autograd.grad`` takes the gradients of the input and of ``params``. Warm the layer up first: a
    first call may run one-time work (the agreement check of a synchronized layer).
    """
    x = leaf * 1.0
    with OpCounter() as ops, BytesCounter() as traffic:
        torch.autograd.grad(layer(x), [x, *params], grad_output)
    return ops, traffic


# The record_function range the counter opens for each phase, and the functional collectives it finds in the profile.
_PHASE_RANGE = "CollectiveCounter.phase."
_CALL_MARK = "CollectiveCounter.call."
_FUNCTIONAL_ALL_REDUCES = ("_c10d_functional::all_reduce", "_c10d_functional::all_reduce_")
# The profiler's dtype names: the counter's name and the element size in bytes.
_PROFILER_DTYPES = {"double": ("float64", 8), "float": ("float32", 4), "c10::BFloat16": ("bfloat16", 2),
                    "c10::Half": ("float16", 2)}

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
    A process group's own ``allreduce`` called from Python (syncbn_dist's eager layers: ``group.allreduce``) is
    recorded as ``all_reduce`` too, once (``dist.all_reduce`` calls it inside). torch's functional ``all_reduce``
    (the collective of compiled graphs: syncbn_dist's layers under ``torch.compile``) has
    no Python to wrap: a profiler running while the counter is active records those, with the phase whose
    ``record_function`` range encloses them and the group ``"in-graph"`` (the profiler does not record the group
    name). Code that bound a collective by name at import time (``from torch.distributed import all_reduce``) or
    calls one from C++ outside the functional ops (DDP's gradient buckets) is not seen.
    """

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self._phase = "forward"
        self._phase_range: Optional[Any] = None
        self._profiler: Optional[torch.profiler.profile] = None
        self._originals: dict[str, Callable[..., Any]] = {}
        self._depth = threading.local()  # inside a counted torch.distributed call: its group.allreduce is not new

    @property
    def phase(self) -> str:
        """What the caller is running (e.g. "forward", "backward"): recorded with each collective."""
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        if self._profiler is not None:
            self._enter_phase_range()

    def _enter_phase_range(self) -> None:
        if self._phase_range is not None:
            self._phase_range.__exit__(None, None, None)
        self._phase_range = torch.profiler.record_function(_PHASE_RANGE + self._phase)
        self._phase_range.__enter__()

    def _add_functional_collectives(self, events: Any) -> None:
        """Add the functional all_reduces among the profiler's ``events``, each with its phase, and put every
        record in the order the profiler saw them (a Python-wrapped call left a mark, :meth:`_record`)."""
        ranges = [(e.time_range, e.name[len(_PHASE_RANGE) :]) for e in events if e.name.startswith(_PHASE_RANGE)]
        marks = {int(e.name[len(_CALL_MARK) :]): e.time_range.start for e in events if e.name.startswith(_CALL_MARK)}
        timed = [(marks.get(index, 0.0), call) for index, call in enumerate(self.calls)]
        # A functional all_reduce that ran sends its process group's c10d op inside it (the out-of-place one through
        # the in-place one: the innermost counts); one traced by a compilation (fake tensors) sends nothing.
        functional = [e for e in events if e.name in _FUNCTIONAL_ALL_REDUCES]
        sent = {}
        for c10d in (e for e in events if e.name == "c10d::allreduce_"):
            t = c10d.time_range.start
            enclosing = [e for e in functional if e.time_range.start <= t <= e.time_range.end]
            if enclosing:
                innermost = max(enclosing, key=lambda e: e.time_range.start)
                sent[id(innermost)] = innermost
        for event in sent.values():
            start = event.time_range.start
            phase = next((name for span, name in ranges if span.start <= start <= span.end), self._phase)
            numel = math.prod(event.input_shapes[0])
            dtype, size = _PROFILER_DTYPES.get(event.input_dtypes[0], (event.input_dtypes[0], 0))
            call = {"op": "all_reduce", "phase": phase, "bytes": numel * size, "dtype": dtype, "group": "in-graph"}
            timed.append((start, call))
        self.calls = [call for _, call in sorted(timed, key=lambda item: item[0])]

    def _record(self, name: str, sent: Any, sent_bytes: int, group: Optional[Any]) -> None:
        if self._profiler is not None:  # a mark that times the call, to order it among the functional ones
            with torch.profiler.record_function(_CALL_MARK + str(len(self.calls))):
                pass
        self.calls.append(
            {
                "op": name,
                "phase": self.phase,
                "bytes": sent_bytes,
                "dtype": str(sent.dtype).replace("torch.", "") if isinstance(sent, Tensor) else None,
                "group": "world" if group is None or group is dist.group.WORLD else "other",
            }
        )

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            sent = args[_SENT_ARG.get(name, 0)] if len(args) > _SENT_ARG.get(name, 0) else None
            self._record(name, sent, _sent_bytes(name, args, kwargs), _group_of(name, args, kwargs))
            self._depth.value = getattr(self._depth, "value", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.value -= 1

        return counted

    def _wrap_group_all_reduce(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(group: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if not getattr(self._depth, "value", 0):
                first = tensors[0] if isinstance(tensors, (list, tuple)) else tensors
                self._record("all_reduce", first, _sent_bytes("all_reduce", (tensors,), {}), group)
            return original(group, tensors, *args, **kwargs)

        return counted

    def __enter__(self) -> CollectiveCounter:
        for name in _COUNTED:
            if hasattr(dist, name):
                self._originals[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._originals[name]))
        # The class's own entry (a pybind instancemethod), restored as it was: the function read through the class
        # no longer binds the group.
        self._group_all_reduce = dist.ProcessGroup.__dict__["allreduce"]
        dist.ProcessGroup.allreduce = self._wrap_group_all_reduce(dist.ProcessGroup.allreduce)
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        self._profiler.__enter__()
        self._enter_phase_range()
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()
        dist.ProcessGroup.allreduce = self._group_all_reduce
        profiler, self._profiler = self._profiler, None
        assert profiler is not None and self._phase_range is not None
        self._phase_range.__exit__(None, None, None)
        self._phase_range = None
        profiler.__exit__(None, None, None)
        self._add_functional_collectives(profiler.events())
