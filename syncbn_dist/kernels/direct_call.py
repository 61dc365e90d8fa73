r"""A compiled region's inductor graph, called without ``torch.compile``'s per-call machinery.

After a signature's first call (which takes the ``torch.compile`` path), :class:`DirectCall` calls its inductor graph
with inputs read from the region's arguments, after checking what Dynamo's guards would; a call that fails a check
returns None and takes the ``torch.compile`` path. How it is built, what it checks, and what it saves (Dynamo's
guards and AOTAutograd's wrappers, 60-120 µs a region inside a step): docs/design.md, "Compiled kernels" ("Cost").
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from .. import torch_changes

__all__ = ["DirectCall", "GraphCallRecorder", "recording_backend"]

# How a graph input is read from the region's arguments: (argument index, None) for the argument itself, else
# (argument index, (method name, method arguments)) for a size, stride or storage offset of it.
_Recipe = tuple[tuple[int, Optional[tuple[str, tuple[int, ...]]]], ...]


def recording_backend(record: dict[str, Any]) -> Callable[..., Any]:
    """Inductor as a ``torch.compile`` backend that first keeps the sources of Dynamo's graph inputs (its placeholders'
    ``grapharg.source``, or None) in ``record["sources"]``, before inductor's passes rewrite the graph."""

    def backend(graph_module: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        placeholders = graph_module.graph.find_nodes(op="placeholder")
        record["sources"] = [getattr(node.meta.get("grapharg"), "source", None) for node in placeholders]
        return compile_fx(graph_module, example_inputs)

    return backend


class GraphCallRecorder:
    """While entered, records every call of an inductor ``CompiledFxGraph`` made on this thread as ``(graph, inputs,
    outputs)`` in :attr:`calls`. Calls on other threads pass through unrecorded. Entered by one thread at a time
    (the caller holds the first-call lock)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, list[Any], Any]] = []

    def __enter__(self) -> GraphCallRecorder:
        from torch._inductor.output_code import CompiledFxGraph

        owner, original = threading.get_ident(), CompiledFxGraph.__call__

        def recording_call(graph: Any, inputs: list[Any]) -> Any:
            if threading.get_ident() != owner:
                return original(graph, inputs)
            recorded = list(inputs)  # the generated code empties the list it is given
            outputs = original(graph, inputs)
            self.calls.append((graph, recorded, outputs))
            return outputs

        self._change = torch_changes.temporarily(CompiledFxGraph, "__call__", recording_call)
        self._change.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._change.__exit__(*exc)


def _layout(t: Tensor) -> Optional[str]:
    """The memory layout class a compiled graph was specialized for: ``"contiguous"``, ``"channels_innermost"`` (a
    dense (N, C, L) whose channels are innermost: channels_last flattened), else None."""
    if t.is_contiguous():
        return "contiguous"
    if t.dim() == 3 and t.stride() == (t.size(1) * t.size(2), 1, t.size(1)):
        return "channels_innermost"
    return None


class DirectCall:
    """Calls one inductor graph with inputs read from a region's arguments; see the module docstring."""

    def __init__(
        self,
        graph: Any,
        recipe: _Recipe,
        layouts: tuple[tuple[int, str], ...],
        offsets: tuple[tuple[int, int], ...],
        outputs: tuple[Optional[int], ...],
    ) -> None:
        self.graph, self.recipe, self.layouts, self.offsets, self.outputs = graph, recipe, layouts, offsets, outputs

    @classmethod
    def build(
        cls,
        fn: Callable[..., Any],
        sources: Optional[list[Any]],
        calls: list[tuple[Any, list[Any], Any]],
        args: tuple[Any, ...],
        result: Any,
    ) -> Optional[DirectCall]:
        """The DirectCall of ``fn``'s compiled graph, from its first call (``args`` -> ``result``), the sources of
        Dynamo's graph inputs (:func:`recording_backend`) and inductor's recorded calls (:class:`GraphCallRecorder`);
        None where they are not of the form a DirectCall can reproduce."""
        from torch._dynamo.source import LocalSource, TensorPropertySource

        if sources is None or len(calls) != 1 or not isinstance(result, tuple):
            return None
        graph, inputs, outputs = calls[0]
        names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
        if len(sources) != len(inputs) or len(names) != len(args):
            return None
        recipe = []
        for source, value in zip(sources, inputs):
            if isinstance(source, LocalSource) and source.local_name in names:
                index = names.index(source.local_name)
                if value is not args[index]:
                    return None
                recipe.append((index, None))
            elif isinstance(source, TensorPropertySource) and isinstance(source.base, LocalSource):
                if source.base.local_name not in names:
                    return None
                index = names.index(source.base.local_name)
                method = (source.prop.method_name(), () if source.idx is None else (source.idx,))
                if not isinstance(args[index], Tensor) or getattr(args[index], method[0])(*method[1]) != value:
                    return None
                recipe.append((index, method))
            else:
                return None
        mapping = []
        for item in result:
            if item is None:
                mapping.append(None)
                continue
            position = next((j for j, output in enumerate(outputs) if output is item), None)
            if position is None:
                return None
            mapping.append(position)
        tensors = [(i, arg) for i, arg in enumerate(args) if isinstance(arg, Tensor)]
        layouts = tuple((i, _layout(arg)) for i, arg in tensors)
        if any(layout is None for _, layout in layouts):
            return None
        read_offsets = {index for index, method in recipe if method is not None and method[0] == "storage_offset"}
        offsets = tuple((i, arg.storage_offset()) for i, arg in tensors if i not in read_offsets)
        return cls(graph, tuple(recipe), layouts, offsets, tuple(mapping))

    def __call__(self, args: tuple[Any, ...]) -> Optional[tuple[Any, ...]]:
        """The region's result for ``args`` (of the signature this graph was compiled for), or None where a check
        fails and the ``torch.compile`` path must run."""
        if torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
            return None
        for index, layout in self.layouts:
            arg = args[index]
            if type(arg) is not Tensor or arg.requires_grad or _layout(arg) != layout:
                return None
        for index, offset in self.offsets:
            if args[index].storage_offset() != offset:
                return None
        inputs = [
            args[index] if method is None else getattr(args[index], method[0])(*method[1])
            for index, method in self.recipe
        ]
        outputs = self.graph(inputs)
        return tuple(None if position is None else outputs[position] for position in self.outputs)
