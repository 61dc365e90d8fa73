"""One training step's record, what the tests compare between two ways of running a model."""

from __future__ import annotations

from typing import Callable

from torch import Tensor, nn


def step_record(
    model: nn.Module, forward: Callable[[Tensor], Tensor], x: Tensor, grad_output: Tensor
) -> dict[str, Tensor]:
    """Run ``forward`` (``model`` or a compiled wrapper of it) on a fresh leaf copy of ``x``, backward ``grad_output``.

    Returns ``{"y", "dx", "grad <parameter>"..., "<buffer>"...}``: the output, the input gradient, every parameter's
    gradient (None for one that got none) and a copy of every buffer after the step.
    """
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = forward(x)
    y.backward(grad_output)
    record = {"y": y.detach(), "dx": x.grad}
    record.update({f"grad {n}": p.grad for n, p in model.named_parameters()})
    record.update({n: b.clone() for n, b in model.named_buffers()})
    return record
