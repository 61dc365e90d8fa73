"""Multi-process tests of the SyncBatchNorm modules over real gloo process groups (torch.distributed path).

Every check compares against ``nn.BatchNorm`` in float64 on the concatenated global batch: outputs and input
gradients row by row, weight/bias gradients summed over ranks, running statistics and num_batches_tracked
after several steps. Each launch runs many cases in one set of worker processes (start-up is the expensive
part); a failing case names itself in the worker's traceback.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from launcher import run_distributed
from torch import Tensor, nn

from syncbn_dist import (
    SyncBatchNorm,
    SynchronizedBatchNorm1d,
    SynchronizedBatchNorm2d,
    SynchronizedBatchNorm3d,
)

pytestmark = pytest.mark.distributed


@dataclass
class _Case:
    """One comparison: a layer, a per-channel input shape, and the per-rank batch sizes of each step."""

    name: str
    layer_cls: type[SyncBatchNorm]
    tail: tuple[int, ...]  # input shape after (N, C)
    splits: Sequence[Sequence[int]]  # splits[step][member] = that member's batch size at that step
    affine: bool = True
    track_running_stats: bool = True
    momentum: float | None = 0.1
    mean: float = 0.5  # |mean| / std of the data, per-channel sign alternating
    std: float = 1.0
    channels_last: bool = False
    num_features: int = 3
    layer_kwargs: dict[str, Any] = field(default_factory=dict)


def _reference_cls(ndim: int) -> type[nn.Module]:
    return {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[ndim]


def _global_batch(case: _Case, step: int, total: int, seed: int) -> tuple[Tensor, Tensor]:
    """The float32 global input (as float64, so the reference sees exactly the same values) and grad_output."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    shape = (total, case.num_features) + case.tail
    offsets = torch.tensor(
        [case.mean * case.std * (1.0 + 0.25 * c) * (-1) ** c for c in range(case.num_features)], dtype=torch.float64
    ).view([1, -1] + [1] * len(case.tail))
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * case.std + offsets).float().double()
    grad_out = torch.randn(shape, generator=gen, dtype=torch.float64)
    return x, grad_out


# Running statistics are float64 results rounded into float32 buffers. running_mean may pass near zero, where
# (1 - momentum) * old + momentum * mean cancels to float32 ulps of its O(1) terms; running_var gets no absolute
# slack: 1e-6 relative always, which is the requirement at |mean|/std = 1e4.
_RUNNING_TOL = {"running_mean": {"rtol": 1e-6, "atol": 1e-7}, "running_var": {"rtol": 1e-6, "atol": 0.0}}


def _tolerances(x: Tensor, grad_out: Tensor, ref: nn.Module, eps: float) -> dict[str, dict[str, float]]:
    """Tolerances for one step, from where float32 rounding enters (float64 ``x`` and ``grad_out``).

    The float32 input and the mean rounded to float32 are each ``2^-24 * max|x|`` off, which is
    ``reach = max|x| * invstd`` units of 2^-24 in the normalized values (about 4 for centred data, 1e4 at
    |mean|/std = 1e4); the output scales that by |weight| (plus the bias's own rounding), the input gradient
    by |weight| * invstd * |dy|, and the weight gradient sums ``count`` such terms of |dy|. A factor 16
    covers the few roundings each value goes through.
    """
    c = x.size(1)
    dims = [0] + list(range(2, x.dim()))
    count = x.numel() // c
    if count == 0:  # empty outputs and exactly zero parameter gradients
        exact = {"rtol": 0.0, "atol": 0.0}
        return {"output": exact, "grad_input": exact, "grad_param": exact, **_RUNNING_TOL}
    var, _ = torch.var_mean(x, dim=dims, correction=0)
    invstd = torch.rsqrt(var + eps)
    reach = x.abs().amax(dim=dims) * invstd + 1.0
    weight = torch.ones(c, dtype=torch.float64) if ref.weight is None else ref.weight.detach().abs()
    bias = torch.zeros(c, dtype=torch.float64) if ref.bias is None else ref.bias.detach().abs()
    dy = grad_out.abs().max().item()
    unit = 16 * 2**-24
    return {
        "output": {"rtol": 0.0, "atol": unit * (weight * reach + bias).max().item()},
        "grad_input": {"rtol": 0.0, "atol": unit * (weight * invstd * reach).max().item() * dy},
        "grad_param": {"rtol": 0.0, "atol": unit * reach.max().item() * dy * count},
        **_RUNNING_TOL,
    }


def _assert_close(actual: Tensor, expected: Tensor, tol: dict[str, float], what: str) -> None:
    torch.testing.assert_close(actual.double(), expected, **tol, msg=lambda m: f"{what}: {m}")


def _init_params(layer: nn.Module, seed: int) -> None:
    """Non-trivial affine parameters, identical on every rank."""
    if layer.weight is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            layer.weight.copy_(1.0 + 0.5 * torch.randn(layer.weight.shape, generator=gen))
            layer.bias.copy_(0.5 * torch.randn(layer.bias.shape, generator=gen))


def _check_case(
    case: _Case, member: int, process_group: Any = None, seed: int = 0, layer: nn.Module | None = None
) -> int:
    """Train ``case`` on this member for every step of ``case.splits`` and compare each step to the reference.

    Every member of ``process_group`` calls this with the same case; weight and bias gradients are summed
    over the group. Returns the number of steps compared.
    """
    c = case.num_features
    if layer is None:
        layer = case.layer_cls(
            c,
            momentum=case.momentum,
            affine=case.affine,
            track_running_stats=case.track_running_stats,
            process_group=process_group,
            **case.layer_kwargs,
        )
    _init_params(layer, seed)
    ndim = 2 + len(case.tail)
    ref = _reference_cls(ndim)(
        c, momentum=case.momentum, affine=case.affine, track_running_stats=case.track_running_stats
    ).double()
    ref.load_state_dict(layer.state_dict())
    layer.train()
    ref.train()

    for step, split in enumerate(case.splits):
        total = sum(split)
        start = sum(split[:member])
        rows = slice(start, start + split[member])
        x_global, grad_global = _global_batch(case, step, total, seed)
        x = x_global[rows].float()
        if case.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        x_ref = x_global.clone().requires_grad_()
        before = {k: v.clone() for k, v in layer.state_dict().items()}

        layer.zero_grad(set_to_none=False)
        ref.zero_grad()
        out = layer(x)
        out.backward(grad_global[rows].float())
        out_ref = ref(x_ref)
        out_ref.backward(grad_global)

        where = f"case {case.name!r}, step {step}, split {list(split)}"
        assert layer.last_transport == "distributed", where
        assert out.shape == x.shape and out.dtype == x.dtype, where
        assert x.grad is not None and x.grad.shape == x.shape, where
        if case.channels_last:
            assert out.is_contiguous(memory_format=torch.channels_last), where
        # Tolerances from where float32 rounding enters, scaled by |mean|/std: see _tolerances.
        tol = _tolerances(x_global, grad_global, ref, ref.eps)
        _assert_close(out, out_ref[rows], tol["output"], f"{where}: output")
        _assert_close(x.grad, x_ref.grad[rows], tol["grad_input"], f"{where}: grad_input")
        if case.affine:
            # Each rank holds its local sums; their sum over the group is the global-batch gradient.
            grads = torch.cat([layer.weight.grad, layer.bias.grad])
            dist.all_reduce(grads, group=process_group)
            ref_grads = torch.cat([ref.weight.grad, ref.bias.grad])
            _assert_close(grads, ref_grads, tol["grad_param"], f"{where}: weight/bias grad")
        if case.track_running_stats:
            _assert_close(layer.running_mean, ref.running_mean, tol["running_mean"], f"{where}: running_mean")
            _assert_close(layer.running_var, ref.running_var, tol["running_var"], f"{where}: running_var")
            assert torch.equal(layer.num_batches_tracked, ref.num_batches_tracked), where
            if total == 0:  # an all-empty step leaves the statistics exactly as they were
                assert torch.equal(layer.running_mean, before["running_mean"]), where
                assert torch.equal(layer.running_var, before["running_var"]), where
                assert layer.num_batches_tracked.item() == before["num_batches_tracked"].item() + 1, where
        else:
            assert layer.running_mean is None and layer.running_var is None, where
    return len(case.splits)


_LAYOUTS: list[tuple[str, type[SyncBatchNorm], tuple[int, ...], bool]] = [
    ("1d-NC", SynchronizedBatchNorm1d, (), False),
    ("1d-NCL", SynchronizedBatchNorm1d, (5,), False),
    ("2d", SynchronizedBatchNorm2d, (3, 2), False),
    ("2d-channels_last", SynchronizedBatchNorm2d, (3, 2), True),
    ("3d", SynchronizedBatchNorm3d, (2, 2, 2), False),
    ("generic-NCL", SyncBatchNorm, (4,), False),
    ("generic-NCDHW", SyncBatchNorm, (2, 1, 3), False),
]

_SPLITS = {
    2: {
        "even": [4, 4],
        "uneven": [5, 2],
        "empty-rank1": [6, 0],
        "empty-rank0": [0, 5],
        "one-each": [1, 1],
    },
    3: {
        "even": [3, 3, 3],
        "uneven": [1, 5, 2],
        "empty-middle": [4, 0, 3],
        "only-middle": [0, 6, 0],
    },
}


_OPTIONS = list(itertools.product([True, False], [True, False], [0.1, None]))  # affine, track, momentum


def _global_batch_cases(world_size: int) -> list[_Case]:
    """Every layout with every split, the option combinations rotated over them (each combination meets
    several layouts and splits), all combinations for one layout, all-empty steps, and |mean|/std of 1e3, 1e4."""
    splits = list(_SPLITS[world_size].items())
    empty = [0] * world_size
    cases = []
    for (i, (layout, cls, tail, channels_last)), (j, (split_name, split)) in itertools.product(
        enumerate(_LAYOUTS), enumerate(splits)
    ):
        affine, track, momentum = _OPTIONS[(i + j) % len(_OPTIONS)]
        options = f"affine={affine}/track={track}/momentum={momentum}"
        cases.append(
            _Case(
                f"{layout}/{split_name}/{options}",
                cls,
                tail,
                [split] * 3,
                affine,
                track,
                momentum,
                channels_last=channels_last,
            )
        )
    for (affine, track, momentum), split_name in itertools.product(_OPTIONS, ["uneven", splits[2][0]]):
        split = dict(splits)[split_name]
        options = f"affine={affine}/track={track}/momentum={momentum}"
        cases.append(
            _Case(f"2d/{split_name}/{options}", SynchronizedBatchNorm2d, (3, 2), [split] * 3, affine, track, momentum)
        )
    uneven = dict(splits)["uneven"]
    for i, (layout, cls, tail, channels_last) in enumerate(_LAYOUTS):
        # Every rank empty at some steps: empty outputs, statistics untouched, counter advanced as nn.BatchNorm.
        momentum = (0.1, None)[i % 2]
        cases.append(
            _Case(
                f"{layout}/all-empty/momentum={momentum}",
                cls,
                tail,
                [uneven, empty, uneven, empty],
                momentum=momentum,
                channels_last=channels_last,
            )
        )
    for (i, (layout, cls, tail, channels_last)), ratio, split_name in itertools.product(
        enumerate(_LAYOUTS), [1e3, 1e4], ["even", "uneven"]
    ):
        momentum = (0.1, None)[i % 2]
        cases.append(
            _Case(
                f"{layout}/{split_name}/|mean|/std={ratio:g}/momentum={momentum}",
                cls,
                tail,
                [dict(splits)[split_name]] * 3,
                momentum=momentum,
                mean=ratio,
                std=0.5,
                channels_last=channels_last,
            )
        )
    return cases


def _worker_global_batch(rank: int, world_size: int) -> int:
    steps = 0
    for index, case in enumerate(_global_batch_cases(world_size)):
        steps += _check_case(case, rank, seed=index)
    return steps


@pytest.mark.parametrize("world_size", [2, 3])
def test_matches_batchnorm_on_global_batch(world_size: int) -> None:
    results = run_distributed(_worker_global_batch, world_size, timeout=240)
    expected = sum(len(case.splits) for case in _global_batch_cases(world_size))
    assert results == [expected] * world_size
