"""Tests of ``syncbn_dist.sync_running_stats`` and ``syncbn_dist.new_sync_groups`` over real gloo groups.

One launch at world size 4 covers groups of 2 (each group equals float64 ``nn.BatchNorm`` on its own
concatenated batch), the whole world and singleton groups, the errors (on every rank), and running-stat sync
in both modes over the world, a subgroup and a group this rank is not in. Collectives are counted by the c10d ops
they dispatch (``launch.common.counting.OpCounter``; observation only: the real ones run). The cases that need no
process group run in the test process.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from closeness import assert_close
from torch import Tensor, nn

import syncbn_dist
from launch.common.counting import OpCounter
from launch.common.spawn import run_distributed
from syncbn_dist import SynchronizedBatchNorm2d, convert_model, new_sync_groups, sync_running_stats

C = 3
SEED = 4321
# Batch sizes of ranks 0..3: uneven, so a wrong grouping or an unweighted mean shows.
SIZES = (2, 3, 1, 4)
# ---------------------------------------------------------------------------------------------------------
# new_sync_groups
# ---------------------------------------------------------------------------------------------------------


def _group_batch(step: int) -> tuple[Tensor, Tensor]:
    """Float32 global batch (as float64) of all 4 ranks; the second pair of ranks gets a shifted mean."""
    gen = torch.Generator().manual_seed(SEED + step)
    x = torch.randn(sum(SIZES), C, 3, 2, generator=gen, dtype=torch.float64)
    x[sum(SIZES[:2]) :] += 2.0  # ranks 2 and 3: different statistics from ranks 0 and 1
    return x.float().double(), torch.randn(x.shape, generator=gen, dtype=torch.float64)


def _rows(rank_list: Sequence[int], t: Tensor) -> Tensor:
    return torch.cat([t[sum(SIZES[:r]) : sum(SIZES[: r + 1])] for r in rank_list])


def _check_group_sync(rank: int, group: Any, members: list[int], others: list[int] | None) -> None:
    """A BN converted with ``group`` equals float64 nn.BatchNorm2d on the concatenated batch of ``members``."""
    layer = convert_model(nn.BatchNorm2d(C), process_group=group)
    ref = nn.BatchNorm2d(C, dtype=torch.float64)
    other = nn.BatchNorm2d(C, dtype=torch.float64)
    for step in range(2):
        x, dy = _group_batch(step)
        mine = _rows([rank], x).float().requires_grad_()
        layer.zero_grad(set_to_none=True)
        y = layer(mine)
        y.backward(_rows([rank], dy).float())
        assert layer.last_transport == ("distributed" if len(members) > 1 else "local"), layer.last_transport
        group_x = _rows(members, x).requires_grad_()
        ref.zero_grad(set_to_none=True)
        y_ref = ref(group_x)
        y_ref.backward(_rows(members, dy))
        own = slice(sum(SIZES[m] for m in members if m < rank), sum(SIZES[m] for m in members if m <= rank))
        what = f"rank {rank} group {members} step {step}"
        # O(1) float32 data: outputs and grads to a few float32 ulps; buffers one float32 rounding.
        assert_close(y.double(), y_ref[own], f"{what} output", rtol=0.0, atol=1e-5)
        assert_close(mine.grad.double(), group_x.grad[own], f"{what} grad_input", rtol=0.0, atol=1e-4)
        grads = torch.cat([layer.weight.grad, layer.bias.grad]).double()
        if len(members) > 1:
            dist.all_reduce(grads, group=group)  # weight/bias grads are local sums; DDP would combine them
        assert_close(grads, torch.cat([ref.weight.grad, ref.bias.grad]), f"{what} grad_param", rtol=1e-5, atol=1e-5)
        for name in ("running_mean", "running_var"):
            assert_close(getattr(layer, name).double(), getattr(ref, name), f"{what} {name}", rtol=1e-6, atol=1e-7)
        if others is not None:
            with torch.no_grad():
                other(_rows(others, x))
            # The other group's statistics are far apart (its mean is shifted by 2): no cross-group leakage.
            assert not torch.allclose(layer.running_mean.double(), other.running_mean, atol=0.05), what


def _check_new_sync_groups(rank: int, world_size: int) -> Any:
    for bad in (3, 0, -2, True, 2.0):
        with OpCounter() as counter:
            with pytest.raises(ValueError) as info:
                new_sync_groups(bad)
        assert not counter.collectives, f"group_size={bad!r} ran collectives before raising: {counter.collectives}"
        if bad == 3:
            message = str(info.value)
            assert "world_size 4" in message and "group_size 3" in message, message

    pairs = new_sync_groups(2)
    members = [rank - rank % 2, rank - rank % 2 + 1]
    assert dist.get_process_group_ranks(pairs) == members
    _check_group_sync(rank, pairs, members, others=[r for r in range(world_size) if r not in members])

    world = new_sync_groups(4)
    assert dist.get_process_group_ranks(world) == [0, 1, 2, 3]
    _check_group_sync(rank, world, [0, 1, 2, 3], others=None)

    alone = new_sync_groups(1)
    assert dist.get_process_group_ranks(alone) == [rank]
    _check_group_sync(rank, alone, [rank], others=None)
    return pairs


# ---------------------------------------------------------------------------------------------------------
# sync_running_stats
# ---------------------------------------------------------------------------------------------------------


def _stats_model() -> nn.Sequential:
    """Every kind of BatchNorm the function must find, at several depths and dtypes, plus ones it must skip."""
    return nn.Sequential(
        nn.BatchNorm1d(C),
        nn.Sequential(nn.Conv2d(C, C, 1), nn.BatchNorm2d(C)),
        SynchronizedBatchNorm2d(C),
        nn.SyncBatchNorm(C),
        nn.BatchNorm2d(C, track_running_stats=False),  # no buffers: skipped
        nn.Linear(2, 2),
        nn.BatchNorm3d(C, dtype=torch.float64),
        nn.BatchNorm1d(C, dtype=torch.bfloat16),
    )


def _tracked(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None
    ]


def _rank_state(model: nn.Module, rank: int) -> dict[str, Tensor]:
    """Distinct, reproducible running statistics of ``rank`` for every tracked layer (as float64)."""
    gen = torch.Generator().manual_seed(SEED + 1000 * rank)
    state = {}
    for name, _ in _tracked(model):
        state[f"{name}.running_mean"] = torch.randn(C, generator=gen, dtype=torch.float64) + rank
        state[f"{name}.running_var"] = torch.rand(C, generator=gen, dtype=torch.float64) + 0.5 + rank
        state[f"{name}.num_batches_tracked"] = torch.tensor(7 * rank + 1, dtype=torch.float64)
    return state


def _load(model: nn.Module, rank: int) -> None:
    state = _rank_state(model, rank)
    with torch.no_grad():
        for name, layer in _tracked(model):
            for buffer in ("running_mean", "running_var", "num_batches_tracked"):
                getattr(layer, buffer).copy_(state[f"{name}.{buffer}"])


def _assert_state(model: nn.Module, expected: dict[str, Tensor], what: str) -> None:
    """Buffers equal float64 ``expected`` rounded once to each buffer's dtype (the sync packs in float64)."""
    for name, layer in _tracked(model):
        for buffer in ("running_mean", "running_var", "num_batches_tracked"):
            actual = getattr(layer, buffer)
            want = expected[f"{name}.{buffer}"].to(actual.dtype)
            # float64 sum of <= 4 values, divided, rounded to the buffer dtype: within one rounding of the
            # correctly rounded mean (one ulp of the buffer dtype; exact for broadcast and num_batches_tracked).
            rtol = torch.finfo(actual.dtype).eps if buffer != "num_batches_tracked" else 0.0
            assert_close(actual, want, f"{what}: {name}.{buffer} ({actual.dtype})", rtol=rtol, atol=0.0)


def _mean_state(model: nn.Module, ranks: Sequence[int], source: dict[str, Tensor]) -> dict[str, Tensor]:
    """Float64 mean over ``ranks`` of the buffers as loaded (rounded to their dtypes), nbt left as ``source``."""
    expected = {}
    for name, layer in _tracked(model):
        for buffer in ("running_mean", "running_var"):
            key = f"{name}.{buffer}"
            dtype = getattr(layer, buffer).dtype
            expected[key] = torch.stack([_rank_state(model, r)[key].to(dtype).double() for r in ranks]).mean(0)
        expected[f"{name}.num_batches_tracked"] = source[f"{name}.num_batches_tracked"]
    return expected


def _check_sync_running_stats(rank: int, world_size: int, pairs: Any) -> None:
    model = _stats_model()
    own = _rank_state(model, rank)
    members = [rank - rank % 2, rank - rank % 2 + 1]

    cases = [
        # (name, process_group, mode, ranks averaged or None, source rank for broadcast or None)
        ("world mean", None, "mean", list(range(world_size)), None),
        ("world broadcast", None, "broadcast", None, 0),
        ("pair mean", pairs, "mean", members, None),
        ("pair broadcast", pairs, "broadcast", None, members[0]),
    ]
    for name, group, mode, averaged, source in cases:
        _load(model, rank)
        with OpCounter() as counter:
            returned = sync_running_stats(model, process_group=group, mode=mode)
        assert returned is model, name
        # One collective for all six layers: the buffers travel packed.
        expected_call = "c10d.allreduce_" if mode == "mean" else "c10d.broadcast_"
        assert counter.collectives == Counter({expected_call: 1}), f"{name}: {counter.collectives}"
        if averaged is not None:
            expected = _mean_state(model, averaged, own)
        else:
            expected = _loaded_dtypes(model, _rank_state(model, source))
            expected.update({k: v for k, v in own.items() if k.endswith("num_batches_tracked")})  # left alone
        _assert_state(model, expected, name)

    # A default mode is "mean".
    _load(model, rank)
    sync_running_stats(model)
    _assert_state(model, _mean_state(model, list(range(world_size)), own), "default mode")

    # Unknown mode: ValueError on every rank before any collective, buffers untouched.
    _load(model, rank)
    with OpCounter() as counter:
        with pytest.raises(ValueError, match="mode"):
            sync_running_stats(model, mode="median")
    assert not counter.collectives, counter.collectives
    _assert_state(model, _loaded_dtypes(model, own), "bad mode")

    # A model without running statistics costs nothing.
    with OpCounter() as counter:
        sync_running_stats(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(C, track_running_stats=False)))
    assert not counter.collectives, counter.collectives

    # A group this rank is not in: ValueError on ranks 2 and 3; ranks 0 and 1 average among themselves.
    low = dist.new_group([0, 1])
    _load(model, rank)
    if rank in (0, 1):
        sync_running_stats(model, process_group=low)
        _assert_state(model, _mean_state(model, [0, 1], own), "group [0, 1]")
    else:
        with pytest.raises(ValueError, match="not a member"):
            sync_running_stats(model, process_group=low)


def _loaded_dtypes(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` as the buffers hold it: rounded to each buffer's dtype, back in float64."""
    out = {}
    for name, layer in _tracked(model):
        for buffer in ("running_mean", "running_var", "num_batches_tracked"):
            key = f"{name}.{buffer}"
            out[key] = state[key].to(getattr(layer, buffer).dtype).double()
    return out


def _worker(rank: int, world_size: int) -> str:
    pairs = _check_new_sync_groups(rank, world_size)
    _check_sync_running_stats(rank, world_size, pairs)
    return "ok"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_groups_and_running_stats_over_gloo_world_size_4() -> None:
    assert run_distributed(_worker, 4, timeout=240) == ["ok"] * 4


def test_new_sync_groups_needs_an_initialized_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        new_sync_groups(2)


def test_sync_running_stats_without_process_group_is_a_no_op_that_still_checks_mode() -> None:
    assert not dist.is_initialized()
    model = _stats_model()
    _load(model, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert sync_running_stats(model) is model
    assert sync_running_stats(model, mode="broadcast") is model
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    with pytest.raises(ValueError, match="'median'"):
        sync_running_stats(model, mode="median")
    assert syncbn_dist.sync_running_stats is sync_running_stats
