"""Every process-wide switch of syncbn_dist, and every environment variable it reads, in one place.

Other modules read the switches here, never the environment. The variables keep their published names
(docs/api/switches.md, "Environment variables"); torchrun's ``WORLD_SIZE`` too (:func:`launched_world_size`).
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

__all__ = [
    "DEFAULT_REPLICA_TIMEOUT",
    "KERNEL_MODES",
    "KERNELS_ENV",
    "PATCH_TORCH_ENV",
    "get_kernels",
    "is_debug_enabled",
    "launched_world_size",
    "set_debug",
    "set_kernels",
    "set_sbn_eps_mode",
]

# The kernels

KERNEL_MODES = ("auto", "compiled", "native")
KERNELS_ENV = "SYNCBN_DIST_KERNELS"
# The modes of the eager compiled kernels, retired in 0.2.0: they run the native kernels, with a DeprecationWarning.
_RETIRED_MODES = ("auto", "compiled")
_RETIRED_IN, _REMOVED_IN = "0.2.0", "0.3.0"


def set_kernels(mode: str) -> None:
    """Choose the kernels of every synchronized layer's eager training forward and backward, process-wide.

    There is one eager kernel set, the native one (torch's batch-norm ops; nothing compiles). ``"compiled"`` and
    ``"auto"``, which chose inductor-compiled kernels until 0.1.0, are accepted until 0.3.0: they warn once and run
    the native kernels. A user's ``torch.compile`` traces the layer into its own graph whatever the mode
    ([compile.md](../compile.md)).

    Args:
        mode: ``"native"``; ``"compiled"`` or ``"auto"``, deprecated.

    Raises:
        ValueError: for any other mode.

    Warns:
        DeprecationWarning: for ``"compiled"`` or ``"auto"``, once per mode and process.
    """
    _checked_mode(mode, "set_kernels")


def get_kernels() -> str:
    """The kernel set of every synchronized layer's eager training calls: ``"native"``, the only one.

    Reads ``SYNCBN_DIST_KERNELS`` (``"native"``; ``"compiled"`` and ``"auto"`` deprecated, as for
    :func:`set_kernels`).

    Raises:
        ValueError: if ``SYNCBN_DIST_KERNELS`` holds an unknown mode.

    Warns:
        DeprecationWarning: if ``SYNCBN_DIST_KERNELS`` holds ``"compiled"`` or ``"auto"``, once per mode and process.
    """
    _checked_mode(os.environ.get(KERNELS_ENV, "native"), KERNELS_ENV)
    return "native"


def _checked_mode(mode: Any, source: str) -> None:
    if mode not in KERNEL_MODES:
        raise ValueError(f"{source}: expected one of {', '.join(map(repr, KERNEL_MODES))}, got {mode!r}")
    if mode in _RETIRED_MODES:
        _warn_retired(mode, source)


@functools.cache
def _warn_retired(mode: str, source: str) -> None:
    warnings.warn(
        f"{source}: the {mode!r} kernels were retired in syncbn_dist {_RETIRED_IN}; the native kernels run instead, "
        f"and {mode!r} is refused from {_REMOVED_IN} (a user's torch.compile still fuses the layer into its graph)",
        DeprecationWarning,
        stacklevel=4,
    )

# Checked once at import, since no call reads it any more: a retired mode warns, an unknown one raises.
if KERNELS_ENV in os.environ:
    get_kernels()


# eps mode

# The process-wide default of SyncBatchNorm.eps_mode; see set_sbn_eps_mode.
_EPS_MODE = "plus"
_EPS_MODE_ALIASES = {"plus": "plus", "clip": "clip", "clamp": "clip"}


def set_sbn_eps_mode(mode: str) -> None:
    """Set how every SyncBatchNorm without its own ``eps_mode`` applies ``eps`` to the batch variance in training.

    The classic Synchronized-BatchNorm-PyTorch API, with the same global scope. ``"plus"`` (the default) normalizes
    by ``sqrt(var + eps)`` as ``nn.BatchNorm`` does; ``"clip"`` (the classic library's default, ``"clamp"`` there) by
    ``sqrt(max(var, eps))``, to reproduce models trained with it, in every training forward, synchronized or not.
    Eval mode always uses ``running_var + eps``, as both libraries do. A layer's ``eps_mode``, unless None, wins.

    Args:
        mode: ``"plus"``, ``"clip"`` or ``"clamp"`` (= ``"clip"``).

    Raises:
        ValueError: for any other mode.
    """
    global _EPS_MODE
    _EPS_MODE = _resolve_eps_mode(mode)


def _resolve_eps_mode(mode: str) -> str:
    if mode not in _EPS_MODE_ALIASES:
        raise ValueError(f"expected eps mode 'plus', 'clip' or 'clamp' (got {mode!r})")
    return _EPS_MODE_ALIASES[mode]


# Debug mode, timeouts, the torch patch of child processes

_DEBUG = os.environ.get("SYNCBN_DEBUG", "0").strip().lower() not in ("", "0", "false", "no", "off")


def set_debug(enabled: bool) -> None:
    """Turn debug mode on or off for this process (also on with the environment variable ``SYNCBN_DEBUG=1``).

    In debug mode a small ``all_gather`` before each synchronized collective, forward and backward, checks that every
    member is at the same one (call number, layer name, num_features, dtype, direction); else every member raises
    :class:`LayerMismatchError` naming each rank's layer, instead of hanging or mixing statistics. Off by default:
    collective tags and the first step check what they can ([What is caught, and
    when](../troubleshooting.md#what-is-caught-and-when)).

    Args:
        enabled: True turns debug mode on, False off.
    """
    global _DEBUG
    _DEBUG = bool(enabled)


def is_debug_enabled() -> bool:
    """Whether debug mode is on (see :func:`set_debug`)."""
    return _DEBUG


# How long a replica waits for the others at one synchronized layer before giving up (seconds).
DEFAULT_REPLICA_TIMEOUT = float(os.environ.get("SYNCBN_REPLICA_TIMEOUT", "300"))

# "1" in the processes of a ``python -m syncbn_dist.run`` job: integrations/_bootstrap/sitecustomize.py patches there.
PATCH_TORCH_ENV = "SYNCBN_PATCH_TORCH"


def launched_world_size() -> int:
    """The number of processes the launcher says this job has (torchrun's ``WORLD_SIZE``), 1 where it says nothing
    (or nothing readable)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1
