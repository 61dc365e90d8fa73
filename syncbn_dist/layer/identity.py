"""A synchronized layer's identity: its place in the model that holds it, read from the model's structure, the same on
every rank for the same layer whoever built it (docs/design.md, "Every collective checks itself").

torch's global module-registration hook records, for every module assigned into another, its parent and its name
there (``_PARENTS`` in the child's ``__dict__``, which DataParallel replicas share and ``copy.deepcopy`` maps to the
copied parent). A layer's identity, read at its first synchronized call, is its path from the outermost module above
it (below torch's wrappers: DDP, DataParallel, ``torch.compile``) and a fingerprint of that module's structure (every
submodule's name, class and width): two places in one model differ by path, two models of different structure (a
GAN's generator and discriminator) by fingerprint. What still collides, a model and its exact copy: docs/design.md.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any, Optional

import torch
from torch import nn

from ..compiler_marks import when_dynamo_loads

__all__ = ["identity_while_tracing", "layer_identity", "record_parents"]

# The key of a module's parent links in its __dict__.
_PARENTS = "_syncbn_dist_parents"
# Each outermost module's structure fingerprint, made at the first synchronized call below it.
_FINGERPRINTS: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


class _ParentLink:
    """A module's place in one parent: the parent (weakly: a child must not keep its parent alive) and the name."""

    __slots__ = ("parent", "name")

    def __init__(self, parent: nn.Module, name: str) -> None:
        self.parent = weakref.ref(parent)
        self.name = name


class _Links(list):  # type: ignore[type-arg]
    """A module's parent links, in the order made. A deep copy links to the copied parents (``copy.deepcopy`` makes a
    parent before its children); a pickle holds none and loads as a plain empty list, so a model saved whole loads
    where syncbn_dist is not installed (``convert_model`` links a loaded model again)."""

    __slots__ = ()

    def __deepcopy__(self, memo: dict[int, Any]) -> _Links:
        copied = memo[id(self)] = _Links()
        for link in self:
            parent = link.parent()
            parent_copy = None if parent is None else memo.get(id(parent))
            if parent_copy is not None:
                copied.append(_ParentLink(parent_copy, link.name))
        return copied

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (list, ())


def _links(module: nn.Module) -> list[_ParentLink]:
    links = module.__dict__.get(_PARENTS)
    if not isinstance(links, _Links):  # (none yet, or a plain list from a pickle)
        links = module.__dict__[_PARENTS] = _Links()
    return links


def _record(parent: nn.Module, name: str, child: Optional[nn.Module]) -> None:
    """torch's module-registration hook: remember that ``child`` sits at ``name`` in ``parent`` (links in the order
    made, dead ones dropped; the first live one is the child's place)."""
    if child is None or not isinstance(child, nn.Module):
        return
    links = _links(child)
    links[:] = [link for link in links if link.parent() is not None]
    if not any(link.parent() is parent and link.name == name for link in links):
        links.append(_ParentLink(parent, name))


def record_parents(root: nn.Module) -> None:
    """Record every parent-child link below ``root`` (convert_model's: a model built before syncbn_dist was imported).

    Args:
        root: any module.
    """
    for parent in root.modules():
        for name, child in parent._modules.items():
            _record(parent, name, child)


def _holds(link: _ParentLink, links: list[_ParentLink]) -> Optional[nn.Module]:
    """The parent of ``link`` if it still holds, at its name, the module whose links are ``links`` (the module itself,
    or a DataParallel replica's original: they share their links), else None."""
    parent = link.parent()
    if parent is None:
        return None
    child = parent._modules.get(link.name)
    return parent if child is not None and child.__dict__.get(_PARENTS) is links else None


def _wraps(parent: nn.Module) -> bool:
    """Whether ``parent`` is one of torch's wrappers, which a rank may add or leave out without changing the model (a
    compilation or a validation copy on one rank): DistributedDataParallel, DataParallel, ``torch.compile``'s module."""
    return isinstance(parent, (nn.parallel.DistributedDataParallel, nn.DataParallel)) or (
        type(parent).__module__ == "torch._dynamo.eval_frame"
    )


def _place(layer: nn.Module) -> tuple[nn.Module, str]:
    """The outermost module above ``layer`` through its first live links, below any of torch's wrappers, and
    ``layer``'s path from it."""
    names: list[str] = []
    module, seen = layer, {id(layer)}
    while True:
        links = module.__dict__.get(_PARENTS) or []
        parent, name = None, ""
        for link in links:
            parent = _holds(link, links)
            if parent is not None:
                name = link.name
                break
        if parent is None or id(parent) in seen or _wraps(parent):
            return module, ".".join(reversed(names))
        names.append(name)
        seen.add(id(parent))
        module = parent


def _fingerprint(root: nn.Module) -> str:
    fingerprint = _FINGERPRINTS.get(root)
    if fingerprint is None:
        structure = "\n".join(
            f"{name}:{type(module).__qualname__}:{getattr(module, 'num_features', '')}"
            for name, module in root.named_modules()
        )
        fingerprint = _FINGERPRINTS[root] = hashlib.blake2b(structure.encode(), digest_size=6).hexdigest()
    return fingerprint


def layer_identity(layer: nn.Module) -> str:
    """What names ``layer`` in its collective tags: ``"<fingerprint>:<path>"``, the path from the outermost module above
    it and a fingerprint of that module's structure (read once per outermost module).

    The same on every rank for the same layer of the same model, whatever built it (directly, a framework,
    ``convert_model``) and whatever else the process built; distinct for two places of one model and for two models of
    different structure.

    A layer that nothing named (``_qualified_name``, set by ``convert_model``) takes its path as its name in errors.

    Args:
        layer: a synchronized layer (or a DataParallel replica of one).

    Returns:
        The identity, short text.
    """
    root, path = _place(layer)
    if layer.__dict__.get("_qualified_name") is None:
        layer.__dict__["_qualified_name"] = path
    return f"{_fingerprint(root)}:{path}"


def identity_while_tracing(layer: nn.Module) -> str:
    """:func:`layer_identity`, called eagerly while Dynamo traces (marked ``assume_constant_result``: the graph keeps
    the text)."""
    return layer_identity(layer)


# From import on: a model built afterwards is linked whole, even one assembled top-down (a container assigned to its
# parent before its layers are built). Only observes; docs/design.md, "Private torch APIs and changes to torch's
# classes".
nn.modules.module.register_module_module_registration_hook(_record)
when_dynamo_loads(lambda: torch.compiler.assume_constant_result(identity_while_tracing))
