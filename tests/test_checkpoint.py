"""Activation checkpointing over DataParallel replicas, where one synchronized layer runs more than once a forward.

A replica's backward runs in one autograd thread for all replicas, where no exchange between them is possible, so a
replica that activation checkpointing makes recompute a synchronized layer replays the totals of the original
forward. These tests call one layer several times in every way a checkpointed forward can (twice in one segment,
once in each of two segments, once outside and once inside a segment, nested segments, ``checkpoint_sequential``)
on 2 and 3 CPU thread replicas, and compare with float64 ``nn.BatchNorm1d`` on the whole batch, called the same
way without checkpointing: outputs, input gradients, parameter gradients, running statistics and
num_batches_tracked, over two steps.

``use_reentrant=True`` recomputes each replica's segment in a backward of its own, where the other replicas'
gradients are out of reach; the global-batch gradient cannot be formed there, and the backward raises a
RuntimeError naming the layer (never a wrong gradient).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from closeness import assert_close
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import syncbn_dist
from syncbn_dist import DataParallelWithCallback

FEATURES = 4
BATCHES = (7, 9)  # the global batch of each step; 2 replicas split 7 as 4 + 3, 3 replicas as 3 + 3 + 1

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class _Twice(nn.Module):
    """``linear -> bn -> relu``, then ``linear -> the same bn``, checkpointed as ``pattern`` says.

    The two calls of ``bn`` see different inputs, so they have different statistics: a replay of the wrong call's
    totals changes every number downstream.
    """

    def __init__(self, pattern: str, use_reentrant: bool) -> None:
        super().__init__()
        self.first = nn.Linear(3, FEATURES)
        self.second = nn.Linear(FEATURES, FEATURES)
        self.bn = nn.BatchNorm1d(FEATURES)
        self.pattern = pattern
        self.checkpointed = checkpoint_with(use_reentrant)

    def _one(self, x: Tensor) -> Tensor:
        return torch.relu(self.bn(self.first(x)))

    def _two(self, x: Tensor) -> Tensor:
        return self.bn(self.second(x))

    def forward(self, x: Tensor) -> Tensor:
        ckpt = self.checkpointed
        if self.pattern == "plain":
            return self._two(self._one(x))
        if self.pattern == "one segment":
            return ckpt(lambda t: self._two(self._one(t)), x)
        if self.pattern == "two segments":
            return ckpt(self._two, ckpt(self._one, x))
        if self.pattern == "outside, then inside":
            return ckpt(self._two, self._one(x))
        if self.pattern == "inside, then outside":
            return self._two(ckpt(self._one, x))
        if self.pattern == "nested":
            return ckpt(lambda t: self._two(ckpt(self._one, t)), x)
        raise AssertionError(self.pattern)


def checkpoint_with(use_reentrant: bool) -> Callable[..., Tensor]:
    def run(function: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        return checkpoint(function, x, use_reentrant=use_reentrant)

    return run


class _Sequential(nn.Module):
    """``checkpoint_sequential`` over ``linear, bn, relu, linear, bn (the same), relu, linear, relu`` in 4 segments of 2
    (the last runs without checkpointing), so that the shared layer runs in the first and the third segment."""

    def __init__(self, use_reentrant: bool, checkpointed: bool = True) -> None:
        super().__init__()
        bn = nn.BatchNorm1d(FEATURES)
        self.layers = nn.Sequential(
            nn.Linear(3, FEATURES), bn, nn.ReLU(), nn.Linear(FEATURES, FEATURES), bn, nn.ReLU(),
            nn.Linear(FEATURES, FEATURES), nn.ReLU(),
        )
        self.use_reentrant = use_reentrant
        self.checkpointed = checkpointed

    def forward(self, x: Tensor) -> Tensor:
        if not self.checkpointed:
            return self.layers(x)
        # As a list: a Sequential's children() would list the shared layer once.
        return checkpoint_sequential(list(self.layers), 4, x, use_reentrant=self.use_reentrant)


def _model(pattern: str, use_reentrant: bool) -> tuple[nn.Module, nn.Module]:
    """The model to convert and its float64 reference (the same parameters, no checkpointing)."""
    torch.manual_seed(0)
    if pattern == "checkpoint_sequential":
        model: nn.Module = _Sequential(use_reentrant)
        reference = copy.deepcopy(model).double()
        reference.checkpointed = False
    else:
        model = _Twice(pattern, use_reentrant)
        reference = copy.deepcopy(model).double()
        reference.pattern = "plain"
    with torch.no_grad():  # parameters that are not BatchNorm's defaults: weight and bias gradients matter
        for module in (model, reference):
            gen = torch.Generator().manual_seed(1)
            for bn in (m for m in module.modules() if isinstance(m, nn.BatchNorm1d)):
                bn.weight.copy_(torch.rand(FEATURES, generator=gen) + 0.5)
                bn.bias.copy_(torch.randn(FEATURES, generator=gen))
    return model, reference


def _batch(step: int) -> tuple[Tensor, Tensor]:
    """Float32-rounded inputs (mean 3, std 2) and output gradients of step ``step``, as float64."""
    gen = torch.Generator().manual_seed(100 + step)
    x = (torch.randn(BATCHES[step], 3, generator=gen, dtype=torch.float64) * 2 + 3).float().double()
    return x, torch.randn(BATCHES[step], FEATURES, generator=gen, dtype=torch.float64)


def _train(forward: Callable[[Tensor], Tensor], model: nn.Module, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Two steps of forward and backward: what each step gives, and every gradient and buffer after it."""
    records = []
    for step in range(len(BATCHES)):
        x, grad_output = _batch(step)
        x = x.to(dtype).requires_grad_()
        model.zero_grad(set_to_none=True)
        y = forward(x)
        y.backward(grad_output.to(dtype))
        record = {"y": y.detach(), "dx": x.grad}
        record.update({f"grad {name}": p.grad for name, p in model.named_parameters()})
        record.update({name: b.clone() for name, b in model.named_buffers()})
        records.append(record)
    return records


PATTERNS = ["one segment", "two segments", "outside, then inside", "inside, then outside", "nested",
            "checkpoint_sequential"]


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_replicas_recompute_a_layer_called_twice_exactly(pattern: str, replicas: int) -> None:
    model, reference = _model(pattern, use_reentrant=False)
    converted = syncbn_dist.convert_model(model)
    data_parallel = DataParallelWithCallback(converted, cpu_replicas=replicas)
    expected = _train(reference, reference, torch.float64)
    got = _train(data_parallel, converted, torch.float32)
    layer = converted.layers[1] if pattern == "checkpoint_sequential" else converted.bn
    assert layer.last_transport == "dataparallel"
    for step, (actual, wanted) in enumerate(zip(got, expected)):
        assert actual.keys() == wanted.keys()
        for key, value in actual.items():
            if key.endswith("num_batches_tracked"):
                assert int(value) == int(wanted[key]) == 2 * (step + 1), key  # two calls a step, none recomputed
                continue
            # float32 activations against float64 throughout: float32 rounding of O(1) values,
            # carried through three layers and two steps.
            assert_close(value, wanted[key], f"{pattern}, {replicas} replicas, step {step}: {key}", rtol=1e-4,
                         atol=1e-4)


@pytest.mark.parametrize("pattern", ["one segment", "outside, then inside", "checkpoint_sequential"])
def test_reentrant_checkpointing_of_replicas_raises_naming_the_layer(pattern: str) -> None:
    model, _ = _model(pattern, use_reentrant=True)
    converted = syncbn_dist.convert_model(model)
    data_parallel = DataParallelWithCallback(converted, cpu_replicas=2)
    x, grad_output = _batch(0)
    y = data_parallel(x.float().requires_grad_())
    name = "layers.1" if pattern == "checkpoint_sequential" else "bn"
    with pytest.raises(RuntimeError, match=rf"use_reentrant=True.*layer '{name}'|layer '{name}'.*use_reentrant=True"):
        y.backward(grad_output.float())


def test_reentrant_checkpointing_of_a_single_replica_is_exact() -> None:
    """One replica has no peer to miss: the reentrant recomputation is plain BatchNorm's, exactly."""
    model, reference = _model("two segments", use_reentrant=True)
    converted = syncbn_dist.convert_model(model)
    expected = _train(reference, reference, torch.float64)
    got = _train(DataParallelWithCallback(converted, cpu_replicas=1), converted, torch.float32)
    for step, (actual, wanted) in enumerate(zip(got, expected)):
        for key, value in actual.items():
            # As above: float32 rounding of O(1) values through three layers and two steps.
            assert_close(value, wanted[key], f"step {step}: {key}", rtol=1e-4, atol=1e-4)
