"""The closeness assertion of the tests: a result equals its float64 reference to a tolerance the call site states."""

from __future__ import annotations

import torch
from torch import Tensor


def assert_close(actual: Tensor, expected: Tensor, what: str, *, rtol: float, atol: float) -> None:
    """``torch.testing.assert_close`` of ``actual`` and ``expected``, both cast to float64, failing with ``what``.

    The tolerance rule: ``rtol`` and ``atol`` have no defaults, so every call site states both, with the reason
    for them in a comment beside it (where float32 or lower-precision rounding enters, and how often). The
    comparison is of values in float64 (exact for every float and integer dtype the tests use), so a float32,
    bfloat16 or integer result compares with its float64 reference directly; dtypes are asserted separately
    where they matter.

    Raises:
        AssertionError: ``"{what}: "`` followed by torch's report (mismatched elements, greatest differences),
            if any element differs by more than ``atol + rtol * |expected|``, or the shapes differ.
    """
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
