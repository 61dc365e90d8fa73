"""join_layers: synchronized BatchNorm under ``torch.distributed.algorithms.Join``, for uneven inputs across ranks.

Usage: docs/training.md, "Uneven inputs"; the protocol (:mod:`syncbn_dist.comm.join_session`) and what
:func:`extend_torch_join` changes in torch's ``Join``: docs/design.md, "Uneven inputs under Join".
"""

from __future__ import annotations

import functools
import weakref
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig
from torch.nn.parallel import DistributedDataParallel

from .. import torch_changes
from ..comm.distributed import all_gather_bytes
from ..comm.join_session import (
    NOTIFICATIONS,
    OPEN_JOINS,
    HeaderSchedule,
    JoinBinding,
    JoinSession,
    JoinTransport,
    NotCoveredByJoinError,
)
from ..comm.tags import LayerMismatchError
from ..kernels.statistics import moments_of_total
from ..layer.batchnorm import SyncBatchNorm
from ..layer.statistics import update_running_stats
from .torch_patch import is_torch_sync_batchnorm_patched

__all__ = ["SyncBatchNormJoinable", "extend_torch_join", "join_layers", "restore_torch_join"]

# The layers' group copies by ranks (making one is collective), held weakly (docs/design.md, "State kept across calls").
_SESSION_GROUPS: dict[tuple[int, ...], Callable[[], Any]] = {}
# What _SESSION_GROUPS gives for a copy this rank is not a member of.
_NOT_A_MEMBER = object()


def _not_a_member() -> Any:
    return _NOT_A_MEMBER

_SESSION_GROUPS_WORLD: list[Optional[weakref.ref[Any]]] = [None]
# The session of each group copy, by the copy's id; held weakly, as its joinables hold it.
_SESSIONS: weakref.WeakValueDictionary[int, JoinSession] = weakref.WeakValueDictionary()
# Each model's joinable, while the model lives (copies and pickles of the model do not carry it).
_JOINABLES: weakref.WeakKeyDictionary[nn.Module, SyncBatchNormJoinable] = weakref.WeakKeyDictionary()


def join_layers(model: nn.Module, join_process_group: Optional[Any] = None) -> SyncBatchNormJoinable:
    """The :class:`~torch.distributed.algorithms.Joinable` of ``model``'s synchronized layers, for ``Join``.

    Call it on every rank after ``convert_model`` and pass the result to ``Join`` beside the DDP model, in either order.
    The first call for a model is collective (it creates a process group per group its layers use). Inside the ``Join``
    the layers run eagerly, with one small all-reduce more per step (and per collective while a rank has joined),
    whichever module runs them: the model, a wrapper of it, its DataParallel replicas or its children; outside it
    nothing changes ([uneven inputs](../training.md#uneven-inputs-ranks-with-different-numbers-of-batches)).

    Args:
        model: a module holding :class:`syncbn_dist.SyncBatchNorm` layers (or the DistributedDataParallel wrapping
            it); every rank passes the same architecture. The joinable covers its layers, not a module: the loop may
            run them through any module that holds them.
        join_process_group: the group ``Join`` counts joined ranks over, which must be the DDP model's ``process_group``
            (None: the world group, DDP's default).

    Returns:
        The joinable (the same object for the same ``model``).

    Raises:
        RuntimeError: if ``torch.distributed`` is not initialized.
        ValueError: if ``model`` holds no synchronized layer.
    """
    extend_torch_join()  # done at the model's first layer already, unless the layers were unpickled
    joinable = _JOINABLES.get(model)
    if joinable is None:
        joinable = _JOINABLES[model] = SyncBatchNormJoinable(model, join_process_group)
    return joinable


class SyncBatchNormJoinable(Joinable):
    """The synchronized layers of one model as a ``Joinable``; build it with :func:`join_layers`."""

    def __init__(self, model: nn.Module, join_process_group: Optional[Any] = None) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("join_layers needs an initialized default process group (init_process_group)")
        self._layers = synchronized_layers(model)
        if not self._layers:
            raise ValueError("join_layers: the model holds no syncbn_dist.SyncBatchNorm layer (run convert_model)")
        self._process_group = dist.group.WORLD if join_process_group is None else join_process_group
        self._device = _layers_device(self._layers, self._process_group)
        self._schedule = HeaderSchedule()
        self._sessions = self._bind_layers()
        self._model = weakref.ref(model)
        model.register_forward_pre_hook(_ForwardHeader(self))
        model.register_forward_hook(_ForwardHeader(self, end=True), always_call=True)

    def _bind_layers(self) -> list[JoinSession]:
        """Give each layer its transport; return the session of each group (one copy and listener per group)."""
        groups = {id(layer.process_group): layer.process_group for layer in self._layers}
        copies = _session_groups([dist.group.WORLD if g is None else g for g in groups.values()], self._device)
        sessions: dict[int, JoinSession] = {}
        for key, group in groups.items():
            ranks = tuple(dist.get_process_group_ranks(dist.group.WORLD if group is None else group))
            if dist.get_rank() in ranks:
                sessions[key] = _session(copies[ranks], self._device)
        for layer in self._layers:
            session = sessions.get(id(layer.process_group))
            if session is not None:
                layer._join_binding = JoinBinding(self, JoinTransport(session, session.code_of(layer), self._schedule))
        return list({id(s): s for s in sessions.values()}.values())

    @property
    def active(self) -> bool:
        """Whether a ``Join`` context with this joinable is open (its layers then use their join transports)."""
        return self._join_config.enable

    def join_hook(self, **kwargs: Any) -> JoinHook:
        for session in self._sessions:
            session.reset()
        self._schedule.reset(by_layers=True)  # (Join.__init__, extended, says whether another joinable notifies)
        return _LayersJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self) -> Any:
        return self._process_group

    def _start_of_call(self, transport: JoinTransport) -> None:
        """Before a synchronized training call of one of the layers (``transport``'s), whichever module runs it: the
        header in each session, where due (:class:`~syncbn_dist.comm.join_session.HeaderSchedule`)."""
        schedule = self._schedule
        if not schedule.due(transport):
            return
        if self._join_config.is_first_joinable:  # no other joinable sends Join's per-step notification
            Join.notify_join_context(self)
        schedule.sent(transport)  # (after our own notification: it is this header's)
        if self._join_config.throw_on_early_termination:
            # No rank goes on once one has joined: every rank raises at Join's next notification, so there is no
            # joined rank to count or answer (the rank that ran out sits in Join's own collectives, with no listener).
            return
        for session in self._sessions:
            session.header()

    def _model_forward(self, module: nn.Module, end: bool) -> None:
        if module is self._model():  # (a DataParallel replica shares the model's hooks: its layers find the steps)
            self._schedule.model_forward(end)

    def _start_listeners(self) -> None:
        for session in self._sessions:
            session.start_listener()

    def _update_running_stats(self) -> None:
        """On a joined rank's main thread: the running statistics of the forwards its listeners answered."""
        for session in self._sessions:
            for layer, total in session.take_forward_totals():
                _update_from_total(layer, total)


def synchronized_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of ``model`` that synchronize through syncbn_dist: its own, and torch's while patched."""
    patched = is_torch_sync_batchnorm_patched()
    return [m for m in model.modules() if isinstance(m, SyncBatchNorm) or (patched and isinstance(m, nn.SyncBatchNorm))]


def _update_from_total(layer: nn.Module, total: Tensor) -> None:
    """Update a joined rank's running statistics from a forward's summed payload, as ``SyncBatchNorm`` does."""
    if not (layer.track_running_stats and layer.running_mean is not None):
        return
    with torch.no_grad():
        layer.num_batches_tracked.add_(1)
        mean, _, unbiased_var, count, _ = moments_of_total(total, layer.num_features)
        if count.item() >= 2:
            momentum = 1.0 / float(layer.num_batches_tracked) if layer.momentum is None else layer.momentum
            update_running_stats(layer.running_mean, layer.running_var, mean, unbiased_var, momentum)


class _ForwardHeader:
    """The model's forward pre-hook, or forward hook (``end``), that tells its joinable's header schedule where the
    model's forwards start and end; inert in a copied or unpickled model."""

    def __init__(self, joinable: Optional[SyncBatchNormJoinable], end: bool = False) -> None:
        self._joinable = joinable
        self._end = end

    def __call__(self, module: nn.Module, *args: Any) -> None:
        joinable = self._joinable
        if joinable is not None and joinable.active:
            joinable._model_forward(module, self._end)

    def __deepcopy__(self, memo: dict[int, Any]) -> _ForwardHeader:
        return _ForwardHeader(None)

    def __reduce__(self) -> tuple[Any, tuple[None]]:
        return (_ForwardHeader, (None,))


class _LayersJoinHook(JoinHook):
    def __init__(self, joinable: SyncBatchNormJoinable) -> None:
        self._joinable = joinable

    def main_hook(self) -> None:
        self._joinable._start_listeners()  # already started by Join.__exit__ (see extend_torch_join)
        self._joinable._update_running_stats()  # once per active step: only the main thread writes the buffers

    def post_hook(self, is_last_joiner: bool) -> None:
        joinable = self._joinable
        joinable._join_config = _JoinConfig.construct_disabled_join_config()
        for session in joinable._sessions:
            session.finish()  # the listener's collectives time out as the group's do
        joinable._update_running_stats()  # what the listeners answered since the last main hook


def _session(group: Any, device: torch.device) -> JoinSession:
    """The session on the group copy ``group``: one per copy, shared by every joinable of this process."""
    session = _SESSIONS.get(id(group))
    if session is None or session.process_group is not group:
        session = JoinSession(group, device)
        _SESSIONS[id(group)] = session
    return session


def _layers_device(layers: list[SyncBatchNorm], group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    for layer in layers:
        for tensor in (*layer.parameters(recurse=False), *layer.buffers(recurse=False)):
            return tensor.device
    return torch.device("cpu")


def _session_groups(groups: list[Any], device: torch.device) -> dict[tuple[int, ...], Any]:
    """A copy of each group any rank's layers use, by ranks, with its timeout; collective, on every rank alike."""
    timeouts = {tuple(dist.get_process_group_ranks(g)): _timeout(g, device) for g in groups}
    mine = ";".join(f"{','.join(map(str, ranks))}:{_seconds(timeout)}" for ranks, timeout in sorted(timeouts.items()))
    wanted: dict[tuple[int, ...], Optional[timedelta]] = {}
    for rank_groups in all_gather_bytes(mine.encode()):  # (all_gather_object would need numpy)
        for entry in filter(None, rank_groups.decode().split(";")):
            ranks, seconds = entry.split(":")
            timeout = None if seconds == "" else timedelta(seconds=float(seconds))
            wanted.setdefault(tuple(map(int, ranks.split(","))), timeout)
    world = _SESSION_GROUPS_WORLD[0]
    if world is None or world() is not dist.group.WORLD:
        _SESSION_GROUPS.clear()
        _SESSION_GROUPS_WORLD[0] = weakref.ref(dist.group.WORLD)
    copies = {}
    for ranks in sorted(wanted):
        # Alike on every rank: torch holds a copy until destroy_process_group; a non-member (an int) records its copy.
        reference = _SESSION_GROUPS.get(ranks)
        group = None if reference is None else reference()
        if group is None:
            group = dist.new_group(list(ranks), timeout=wanted[ranks])
            member = isinstance(group, dist.ProcessGroup)
            _SESSION_GROUPS[ranks] = weakref.ref(group) if member else _not_a_member
        if group is not _NOT_A_MEMBER:
            copies[ranks] = group
    return copies


def _seconds(timeout: Optional[timedelta]) -> str:
    return "" if timeout is None else repr(timeout.total_seconds())


def _timeout(group: Any, device: torch.device) -> Optional[timedelta]:
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):  # a backend without options: new_group's default
        return None


def _ours(join: Join) -> list[SyncBatchNormJoinable]:
    return [j for j in join._joinables if isinstance(j, SyncBatchNormJoinable)]


def _only_layers_joined(join: Join, ours: list[SyncBatchNormJoinable]) -> bool:
    """Whether ``join`` holds only the layers' joinables and one of their peers has joined."""
    if not join._enable or len(ours) != len(join._joinables):
        return False
    return any(session.peers_joined for joinable in ours for session in joinable._sessions)


def extend_torch_join() -> None:
    """Extend torch's ``Join`` for synchronized layers, until :func:`restore_torch_join` (docs/design.md, "Uneven
    inputs under Join"). Done when the process makes its first synchronized layer; a no-op if already done."""
    if torch_changes.is_replaced(Join, "__init__"):
        return
    init, enter, exit_, notify = Join.__init__, Join.__enter__, Join.__exit__, Join.notify_join_context

    @functools.wraps(init)
    def __init__(self: Join, joinables: list[Joinable], *args: Any, **kwargs: Any) -> None:
        init(self, joinables, *args, **kwargs)
        _join_layers_of_ddp(self, kwargs)
        ours = _ours(self)
        if ours:
            _let_another_notify(self)
        for joinable in ours:  # with ours first, the layers find the steps themselves (HeaderSchedule)
            joinable._schedule.reset(by_layers=isinstance(self._joinables[0], SyncBatchNormJoinable))

    @functools.wraps(enter)
    def __enter__(self: Join) -> Any:
        result = enter(self)
        OPEN_JOINS[0] += self._enable  # a layer no joinable covers raises in it (comm/join_session.py)
        return result

    @functools.wraps(exit_)
    def __exit__(self: Join, type: Any, value: Any, traceback: Any) -> Any:
        try:
            return _exit_extended(self, type, value, traceback)
        finally:
            OPEN_JOINS[0] -= self._enable

    def _exit_extended(self: Join, type: Any, value: Any, traceback: Any) -> Any:
        ours = _ours(self)
        # A layer no joinable covers raised before any collective, on every rank that ran it: join as a rank out of
        # inputs does, so a rank that joined before (with no batch at all) leaves the Join too; then raise.
        not_covered = type is not None and issubclass(type, NotCoveredByJoinError)
        if self._enable and (type is None or not_covered) and not self._throw_on_early_termination:
            for joinable in ours:  # before Join's first collective: the active ranks' next ones need the listeners
                joinable._start_listeners()
            if not_covered:
                exit_(self, None, None, None)
                return False
        elif type is not None and issubclass(type, LayerMismatchError) and _only_layers_joined(self, ours):
            # All active ranks raised at one collective: leave as a rank out of inputs does, so joined ranks raise too;
            # not beside others, whose collectives joined ranks may shadow (docs/design.md, "Uneven inputs under Join").
            exit_(self, None, None, None)
            return False
        try:
            return exit_(self, type, value, traceback)
        except Exception as error:
            for joinable in ours:  # the active ranks' disagreement, if the listener saw it, is the cause
                for session in joinable._sessions:
                    try:
                        session.raise_listener_error()
                    except Exception as cause:
                        raise cause from error
            raise

    @functools.wraps(notify)
    def notify_join_context(joinable: Joinable) -> Any:
        work = notify(joinable)
        config = joinable._join_config
        if config.enable and config.is_first_joinable:  # Join's per-step notification: a header is due (DDP's too)
            NOTIFICATIONS[0] += 1
        return work

    torch_changes.replace(Join, "__init__", __init__)
    torch_changes.replace(Join, "__enter__", __enter__)
    torch_changes.replace(Join, "__exit__", __exit__)
    torch_changes.replace(Join, "notify_join_context", staticmethod(notify_join_context))


def restore_torch_join() -> None:
    """Undo :func:`extend_torch_join`: torch's ``Join`` again, reaching the layers only through ``join_layers``."""
    torch_changes.restore(Join, "__init__")
    torch_changes.restore(Join, "__enter__")
    torch_changes.restore(Join, "__exit__")
    torch_changes.restore(Join, "notify_join_context")


def _let_another_notify(join: Join) -> None:
    """If ours is first beside another joinable (DDP), the other sends Join's per-step notification (docs/design.md)."""
    first = join._joinables[0]
    other = next((j for j in join._joinables if not isinstance(j, SyncBatchNormJoinable)), None)
    if isinstance(first, SyncBatchNormJoinable) and other is not None:
        first._join_config = first._join_config._replace(is_first_joinable=False)
        other._join_config = other._join_config._replace(is_first_joinable=True)


def _join_layers_of_ddp(join: Join, kwargs: dict[str, Any]) -> None:
    """Append a joinable for each DDP model's layers no listed one covers: collective at a model's first ``Join``, on
    every rank alike, as every rank builds the same ``Join``."""
    covered = {id(layer) for joinable in _ours(join) for layer in joinable._layers}
    added = []
    for ddp in join._joinables:
        if not isinstance(ddp, DistributedDataParallel):
            continue
        if any(id(layer) not in covered for layer in synchronized_layers(ddp)):
            joinable = join_layers(ddp, ddp.process_group)
            joinable._join_config = _JoinConfig(join._enable, join._throw_on_early_termination, False)
            added.append(joinable)
    if added:
        join._joinables = [*join._joinables, *added]
        join._join_hooks = [*join._join_hooks, *(j.join_hook(**kwargs) for j in added)]


torch_changes.on_first_use(extend_torch_join)
