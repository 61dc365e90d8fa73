"""Run a training script or module with every ``torch.nn.SyncBatchNorm`` synchronized through syncbn_dist.

Usage::

    python -m syncbn_dist.run train.py ARGS...                       # as `python train.py ARGS...`
    python -m syncbn_dist.run -m package.module ARGS...              # as `python -m package.module ...`
    torchrun --nproc_per_node=2 -m syncbn_dist.run train.py ARGS...  # each worker as `python train.py`

It calls :func:`syncbn_dist.patch_torch_sync_batchnorm`, then runs the target as Python would: ``__name__ ==
"__main__"``, ``sys.argv`` = ``[target, *ARGS]`` (the module's file for ``-m``), ``sys.path[0]`` the script's directory
(the working directory for ``-m``); the target's exit status and exceptions pass through (``sys.exit(3)`` exits 3).
Python processes it starts inherit the patch (Lightning's DDP launcher, ``torch.multiprocessing`` spawn) unless started
with ``-E`` or ``-I`` ([how to undo it](../frameworks.md#how-to-undo-it)). No target: exit status 2, usage on
stderr.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Optional, Sequence

from ..settings import PATCH_TORCH_ENV
from .torch_patch import patch_torch_sync_batchnorm

__all__ = ["ENV_VAR", "main"]

# Set to "1" for the target and every process it starts: the start-up hook patches where it is "1".
ENV_VAR = PATCH_TORCH_ENV
_BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")
_USAGE = "usage: python -m syncbn_dist.run (SCRIPT | -m MODULE) [ARGS...]"


def _export_to_children() -> None:
    """Set ``SYNCBN_PATCH_TORCH=1`` and put the start-up hook first on ``PYTHONPATH`` (once) for child processes."""
    os.environ[ENV_VAR] = "1"
    entries = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    if _BOOTSTRAP not in entries:
        os.environ["PYTHONPATH"] = os.pathsep.join([_BOOTSTRAP, *entries])


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Patch, then run the target of ``argv`` (default ``sys.argv[1:]``) as ``__main__``; see the module docstring.

    Args:
        argv: ``[SCRIPT, *ARGS]`` or ``["-m", MODULE, *ARGS]`` (``-mMODULE`` too).

    Returns:
        0 after the target returns normally; 2 for a missing target. The target's ``SystemExit`` or error propagates.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    module: Optional[str] = None
    if args and args[0] == "-m" and len(args) > 1:
        module, rest = args[1], args[2:]
    elif args and args[0].startswith("-m") and len(args[0]) > 2:
        module, rest = args[0][2:], args[1:]
    elif args and not args[0].startswith("-"):
        script, rest = args[0], args[1:]
    else:
        print(_USAGE, file=sys.stderr)
        return 2
    _export_to_children()
    patch_torch_sync_batchnorm()
    if module is not None:
        sys.argv = [module, *rest]  # run_module replaces argv[0] with the module's file, as `python -m` does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [script, *rest]
        sys.path[0] = os.path.dirname(os.path.realpath(script))  # `python script.py` puts the script's directory first
        runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
