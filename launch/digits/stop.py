"""Stopping on a signal at a step every rank agrees on: SIGTERM and SIGINT become a collective decision."""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

from launch.digits.runtime import Runtime


class StopRequest:
    """Turns SIGTERM and SIGINT into a request to stop at the next step boundary that every rank agrees on.

    Use it as a context manager around training: it installs the handlers (main thread only) and restores
    the previous ones on exit. A handler only records the signal; :meth:`agreed` all-reduces it (MAX over
    ranks, one int64) so that every rank stops at the same step, whichever ranks got the signal and when:
    a rank that left alone would leave the others waiting in the next collective. Repeated signals
    change nothing (a second Ctrl-C does not abort the checkpoint; torchrun SIGKILLs workers 30 s after
    forwarding a signal anyway).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _record(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum

    def agreed(self, runtime: Runtime) -> int:
        """The signal number some rank received (0 if none): the same value on every rank (a collective)."""
        if runtime.world_size == 1:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int64, device=runtime.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
