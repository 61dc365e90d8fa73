"""Uneven inputs across ranks under ``torch.distributed.algorithms.Join`` (syncbn_dist.join_layers), over gloo.

Each rank has its own number of batches (one rank may have none). Every step's outputs, input gradients, parameter
gradients and running statistics must equal ``nn.BatchNorm`` in float64 on the union of the batches of the ranks
still active at that step, and so must the evaluation after the uneven epoch, on every rank. A model whose layer
order changes from step to step is served exactly; active ranks at different layers raise on every rank.
"""

from __future__ import annotations

import copy
import gc
import io
import weakref
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from closeness import assert_close
from torch import Tensor, nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from launch.common.counting import CollectiveCounter
from launch.common.spawn import run_distributed
from syncbn_dist import DataParallelWithCallback, SyncBatchNormJoinable, convert_model, join_layers
from syncbn_dist.integrations import torch_join

pytestmark = pytest.mark.distributed

C = 4
LR = 0.1


def _net(momentum: Optional[float] = 0.1) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, C, 1),
        nn.BatchNorm2d(C, momentum=momentum),
        nn.ReLU(),
        nn.Conv2d(C, C, 1),
        nn.BatchNorm2d(C, momentum=momentum),
    )


def _batch_size(rank: int, step: int) -> int:
    """Uneven within a step, one empty shard (rank 0, step 1)."""
    return 0 if (rank, step) == (0, 1) else 2 + (rank + step) % 3


def _batches(rank: int, counts: list[int], epoch: int = 0) -> list[tuple[Tensor, Tensor]]:
    """Rank ``rank``'s batches of epoch ``epoch``: inputs (N, 3, 3, 2) with a per-channel offset, and weights for the
    loss."""
    generator = torch.Generator().manual_seed(1000 + rank + 100 * epoch)
    batches = []
    for step in range(counts[rank]):
        n = _batch_size(rank, step)
        x = torch.randn(n, 3, 3, 2, generator=generator, dtype=torch.float64) * 2.0 + 3.0
        batches.append((x, torch.randn(n, C, 3, 2, generator=generator, dtype=torch.float64)))
    return batches


def _epochs(counts: list[int], setup: dict[str, Any]) -> list[list[int]]:
    """Each epoch's batch counts by rank: ``counts``, then those of ``setup["then"]`` (each epoch its own Join)."""
    return [counts, *setup.get("then", [])]


def _eval_input() -> Tensor:
    return torch.randn(5, 3, 3, 2, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def _running_stats(model: nn.Module) -> list[Tensor]:
    return [
        t.detach().to("cpu", torch.float64, copy=True)
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        for t in (m.running_mean, m.running_var, m.num_batches_tracked)
    ]


def _train_uneven(rank: int, world_size: int, counts: list[int], setup: dict[str, Any]) -> dict[str, Any]:
    """Uneven epochs under Join, one Join each; each step's records, then the model in eval mode on every rank. The
    model runs on
    ``setup["device"]`` (default the CPU; tests/test_gpu.py runs it on CUDA tensors over gloo); records are on the
    CPU."""
    torch.manual_seed(0)
    device = torch.device(setup.get("device", "cpu"))
    model = convert_model(_net(setup.get("momentum", 0.1))).to(device)
    if setup.get("cpu_replicas"):
        model = DataParallelWithCallback(model, cpu_replicas=setup["cpu_replicas"])
    wrapped = DistributedDataParallel(model) if setup["ddp"] else model
    if setup.get("ddp_alone"):  # Join([ddp_model]): syncbn_dist's extension of Join adds the layers' joinable
        joinables = [wrapped]
    else:
        joinable = join_layers(wrapped if setup.get("join_outer") else model)
        joinables = [joinable, wrapped] if setup.get("ours_first") else [wrapped, joinable]
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    # Copies and pickles of the model (an EMA copy, torch.save) leave the Join behind and are plain layers.
    copy.deepcopy(model).train()(torch.randn(2, 3, 3, 2))
    torch.save(model, io.BytesIO())
    records = []
    for epoch, epoch_counts in enumerate(_epochs(counts, setup)):
        join = Join(joinables if setup["ddp"] else [joinable])
        assert any(isinstance(j, SyncBatchNormJoinable) for j in join._joinables)
        with join:
            for x, w in _batches(rank, epoch_counts, epoch):
                x = x.float().to(device).requires_grad_()
                out = wrapped(x)
                (out * w.float().to(device)).sum().backward()
                records.append(
                    {
                        "out": out.detach().double().cpu(),
                        "grad_input": x.grad.double().cpu(),
                        "grads": [p.grad.to("cpu", torch.float64, copy=True) for p in model.parameters()],
                        "stats": _running_stats(model),
                    }
                )
                if setup["ddp"]:  # without DDP each rank's gradients are its own: the parent sums them
                    optimizer.step()
                optimizer.zero_grad()
    wrapped.eval()
    with torch.no_grad():
        evaluated = wrapped(_eval_input().float().to(device)).double().cpu()
    return {"records": records, "eval": evaluated, "stats": _running_stats(model)}


def _reference(world_size: int, epochs: list[list[int]], momentum: Optional[float], train: bool) -> dict[str, Any]:
    """nn.BatchNorm in float64 on the union of the active ranks' batches, step by step over ``epochs`` (each epoch's
    batch counts by rank; SGD steps if ``train``). Each step says where each active rank's record of it is: the
    rank's steps of the earlier epochs come first."""
    model = _net(momentum).double()
    # DDP divides the summed gradients by the initial world size, even under Join.
    optimizer = torch.optim.SGD(model.parameters(), lr=LR / world_size if train else 0.0)
    steps = []
    for epoch, counts in enumerate(epochs):
        batches = [_batches(rank, counts, epoch) for rank in range(world_size)]
        done = [sum(earlier[rank] for earlier in epochs[:epoch]) for rank in range(world_size)]
        for step in range(max(counts)):
            steps.append(_reference_step(model, optimizer, batches, counts, step, done))
    model.eval()
    with torch.no_grad():
        evaluated = model(_eval_input())
    return {"steps": steps, "eval": evaluated, "stats": _running_stats(model)}


def _reference_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[list[tuple[Tensor, Tensor]]],
    counts: list[int],
    step: int,
    done: list[int],
) -> dict[str, Any]:
    """One step of :func:`_reference` over the ranks with a batch at ``step``; ``done``: each rank's earlier steps."""
    active = [rank for rank in range(len(counts)) if step < counts[rank]]
    x = torch.cat([batches[rank][step][0] for rank in active]).requires_grad_()
    w = torch.cat([batches[rank][step][1] for rank in active])
    out = model(x)
    (out * w).sum().backward()
    sizes = [batches[rank][step][0].size(0) for rank in active]
    record = {
        "active": active,
        "record": {rank: done[rank] + step for rank in active},
        "out": dict(zip(active, out.detach().split(sizes))),
        "grad_input": dict(zip(active, x.grad.split(sizes))),
        "grads": [p.grad.clone() for p in model.parameters()],
        "stats": _running_stats(model),
    }
    optimizer.step()
    optimizer.zero_grad()
    return record


# float32 activations and parameters against float64: a few float32 roundings per value, amplified by 1/std and by
# up to five SGD steps of shared weights.
TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}


def _assert_matches_reference(results: list[dict[str, Any]], world_size: int, counts: list[int], setup: dict) -> None:
    epochs = _epochs(counts, setup)
    reference = _reference(world_size, epochs, setup.get("momentum", 0.1), train=setup["ddp"])
    for step, expected in enumerate(reference["steps"]):
        records = {rank: results[rank]["records"][index] for rank, index in expected["record"].items()}
        # DDP's averaged gradients times the initial world size, or the sum of the ranks' own gradients.
        grads = [
            records[expected["active"][0]]["grads"][i] * world_size
            if setup["ddp"]
            else sum(records[rank]["grads"][i] for rank in expected["active"])
            for i in range(len(expected["grads"]))
        ]
        for i, (g, e) in enumerate(zip(grads, expected["grads"])):
            assert_close(g, e, f"parameter {i} gradient, step {step}", **TOLERANCE)
        for rank in expected["active"]:
            got = records[rank]
            where = f"rank {rank}, step {step}"
            assert_close(got["out"], expected["out"][rank], f"output, {where}", **TOLERANCE)
            assert_close(got["grad_input"], expected["grad_input"][rank], f"input gradient, {where}", **TOLERANCE)
            for i, (s, e) in enumerate(zip(got["stats"], expected["stats"])):
                assert_close(s, e, f"running statistic {i}, {where}", **TOLERANCE)
    for rank, result in enumerate(results):
        assert len(result["records"]) == sum(epoch[rank] for epoch in epochs)
        for i, (s, e) in enumerate(zip(result["stats"], reference["stats"])):
            assert_close(s, e, f"running statistic {i} after the last epoch, rank {rank}", **TOLERANCE)
        assert_close(result["eval"], reference["eval"], f"evaluation after the last epoch, rank {rank}", **TOLERANCE)


@pytest.mark.parametrize(
    "counts, setup",
    [
        ([3, 5], {"ddp": True}),
        ([2, 0, 4], {"ddp": True, "ours_first": True, "join_outer": True}),
        ([2, 3], {"ddp": True, "ddp_alone": True}),
        # No DDP, a cumulative average: the joined rank keeps its running statistics from what it answers.
        ([4, 1], {"ddp": False, "momentum": None}),
        # Two thread replicas in each process, the master of each summing over processes.
        ([1, 3], {"ddp": False, "cpu_replicas": 2, "join_outer": True}),
        # A second Join of the same model (the next epoch), where the other rank runs out first: nothing of the first
        # Join (the joinable found for the model, the session, a layer's tracked-forward flag) outlives it wrongly.
        ([3, 1], {"ddp": True, "ddp_alone": True, "then": [[1, 2]]}),
        ([0, 2], {"ddp": False, "cpu_replicas": 2, "join_outer": True, "then": [[2, 1]]}),
    ],
    ids=[
        "ddp-3-5",
        "ddp-2-0-4-ours-first",
        "ddp-alone-2-3",
        "no-ddp-4-1-cumulative",
        "replicas-1-3",
        "ddp-alone-3-1-then-1-2",
        "replicas-0-2-then-2-1",
    ],
)
def test_uneven_batch_counts_under_join_equal_batchnorm_on_the_active_ranks_union(
    counts: list[int], setup: dict
) -> None:
    results = run_distributed(_train_uneven, len(counts), counts, setup)
    _assert_matches_reference(results, len(counts), counts, setup)


class _Reordering(nn.Module):
    """Two synchronized layers whose order changes from step to step, or from rank to rank."""

    def __init__(self, by_rank: bool) -> None:
        super().__init__()
        self.first, self.second = nn.BatchNorm2d(3), nn.BatchNorm2d(3)
        self.by_rank, self.calls = by_rank, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        flip = dist.get_rank() // 2 if self.by_rank else self.calls % 2  # ranks 0 and 2 differ
        a, b = (self.second, self.first) if flip else (self.first, self.second)
        return b(a(x))


def _reorder_worker(rank: int, world_size: int, counts: list[int], by_rank: bool) -> dict[str, Any]:
    model = convert_model(_Reordering(by_rank))
    ddp = DistributedDataParallel(model)
    outputs: list[Tensor] = []
    try:
        with Join([ddp, join_layers(model)]):
            for x, _ in _batches(rank, counts):
                out = ddp(x.float())
                out.sum().backward()
                outputs.append(out.detach().double())
    except Exception as error:  # noqa: BLE001 - reported to the parent, which checks every rank's
        return {"error": type(error).__name__, "message": str(error), "outputs": outputs}
    return {"error": None, "outputs": outputs, "stats": _running_stats(model)}


def test_layer_order_changing_from_step_to_step_is_served_exactly() -> None:
    counts = [3, 1]
    results = run_distributed(_reorder_worker, 2, counts, False)
    assert [r["error"] for r in results] == [None, None]
    reference = _Reordering(by_rank=False).double()
    batches = [_batches(rank, counts) for rank in range(2)]
    for step in range(max(counts)):
        active = [rank for rank in range(2) if step < counts[rank]]
        out = reference(torch.cat([batches[rank][step][0] for rank in active]))
        sizes = [batches[rank][step][0].size(0) for rank in active]
        for rank, expected in zip(active, out.split(sizes)):
            assert_close(results[rank]["outputs"][step], expected, f"output, rank {rank}, step {step}", **TOLERANCE)
    for rank in range(2):
        for i, (s, e) in enumerate(zip(results[rank]["stats"], _running_stats(reference))):
            assert_close(s, e, f"running statistic {i}, rank {rank}", **TOLERANCE)


def test_active_ranks_at_different_layers_raise_on_every_rank() -> None:
    """Rank 1 has no batch; ranks 0 and 2 run the two layers in opposite orders: all three raise the clear error
    (rank 1 when the others have left), well before the process group's 60 s timeout."""
    results = run_distributed(_reorder_worker, 3, [2, 0, 2], True, timeout=50)
    for rank, result in enumerate(results):
        assert result["error"] == "LayerMismatchError", (rank, result)
        assert "different synchronized layers" in result["message"]


def _count_worker(rank: int, world_size: int) -> list[dict[str, int]]:
    """Rank 1's collectives per step, by group, with rank 0 joined from step 1 on (no DDP: only the layers')."""
    model = convert_model(_net())
    joinable = join_layers(model)
    per_step = []
    with Join([joinable]):
        for x, _ in _batches(rank, [1, 3]):
            with CollectiveCounter() as counter:
                model(x.float()).sum().backward()
            calls = [c for c in counter.calls if c["op"] == "all_reduce"]
            per_step.append({group: sum(c["group"] == group for c in calls) for group in ("world", "other")})
    return per_step


def test_collectives_per_step_a_header_then_a_control_before_each_while_a_rank_has_joined() -> None:
    """Two layers, one all_reduce each per direction on the layers' own group ("other"); Join's notification on
    the world group (our joinable alone is first). Every step adds one header; while rank 0 has joined, each of
    the four collectives gets a control before it."""
    per_step = run_distributed(_count_worker, 2)[1]
    assert per_step == [
        {"world": 1, "other": 1 + 4},
        {"world": 1, "other": 1 + 2 * 4},
        {"world": 1, "other": 1 + 2 * 4},
    ]


def _groups_after_destroy_worker(rank: int, world_size: int) -> list[bool]:
    """An uneven epoch under ``Join([ddp])``, the model dropped, then torch destroys the groups syncbn_dist made for
    it: whether each is still alive (something of syncbn_dist holds it)."""
    model = convert_model(_net())
    ddp = DistributedDataParallel(model)
    with Join([ddp]):
        for x, _ in _batches(rank, [2, 3]):
            ddp(x.float()).sum().backward()
    copies = list(torch_join._session_groups([dist.group.WORLD], torch.device("cpu")).values())
    del model, ddp
    refs = [weakref.ref(group) for group in copies]
    for group in copies:
        dist.destroy_process_group(group)
    del copies, group
    gc.collect()
    return [ref() is not None for ref in refs]


def test_join_holds_no_process_group_past_destroy_process_group() -> None:
    """The copies of the layers' groups that Join synchronizes over are freed when torch destroys them, as a group
    torch made is: one that outlives destroy_process_group is destroyed during the interpreter's exit, where gloo's can
    abort the process ("terminate called without an active exception", exit code -6, after the README's Join recipe
    had printed its result)."""
    assert run_distributed(_groups_after_destroy_worker, 2) == [[False], [False]]
