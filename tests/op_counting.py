"""Count the ops a piece of code dispatches (views and collectives included): the host cost of a layer, and
the collectives it sends.

On a GPU every dispatched op is a kernel launch or a host-side bookkeeping step, so the count is the
deterministic stand-in for a timing that CI (no GPU) cannot take. Every eager ``torch.distributed`` collective,
whichever Python function called it, dispatches one ``c10d`` op (``dist.all_reduce`` -> ``c10d.allreduce_``,
``dist.all_gather`` -> ``c10d.allgather_``, ``dist.broadcast`` -> ``c10d.broadcast_``, ``dist.barrier`` ->
``c10d.barrier``), so :attr:`OpCounter.collectives` counts what a rank puts on the wire; the real collectives
still run.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched while active, by overload packet name (``aten.add``, ``c10d.allreduce_``, ...).

    Ops that a composite op decomposes into above the dispatch mode are counted one by one; an op's own kernel
    internals are not.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def collectives(self) -> Counter[str]:
        """The ``c10d`` ops among the counts, e.g. ``Counter({"c10d.allreduce_": 2, "c10d.allgather_": 1})``."""
        return Counter({name: n for name, n in self.counts.items() if name.startswith("c10d.")})

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def histogram(self) -> str:
        """One ``name: count`` per line, most frequent first."""
        return "\n".join(f"  {name}: {n}" for name, n in self.counts.most_common())
