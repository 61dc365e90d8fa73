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

import syncbn_dist
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
    if setup.get("torch_class"):  # torch.nn.SyncBatchNorm layers, built by torch's converter, under syncbn_dist's patch
        model = nn.SyncBatchNorm.convert_sync_batchnorm(_net(setup.get("momentum", 0.1))).to(device)
    else:
        model = convert_model(_net(setup.get("momentum", 0.1))).to(device)
    net = model
    if setup.get("cpu_replicas"):
        model = DataParallelWithCallback(model, cpu_replicas=setup["cpu_replicas"])
    wrapped = DistributedDataParallel(model) if setup["ddp"] else model
    if setup.get("module_train"):  # DDP in eval mode, the model inside it in training mode: the layers train
        wrapped.eval()
        wrapped.module.train()
    if setup.get("ddp_alone"):  # Join([ddp_model]): syncbn_dist's extension of Join adds the layers' joinable
        joinables = [wrapped]
    else:
        # The joinable of the DDP model, of the module inside it (the default), or of the model that the wrappers
        # replicate ("join_inner": DataParallel runs replicas of it, never it).
        joinable = join_layers(wrapped if setup.get("join_outer") else net if setup.get("join_inner") else model)
        joinables = [joinable, wrapped] if setup.get("ours_first") else [wrapped, joinable]
    forward = _children_in_turn(net) if setup.get("children") else wrapped
    if setup.get("compile"):  # the layers run eagerly inside the compiled function (a graph break each)
        forward = torch.compile(forward, backend="eager")
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
                out = forward(x)
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


def _children_in_turn(model: nn.Module) -> Any:
    """``model``'s forward with its children called one by one (as self-supervised code calls ``model.backbone``):
    the model's own forward never runs."""

    def forward(x: Tensor) -> Tensor:
        for child in model.children():
            x = child(x)
        return x

    return forward


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


@pytest.mark.parametrize(
    "counts, setup",
    [
        # DDP over DataParallel replicas, the joinable of the model inside both (docs/training.md: "the inner model
        # works too"): the master replica of each process sums over processes.
        ([3, 1], {"ddp": True, "cpu_replicas": 2, "join_inner": True}),
        ([2, 0, 3], {"ddp": True, "cpu_replicas": 2, "join_inner": True}),
        # DataParallel replicas of the model the joinable was built from, no DDP: nothing runs the model itself.
        ([3, 1], {"ddp": False, "cpu_replicas": 2, "join_inner": True}),
        ([2, 0, 3], {"ddp": False, "cpu_replicas": 2, "join_inner": True}),
        # The model's children called in turn: no forward of the model.
        ([1, 3], {"ddp": False, "children": True}),
        ([2, 0, 3], {"ddp": False, "children": True, "momentum": None}),
        ([1, 3], {"ddp": False, "children": True, "compile": True}),
        # ddp.eval(), then ddp.module.train(): the layers train, the DDP model (whose joinable it is) is in eval mode.
        ([3, 1], {"ddp": True, "ddp_alone": True, "module_train": True}),
        ([2, 0, 3], {"ddp": True, "module_train": True, "join_outer": True, "ours_first": True}),
    ],
    ids=[
        "ddp-dataparallel-inner-3-1",
        "ddp-dataparallel-inner-2-0-3",
        "dataparallel-inner-3-1",
        "dataparallel-inner-2-0-3",
        "children-1-3",
        "children-2-0-3-cumulative",
        "children-compiled-1-3",
        "ddp-eval-module-train-3-1",
        "ddp-eval-module-train-2-0-3-ours-first",
    ],
)
def test_joinables_serve_whichever_wrapper_or_child_runs_exactly(counts: list[int], setup: dict) -> None:
    """The module that runs is not the one the joinable was built from: a replica, a child (in a compiled function
    too), a wrapper in another mode.
    Every step still equals float64 BatchNorm on the active ranks' union (the layers start each step's header
    themselves); a rank that runs a step without it would wait for the 10 s collective timeout, or abort on gloo's
    size check."""
    results = run_distributed(_train_uneven, len(counts), counts, setup, timeout=90, collective_timeout=10)
    _assert_matches_reference(results, len(counts), counts, setup)


def _train_uneven_patched(rank: int, world_size: int, counts: list[int], setup: dict[str, Any]) -> dict[str, Any]:
    with syncbn_dist.patch_torch_sync_batchnorm():
        return _train_uneven(rank, world_size, counts, {**setup, "torch_class": True})


@pytest.mark.parametrize("counts", [[1, 3], [2, 0, 3]], ids=["W2-1-3", "W3-2-0-3"])
def test_torchs_patched_class_under_join_of_its_ddp_model_is_exact(counts: list[int]) -> None:
    """torch.nn.SyncBatchNorm layers (torch's converter) under patch_torch_sync_batchnorm: Join([ddp]) finds them as
    it finds syncbn_dist's own, and every step equals float64 BatchNorm on the active ranks' union."""
    setup = {"ddp": True, "ddp_alone": True}
    results = run_distributed(_train_uneven_patched, len(counts), counts, setup, timeout=90, collective_timeout=30)
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


class _Alternating(nn.Module):
    """A head of its own for even and odd steps (``calls``: the steps so far), then a layer both share: no step starts
    at the layer the step before started at."""

    def __init__(self) -> None:
        super().__init__()
        self.even, self.odd, self.shared = nn.BatchNorm2d(3), nn.BatchNorm2d(3), nn.BatchNorm2d(3)
        self.calls = 0

    def head(self, x: Tensor) -> Tensor:
        self.calls += 1
        return (self.odd if self.calls % 2 == 0 else self.even)(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.shared(self.head(x))


def _alternating_worker(rank: int, world_size: int, counts: list[int], children: bool) -> dict[str, Any]:
    """``_Alternating`` under ``Join([join_layers(model)])``, called as a model or through its parts (``children``)."""
    model = convert_model(_Alternating())
    outputs = []
    with Join([join_layers(model)]):
        for x, _ in _batches(rank, counts):
            x = x[:, :3].float()
            out = model.shared(model.head(x)) if children else model(x)
            (out * out).sum().backward()
            outputs.append(out.detach().double())
    return {"outputs": outputs, "stats": _running_stats(model)}


@pytest.mark.parametrize("children", [False, True], ids=["model", "its parts"])
def test_a_step_that_starts_at_another_layer_than_the_step_before_is_served_exactly(children: bool) -> None:
    """With our joinable alone in the Join, the layers find each step's start from the step before's backward: a
    step that starts at a layer the step before did not run still starts with the header, whoever calls the layers
    (rank 0 joins after the first step, so the header of every later step must count it out)."""
    counts = [1, 3]
    results = run_distributed(_alternating_worker, 2, counts, children, timeout=60, collective_timeout=10)
    reference = _Alternating().double()
    batches = [_batches(rank, counts) for rank in range(2)]
    for step in range(max(counts)):
        active = [rank for rank in range(2) if step < counts[rank]]
        out = reference(torch.cat([batches[rank][step][0][:, :3] for rank in active]))
        (out * out).sum().backward()
        sizes = [batches[rank][step][0].size(0) for rank in active]
        for rank, expected in zip(active, out.split(sizes)):
            assert_close(results[rank]["outputs"][step], expected, f"output, rank {rank}, step {step}", **TOLERANCE)
    for rank in range(2):
        for i, (s, e) in enumerate(zip(results[rank]["stats"], _running_stats(reference))):
            assert_close(s, e, f"running statistic {i}, rank {rank}", **TOLERANCE)


class _Twice(nn.Module):
    """Layers ``a`` and ``b`` of one width; at step ``parting`` (counted by ``calls``) rank 0 runs ``a`` twice, the
    others ``b`` twice, inside the model's forward."""

    def __init__(self, parting: int) -> None:
        super().__init__()
        self.a, self.b = nn.BatchNorm2d(3), nn.BatchNorm2d(3)
        self.parting, self.calls = parting, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls - 1 != self.parting:
            return self.b(self.a(x))
        return self.b(self.a(self.a(x))) if dist.get_rank() == 0 else self.b(self.b(self.a(x)))


def _twice_worker(rank: int, world_size: int, counts: list[int], parting: int) -> dict[str, Any]:
    import time

    model = convert_model(_Twice(parting))
    steps, error = 0, None
    dist.barrier()
    start = time.monotonic()
    try:
        with Join([join_layers(model)]):
            for x, _ in _batches(rank, counts):
                model(x[:, :3].float()).sum().backward()
                steps += 1
    except Exception as caught:  # noqa: BLE001 - reported to the parent, which checks every rank's
        error = caught
    return {"error": type(error).__name__, "steps": steps, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("parting", [0, 1], ids=["first step", "a later step"])
def test_ranks_that_call_a_layer_more_often_inside_the_models_forward_raise_on_every_rank(parting: int) -> None:
    """Our joinable alone: a forward of the model starts each step's header, whatever runs inside it, so ranks that
    part there meet at their layers' collectives, whose check (the first step) or tags (later) raise on every rank
    within seconds (a header on one rank against a payload on another would wait for the 10 s timeout)."""
    results = run_distributed(_twice_worker, 2, [3, 3], parting, timeout=60, collective_timeout=10)
    for rank, result in enumerate(results):
        assert result["error"] == "LayerMismatchError", (rank, result)
        assert result["steps"] == parting and result["seconds"] < 8.0, (rank, result)


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


# ---------------------------------------------------------------------------------------------------------------
# Several joinables in one Join, process subgroups, and torch's patched class
# ---------------------------------------------------------------------------------------------------------------

SETUPS = ["two join_layers", "ddp and a target network", "two ddp", "a layer shared by both"]


def _pair(how: str, double: bool = False) -> tuple[nn.Module, nn.Module]:
    """Models A and B (B's first BatchNorm is A's for "a layer shared by both"), the same on every rank and in the
    reference; synchronized unless ``double`` (the float64 reference)."""
    torch.manual_seed(0)
    a, b = _net(), _net()
    if how == "a layer shared by both":
        b[1] = a[1]
    if double:
        return a.double(), b.double()
    return convert_model(a), convert_model(b)


def _step_of_pair(a: Any, b: Any, x: Tensor, w: Tensor, how: str) -> dict[str, Any]:
    """A trains on ``x``; B trains too, or, as a target network (BYOL, MoCo), runs in train mode under no_grad."""
    x = x.clone().requires_grad_()
    out_a = a(x)
    (out_a * w).sum().backward()
    if how == "ddp and a target network":
        with torch.no_grad():
            out_b = b(x.detach())
    else:
        out_b = b(x.detach())
        (out_b * w).sum().backward()
    return {"out": [out_a.detach(), out_b.detach()], "grad_input": x.grad}


def _records_of(a: nn.Module, b: nn.Module, step: dict[str, Any]) -> dict[str, Any]:
    grads = [p.grad.to(torch.float64, copy=True) for p in (*a.parameters(), *b.parameters()) if p.grad is not None]
    return {**{k: v for k, v in step.items()}, "grads": grads, "stats": _running_stats(a) + _running_stats(b)}


def _pair_worker(rank: int, world_size: int, counts: list[int], how: str) -> list[dict[str, Any]]:
    a, b = _pair(how)
    wrapped_a, wrapped_b = a, b
    if how == "two join_layers" or how == "a layer shared by both":
        joinables = [join_layers(a), join_layers(b)]
    elif how == "ddp and a target network":
        wrapped_a = DistributedDataParallel(a)
        joinables = [wrapped_a, join_layers(b)]  # the online network's layers: found through its DDP
    else:
        wrapped_a, wrapped_b = DistributedDataParallel(a), DistributedDataParallel(b)
        joinables = [wrapped_a, wrapped_b]
    records = []
    with Join(joinables):
        for x, w in _batches(rank, counts):
            for model in (a, b):
                model.zero_grad(set_to_none=True)
            step = _step_of_pair(wrapped_a, wrapped_b, x.float(), w.float(), how)
            records.append(_records_of(a, b, step))
    records.append({"stats": _running_stats(a) + _running_stats(b)})  # after the Join, the joined ranks' included
    return records


def _assert_pair_matches_reference(results: list[list[dict[str, Any]]], counts: list[int], how: str) -> None:
    a, b = _pair(how, double=True)
    batches = [_batches(rank, counts) for rank in range(len(counts))]
    ddp_a, ddp_b = how in ("ddp and a target network", "two ddp"), how == "two ddp"
    for step in range(max(counts)):
        active = [rank for rank in range(len(counts)) if step < counts[rank]]
        for model in (a, b):
            model.zero_grad(set_to_none=True)
        x = torch.cat([batches[rank][step][0] for rank in active])
        w = torch.cat([batches[rank][step][1] for rank in active])
        expected = _step_of_pair(a, b, x, w, how)
        expected = _records_of(a, b, expected)
        sizes = [batches[rank][step][0].size(0) for rank in active]
        for rank in active:
            got, where = results[rank][step], f"{how}: rank {rank}, step {step}"
            for i in range(2):
                assert_close(got["out"][i], expected["out"][i].split(sizes)[active.index(rank)], f"output {i}, {where}",
                             **TOLERANCE)
            assert_close(got["grad_input"], expected["grad_input"].split(sizes)[active.index(rank)],
                         f"input gradient, {where}", **TOLERANCE)
            for i, (s, e) in enumerate(zip(got["stats"], expected["stats"])):
                assert_close(s, e, f"running statistic {i}, {where}", **TOLERANCE)
        # Parameter gradients: DDP's average times the initial world size (a DDP model), or the ranks' sum.
        count_a = len(list(a.parameters()))
        for i, e in enumerate(expected["grads"]):
            ddp = ddp_a if i < count_a else ddp_b
            got = results[active[0]][step]["grads"][i] * len(counts) if ddp else sum(
                results[rank][step]["grads"][i] for rank in active
            )
            assert_close(got, e, f"{how}: parameter gradient {i}, step {step}", **TOLERANCE)
    final = _running_stats(a) + _running_stats(b)
    for rank, result in enumerate(results):
        for i, (s, e) in enumerate(zip(result[-1]["stats"], final)):
            assert_close(s, e, f"{how}: running statistic {i} after the Join, rank {rank}", **TOLERANCE)


@pytest.mark.parametrize("how", SETUPS)
@pytest.mark.parametrize("counts", [[1, 3], [2, 0, 3]], ids=["W2-1-3", "W3-2-0-3"])
def test_several_joinables_in_one_join_equal_batchnorm_on_the_active_ranks_union(counts: list[int], how: str) -> None:
    """Two models under one Join, each layer's outputs, gradients and running statistics against float64 BatchNorm
    on the active ranks' union: every joinable's layers share one copy of their group and one listener per rank."""
    results = run_distributed(_pair_worker, len(counts), counts, how, timeout=90, collective_timeout=30)
    _assert_pair_matches_reference(results, counts, how)


def _subgroup_worker(rank: int, world_size: int, counts: list[int], by_hand: bool) -> list[dict[str, Any]]:
    """Groups of two ranks in a world of four, made by new_sync_groups or by hand, under Join([ddp]) (DDP over the
    world): the groups' uneven batch counts, one group running out while the other goes on."""
    if by_hand:
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
        group = groups[rank // 2]
    else:
        group = syncbn_dist.new_sync_groups(2)
    model = convert_model(_net(), process_group=group)
    # Each group keeps its own running statistics: DDP's buffer broadcast from one rank would overwrite the others'.
    ddp = DistributedDataParallel(model, broadcast_buffers=False)
    records = []
    with Join([ddp]):
        for x, w in _batches(rank, counts):
            model.zero_grad(set_to_none=True)
            x = x.float().requires_grad_()
            out = ddp(x)
            (out * w.float()).sum().backward()
            records.append(
                {
                    "out": out.detach().double(),
                    "grad_input": x.grad.double(),
                    "grads": [p.grad.to(torch.float64, copy=True) for p in model.parameters()],
                    "stats": _running_stats(model),
                }
            )
    records.append({"stats": _running_stats(model)})
    return records


@pytest.mark.parametrize("by_hand", [False, True], ids=["new_sync_groups", "process_group by hand"])
def test_join_on_process_subgroups_is_exact_per_subgroup(by_hand: bool) -> None:
    """W=4, groups {0, 1} and {2, 3}: each group's layers equal float64 BatchNorm on the union of that group's active
    ranks, while the group {0, 1} runs out first (its ranks join) and {2, 3} goes on."""
    counts = [1, 2, 4, 3]
    results = run_distributed(_subgroup_worker, 4, counts, by_hand, timeout=120, collective_timeout=30)
    batches = [_batches(rank, counts) for rank in range(4)]
    references = [_net().double() for _ in range(2)]
    for step in range(max(counts)):
        summed: Optional[list[Tensor]] = None
        for index, reference in enumerate(references):
            members = [rank for rank in (2 * index, 2 * index + 1) if step < counts[rank]]
            if not members:
                continue
            reference.zero_grad(set_to_none=True)
            x = torch.cat([batches[rank][step][0] for rank in members]).requires_grad_()
            out = reference(x)
            (out * torch.cat([batches[rank][step][1] for rank in members])).sum().backward()
            sizes = [batches[rank][step][0].size(0) for rank in members]
            for rank, expected_out, expected_grad in zip(members, out.detach().split(sizes), x.grad.split(sizes)):
                got, where = results[rank][step], f"rank {rank}, step {step}"
                assert_close(got["out"], expected_out, f"output, {where}", **TOLERANCE)
                assert_close(got["grad_input"], expected_grad, f"input gradient, {where}", **TOLERANCE)
                for i, (s, e) in enumerate(zip(got["stats"], _running_stats(reference))):
                    assert_close(s, e, f"running statistic {i}, {where}", **TOLERANCE)
            grads = [p.grad for p in reference.parameters()]
            summed = grads if summed is None else [g + h for g, h in zip(summed, grads)]
        active = next(rank for rank in range(4) if step < counts[rank])
        assert summed is not None
        for i, expected in enumerate(summed):  # DDP's average over the world times its size: the sum over groups
            assert_close(results[active][step]["grads"][i] * 4, expected, f"parameter gradient {i}, step {step}",
                         **TOLERANCE)
    for rank in range(4):  # after the Join: the joined ranks kept their group's running statistics in step
        for i, (s, e) in enumerate(zip(results[rank][-1]["stats"], _running_stats(references[rank // 2]))):
            assert_close(s, e, f"running statistic {i} after the Join, rank {rank}", **TOLERANCE)


def _buffer_writers_worker(rank: int, world_size: int) -> list[str]:
    """Rank 0 has one batch, rank 1 three, under Join([ddp]) with DDP's buffer broadcast (its default): the threads
    that wrote rank 0's running statistics from the totals its listener answered (DDP's broadcast writes them on the
    main thread)."""
    import threading

    writers: list[str] = []
    update = torch_join.update_running_stats

    def recording(*args: Any) -> None:
        writers.append(threading.current_thread().name)
        update(*args)

    torch_join.update_running_stats = recording
    try:
        model = convert_model(_net())
        ddp = DistributedDataParallel(model)  # broadcast_buffers=True
        with Join([ddp]):
            for x, w in _batches(rank, [1, 3]):
                (ddp(x.float()) * w.float()).sum().backward()
    finally:
        torch_join.update_running_stats = update
    return writers


def test_a_joined_ranks_buffers_are_written_by_its_main_thread_only() -> None:
    """The listener thread hands the totals over; the main thread, which also runs DDP's buffer broadcast, applies
    them: two layers, two steps after rank 0 joined, four updates, all on the main thread."""
    writers, _ = run_distributed(_buffer_writers_worker, 2)
    assert writers == ["MainThread"] * 4, writers


# ---------------------------------------------------------------------------------------------------------------
# Join(..., throw_on_early_termination=True): every rank raises torch's error as soon as one has run out
# ---------------------------------------------------------------------------------------------------------------

THROWING = [
    "ddp alone",
    "ddp, join_layers(model)",
    "ddp, join_layers(ddp)",
    "join_layers(ddp), ddp",
    "join_layers alone",
    "join_layers alone, its children run",
    "join_layers alone, dataparallel replicas run",
    "plain batchnorm",
]


def _throwing_worker(rank: int, world_size: int, counts: list[int], how: str) -> dict[str, Any]:
    """Uneven batch counts under ``Join(..., throw_on_early_termination=True)`` (``how``: the joinables, or "plain
    batchnorm": nn.BatchNorm2d layers in ``Join([ddp])``): the error each rank raised, after how many steps, and the
    seconds its Join took (the ranks start together, after a barrier)."""
    import time

    net = _net()
    model = net if how == "plain batchnorm" else convert_model(net)
    ddp = DistributedDataParallel(model)
    wrapped: Any = model if how == "join_layers alone" else ddp
    if how == "join_layers alone, its children run":
        wrapped = _children_in_turn(model)
    elif how == "join_layers alone, dataparallel replicas run":
        wrapped = DataParallelWithCallback(model, cpu_replicas=2)
    if how in ("ddp alone", "plain batchnorm"):
        joinables: list[Any] = [ddp]
    elif how == "ddp, join_layers(model)":
        joinables = [ddp, join_layers(model)]
    elif how == "ddp, join_layers(ddp)":
        joinables = [ddp, join_layers(ddp)]
    elif how == "join_layers(ddp), ddp":
        joinables = [join_layers(ddp), ddp]
    else:
        joinables = [join_layers(model)]
    steps, error = 0, None
    dist.barrier()
    start = time.monotonic()
    try:
        with Join(joinables, throw_on_early_termination=True):
            for x, w in _batches(rank, counts):
                (wrapped(x.float()) * w.float()).sum().backward()
                steps += 1
    except Exception as caught:  # noqa: BLE001 - reported to the parent, which checks every rank's
        error = caught
    seconds = time.monotonic() - start
    stats = _running_stats(model)
    # The error caught, every rank trains on (outside any Join): one more step, as the other ranks run it.
    x, w = _batches(rank, [1] * world_size, epoch=1)[0]
    (wrapped(x.float()) * w.float()).sum().backward()
    return {
        "error": None if error is None else type(error).__name__,
        "message": str(error),
        "steps": steps,
        "seconds": seconds,
        "stats": stats,
        "stats_after": _running_stats(model),
    }


@pytest.mark.parametrize("how", THROWING)
@pytest.mark.parametrize("counts", [[1, 3], [2, 0, 3], [3, 2, 3]], ids=["W2-1-3", "W3-2-0-3", "W3-3-2-3"])
def test_throw_on_early_termination_raises_torchs_error_on_every_rank_at_once(counts: list[int], how: str) -> None:
    """As with plain BatchNorm ("plain batchnorm", the control): at the first step a rank has no batch for, that
    rank raises "Rank r exhausted all inputs." and every other rank "Detected at least one rank that exhausted
    inputs. Throwing across all ranks.", within seconds (a hang would end at the 10 s collective timeout with
    gloo's message), after the same number of steps; each catches it and trains one more step in step."""
    results = run_distributed(_throwing_worker, len(counts), counts, how, timeout=60, collective_timeout=10)
    shortest = min(counts)
    for rank, result in enumerate(results):
        where = f"{how}, rank {rank}: {result}"
        assert result["error"] == "RuntimeError", where
        if counts[rank] == shortest:
            assert result["message"] == f"Rank {rank} exhausted all inputs.", where
        else:
            assert result["message"] == (
                "Detected at least one rank that exhausted inputs. Throwing across all ranks."
            ), where
        assert result["steps"] == shortest, where
        assert result["seconds"] < 8.0, where
        # Synchronized layers: every rank ran the same steps, so the same running statistics (plain BatchNorm's are
        # each rank's own: only its num_batches_tracked, every third, is the same).
        for key in ("stats", "stats_after"):
            for i, (s, e) in enumerate(zip(result[key], results[0][key])):
                if how != "plain batchnorm" or i % 3 == 2:
                    assert_close(s, e, f"{key} {i}, {where}", rtol=0, atol=0)


def _uncovered_worker(rank: int, world_size: int, counts: list[int], listed: bool) -> dict[str, Any]:
    """A student under ``Join([ddp])`` beside a second synchronized model (an EMA-style teacher in training mode) that
    the ``Join`` lists (``listed``) or not: each rank's error and steps, then one step of both outside any Join."""
    import time

    student, teacher = convert_model(_net()), convert_model(_net())
    ddp = DistributedDataParallel(student)
    joinables: list[Any] = [ddp, join_layers(teacher)] if listed else [ddp]
    steps, error = 0, None
    dist.barrier()
    start = time.monotonic()
    try:
        with Join(joinables):
            for x, w in _batches(rank, counts):
                with torch.no_grad():
                    teacher(x.float())
                (ddp(x.float()) * w.float()).sum().backward()
                steps += 1
    except Exception as caught:  # noqa: BLE001 - reported to the parent, which checks every rank's
        error = caught
    seconds = time.monotonic() - start
    x, w = _batches(rank, [1] * world_size, epoch=1)[0]
    with torch.no_grad():
        teacher(x.float())
    (ddp(x.float()) * w.float()).sum().backward()
    return {
        "error": None if error is None else type(error).__name__, "message": str(error), "steps": steps,
        "runtime_error": isinstance(error, RuntimeError),
        "seconds": seconds, "open_joins": torch_join.OPEN_JOINS[0], "teacher": _running_stats(teacher),
    }


@pytest.mark.parametrize("counts", [[1, 3], [2, 0, 3]], ids=["W2-1-3", "W3-2-0-3"])
def test_a_synchronized_model_no_joinable_covers_raises_on_every_rank_naming_it(counts: list[int]) -> None:
    """A second model trained in the loop but not listed in the ``Join`` (a teacher): every rank that runs it raises
    at its first forward, before any collective (a hang would end at the 10 s collective timeout), with the layer and
    the remedy; a rank with no batch at all, which joined at once, leaves the Join as the others do, with nothing to
    raise. Outside the Join both models train again, in step. Listed, the same loop runs every rank's batches."""
    results = run_distributed(_uncovered_worker, len(counts), counts, False, timeout=60, collective_timeout=10)
    for rank, result in enumerate(results):
        where = f"rank {rank}: {result}"
        assert result["steps"] == 0 and result["seconds"] < 8.0 and result["open_joins"] == 0, where
        if counts[rank] == 0:
            assert result["error"] is None, where
            continue
        assert result["runtime_error"], where
        assert "layer '1' (SynchronizedBatchNorm2d) trains over a process group inside torch's Join" in (
            result["message"]
        ), where
        assert "Join([ddp, syncbn_dist.join_layers(teacher)])" in result["message"], where
    for rank, result in enumerate(results):
        for s, e in zip(result["teacher"], results[0]["teacher"]):
            assert_close(s, e, f"teacher's running statistics after the Join, rank {rank}", rtol=0, atol=0)
    listed = run_distributed(_uncovered_worker, len(counts), counts, True, timeout=60, collective_timeout=10)
    for rank, result in enumerate(listed):
        assert result["error"] is None and result["steps"] == counts[rank], f"rank {rank}: {result}"


class _HookOf010:
    """What syncbn_dist 0.1.0 pickled for the forward pre-hook that ``join_layers`` put on the model."""

    def __reduce__(self) -> tuple[Any, tuple[None]]:
        return (torch_join._ForwardHeader, (None,))


def test_a_model_pickled_with_the_forward_hook_of_0_1_0_loads_and_runs() -> None:
    """0.1.0 hooked the model's forward; a whole model saved then (``torch.save(model)``) carries the hook, which
    loads as an inert one and runs the model as it was."""
    model, x = _net().eval(), torch.randn(2, 3, 3, 2)
    expected = model(x)
    model._forward_pre_hooks[0] = _HookOf010()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded._forward_pre_hooks[0], torch_join._ForwardHeader)
    assert_close(loaded(x), expected, "the loaded model's output", rtol=0, atol=0)  # the same model, the same ops
