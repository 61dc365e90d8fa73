"""Start-up hook of the processes a ``python -m syncbn_dist.run`` job starts: the patch, inherited.

:mod:`site` imports it in every Python process of the job (docs/frameworks.md, "How to undo it"), as ``ddtrace-run`` and
``opentelemetry-instrument`` do. It runs the ``sitecustomize`` it shadows, then patches if ``SYNCBN_PATCH_TORCH=1``.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _run_shadowed() -> None:
    """Run the ``sitecustomize`` that this one shadows (the next one on sys.path), as Python would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _patch() -> None:
    if os.environ.get("SYNCBN_PATCH_TORCH") != "1":
        return
    import syncbn_dist

    syncbn_dist.patch_torch_sync_batchnorm()


for _step in (_run_shadowed, _patch):
    try:
        _step()
    except Exception as _error:  # noqa: BLE001 - reported on stderr; start-up goes on, as site does for sitecustomize
        sys.stderr.write(f"syncbn_dist start-up hook ({_step.__name__}) failed: {type(_error).__name__}: {_error}\n")
