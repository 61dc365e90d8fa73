"""Long-lived gloo ranks for the test suite: :func:`~launch.common.spawn.run_distributed`'s jobs one after another in
the same rank processes.

A spawned rank spends seconds of CPU before its job starts (a new interpreter imports torch, Dynamo, inductor and
syncbn_dist); the suite pays that once per rank process instead of once per job, in the spirit of torch's
``MultiProcessTestCase`` kept alive. Process ``r`` of the pool is rank ``r`` of every job of more than ``r`` ranks: a
job of world size ``n`` runs on the first ``n`` processes, spawned when first needed. Each job still runs on a real
gloo process group on loopback, set up for it (file:// rendezvous, the job's collective timeout) and destroyed after it
(:func:`~launch.common.rank_jobs.run_on_group`), so no process group, pending collective or group-keyed cache outlives
its job.

What a job may leave in a rank that a fresh process would not have is put back after it (:class:`_RankState`):

- the environment: the caller's ``os.environ`` is sent with every job and replaces the rank's;
- Dynamo's caches (``torch._dynamo.reset()``) and counters, Dynamo's, inductor's and functorch's configs;
- torch's global modes (default dtype, grad mode, deterministic algorithms, anomaly detection, float32 matmul
  precision), global module hooks, the default generator (reseeded at random, as a new process is);
- warnings filters, signal handlers, the working directory and ``sys.path``;
- syncbn_dist's state: every change to torch's classes undone (syncbn_dist.torch_changes), then every module's
  globals, the contents of the containers among them and the attributes of its module-level objects and classes
  as they were when the rank started (debug mode, eps mode, agreement records, registries), its ``functools``
  caches cleared.

Not put back: the globals of the test modules a worker comes from (workers keep no state there), and what torch
caches by content (inductor's compiled kernels in memory and on disk, as any process on the machine shares them).

A job's ranks are retired (they exit; the next job spawns new ones) when the job raised on any rank, timed out or lost
a rank, or left what cannot be put back: a syncbn_dist module the rank had not imported (its start state is unknown),
a non-daemon thread still running, or a subclass of ``nn.SyncBatchNorm`` that the job's code defined still alive (the
torch patch checks every subclass; those a module defines on import are any importing process's). So one failure
never reaches a later job.

Rank processes are keyed by threads and the environment, less the variables that do not select a process
(:data:`PER_JOB_ENV`): a rank reads the others once, at import, so a job whose environment differs there gets
processes spawned with it.
Jobs that must own their processes pass ``fresh=True`` to ``run_distributed``.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import os
import pickle
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
import weakref
from collections import OrderedDict
from concurrent.futures.thread import _worker as _executor_worker
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional

import torch
import torch.multiprocessing as mp

from syncbn_dist.settings import KERNELS_ENV

from .rank_jobs import job_results, run_on_group

__all__ = ["PER_JOB_ENV", "WorldPool"]

# Environment variables that do not select a rank process (each job sets the caller's in its ranks): read at every
# use (the kernel set, pytest's current test, the inductor cache directory), or set by a library in the test process
# for its own later use, as it sets them in a rank that uses it (inductor before it loads a kernel, Lightning's CUDA
# check, OpenCV's Qt paths and library path and scikit-learn's Intel OpenMP settings on import).
PER_JOB_ENV = frozenset(
    {
        KERNELS_ENV,
        "PYTEST_CURRENT_TEST",
        "TORCHINDUCTOR_CACHE_DIR",
        "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
        "PYTORCH_NVML_BASED_CUDA_CHECK",
        "QT_QPA_PLATFORM_PLUGIN_PATH",
        "QT_QPA_FONTDIR",
        "LD_LIBRARY_PATH",
        "KMP_DUPLICATE_LIB_OK",
        "KMP_INIT_AT_FORK",
    }
)
_LIBRARY = "syncbn_dist"
_CONFIGS = ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config")
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_CONTAINERS = (dict, set, list, weakref.WeakKeyDictionary, weakref.WeakValueDictionary, weakref.WeakSet)


class _Namespace:
    """The attributes of a module, class or object, and the contents of the containers among them, to put back."""

    def __init__(self, owner: Any, names: Optional[list[str]] = None) -> None:
        self.owner = owner
        self.only = names is not None  # track these names only; otherwise every name, and drop new ones
        namespace = vars(owner)
        self.entries = {name: namespace[name] for name in (names if names is not None else list(namespace))}
        self.entries = {name: value for name, value in self.entries.items() if not _is_dunder(name)}
        self.contents = [(value, value.copy()) for value in self.entries.values() if isinstance(value, _CONTAINERS)]

    def restore(self) -> None:
        namespace = vars(self.owner)
        if not self.only:
            for name in [name for name in namespace if not _is_dunder(name) and name not in self.entries]:
                delattr(self.owner, name)
        for name, value in self.entries.items():
            if namespace.get(name, _Namespace) is not value:
                setattr(self.owner, name, value)
        for value, saved in self.contents:
            if isinstance(value, list):
                value[:] = saved
            else:
                value.clear()
                value.update(saved)


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _library_modules() -> dict[str, types.ModuleType]:
    return {name: m for name, m in list(sys.modules.items()) if name == _LIBRARY or name.startswith(_LIBRARY + ".")}


def _sync_batchnorm_subclasses() -> set[type]:
    found, stack = set(), [torch.nn.SyncBatchNorm]
    while stack:
        for cls in stack.pop().__subclasses__():
            if cls not in found:
                found.add(cls)
                stack.append(cls)
    return found


def _module_level(cls: type) -> bool:
    """Whether ``cls`` is its module's attribute: defined by importing a module (as in any process that imports it),
    not by a job's code."""
    return getattr(sys.modules.get(cls.__module__), cls.__qualname__, None) is cls


def _deterministic() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _anomaly() -> tuple[bool, bool]:
    return torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()


def _leftover_threads() -> list[str]:
    """Non-daemon threads still running, but for the idle workers of a ``concurrent.futures`` thread pool: those are a
    pool a library keeps for its process (inductor compiles in one), which runs only what is submitted to it."""
    main = threading.main_thread()
    return [
        t.name
        for t in threading.enumerate()
        if t.is_alive() and not t.daemon and t is not main and getattr(t, "_target", None) is not _executor_worker
    ]


class _RankState:
    """What a job may change in a rank process, as it was when the rank started; :meth:`restore` puts it back."""

    def __init__(self) -> None:
        self.dtype = torch.get_default_dtype()
        self.grad = torch.is_grad_enabled()
        self.deterministic = _deterministic()
        self.anomaly = _anomaly()
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.configs = {name: importlib.import_module(name).get_config_copy() for name in _CONFIGS}
        hooks = torch.nn.modules.module
        self.module_hooks = _Namespace(hooks, [name for name in vars(hooks) if name.startswith("_global_")])
        self.signals = {signum: signal.getsignal(signum) for signum in _SIGNALS}
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.modules = _library_modules()
        self.library: list[_Namespace] = []
        self.caches: list[Any] = []
        seen: set[int] = set()
        for module in self.modules.values():
            self.library.append(_Namespace(module))
            for value in vars(module).values():
                if id(value) in seen:
                    continue
                seen.add(id(value))
                defined_here = getattr(value, "__module__", None) == module.__name__
                if isinstance(value, type) and defined_here:
                    self.library.append(_Namespace(value))
                elif hasattr(value, "cache_clear") and defined_here:
                    self.caches.append(value)
                elif type(value).__module__.startswith(_LIBRARY) and hasattr(value, "__dict__"):
                    self.library.append(_Namespace(value))

    def restore(self) -> Optional[str]:
        """Put the state back; return why this process cannot serve another job, or None."""
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        # Each set only where a job changed it: setting a mode to its own value can change torch's state (setting the
        # float32 matmul precision to "highest" turns the fp32_precision backends from "none" to "ieee", which is
        # part of inductor's cache keys: every later compilation would miss the cache).
        if torch.get_default_dtype() != self.dtype:
            torch.set_default_dtype(self.dtype)
        if torch.is_grad_enabled() != self.grad:
            torch.set_grad_enabled(self.grad)
        if _deterministic() != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        if _anomaly() != self.anomaly:
            torch.autograd.set_detect_anomaly(*self.anomaly)
        if torch.get_float32_matmul_precision() != self.matmul_precision:
            torch.set_float32_matmul_precision(self.matmul_precision)
        for name, saved in self.configs.items():
            config, current = sys.modules[name], sys.modules[name].get_config_copy()
            for key, value in saved.items():
                if current[key] is not value and current[key] != value:
                    setattr(config, key, value)
        self.module_hooks.restore()
        for signum, handler in self.signals.items():
            if signal.getsignal(signum) is not handler and handler is not None:
                signal.signal(signum, handler)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        # torch's own classes first (the patch, the Join extension): their record is in the module state put back below.
        sys.modules["syncbn_dist.torch_changes"].restore_all()
        for namespace in self.library:
            namespace.restore()
        for cache in self.caches:
            cache.cache_clear()
        gc.collect()
        new_modules = sorted(set(_library_modules()) - set(self.modules))
        if new_modules:
            return f"the job imported {new_modules}"
        threads = _leftover_threads()
        if threads:
            return f"the job left threads running: {threads}"
        return None


def _exit_with_parent() -> None:
    """Have the kernel kill this rank when the thread that spawned it ends (Linux's PR_SET_PDEATHSIG), so that no rank
    outlives a killed test process; elsewhere a rank ends when its pipe closes, at its next read."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent was already gone
        os._exit(1)


def _job(
    rank: int, world_size: int, job: bytes, init_file: str, collective_timeout: float, threads: int
) -> tuple[bool, Any, set[type]]:
    """Run one job: (ok, pickled value or traceback, the subclasses of nn.SyncBatchNorm alive before it ran)."""
    subclasses = _sync_batchnorm_subclasses()
    with warnings.catch_warnings():  # the filters a job sets end with it
        try:
            worker, args = pickle.loads(job)
            subclasses = _sync_batchnorm_subclasses()  # those of the worker's module, imported just now, stay
            value = run_on_group(worker, rank, world_size, init_file, args, collective_timeout, "gloo", threads)
            return True, pickle.dumps(value), subclasses
        except BaseException:  # noqa: B036 - reported to the parent, which fails the test
            return False, traceback.format_exc(), subclasses


def _serve(conn: Connection) -> None:
    """A rank process's life: jobs from ``conn`` until it closes or sends None; each reply says whether to retire it.
    Its rank and world size are the job's: process ``r`` of a pool is rank ``r`` of every job it takes part in."""
    _exit_with_parent()
    import syncbn_dist  # noqa: F401 - paid once here; the state put back after each job is this one

    start = _RankState()
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the pool is gone
            message = None
        if message is None:
            # Every result is delivered: the exit handlers run (multiprocessing's finalizers, inductor's compile
            # workers), the rest of the interpreter's finalization is skipped: it takes a second or more in a process
            # holding torch on a loaded machine, and every world ends at once at the end of a session.
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        job, rank, world_size, init_file, collective_timeout, threads, env = message
        os.environ.clear()
        os.environ.update(env)
        torch.seed()
        cpu_start = cpu_seconds(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        ok, payload, subclasses = _job(rank, world_size, job, init_file, collective_timeout, threads)
        try:
            retire = start.restore()
        except BaseException:  # noqa: B036 - this rank is retired; the job's own outcome stands
            retire = "putting the state back failed:\n" + traceback.format_exc()
        left = [cls for cls in _sync_batchnorm_subclasses() - subclasses if not _module_level(cls)]
        if retire is None and left:
            retire = f"the job's subclasses of nn.SyncBatchNorm are alive: {sorted(c.__qualname__ for c in left)}"
        sys.stdout.flush()  # what the job printed, while its test still captures the output
        sys.stderr.flush()
        # This process's CPU in the job, with that of the children it waited for (inductor's compile workers).
        conn.send((ok, payload, retire, cpu_seconds(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) - cpu_start))


def cpu_seconds(*who: int) -> float:
    """User plus system CPU seconds of ``getrusage(w)`` for each ``w`` in ``who`` (``resource.RUSAGE_SELF``,
    ``resource.RUSAGE_CHILDREN``: the children this process waited for), summed."""
    return sum(usage.ru_utime + usage.ru_stime for usage in map(resource.getrusage, who))


class _Rank:
    """One rank process serving jobs (:func:`_serve`) through a pipe of its own."""

    def __init__(self, index: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(theirs,), daemon=True, name=f"pooled-rank-{index}")
        self.proc.start()
        theirs.close()

    def ask_to_exit(self) -> None:
        try:
            self.conn.send(None)
        except OSError:  # gone already
            pass

    def close(self, kill: bool = False, deadline: float = 0.0) -> None:
        """End the process: asked to exit (:meth:`ask_to_exit`, here unless ``kill``) and killed if it has not by
        ``deadline`` (``time.monotonic()``), or killed at once."""
        if not kill:
            self.ask_to_exit()
            self.proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.conn.close()


def _run_job(
    ranks: list[_Rank], message: tuple[Any, ...], timeout: Optional[float]
) -> tuple[dict[int, tuple[bool, Any]], bool, dict[int, str], float]:
    """Send ``message`` (a job less rank and world size) to every rank; return (reports by rank, whether ranks were
    still running at the deadline, why each rank that must be retired must be, the CPU seconds the ranks reported)."""
    job, init_file, collective_timeout, threads, env = message
    for rank, member in enumerate(ranks):
        member.conn.send((job, rank, len(ranks), init_file, collective_timeout, threads, env))
    deadline = float("inf") if timeout is None else time.monotonic() + timeout
    reports: dict[int, tuple[bool, Any]] = {}
    retire: dict[int, str] = {}
    cpu_s = 0.0
    pending = dict(enumerate(ranks))
    while pending and time.monotonic() < deadline:
        remaining = deadline - time.monotonic()
        waited = [obj for member in pending.values() for obj in (member.conn, member.proc.sentinel)]
        wait(waited, timeout=None if remaining == float("inf") else remaining)
        for rank, member in list(pending.items()):
            if member.conn.poll():
                try:
                    ok, payload, reason, spent = member.conn.recv()
                except EOFError:  # died without a report
                    del pending[rank]
                    continue
                reports[rank] = (ok, payload)
                cpu_s += spent
                if reason is not None:
                    retire[rank] = reason
                del pending[rank]
            elif not member.proc.is_alive():
                del pending[rank]
    hung = bool(pending) and any(member.proc.is_alive() for member in pending.values())
    failed = any(not ok for ok, _ in reports.values())
    for rank in range(len(ranks)):
        if rank not in reports:
            retire[rank] = "no report"
        elif failed:
            retire.setdefault(rank, "the job failed")
    return reports, hung, retire, cpu_s


class WorldPool:
    """Rank processes kept alive between jobs, by (threads, environment less :data:`PER_JOB_ENV`): a job of world
    size ``n`` runs on the first ``n`` (spawned as needed), each on a process group of its own.

    Args:
        max_ranks: the most rank processes alive at once; the least recently used group of them exits to make room.

    Attributes:
        jobs: jobs run so far; spawned: rank processes started; evicted: processes ended to make room for others;
        retired: why each process that a job ended was retired; job_cpu_s: the CPU seconds of the jobs' ranks, from
        the jobs' start to their state put back (each rank's own count; start-up and idle time are not in it).
    """

    def __init__(self, max_ranks: int) -> None:
        self.max_ranks = max_ranks
        self.jobs = 0
        self.job_cpu_s = 0.0
        self.spawned = 0
        self.evicted = 0
        self.retired: list[str] = []
        self._ranks: OrderedDict[tuple[Any, ...], list[Optional[_Rank]]] = OrderedDict()
        self._tmp = tempfile.mkdtemp(prefix="syncbn_dist-worlds-")

    def run(
        self,
        worker: Callable[..., Any],
        world_size: int,
        args: tuple[Any, ...],
        timeout: Optional[float],
        collective_timeout: float,
        threads: int,
    ) -> list[Any]:
        """:func:`~launch.common.spawn.run_distributed` on pooled ranks (same arguments, results and errors)."""
        job = pickle.dumps((worker, args))  # plain pickle: tensors travel as bytes, whatever becomes of the sender
        key = (threads, tuple(sorted((k, v) for k, v in os.environ.items() if k not in PER_JOB_ENV)))
        ranks = self._take(key, world_size)
        init_file = os.path.join(self._tmp, f"rendezvous-{self.jobs}")
        self.jobs += 1
        try:
            reports, hung, retire, cpu_s = _run_job(
                ranks, (job, init_file, collective_timeout, threads, dict(os.environ)), timeout
            )
            self.job_cpu_s += cpu_s
        except BaseException:  # noqa: B036 - interrupted (a test's own timeout, say): these ranks serve no more
            self._retire(key, {rank: "interrupted" for rank in range(world_size)}, kill=True)
            raise
        self._retire(key, retire, kill=hung)
        return job_results(reports, world_size, hung, timeout, lambda rank: ranks[rank].proc.exitcode)

    def _take(self, key: tuple[Any, ...], world_size: int) -> list[_Rank]:
        """The first ``world_size`` processes for ``key`` (most recently used now), spawning the missing ones."""
        members = self._ranks.pop(key, [])
        for index, member in enumerate(members):
            if member is not None and not member.proc.is_alive():
                member.close(kill=True)
                members[index] = None
        kept = sum(m is not None for m in members)
        missing = sum(m is None for m in members[:world_size]) + max(0, world_size - len(members))
        while self._ranks and self._alive_ranks() + kept + missing > self.max_ranks:
            for member in self._ranks.popitem(last=False)[1]:  # the least recently used key's processes
                if member is not None:
                    member.close(deadline=time.monotonic() + 5)
                    self.evicted += 1
        members += [None] * (world_size - len(members))
        for index in range(world_size):
            if members[index] is None:
                members[index] = _Rank(index)
                self.spawned += 1
        self._ranks[key] = members
        return [m for m in members[:world_size] if m is not None]

    def _alive_ranks(self) -> int:
        return sum(m is not None for members in self._ranks.values() for m in members)

    def _retire(self, key: tuple[Any, ...], reasons: dict[int, str], kill: bool) -> None:
        members = self._ranks[key]
        deadline = time.monotonic() + 5
        for rank, reason in sorted(reasons.items()):
            member = members[rank]
            if member is not None:
                self.retired.append(reason)
                member.close(kill=kill, deadline=deadline)
                members[rank] = None

    def close(self) -> None:
        """End every rank process (all asked at once, then waited for)."""
        members = [m for ranks in self._ranks.values() for m in ranks if m is not None]
        self._ranks.clear()
        for member in members:
            member.ask_to_exit()
        deadline = time.monotonic() + 5
        for member in members:
            member.close(deadline=deadline)
        shutil.rmtree(self._tmp, ignore_errors=True)
