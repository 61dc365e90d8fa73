"""Every change syncbn_dist makes to torch's own classes, in one place: what is changed now, and the undo of each.

Changes go only through :func:`replace` (until :func:`restore`), so :func:`changed` always says what differs from
torch. None at import: on request (:func:`syncbn_dist.patch_torch_sync_batchnorm`) or at the first synchronized layer
(:func:`on_first_use`); each, and what it buys: docs/design.md, "Private torch APIs and changes to torch's
classes". Imports nothing of syncbn_dist, so that every part of it can use it.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = [
    "apply_first_use_changes",
    "changed",
    "is_replaced",
    "on_first_use",
    "replace",
    "restore",
    "restore_all",
]

_MISSING = object()
_NOT_CHANGED = object()
# (class, attribute) -> torch's own value (or _MISSING where the class had none), for each attribute changed now.
_ORIGINALS: dict[tuple[type, str], Any] = {}
# Changes to make when the first synchronized layer is made (on_first_use), and whether that happened.
_FIRST_USE: list[Callable[[], None]] = []
_FIRST_USE_DONE = [False]


def replace(owner: type, name: str, value: Any) -> None:
    """Set ``owner.name`` to ``value``, keeping torch's own value (the first time) for :func:`restore`."""
    _ORIGINALS.setdefault((owner, name), owner.__dict__.get(name, _MISSING))
    setattr(owner, name, value)


def restore(owner: type, name: str) -> None:
    """Put torch's own ``owner.name`` back, the same object (a no-op where it is not changed)."""
    original = _ORIGINALS.pop((owner, name), _NOT_CHANGED)
    if original is _NOT_CHANGED:
        return
    if original is _MISSING:
        delattr(owner, name)
    else:
        setattr(owner, name, original)


def restore_all() -> None:
    """Put torch's own value back for every attribute :func:`replace` changed: torch as it was before syncbn_dist."""
    for owner, name in list(_ORIGINALS):
        restore(owner, name)


def is_replaced(owner: type, name: str) -> bool:
    """Whether ``owner.name`` is changed by :func:`replace` now."""
    return (owner, name) in _ORIGINALS


def changed() -> list[str]:
    """What differs from torch now: ``"module.Class.attribute"`` for each attribute :func:`replace` changed."""
    return sorted(f"{owner.__module__}.{owner.__qualname__}.{name}" for owner, name in _ORIGINALS)


def on_first_use(change: Callable[[], None]) -> None:
    """Make ``change`` (which calls :func:`replace`) when the first synchronized layer is made, or now if one was."""
    if _FIRST_USE_DONE[0]:
        change()
    else:
        _FIRST_USE.append(change)


def apply_first_use_changes() -> None:
    """Called by every synchronized layer as it is made: the first call makes the changes :func:`on_first_use` holds."""
    if _FIRST_USE_DONE[0]:
        return
    _FIRST_USE_DONE[0] = True
    while _FIRST_USE:
        _FIRST_USE.pop(0)()
