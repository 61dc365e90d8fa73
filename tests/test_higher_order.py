"""Higher-order derivatives through the synchronized layer, against nn.BatchNorm on the global batch in float64.

Double backward (``create_graph=True``): a gradient penalty (also as a WGAN-GP step under DistributedDataParallel),
a MAML-style inner step through ``torch.func.functional_call``, Hessian-vector products over the parameters and
over the input (``torch.autograd.functional.hvp``), the penalty through ``torch.func.grad`` of ``torch.func.grad``.
Forward-mode AD (``torch.autograd.forward_ad``, ``torch.func.jvp``). Each runs over real gloo process groups (world
sizes 2 and 3, uneven and empty shards), over DataParallel thread replicas, and over both at once (thread replicas
inside each gloo process).

Every rank differentiates its own share of a global objective that is a sum over the batch, so the sum over ranks of
its second-order parameter gradients is the global one; per-sample quantities (input gradients, jvp tangents, the
input HVP) are compared row by row with the reference's rows of this rank.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import Tensor, nn
from torch.autograd import forward_ad
from torch.func import functional_call
from torch.nn.parallel import DistributedDataParallel

import syncbn_dist
from launch.common.spawn import run_distributed
from syncbn_dist.comm import run_replicas_in_threads
from syncbn_dist.integrations.data_parallel import _abort_exchanges, _replicate_on_cpu
from tests.closeness import assert_close

# Float64 end to end: the results differ from the reference by float64 rounding of a few hundred operations.
TOL = dict(rtol=1e-9, atol=1e-10)

# Per-rank (or per-replica) batch sizes, uneven and empty included.
SHARDS = {2: [[3, 5], [0, 4]], 3: [[2, 0, 5], [3, 3, 2]]}


def _net() -> nn.Sequential:
    """The issue's network: conv - BatchNorm2d - ReLU - pool - Linear - BatchNorm1d (float64)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16, 5),
        nn.BatchNorm1d(5),
    ).double()


def _batch(total: int, seed: int) -> tuple[Tensor, Tensor]:
    """The global batch (total, 3, 5, 5) and a cotangent for the (total, 5) output."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(total, 3, 5, 5, generator=gen, dtype=torch.float64) + 0.5
    u = torch.randn(total, 5, generator=gen, dtype=torch.float64)
    return x, u


def _rows(shards: Sequence[int], member: int) -> slice:
    start = sum(shards[:member])
    return slice(start, start + shards[member])


def _grads(output: Tensor, inputs: Sequence[Tensor], **kwargs: bool) -> list[Tensor]:
    """``torch.autograd.grad`` with zeros for inputs the output does not reach (e.g. the last layer's bias)."""
    return list(torch.autograd.grad(output, inputs, allow_unused=True, materialize_grads=True, **kwargs))


# The objectives, each written once and run both on a shard (synchronized model) and on the global batch (reference).
# ``reduce`` sums a differentiable per-member quantity over the members (identity for the reference).


def _penalty(model: nn.Module, x: Tensor, u: Tensor) -> tuple[Tensor, list[Tensor]]:
    """First order: the input gradient of (model(x) * u).sum(); second order: the parameter gradient of its square."""
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad((model(x) * u).sum(), x, create_graph=True)
    return g.detach(), _grads(g.pow(2).sum(), list(model.parameters()))


def _maml(model: nn.Module, x: Tensor, u: Tensor, reduce: Callable[[Tensor], Tensor]) -> tuple[Tensor, list[Tensor]]:
    """One inner SGD step on the first half of the objective (functional_call), the outer gradient on the second."""
    params = dict(model.named_parameters())
    inner = (functional_call(model, params, (x,)) * u).sum()
    inner_grads = _grads(inner, list(params.values()), create_graph=True)
    fast = {name: p - 0.1 * reduce(g) for (name, p), g in zip(params.items(), inner_grads)}
    outer = (functional_call(model, fast, (x.flip(-1),)) * u.flip(-1)).pow(2).sum()
    return outer.detach(), _grads(outer, list(params.values()))


def _hvp_parameters(model: nn.Module, x: Tensor, u: Tensor) -> tuple[Tensor, list[Tensor]]:
    """The Hessian (over the parameters) of (tanh(model(x)) * u).sum() times a fixed direction."""
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(7)
    direction = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
    loss = (torch.tanh(model(x)) * u).sum()
    grads = _grads(loss, params, create_graph=True)
    dot = sum((g * v).sum() for g, v in zip(grads, direction))
    return loss.detach(), _grads(dot, params)


def _hvp_input(model: nn.Module, x: Tensor, u: Tensor) -> Tensor:
    """``torch.autograd.functional.hvp`` over the input of (tanh(model(x)) * u).sum(), direction cos(x)."""
    _, hvp = torch.autograd.functional.hvp(lambda inp: (torch.tanh(model(inp)) * u).sum(), x, torch.cos(x))
    return hvp


def _ddp_penalty_step(model: nn.Module, x: Tensor, u: Tensor, scale: int) -> None:
    """Backward of ``(model(x) * u).sum() + sum((|grad_x| - 1)**2)`` (the WGAN-GP penalty), times ``scale``."""
    x = x.clone().requires_grad_()
    out = model(x)
    (g,) = torch.autograd.grad((out * u).sum(), x, create_graph=True)
    loss = (out * u).sum() + (g.flatten(1).norm(dim=1) - 1).pow(2).sum()
    (loss * scale).backward()


def _func_penalty_gradient(model: nn.Module, x: Tensor, u: Tensor) -> list[Tensor]:
    """``torch.func.grad`` of the input-gradient penalty, itself taken with ``torch.func.grad``, over the parameters."""

    def loss(params: dict[str, Tensor], inp: Tensor) -> Tensor:
        return (functional_call(model, params, (inp,)) * u).sum()

    def penalty(params: dict[str, Tensor]) -> Tensor:
        return torch.func.grad(loss, argnums=1)(params, x).pow(2).sum()

    grads = torch.func.grad(penalty)({name: p.detach() for name, p in model.named_parameters()})
    return list(grads.values())


def _jvp_forward_ad(model: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """Output and tangent of model at x in the direction sin(x), by torch.autograd.forward_ad."""
    with forward_ad.dual_level():
        out = forward_ad.unpack_dual(model(forward_ad.make_dual(x, torch.sin(x))))
        return out.primal.detach(), out.tangent.detach()


def _sum_over_ranks(tensors: Sequence[Tensor]) -> list[Tensor]:
    # Contiguous copies: gloo reduces the storage in order, and an empty shard's conv weight gradient is strided.
    summed = [t.clone(memory_format=torch.contiguous_format) for t in tensors]
    for t in summed:
        dist.all_reduce(t)
    return summed


def _assert_all_close(actual: Sequence[Tensor], expected: Sequence[Tensor], what: str) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_close(a, e, f"{what} [{i}]", **TOL)


def _check_process_group(rank: int, world_size: int, shards: list[int], objective: str) -> None:
    reference = _net()
    model = syncbn_dist.convert_model(copy.deepcopy(reference))
    x, u = _batch(sum(shards), seed=sum(shards))
    rows = _rows(shards, rank)
    what = f"{objective} shards={shards} rank={rank}"
    if objective == "penalty":
        g, second = _penalty(model, x[rows], u[rows])
        g_ref, second_ref = _penalty(reference, x, u)
        assert_close(g, g_ref[rows], f"{what}: first order", **TOL)
        _assert_all_close(_sum_over_ranks(second), second_ref, f"{what}: penalty gradient")
    elif objective == "maml":
        outer, grads = _maml(model, x[rows], u[rows], dist_nn.all_reduce)
        outer_ref, grads_ref = _maml(reference, x, u, lambda g: g)
        assert_close(_sum_over_ranks([outer])[0], outer_ref, f"{what}: outer loss", **TOL)
        _assert_all_close(_sum_over_ranks(grads), grads_ref, f"{what}: outer gradient")
    elif objective == "hvp-parameters":
        _, hvp = _hvp_parameters(model, x[rows], u[rows])
        _, hvp_ref = _hvp_parameters(reference, x, u)
        _assert_all_close(_sum_over_ranks(hvp), hvp_ref, f"{what}: Hessian-vector product")
    elif objective == "hvp-input":
        assert_close(_hvp_input(model, x[rows], u[rows]), _hvp_input(reference, x, u)[rows], what, **TOL)
    elif objective == "forward-ad":
        out, tangent = _jvp_forward_ad(model, x[rows])
        out_ref, tangent_ref = _jvp_forward_ad(reference, x)
        assert_close(out, out_ref[rows], f"{what}: primal", **TOL)
        assert_close(tangent, tangent_ref[rows], f"{what}: tangent", **TOL)
    elif objective == "func-jvp":
        # torch.func transforms refuse in-place updates of captured buffers (nn.BatchNorm's too): no running stats.
        for net in (model, reference):
            torch.func.replace_all_batch_norm_modules_(net)
        out, tangent = torch.func.jvp(model, (x[rows],), (torch.sin(x[rows]),))
        out_ref, tangent_ref = torch.func.jvp(reference, (x,), (torch.sin(x),))
        assert_close(out, out_ref[rows], f"{what}: primal", **TOL)
        assert_close(tangent, tangent_ref[rows], f"{what}: tangent", **TOL)
    elif objective == "ddp-gradient-penalty":
        # A WGAN-GP-style step under DistributedDataParallel: loss plus the input-gradient penalty, one backward.
        _ddp_penalty_step(DistributedDataParallel(model), x[rows], u[rows], scale=world_size)  # DDP averages
        _ddp_penalty_step(reference, x, u, scale=1)
        grads = [p.grad for p in model.parameters()]
        _assert_all_close(grads, [p.grad for p in reference.parameters()], f"{what}: DDP parameter gradients")
    elif objective == "func-grad":
        # The penalty through the torch.func transforms: grad of a function of grad, over functional_call.
        for net in (model, reference):
            torch.func.replace_all_batch_norm_modules_(net)
        second = _func_penalty_gradient(model, x[rows], u[rows])
        second_ref = _func_penalty_gradient(reference, x, u)
        _assert_all_close(_sum_over_ranks(second), second_ref, f"{what}: torch.func penalty gradient")
    elif objective == "replicas":
        # Processes x thread replicas: each rank splits its shard over two replicas (the master all-reduces).
        halves = [shards[rank] // 2, shards[rank] - shards[rank] // 2]
        replicated = _AsModule(functools.partial(_replicated_forward, model, halves), model)
        g, second = _penalty(replicated, x[rows], u[rows])
        g_ref, second_ref = _penalty(reference, x, u)
        assert_close(g, g_ref[rows], f"{what}: first order", **TOL)
        _assert_all_close(_sum_over_ranks(second), second_ref, f"{what}: penalty gradient")
        layers = [m for m in model.modules() if isinstance(m, syncbn_dist.SyncBatchNorm)]
        assert [m.last_transport for m in layers] == ["dataparallel"] * 2
        return
    else:
        raise AssertionError(objective)
    layers = [m for m in model.modules() if isinstance(m, syncbn_dist.SyncBatchNorm)]
    assert [m.last_transport for m in layers] == ["distributed"] * 2


OBJECTIVES = [
    "penalty",
    "ddp-gradient-penalty",
    "maml",
    "hvp-parameters",
    "hvp-input",
    "forward-ad",
    "func-jvp",
    "func-grad",
    "replicas",
]


# World size 3 repeats the objectives whose collectives differ with more members; the torch.func transforms and the
# third-order hvp run the same collectives at any world size, so world size 2 (with an empty shard) covers them.
OBJECTIVES_AT_3 = ["penalty", "ddp-gradient-penalty", "maml", "hvp-parameters", "forward-ad", "replicas"]


def _worker(rank: int, world_size: int, objectives: list[str]) -> None:
    for shards in SHARDS[world_size]:
        for objective in objectives:
            if objective == "hvp-input" and 0 in shards:
                # torch.autograd.functional.hvp differentiates three times; torch's own convolution leaves an
                # empty batch's third-order graph disconnected (its hvp is None without a process group), so that
                # member would skip the collectives of the third pass (docs/design.md, "Higher-order derivatives").
                continue
            _check_process_group(rank, world_size, shards, objective)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
def test_higher_order_derivatives_over_gloo_equal_batchnorm_on_the_global_batch(world_size: int) -> None:
    run_distributed(_worker, world_size, OBJECTIVES if world_size == 2 else OBJECTIVES_AT_3)


# DataParallel thread replicas: the model is replicated by hand so that each replica's share is exact.


def _run_replicas(model: nn.Module, parts: Sequence[Tensor]) -> Tensor:
    replicas = _replicate_on_cpu(model, len(parts))
    syncbn_dist.execute_replication_callbacks(replicas)
    outputs = run_replicas_in_threads(
        replicas, [(p,) for p in parts], [{}] * len(parts), functools.partial(_abort_exchanges, replicas)
    )
    return torch.cat(outputs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("splits", [[3, 5], [2, 0, 5], [1, 3, 0, 4]])
def test_higher_order_derivatives_through_data_parallel_replicas(
    splits: list[int], one_intra_op_thread: None
) -> None:
    reference = _net()
    model = syncbn_dist.convert_model(copy.deepcopy(reference))
    replicated = functools.partial(_replicated_forward, model, splits)
    x, u = _batch(sum(splits), seed=len(splits))

    g, second = _penalty(_AsModule(replicated, model), x, u)
    g_ref, second_ref = _penalty(reference, x, u)
    assert_close(g, g_ref, f"replicas {splits}: first order", **TOL)
    _assert_all_close(second, second_ref, f"replicas {splits}: penalty gradient")

    _, hvp = _hvp_parameters(_AsModule(replicated, model), x, u)
    _, hvp_ref = _hvp_parameters(reference, x, u)
    _assert_all_close(hvp, hvp_ref, f"replicas {splits}: Hessian-vector product")

    assert_close(_hvp_input(_AsModule(replicated, model), x, u), _hvp_input(reference, x, u), "input hvp", **TOL)

    out, tangent = _jvp_forward_ad(_AsModule(replicated, model), x)
    out_ref, tangent_ref = _jvp_forward_ad(reference, x)
    assert_close(out, out_ref, f"replicas {splits}: forward-AD primal", **TOL)
    assert_close(tangent, tangent_ref, f"replicas {splits}: forward-AD tangent", **TOL)
    layers = [m for m in model.modules() if isinstance(m, syncbn_dist.SyncBatchNorm)]
    assert [m.last_transport for m in layers] == ["dataparallel"] * 2


def _replicated_forward(model: nn.Module, splits: list[int], x: Tensor) -> Tensor:
    return _run_replicas(model, x.split(splits))


class _AsModule(nn.Module):
    """A callable with ``model``'s parameters, for the objectives above."""

    def __init__(self, forward: Callable[[Tensor], Tensor], model: nn.Module) -> None:
        super().__init__()
        self._forward = forward
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self._forward(x)


def test_a_compiled_layer_refuses_double_backward_with_torchs_error() -> None:
    """Under torch.compile the backward is a compiled graph, which cannot be differentiated again: an error, never a
    silent first-order-only result. ("clip" puts the layer on its synchronized Function with no peers.)"""
    layer = syncbn_dist.SynchronizedBatchNorm1d(3).double()
    layer.eps_mode = "clip"
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="does not currently support double backward|donated buffer"):
        (g,) = torch.autograd.grad(compiled(x).pow(3).sum(), x, create_graph=True)
        g.sum().backward()


def test_clip_mode_double_backward_equals_its_own_autograd_reference() -> None:
    """eps_mode "clip" normalizes by sqrt(max(var, eps)): second derivatives match the same formula under autograd."""
    layer = syncbn_dist.SynchronizedBatchNorm1d(3, eps=0.5).double()
    layer.eps_mode = "clip"
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 3, generator=gen, dtype=torch.float64) * torch.tensor([0.1, 1.0, 3.0], dtype=torch.float64)

    def reference(inp: Tensor) -> Tensor:
        var, mean = torch.var_mean(inp, 0, correction=0)
        return (inp - mean) / var.clamp(min=0.5).sqrt() * layer.weight + layer.bias

    u = torch.randn(7, 3, generator=gen, dtype=torch.float64)
    results = []
    for fn in (layer, reference):
        inp = x.clone().requires_grad_()
        (g,) = torch.autograd.grad((torch.tanh(fn(inp)) * u).sum(), inp, create_graph=True)
        results.append([g.detach(), *_grads(g.pow(2).sum(), [inp, layer.weight])])
    _assert_all_close(results[0], results[1], "clip mode")


@pytest.mark.timeout(60)
def test_data_parallel_with_callback_forward_ad_is_exact_and_torch_func_is_refused(one_intra_op_thread: None) -> None:
    """forward_ad through the public DataParallelWithCallback is exact; a torch.func transform, whose state does not
    reach the replica threads (its tangents would be dropped silently), raises instead."""
    reference = _net()
    torch.func.replace_all_batch_norm_modules_(reference)
    parallel = syncbn_dist.DataParallelWithCallback(syncbn_dist.convert_model(copy.deepcopy(reference)), cpu_replicas=3)
    x, _ = _batch(8, seed=4)
    out, tangent = _jvp_forward_ad(parallel, x)
    out_ref, tangent_ref = _jvp_forward_ad(reference, x)
    assert_close(out, out_ref, "DataParallelWithCallback forward-AD primal", **TOL)
    assert_close(tangent, tangent_ref, "DataParallelWithCallback forward-AD tangent", **TOL)
    with pytest.raises(RuntimeError, match="outside torch.func transforms"):
        torch.func.jvp(parallel, (x,), (torch.sin(x),))
