"""Multi-process tests of the SyncBatchNorm modules over real gloo process groups (torch.distributed path).

Every check compares against ``nn.BatchNorm`` in float64 on the concatenated global batch: outputs and input
gradients row by row, weight/bias gradients summed over ranks, running statistics and num_batches_tracked
after several steps.

Process start-up is the expensive part, so there is one launch per topology: world sizes 2 and 3 run every
section (global batch, eval without communication, errors on every rank, DDP training parity) in the same
processes, world size 4 the process subgroups. A failing section and case name themselves in the worker's
traceback. The NCCL variant is marked ``gpu`` and needs two CUDA devices.
"""

from __future__ import annotations

import copy
import itertools
import pickle
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from closeness import assert_close
from conftest import WORLD_SIZES
from torch import Tensor, nn

from launch.common.spawn import run_distributed
from syncbn_dist import (
    SyncBatchNorm,
    SynchronizedBatchNorm1d,
    SynchronizedBatchNorm2d,
    SynchronizedBatchNorm3d,
    convert_model,
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
        assert_close(out, out_ref[rows], f"{where}: output", **tol["output"])
        assert_close(x.grad, x_ref.grad[rows], f"{where}: grad_input", **tol["grad_input"])
        if case.affine:
            # Each rank holds its local sums; their sum over the group is the global-batch gradient.
            grads = torch.cat([layer.weight.grad, layer.bias.grad])
            dist.all_reduce(grads, group=process_group)
            ref_grads = torch.cat([ref.weight.grad, ref.bias.grad])
            assert_close(grads, ref_grads, f"{where}: weight/bias grad", **tol["grad_param"])
        if case.track_running_stats:
            assert_close(layer.running_mean, ref.running_mean, f"{where}: running_mean", **tol["running_mean"])
            assert_close(layer.running_var, ref.running_var, f"{where}: running_var", **tol["running_var"])
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
    with_empty_rank = next(name for name, split in splits if 0 in split)
    for (affine, track, momentum), split_name in itertools.product(_OPTIONS, ["uneven", with_empty_rank]):
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


def _global_batch_section(rank: int, world_size: int) -> int:
    steps = 0
    for index, case in enumerate(_global_batch_cases(world_size)):
        steps += _check_case(case, rank, seed=index)
    return steps


# ------------------------------------------------------------------------------------------------------------
# Process subgroups: {0, 1} and {2, 3} at world size 4.
# ------------------------------------------------------------------------------------------------------------


def _subgroup_cases(group_index: int) -> list[_Case]:
    """The same cases for both groups, but each group draws its own data (seed) around its own mean."""
    mean = (0.5, 3.0)[group_index]
    splits = ([3, 5], [0, 4], [1, 1]) if group_index == 0 else ([6, 2], [2, 0], [3, 3])
    return [
        _Case("1d-NC", SynchronizedBatchNorm1d, (), splits, mean=mean),
        _Case("2d/momentum=None", SynchronizedBatchNorm2d, (3, 2), splits, momentum=None, mean=mean),
        _Case("generic-NCL/no-affine", SyncBatchNorm, (4,), splits, affine=False, mean=mean),
    ]


def _worker_subgroups(rank: int, world_size: int) -> int:
    # Every rank creates every group, in the same order, as torch.distributed requires.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group_index, member = divmod(rank, 2)
    group = groups[group_index]
    steps = 0
    for index, case in enumerate(_subgroup_cases(group_index)):
        steps += _check_case(case, member, process_group=group, seed=100 * (group_index + 1) + index)

    # A layer converted with the group synchronizes over the group only: the running means of the two groups
    # (one batch each, different data) agree within a group and differ between groups.
    layer = convert_model(nn.BatchNorm2d(3), process_group=group)
    x = _global_batch(
        _Case("", SynchronizedBatchNorm2d, (2, 2), [], mean=(0.5, 3.0)[group_index]), 0, 8, seed=group_index
    )[0]
    layer(x[4 * member : 4 * member + 4].float())
    assert layer.last_transport == "distributed"
    gathered = [torch.empty(3) for _ in range(world_size)]
    dist.all_gather(gathered, layer.running_mean)
    torch.testing.assert_close(gathered[0], gathered[1], rtol=0, atol=0)  # same all-reduced sums, same value
    torch.testing.assert_close(gathered[2], gathered[3], rtol=0, atol=0)
    assert not torch.allclose(gathered[0], gathered[2], rtol=0.1, atol=0.1)
    ref = nn.BatchNorm2d(3).double()
    ref(x)
    assert_close(layer.running_mean, ref.running_mean, "converted layer", **_RUNNING_TOL["running_mean"])
    return steps


def test_process_subgroups() -> None:
    results = run_distributed(_worker_subgroups, 4, timeout=240)
    assert results == [sum(len(case.splits) for case in _subgroup_cases(rank // 2)) for rank in range(4)]


# ------------------------------------------------------------------------------------------------------------
# Eval mode never communicates (section).
# ------------------------------------------------------------------------------------------------------------


def _train_step(layer: nn.Module, ref: nn.Module, rank: int, split: Sequence[int], seed: int) -> None:
    """One synchronized training forward/backward on every rank, checked against the float64 reference."""
    case = _Case("train", SynchronizedBatchNorm2d, (3, 2), [split], num_features=layer.num_features)
    x_global, grad_global = _global_batch(case, 0, sum(split), seed)
    start = sum(split[:rank])
    x = x_global[start : start + split[rank]].float().requires_grad_()
    out = layer(x)
    out.backward(grad_global[start : start + split[rank]].float())
    out_ref = ref(x_global)
    assert layer.last_transport == "distributed"
    tol = _tolerances(x_global, grad_global, ref, ref.eps)  # float32 rounding, see _tolerances
    assert_close(out, out_ref[start : start + split[rank]], "training output", **tol["output"])
    assert_close(layer.running_mean, ref.running_mean, "running_mean", **tol["running_mean"])
    assert_close(layer.running_var, ref.running_var, "running_var", **tol["running_var"])
    assert torch.equal(layer.num_batches_tracked, ref.num_batches_tracked)


def _eval_section(rank: int, world_size: int) -> int:
    layer = SynchronizedBatchNorm2d(4)
    _init_params(layer, seed=1)
    ref = nn.BatchNorm2d(4).double()
    ref.load_state_dict(layer.state_dict())
    _train_step(layer, ref, rank, [5, 3, 4][:world_size], seed=2)

    # Only rank 0 evaluates, many times, while the other ranks wait at the barrier below: a single collective
    # in eval mode would pair with the barrier or hang until the collective timeout, and fail this test.
    layer.eval()
    no_stats = SynchronizedBatchNorm2d(4, track_running_stats=False).eval()
    evaluated = 0
    if rank == 0:
        eval_ref = nn.BatchNorm2d(4).eval()  # float32 on purpose: eval is exactly nn.BatchNorm, bit for bit
        eval_ref.load_state_dict(layer.state_dict())
        no_stats_ref = nn.BatchNorm2d(4, track_running_stats=False).eval()
        state_before = {k: v.clone() for k, v in layer.state_dict().items()}
        gen = torch.Generator().manual_seed(3)
        for i in range(40):
            x = torch.randn(1 + i % 5, 4, 3, 2, generator=gen) * 2 + 1
            if i % 3 == 0:
                x = x.contiguous(memory_format=torch.channels_last)
            with torch.set_grad_enabled(i % 2 == 0):
                torch.testing.assert_close(layer(x), eval_ref(x), rtol=0, atol=0)  # same kernel, same inputs
                assert layer.last_transport == "local"
                if x.size(0) > 1:  # batch statistics of this rank's batch only, as torch.nn.SyncBatchNorm
                    torch.testing.assert_close(no_stats(x), no_stats_ref(x), rtol=0, atol=0)
                    assert no_stats.last_transport == "local"
            evaluated += 1
        for key, value in layer.state_dict().items():  # eval leaves every buffer alone
            assert torch.equal(value, state_before[key]), key
    dist.barrier()
    # The collective streams are still aligned: a plain all_reduce and a synchronized step come out right.
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    assert total.item() == world_size * (world_size + 1) / 2
    layer.train()
    _train_step(layer, ref, rank, [2, 6, 0][:world_size], seed=4)
    return evaluated


# ------------------------------------------------------------------------------------------------------------
# Errors: raised on every rank, with a clear message, without a hang (section).
# ------------------------------------------------------------------------------------------------------------


def _expect_error(error: type[Exception], match: str, fn: Any, *args: Any) -> str:
    with pytest.raises(error, match=match) as info:
        fn(*args)
    return str(info.value)


def _errors_section(rank: int, world_size: int) -> list[str]:
    messages = []
    # A global batch of one value per channel in training: rank 0 holds the one sample, the others none.
    for layer, shape in [
        (SynchronizedBatchNorm1d(3), (3,)),
        (SynchronizedBatchNorm1d(3), (3, 1)),
        (SynchronizedBatchNorm2d(3), (3, 1, 1)),
        (SyncBatchNorm(3), (3, 1, 1, 1)),
    ]:
        x = torch.randn((1 if rank == 0 else 0,) + shape)
        stats_before = (layer.running_mean.clone(), layer.running_var.clone())
        messages.append(_expect_error(ValueError, "more than 1 value per channel", layer, x))
        assert torch.equal(layer.running_mean, stats_before[0]) and torch.equal(layer.running_var, stats_before[1])
    # Input checks: every rank gets the same wrong input, and nothing is sent.
    messages.append(
        _expect_error(ValueError, r"expected 4D input \(got 2D input\)", SynchronizedBatchNorm2d(3), torch.randn(4, 3))
    )
    messages.append(
        _expect_error(
            ValueError, r"expected 2D or 3D input \(got 4D input\)", SynchronizedBatchNorm1d(3), torch.randn(4, 3, 2, 2)
        )
    )
    messages.append(
        _expect_error(
            ValueError, r"expected 5D input \(got 4D input\)", SynchronizedBatchNorm3d(3), torch.randn(4, 3, 2, 2)
        )
    )
    messages.append(
        _expect_error(ValueError, r"expected at least 2D input \(got 1D input\)", SyncBatchNorm(3), torch.randn(4))
    )
    messages.append(
        _expect_error(ValueError, "3 channels.*5 channels", SynchronizedBatchNorm2d(3), torch.randn(4, 5, 2, 2))
    )
    messages.append(
        _expect_error(TypeError, "floating point", SynchronizedBatchNorm2d(3), torch.randint(0, 5, (4, 3, 2, 2)))
    )
    # A group without this rank: new_group is called on every rank, but only rank 0 is a member.
    solo = dist.new_group([0])
    layer = SynchronizedBatchNorm2d(3, process_group=solo)
    x = torch.randn(4, 3, 2, 2)
    if rank != 0:
        messages.append(_expect_error(ValueError, "not a member", layer, x))
    else:  # a group of one needs no communication: plain batch norm on the local batch
        ref = nn.BatchNorm2d(3)
        torch.testing.assert_close(layer(x), ref(x), rtol=1e-6, atol=1e-6)  # float32 rounding, different kernels
        assert layer.last_transport == "local"

    # No rank is left behind in a collective: a synchronized step afterwards is exact.
    layer = SynchronizedBatchNorm2d(3)
    ref = nn.BatchNorm2d(3).double()
    ref.load_state_dict(layer.state_dict())
    _train_step(layer, ref, rank, [3, 4, 2][:world_size], seed=5)
    return messages


# ------------------------------------------------------------------------------------------------------------
# DistributedDataParallel training equals single-process training on the global batch (section).
# ------------------------------------------------------------------------------------------------------------


def _small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2, padding=1),
        nn.BatchNorm2d(6, momentum=None),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 5),
        nn.BatchNorm1d(5),
        nn.ReLU(),
        nn.Linear(5, 3),
    )


_DDP_SPLITS = {2: [[6, 4], [3, 7], [5, 5], [8, 2]], 3: [[4, 3, 3], [2, 6, 2], [5, 0, 5], [1, 1, 8]]}


def _train_ddp(rank: int, world_size: int, dtype: torch.dtype) -> int:
    torch.manual_seed(0)
    model = _small_cnn().to(dtype)
    reference = copy.deepcopy(model).double()
    ddp = nn.parallel.DistributedDataParallel(convert_model(model))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.2, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    splits = _DDP_SPLITS[world_size]
    gen = torch.Generator().manual_seed(1)
    for split in splits:
        total = sum(split)
        x = torch.randn(total, 3, 8, 8, generator=gen, dtype=torch.float64) * 2 + 0.5
        y = torch.randint(0, 3, (total,), generator=gen)
        start = sum(split[:rank])
        rows = slice(start, start + split[rank])
        # DDP averages gradients over ranks, so each rank's loss is its share of the global mean times the
        # world size: mean_r(grad(sum_local * W / N)) = grad(sum_all / N), the global-batch mean loss.
        loss = F.cross_entropy(ddp(x[rows].to(dtype)), y[rows], reduction="sum") * world_size / total
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ref_loss = F.cross_entropy(reference(x), y)
        ref_optimizer.zero_grad()
        ref_loss.backward()
        ref_optimizer.step()
    assert all(m.last_transport == "distributed" for m in ddp.modules() if isinstance(m, SyncBatchNorm))
    # float64: float64 rounding only (measured 3e-15). float32: four SGD steps carry the float32 rounding of
    # forward and backward (~1e-7) into the parameters; measured 3e-7 relative, allowed 1e-5.
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    ref_state = reference.state_dict()
    state = ddp.module.state_dict()
    assert state.keys() == ref_state.keys()
    for key, value in state.items():
        if key.endswith("num_batches_tracked"):
            assert value.item() == ref_state[key].item() == len(splits), key
        else:
            assert_close(value, ref_state[key], f"{dtype} {key}", rtol=tol, atol=tol)
    return len(splits)


def _ddp_section(rank: int, world_size: int) -> int:
    return sum(_train_ddp(rank, world_size, dtype) for dtype in (torch.float32, torch.float64))


# ------------------------------------------------------------------------------------------------------------
# One launch per world size: every section above, in order, in the same processes.
# ------------------------------------------------------------------------------------------------------------


def _worker_all_sections(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "global_batch_steps": _global_batch_section(rank, world_size),
        "eval_forwards": _eval_section(rank, world_size),
        "error_messages": _errors_section(rank, world_size),
        "ddp_steps": _ddp_section(rank, world_size),
    }


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_sync_batchnorm_over_gloo(world_size: int) -> None:
    """Global-batch equality, eval without communication, errors on every rank, DDP training parity.

    A failing section names itself (and the case) in the worker's traceback; a section that hangs is ended
    by the collective timeout.
    """
    results = run_distributed(_worker_all_sections, world_size, timeout=300, collective_timeout=30)
    steps = sum(len(case.splits) for case in _global_batch_cases(world_size))
    for rank, result in enumerate(results):
        assert result["global_batch_steps"] == steps
        assert result["eval_forwards"] == (40 if rank == 0 else 0)
        assert result["ddp_steps"] == 2 * len(_DDP_SPLITS[world_size])
        # Ten errors on every rank; the ranks outside new_group([0]) also get the non-member error.
        messages = result["error_messages"]
        assert len(messages) == (10 if rank == 0 else 11)
        for message in messages:
            assert "expected" in message.lower() or "not a member" in message, message


# ------------------------------------------------------------------------------------------------------------
# NCCL on CUDA: the same math with the tensors and the group on GPUs.
# ------------------------------------------------------------------------------------------------------------


def _worker_nccl(rank: int, world_size: int) -> int:
    torch.cuda.set_device(rank)
    group = dist.new_group(backend="nccl")  # the launcher's world group is gloo; this one runs on the GPUs
    device = torch.device("cuda", rank)
    layer = SynchronizedBatchNorm2d(3, process_group=group, device=device)
    _init_params(layer, seed=0)
    ref = nn.BatchNorm2d(3).double()
    ref.load_state_dict(layer.state_dict())
    splits = [[5, 3], [0, 4], [2, 2]]
    for step, split in enumerate(splits):
        case = _Case("nccl", SynchronizedBatchNorm2d, (3, 2), [split])
        x_global, grad_global = _global_batch(case, step, sum(split), seed=6)
        start = sum(split[:rank])
        rows = slice(start, start + split[rank])
        x = x_global[rows].float().to(device).requires_grad_()
        layer.zero_grad()
        ref.zero_grad()
        out = layer(x)
        out.backward(grad_global[rows].float().to(device))
        x_ref = x_global.clone().requires_grad_()
        out_ref = ref(x_ref)
        out_ref.backward(grad_global)
        assert layer.last_transport == "distributed" and out.device == device
        grads = torch.cat([layer.weight.grad, layer.bias.grad])
        dist.all_reduce(grads, group=group)
        tol = _tolerances(x_global, grad_global, ref, ref.eps)  # float32 rounding, see _tolerances
        assert_close(out.cpu(), out_ref[rows], f"nccl step {step}: output", **tol["output"])
        assert_close(x.grad.cpu(), x_ref.grad[rows], f"nccl step {step}: grad_input", **tol["grad_input"])
        assert_close(grads.cpu(), torch.cat([ref.weight.grad, ref.bias.grad]), "nccl grads", **tol["grad_param"])
        assert_close(layer.running_mean.cpu(), ref.running_mean, "nccl running_mean", **tol["running_mean"])
        assert_close(layer.running_var.cpu(), ref.running_var, "nccl running_var", **tol["running_var"])
    return len(splits)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for an NCCL group")
def test_nccl_matches_batchnorm_on_global_batch() -> None:
    # Fresh ranks: each takes a GPU and an NCCL group, which a pooled CPU world should not carry into later jobs.
    assert run_distributed(_worker_nccl, 2, timeout=180, fresh=True) == [3, 3]


def test_a_launcher_world_without_a_process_group_warns_once_naming_the_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchrun says this is one of 2 processes (WORLD_SIZE), but the script never called init_process_group: the
    first training forward warns, naming the layer and saying its statistics are local; later ones do not."""
    from syncbn_dist.layer import batchnorm

    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(batchnorm, "_WARNED_NO_GROUP", [False])
    layer = convert_model(torch.nn.Sequential(torch.nn.BatchNorm1d(3)))
    with pytest.warns(RuntimeWarning, match=r"layer '0' \(SynchronizedBatchNorm1d\) trains with local statistics"):
        layer(torch.randn(4, 3))
    assert layer[0].last_transport == "local"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(torch.randn(4, 3))  # once per process
        layer.eval()(torch.randn(4, 3))  # and never in eval mode
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(batchnorm, "_WARNED_NO_GROUP", [False])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer.train()(torch.randn(4, 3))  # one process: nothing to warn about


# ---------------------------------------------------------------------------------------------------------------
# Copies of a model on a subgroup: deepcopy keeps the group, pickling saves none
# ---------------------------------------------------------------------------------------------------------------


def _teacher_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Linear(3, 2))


def _ema_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, student: nn.Module, teacher: nn.Module, x: Tensor
) -> Tensor:
    """One SGD step of ``model`` (the student, or its DDP wrapper) on ``x``, the teacher's parameters moved halfway to
    the student's, then the teacher's train-mode output on ``x`` under no_grad."""
    optimizer.zero_grad()
    model(x).square().sum().backward()
    optimizer.step()
    with torch.no_grad():
        for t, s in zip(teacher.parameters(), student.parameters()):
            t.lerp_(s, 0.5)
        return teacher(x)


def _ema_worker(rank: int, world_size: int) -> dict[str, Any]:
    """A student under DDP and its EMA copy (a teacher, run in train mode under no_grad each step), both on a subgroup
    made by new_group: the copy synchronizes over the same group object; each step's teacher output and running
    statistics are returned, with what a pickled student's layer synchronizes over."""
    group = dist.new_group(list(range(world_size)))
    student = convert_model(_teacher_net(), process_group=group)
    teacher = copy.deepcopy(student)
    assert teacher[1].process_group is group and copy.copy(student[1]).process_group is group
    ddp = nn.parallel.DistributedDataParallel(student)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    outputs, stats = [], []
    for step in range(3):
        x = torch.randn(3 + rank, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        outputs.append(_ema_step(ddp, optimizer, student, teacher, x).double())
        assert teacher[1].last_transport == "distributed"
        stats.append([teacher[1].running_mean.double().clone(), teacher[1].running_var.double().clone()])
    loaded = pickle.loads(pickle.dumps(student[1]))  # torch.save pickles the same way
    loaded_group = loaded.process_group
    loaded(torch.randn(4, 3))
    return {"outputs": outputs, "stats": stats, "loaded": (loaded_group, loaded.last_transport)}


def test_an_ema_copy_on_a_subgroup_keeps_the_group_and_equals_batchnorm_on_the_global_batch() -> None:
    results = run_distributed(_ema_worker, 2, timeout=60)
    student = _teacher_net().double()
    teacher = copy.deepcopy(student)
    # DDP averages the ranks' gradients of their own losses: the global loss's gradient over the world size.
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1 / 2)
    for step in range(3):
        xs = [torch.randn(3 + rank, 4, generator=torch.Generator().manual_seed(10 * step + rank)) for rank in (0, 1)]
        x = torch.cat(xs).double()
        out = _ema_step(student, optimizer, student, teacher, x)
        for rank, expected in enumerate(out.split([3, 4])):
            # float32 layers against float64: float32 rounding of O(1) values over three steps.
            assert_close(results[rank]["outputs"][step], expected, f"teacher output, rank {rank}, step {step}",
                         rtol=1e-4, atol=1e-5)
            for got, want, name in zip(results[rank]["stats"][step], (teacher[1].running_mean, teacher[1].running_var),
                                       ("running_mean", "running_var")):
                assert_close(got, want, f"teacher {name}, rank {rank}, step {step}", rtol=1e-4, atol=1e-6)
    # A pickled layer (torch.save of the model) saves no group: loaded, it synchronizes over the default group.
    assert [result["loaded"] for result in results] == [(None, "distributed")] * 2
