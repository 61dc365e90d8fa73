"""What Dynamo must know of syncbn_dist (what it must not trace, or must call while tracing), marked once
``torch._dynamo`` loads, so that importing syncbn_dist loads none of torch's compiler stack (tests/test_imports.py;
docs/design.md, "Private torch APIs and changes to torch's classes").
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Any, Callable, Optional

__all__ = ["never_traced", "when_dynamo_loads"]

_DYNAMO = "torch._dynamo"
# The marks waiting for Dynamo, made in the order they were asked for.
_ON_DYNAMO: list[Callable[[], None]] = []


def when_dynamo_loads(mark: Callable[[], None]) -> None:
    """Call ``mark`` once ``torch._dynamo`` is imported: now, if it is; else right after its import, which every
    ``torch.compile`` makes before it traces (through an import hook that removes itself)."""
    if _DYNAMO in sys.modules and getattr(sys.modules[_DYNAMO], "disable", None) is not None:
        mark()
        return
    if not _ON_DYNAMO:
        sys.meta_path.insert(0, _DynamoImportHook())
    _ON_DYNAMO.append(mark)


def never_traced(owner: type, *names: str) -> None:
    """Replace each method ``owner.<name>`` by ``torch.compiler.disable`` of it, once Dynamo is loaded."""

    def mark() -> None:
        import torch

        for name in names:
            setattr(owner, name, torch.compiler.disable(getattr(owner, name)))

    when_dynamo_loads(mark)


class _DynamoImportHook(importlib.abc.MetaPathFinder):
    """Finds ``torch._dynamo`` as the other finders do, and runs the waiting marks once its module has executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != _DYNAMO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            marks = list(_ON_DYNAMO)
            _ON_DYNAMO.clear()
            for mark in marks:
                mark()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
