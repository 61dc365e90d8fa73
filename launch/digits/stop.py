"""Stopping on a signal at a step every rank agrees on: SIGTERM and SIGINT become a collective decision."""

from __future__ import annotations

import functools
import signal
import threading
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from launch.digits.runtime import Runtime

T = TypeVar("T")


class StopRequest(Joinable):
    """Turns SIGTERM and SIGINT into a request to stop at the next step boundary that every rank agrees on.

    Use it as a context manager around training: it installs the handlers (main thread only) and restores
    the previous ones on exit. A handler only records the signal; :meth:`agreed` all-reduces it (MAX over
    ranks, one int64) so that every rank stops at the same step, whichever ranks got the signal and when:
    a rank that left alone would leave the others waiting in the next collective. Repeated signals
    change nothing (a second Ctrl-C does not abort the checkpoint; torchrun SIGKILLs workers 30 s after
    forwarding a signal anyway).

    It is also a :class:`~torch.distributed.algorithms.Joinable`: under ``Join`` (uneven shards), a rank that has
    run out of batches answers the others' agreements with "no signal", and the first joinable notifies ``Join``
    before the agreement, the first collective of a step.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        super().__init__()
        self.signum = 0
        self._previous: dict[int, Any] = {}
        self._device = torch.device("cpu")

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
        self._device = runtime.device
        Join.notify_join_context(self)
        flag = torch.tensor([self.signum], dtype=torch.int64, device=runtime.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _NoSignalHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self) -> Any:
        return dist.group.WORLD


class _NoSignalHook(JoinHook):
    """A joined rank's part of each step's agreement: no signal (0 under MAX)."""

    def __init__(self, stop: StopRequest) -> None:
        self._stop = stop

    def main_hook(self) -> None:
        dist.all_reduce(torch.zeros(1, dtype=torch.int64, device=self._stop.join_device), op=dist.ReduceOp.MAX)


def deaf_once_failed(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn``, with SIGTERM and SIGINT ignored from the moment it raises, for the failure report to be written whole.

    Wrap a worker's entry point inside torchrun's ``record``. When one worker dies, torchrun's agent SIGTERMs the
    others and then parses each one's report (the error file ``record`` writes). A worker whose collective just
    failed with its dead peer is often writing that file at that moment: killed there, it leaves a truncated file,
    and the agent dies on a ``JSONDecodeError`` instead of restarting the job. A worker that raised is on its way
    out anyway; torchrun SIGKILLs it 30 s after the SIGTERM if it hangs. Main thread only (``signal.signal``).
    """

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except BaseException:
            for signum in StopRequest.SIGNALS:
                signal.signal(signum, signal.SIG_IGN)
            raise

    return wrapped
