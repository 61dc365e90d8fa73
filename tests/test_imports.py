"""The package's import graph: no circles in ``syncbn_dist/`` or ``launch/``, and the direction of the layers.

The graph is read from the source with :mod:`ast`, so nothing is imported. Imports at module level and under
``TYPE_CHECKING`` are the structure: no circle among them. An import inside a function runs when the function is
called; each one into a package above the importing module's (docs/design.md, "The package") is listed here as a
deliberate exception, so that a new one is a decision.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def import_graph(packages: tuple[str, ...], *, deferred: bool = False) -> dict[str, set[str]]:
    """``{module: modules of ``packages`` it imports}`` for every module of ``packages`` (dotted names): the imports at
    module level and under ``TYPE_CHECKING``, or with ``deferred`` those inside functions.

    ``from package import name`` depends on ``package.name`` where that is a module, else on ``package``; a module's
    own packages (imported before it anyway) are left out.
    """
    modules = {
        _module_name(path): path for package in packages for path in (ROOT / package).rglob("*.py")
    }
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        base = name if _is_package(path) else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text()), deferred):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = base.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    source = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" for alias in node.names] + [source]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                # A module's own packages are imported before it anyway: an edge to one is no dependency.
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def _imports(tree: ast.Module, deferred: bool) -> list[ast.AST]:
    """The import statements outside every function body (or, with ``deferred``, inside one)."""
    found: list[ast.AST] = []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and inside == deferred:
                found.append(child)
            walk(child, inside)

    walk(tree, False)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


@pytest.mark.parametrize("package", ["syncbn_dist", "launch"])
def test_no_import_circles(package: str) -> None:
    assert import_cycles(import_graph((package,))) == []


# The order of the parts of syncbn_dist: a module imports (at module level) only from its own part and those before it.
LAYERS = ("settings", "torch_changes", "compiler_marks", "comm", "kernels", "layer", "integrations")
# Imports inside a function that go up the order, each deliberate: the classmethod alias of convert_model.
DEFERRED_UPWARD = {("syncbn_dist.layer.batchnorm", "syncbn_dist.integrations.convert")}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else ""


def test_the_parts_of_the_library_import_downward() -> None:
    upward = {
        (module, target)
        for deferred in (False, True)
        for module, targets in import_graph(("syncbn_dist",), deferred=deferred).items()
        for target in targets
        if _part(module) and _part(target) and LAYERS.index(_part(target)) > LAYERS.index(_part(module))
    }
    assert upward == DEFERRED_UPWARD


def test_the_library_never_imports_the_recipes() -> None:
    graph = {module: set() for module in import_graph(("syncbn_dist", "launch"))}
    for deferred in (False, True):
        for module, targets in import_graph(("syncbn_dist", "launch"), deferred=deferred).items():
            graph[module] |= targets
    assert not [(module, target) for module, targets in graph.items() if module.startswith("syncbn_dist")
                for target in targets if target.startswith("launch")]


def test_the_checks_find_a_circle() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


# Run in a fresh interpreter: what `import syncbn_dist` loads, then what the compiler's marks are once Dynamo loads.
_MARKS = """
import sys
import torch
if {dynamo_first}:
    import torch._dynamo
import syncbn_dist
from syncbn_dist.comm import agreement
from syncbn_dist.kernels import tracing
from syncbn_dist.layer.batchnorm import SyncBatchNorm

def marks():
    return [
        hasattr(SyncBatchNorm._replica_forward, "_torchdynamo_disable"),
        hasattr(SyncBatchNorm._eager_sync_forward, "_torchdynamo_disable"),
        getattr(tracing._in_eager_replica, "_dynamo_marked_constant", False),
        getattr(agreement.verify_while_tracing, "_dynamo_marked_constant", False),
    ]

loaded = sorted({{name for name in sys.modules if name.startswith(("torch._dynamo", "torch._inductor"))}})
before = marks()
torch.compile(torch.nn.Linear(2, 2), backend="eager")(torch.ones(1, 2))
print(repr((loaded[:3], "torch.distributed.nn" in sys.modules, before, marks())))
"""


def _marks(dynamo_first: bool) -> tuple[list[str], bool, list[bool], list[bool]]:
    code = _MARKS.format(dynamo_first=dynamo_first)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return ast.literal_eval(result.stdout.strip().splitlines()[-1])


def test_importing_the_library_loads_no_compiler_and_compiling_marks_it() -> None:
    loaded, distributed_nn, before, after = _marks(dynamo_first=False)
    assert loaded == []  # import torch._dynamo alone costs more than import torch
    assert distributed_nn  # before init_process_group: its group=group.WORLD defaults hold nothing
    assert before == [False] * 4
    assert after == [True] * 4


def test_marks_made_at_import_when_dynamo_is_loaded_first() -> None:
    loaded, _, before, after = _marks(dynamo_first=True)
    assert loaded and before == [True] * 4 and after == [True] * 4
