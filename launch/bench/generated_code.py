"""What inductor's generated C++ computes per activation element: statements in float64, roots and divisions.

A BatchNorm layer's per-channel coefficients (mean, invstd, scale, shift; backward's ``a, b, c``) are C values: they
belong in a loop over channels, computed once. Inlined into the pointwise loop over the activation, they are computed
again at every element, and for a synchronized layer, whose statistics come from a float64 payload, in float64 with a
division and a root each time: costly on any device (issue 45). This module counts, in the kernels inductor generates
for a compiled step, the statements of the loops over activation elements that name ``double``, take a root or
divide, split by kind of loop (pointwise, or a reduction over the activation). Counts are deterministic; the CPU's C++
is what a machine without a GPU can inspect.

A loop nest is over activation elements when its iteration space (the product of its loops' ranges, in elements)
exceeds ``min_elements``: the caller passes 4 x the model's largest channel count, above any per-channel loop (at most
the 2C + 6 values of a payload) and below any activation of a batch of 8 or more.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable

__all__ = ["KINDS", "per_element_statements"]

# The kinds counted, each a test of one generated statement.
KINDS = ("statements", "double", "root", "division")
_LOOP = re.compile(
    r"for\(int64_t (\w+)=static_cast<int64_t>\((-?\d+)L\); \1<static_cast<int64_t>\((\d+)L\); "
    r"\1\+=static_cast<int64_t>\((\d+)L\)\)"
)
_KERNEL = re.compile(r"cpp_fused\w* = async_compile\.cpp_pybinding\(\[.*?\], r'''(.*?)'''\)", re.S)
_DIVISION = re.compile(r"[^/*]/[^/*]|reciprocal")


def _kinds_of(statement: str) -> list[str]:
    kinds = ["statements"]
    if "double" in statement:
        kinds.append("double")
    if "sqrt" in statement:  # rsqrt(), sqrt(), 1 / std::sqrt()
        kinds.append("root")
    if _DIVISION.search(statement):
        kinds.append("division")
    return kinds


def _loop_nests(kernel: str) -> Iterable[tuple[bool, list[tuple[int, str]]]]:
    """Each outermost loop nest of a C++ kernel: whether it accumulates (a reduction), and its statements, each with
    the iteration space of the loops around it."""
    depth, pending = 0, None
    open_loops: list[tuple[int, int]] = []  # (brace depth of the loop's body, its range)
    nest: list[tuple[int, str]] = []  # (iteration space at the statement, statement)
    reduction = False
    for line in kernel.splitlines():
        text = line.strip()
        loop = _LOOP.search(text)
        if loop is not None:
            pending = int(loop.group(3)) - int(loop.group(2))
        elif text == "{":
            depth += 1
            if pending is not None:
                open_loops.append((depth, pending))
                pending = None
        elif text == "}":
            while open_loops and open_loops[-1][0] == depth:
                open_loops.pop()
            depth -= 1
            if not open_loops and nest:
                yield reduction, nest
                nest, reduction = [], False
        elif open_loops and text.endswith(";"):
            space = 1
            for _, extent in open_loops:
                space *= extent
            nest.append((space, text))
            reduction = reduction or "tmp_acc" in text


def per_element_statements(sources: Iterable[str], min_elements: int) -> dict[str, Counter[str]]:
    """Statements of the loops over more than ``min_elements`` elements in inductor's generated C++ ``sources`` (the
    module sources ``torch._inductor.utils.run_and_get_code`` returns), by kind of loop and of statement.

    Returns:
        ``{"pointwise": Counter, "reduction": Counter}``, each counting :data:`KINDS`: every statement, those that
        name ``double``, those that take a root, those that divide. A nest that accumulates is a reduction.
    """
    counts: dict[str, Counter[str]] = {"pointwise": Counter(), "reduction": Counter()}
    for source in sources:
        for kernel in _KERNEL.findall(source):
            for reduction, statements in _loop_nests(kernel):
                counter = counts["reduction" if reduction else "pointwise"]
                for space, statement in statements:
                    if space > min_elements:
                        counter.update(_kinds_of(statement))
    return counts
