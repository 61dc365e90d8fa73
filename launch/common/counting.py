"""Count the ops a piece of code dispatches (views and collectives included): the host cost of a layer, and
the collectives it sends.

On a GPU every dispatched op is a kernel launch or a host-side bookkeeping step, so the count is the
deterministic stand-in for a timing that CI (no GPU) cannot take. Every eager ``torch.distributed`` collective,
whichever Python function called it, dispatches one ``c10d`` op (``dist.all_reduce`` -> ``c10d.allreduce_``,
``dist.all_gather`` -> ``c10d.allgather_``, ``dist.broadcast`` -> ``c10d.broadcast_``, ``dist.barrier`` ->
``c10d.barrier``), so :attr:`OpCounter.collectives` counts what a rank puts on the wire and
:attr:`OpCounter.payloads` lists them in order with their sizes; the real collectives still run.

Dispatch modes are thread-local: a counter sees the ops of the thread that entered it (DataParallel replicas
run in threads of their own, so enter one counter in each), and the backward of a CPU graph, which runs on
the thread that called ``backward``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
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
