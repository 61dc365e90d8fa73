"""Tests of syncbn_dist.integrations.torch_patch: ``torch.nn.SyncBatchNorm`` itself synchronizing through syncbn_dist.

In this process: the patch and its undo (torch's attributes restored, the same objects), idempotence and the context
form, torch's behaviour bit for bit in eval and without peers, state_dict round trips with torch's class, the patched
``convert_sync_batchnorm`` (hooks, parametrizations, timm's norm+act layers, refusals), DataParallel thread replicas,
and subclasses the patch cannot reach. In one launch of 2 gloo processes (uneven shards 3 + 5, float64): the model
zoos' own conversion paths under DDP (timm's ``convert_sync_batchnorm`` through the stand-ins of tests/zoo_layers.py,
with the classes defined before and after the patch; mmcv's ``build_norm_layer(dict(type="SyncBN"))`` under mmengine's
``MMDistributedDataParallel`` and ``revert_sync_batchnorm``), a ``process_group``, and the refusal in DDP of a subclass
defined after the patch. The reference is ``nn.BatchNorm`` on the concatenated global batch in one process.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import zoo_layers
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import parametrize

import syncbn_dist
from launch.common.spawn import run_distributed
from syncbn_dist import patch_torch_sync_batchnorm, unpatch_torch_sync_batchnorm
from syncbn_dist.integrations.torch_patch import SyncBatchNormAct

HERE = Path(__file__).resolve().parent
ROWS = (3, 5)  # rows of the global batch on rank 0 and rank 1
# float64, the global sums merged from two ranks' partial sums: rounding only.
TOL = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    """Every test starts and ends with torch's own class, whatever it does in between."""
    assert not syncbn_dist.is_torch_sync_batchnorm_patched()
    try:
        yield
    finally:
        unpatch_torch_sync_batchnorm()


def _attributes(cls: type) -> dict[str, Any]:
    return dict(vars(cls))


def _assert_same_attributes(now: dict[str, Any], before: dict[str, Any]) -> None:
    assert now.keys() == before.keys()
    assert all(now[name] is before[name] for name in before), [n for n in before if now[n] is not before[n]]


# ------------------------------------------------------------------------------------------------------------
# The patch itself
# ------------------------------------------------------------------------------------------------------------


def test_unpatch_restores_torch_exactly() -> None:
    before, ddp_before = _attributes(nn.SyncBatchNorm), _attributes(DistributedDataParallel)
    original_forward = nn.SyncBatchNorm.forward
    patch_torch_sync_batchnorm()
    assert syncbn_dist.is_torch_sync_batchnorm_patched()
    assert nn.SyncBatchNorm.forward is not original_forward
    added = {"last_transport", "__data_parallel_replicate__", "_replicate_for_data_parallel"}
    assert added <= vars(nn.SyncBatchNorm).keys()
    assert DistributedDataParallel._passing_sync_batchnorm_handle is not ddp_before["_passing_sync_batchnorm_handle"]
    unpatch_torch_sync_batchnorm()
    assert not syncbn_dist.is_torch_sync_batchnorm_patched()
    _assert_same_attributes(_attributes(nn.SyncBatchNorm), before)
    _assert_same_attributes(_attributes(DistributedDataParallel), ddp_before)
    unpatch_torch_sync_batchnorm()  # a no-op when not patched
    _assert_same_attributes(_attributes(nn.SyncBatchNorm), before)


def test_patch_is_idempotent_and_the_block_restores_the_state_before_it() -> None:
    before = _attributes(nn.SyncBatchNorm)
    patch_torch_sync_batchnorm()
    patched = _attributes(nn.SyncBatchNorm)
    patch_torch_sync_batchnorm()
    _assert_same_attributes(_attributes(nn.SyncBatchNorm), patched)
    with patch_torch_sync_batchnorm():  # already patched: leaving the block keeps the patch
        pass
    _assert_same_attributes(_attributes(nn.SyncBatchNorm), patched)
    unpatch_torch_sync_batchnorm()  # one undo for any number of calls
    _assert_same_attributes(_attributes(nn.SyncBatchNorm), before)

    with pytest.raises(RuntimeError, match="inside"):
        with patch_torch_sync_batchnorm():
            _assert_same_attributes(_attributes(nn.SyncBatchNorm), patched)
            raise RuntimeError("inside the block")
    _assert_same_attributes(_attributes(nn.SyncBatchNorm), before)


@pytest.mark.parametrize("shape", [(6, 3), (6, 3, 5), (6, 3, 4, 2), (4, 3, 2, 2, 2)])
@pytest.mark.parametrize(
    "config",
    [
        dict(),
        dict(affine=False),
        dict(track_running_stats=False),
        dict(momentum=None),
        pytest.param(
            dict(bias=False),
            marks=pytest.mark.skipif(
                "bias" not in inspect.signature(torch.nn.SyncBatchNorm.__init__).parameters,
                reason="this torch's nn.SyncBatchNorm has no bias argument (2.11 has none)",
            ),
        ),
    ],
    ids=["default", "no-affine", "no-running-stats", "cumulative", "no-bias"],
)
def test_without_peers_and_in_eval_it_is_torch_bit_for_bit(shape: tuple[int, ...], config: dict[str, Any]) -> None:
    torch.manual_seed(0)
    original = nn.SyncBatchNorm(3, **config).double()
    if original.weight is not None:
        with torch.no_grad():
            original.weight.uniform_(0.5, 1.5)
    patched_layer = copy.deepcopy(original)
    inputs = [torch.randn(shape, dtype=torch.float64) * 2 + 1 for _ in range(3)]

    def run(layer: nn.SyncBatchNorm) -> list[Tensor]:
        seen = []
        for mode, x in zip(("train", "train", "eval"), inputs):
            layer.train(mode == "train")
            x = x.clone().requires_grad_()
            out = layer(x)
            out.mul(torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
            seen += [out, x.grad]
        seen += [t.clone() for t in layer.state_dict().values()]
        seen += [p.grad for p in layer.parameters()]
        return seen

    expected = run(original)
    syncbn_dist.set_sbn_eps_mode("clip")  # syncbn_dist's own layers only: torch's class keeps var + eps
    try:
        with patch_torch_sync_batchnorm():
            got = run(patched_layer)
            assert patched_layer.last_transport == "local"
    finally:
        syncbn_dist.set_sbn_eps_mode("plus")
    assert len(got) == len(expected)
    for index, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), index


def test_state_dict_round_trips_with_torch_class() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), zoo_layers.BatchNormAct2d(4))
    plain_keys = list(model.state_dict())
    torch_model = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))  # torch's, unpatched
    with patch_torch_sync_batchnorm():
        patched = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))
        patched(torch.randn(5, 3, 2, 2))  # a training step: running stats and num_batches_tracked move
        state = patched.state_dict()
    assert list(state) == plain_keys == list(torch_model.state_dict())
    torch_model.load_state_dict(state)  # checkpoints load into torch's class (and the plain model) ...
    model.load_state_dict(state)
    for key, value in state.items():
        torch.testing.assert_close(torch_model.state_dict()[key], value, rtol=0, atol=0)
    with patch_torch_sync_batchnorm():
        fresh = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))
        fresh.load_state_dict(torch_model.state_dict())  # ... and back
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in state.items())


class _Scale(nn.Module):
    def forward(self, weight: Tensor) -> Tensor:
        return weight * 3


def test_convert_sync_batchnorm_keeps_what_each_layer_computes() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 1),
        nn.BatchNorm2d(4),
        zoo_layers.BatchNormAct2d(4, act_layer=nn.SiLU),
        zoo_layers._BatchNormXd(4),
        nn.SyncBatchNorm(4),
        zoo_layers.SyncBatchNormAct(4),
    ).double()
    model[5].act = nn.Tanh()  # timm's converter sets act on SyncBatchNormAct
    parametrize.register_parametrization(model[3], "weight", _Scale())
    reference = copy.deepcopy(model)
    calls: list[str] = []
    handle = model[1].register_forward_hook(lambda *_: calls.append("hook"))
    with patch_torch_sync_batchnorm():
        group = object()  # honoured as given; only used when a process group is initialized
        converted = nn.SyncBatchNorm.convert_sync_batchnorm(model, group)
        assert converted is model
        # model[3]'s class is parametrize's ParametrizedSyncBatchNorm, a subclass made for the moved parametrization.
        classes = [type(m) for m in model[1:]]
        expected = [nn.SyncBatchNorm, SyncBatchNormAct, nn.SyncBatchNorm, zoo_layers.SyncBatchNormAct]
        assert classes[:2] + classes[3:] == expected
        assert classes[2].__bases__ == (nn.SyncBatchNorm,)
        assert all(isinstance(m, nn.SyncBatchNorm) and isinstance(m, _BatchNorm) for m in model[1:])
        assert all(m.process_group is group for m in model[1:])
        assert parametrize.is_parametrized(model[3], "weight")
        for mode in ("train", "eval"):
            model.train(mode == "train")
            reference.train(mode == "train")
            x = torch.randn(6, 3, 2, 2, dtype=torch.float64)
            assert torch.equal(model(x), reference(x)), mode  # one process: the original's function, bit for bit
        assert calls == ["hook", "hook"]
        handle.remove()  # the original handle still removes the moved hook
        model(x)
        assert calls == ["hook", "hook"]
        single = nn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(3))
        assert type(single) is nn.SyncBatchNorm

        class Doubled(nn.BatchNorm2d):
            def forward(self, x: Tensor) -> Tensor:
                return super().forward(x) * 2

        unknown = nn.Sequential(nn.BatchNorm2d(2), Doubled(2))
        with pytest.raises(TypeError, match=r"'1' \(.*Doubled\)"):
            nn.SyncBatchNorm.convert_sync_batchnorm(unknown)
        assert type(unknown[0]) is nn.BatchNorm2d  # nothing converted
        with pytest.warns(UserWarning, match="Doubled"):
            nn.SyncBatchNorm.convert_sync_batchnorm(unknown, strict=False)
        assert type(unknown[0]) is nn.SyncBatchNorm and type(unknown[1]) is Doubled


@pytest.mark.usefixtures("one_intra_op_thread")
def test_dataparallel_thread_replicas_give_global_batch_statistics() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 3), nn.SyncBatchNorm(3)).double()  # built before the patch
    reference = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).double()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(7, 4, dtype=torch.float64)  # replicas of 4 and 3 rows
    weights = torch.randn(7, 3, dtype=torch.float64)
    with patch_torch_sync_batchnorm():
        parallel = syncbn_dist.DataParallelWithCallback(model, cpu_replicas=2)
        out = parallel(x)
        (out * weights).sum().backward()
        assert model[1].last_transport == "dataparallel"
    expected = reference(x)
    (expected * weights).sum().backward()
    torch.testing.assert_close(out, expected, **TOL)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, **TOL, msg=name)


def test_a_subclass_the_patch_cannot_reach_is_refused_by_name() -> None:
    class Reaching(nn.SyncBatchNorm):
        def forward(self, x: Tensor) -> Tensor:
            return super().forward(x).relu()

    class Unreached(nn.SyncBatchNorm):
        def forward(self, x: Tensor) -> Tensor:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training)

    class Inherits(Unreached):
        pass

    before = _attributes(nn.SyncBatchNorm)
    try:
        with pytest.raises(TypeError, match=r"2 torch.nn.SyncBatchNorm subclass") as caught:
            patch_torch_sync_batchnorm()
        message = str(caught.value)
        assert "test_torch_patch." in message and "Unreached.forward does not call super().forward" in message
        assert "Inherits" in message and "Reaching" not in message and "strict=False" in message
        _assert_same_attributes(_attributes(nn.SyncBatchNorm), before)  # nothing patched
        with pytest.warns(UserWarning, match="Unreached"):
            patch_torch_sync_batchnorm(strict=False)
        assert syncbn_dist.is_torch_sync_batchnorm_patched()
        layer = Reaching(2).double()
        layer(torch.randn(4, 2, dtype=torch.float64))
        assert layer.last_transport == "local"  # the patched forward ran under Reaching's
    finally:
        unpatch_torch_sync_batchnorm()
        # The caught error's traceback holds the patch's frame, whose locals list the subclasses.
        del Reaching, Unreached, Inherits, caught
        gc.collect()  # later patches in this process must not find them among the subclasses


@pytest.mark.skipif(importlib.util.find_spec("timm") is None, reason="timm is not installed (it needs torchvision)")
def test_real_timm_convert_sync_batchnorm_is_reached() -> None:
    import timm.layers

    norm_act = timm.layers.BatchNormAct2d(4, act_layer=nn.SiLU).double()
    reference = copy.deepcopy(norm_act)
    with patch_torch_sync_batchnorm():
        synced = timm.layers.convert_sync_batchnorm(nn.Sequential(norm_act))
        assert type(synced[0]).__name__ == "SyncBatchNormAct" and isinstance(synced[0], nn.SyncBatchNorm)
        x = torch.randn(5, 4, 2, 2, dtype=torch.float64)
        assert torch.equal(synced(x), reference(x))
        assert synced[0].last_transport == "local"


# ------------------------------------------------------------------------------------------------------------
# Under DDP on 2 gloo processes
# ------------------------------------------------------------------------------------------------------------


def _global_batch(channels: int, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(ROWS), 3, 2, 2, generator=gen, dtype=torch.float64) * 2 + 1
    return x, torch.randn(sum(ROWS), channels, 2, 2, generator=gen, dtype=torch.float64)


def _check_against_global_batch(
    rank: int, world_size: int, wrapped: nn.Module, inner: nn.Module, reference: nn.Module, seed: int
) -> None:
    """One forward/backward of ``wrapped`` (DDP over ``inner``) on this rank's rows vs ``reference`` on all rows."""
    x, weights = _global_batch(reference[-1].num_features, seed)
    rows = slice(sum(ROWS[:rank]), sum(ROWS[: rank + 1]))
    x_rank = x[rows].clone().requires_grad_()
    out = wrapped(x_rank)
    # × world_size: DDP averages the gradients, so they are those of the global sum.
    (out * weights[rows]).sum().mul(world_size).backward()
    x_all = x.clone().requires_grad_()
    expected = reference(x_all)
    (expected * weights).sum().backward()
    torch.testing.assert_close(out, expected[rows], **TOL)
    torch.testing.assert_close(x_rank.grad / world_size, x_all.grad[rows], **TOL)  # the global sum's, × world_size
    for (name, p), q in zip(inner.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=f"rank {rank} {name}")
    for (name, b), c in zip(inner.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, **TOL, msg=f"rank {rank} {name}")


def _zoo_model(zoo: Any) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), zoo.BatchNormAct2d(4, act_layer=nn.SiLU), nn.Conv2d(4, 4, 1))
    return model.append(nn.BatchNorm2d(4)).double()


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    done = []
    patch_torch_sync_batchnorm()

    # timm's convert_sync_batchnorm, its classes defined before the patch (zoo_layers imported with this module) and
    # after it (a fresh copy of the module, executed now).
    spec = importlib.util.spec_from_file_location("zoo_layers_after_patch", HERE / "zoo_layers.py")
    assert spec is not None and spec.loader is not None
    zoo_after = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zoo_after)
    for order, zoo in (("before", zoo_layers), ("after", zoo_after)):
        model = _zoo_model(zoo)
        reference = copy.deepcopy(model)
        model = zoo.convert_sync_batchnorm(model)
        assert type(model[1]) is zoo.SyncBatchNormAct and type(model[3]) is nn.SyncBatchNorm, order
        _check_against_global_batch(rank, world_size, DistributedDataParallel(model), model, reference, seed=1)
        assert model[1].last_transport == model[3].last_transport == "distributed", order
        done.append(f"timm-{order}")

    # torch's own converter on the same model: timm's act kept (SyncBatchNormAct), under DDP on CPU.
    model = _zoo_model(zoo_layers)
    reference = copy.deepcopy(model)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert type(model[1]) is SyncBatchNormAct
    _check_against_global_batch(rank, world_size, DistributedDataParallel(model), model, reference, seed=2)
    done.append("torch-convert")

    # torch.compile(fullgraph=True) of a model holding patched torch layers: one graph, the global batch's result.
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).double()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(reference))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    _check_against_global_batch(rank, world_size, DistributedDataParallel(compiled), model, reference, seed=5)
    assert model[1].last_transport == "distributed"
    done.append("compiled")

    # process_group honoured: each rank alone in its group, so each normalizes over its own rows only.
    groups = [dist.new_group([r]) for r in range(world_size)]
    layer = nn.Sequential(nn.SyncBatchNorm(3, process_group=groups[rank])).double()
    x, _ = _global_batch(3, seed=3)
    rows = slice(sum(ROWS[:rank]), sum(ROWS[: rank + 1]))
    torch.testing.assert_close(layer(x[rows]), nn.BatchNorm2d(3).double()(x[rows]), **TOL)
    done.append("process-group")

    # mmcv's norm registry ("SyncBN" is torch.nn.SyncBatchNorm) under mmengine's MMDistributedDataParallel.
    if importlib.util.find_spec("mmcv") is not None and importlib.util.find_spec("mmengine") is not None:
        from mmcv.cnn import build_norm_layer
        from mmengine.model import MMDistributedDataParallel, revert_sync_batchnorm

        torch.manual_seed(0)
        name, norm = build_norm_layer(dict(type="SyncBN"), 4)
        # mmengine's parrots_wrapper.SyncBatchNorm, a subclass defined (at import) before the patch.
        assert isinstance(norm, nn.SyncBatchNorm) and type(norm) is not nn.SyncBatchNorm, name
        second = build_norm_layer(dict(type="SyncBN"), 4)[1]
        model = nn.Sequential(nn.Conv2d(3, 4, 1), norm, nn.ReLU(), nn.Conv2d(4, 4, 1), second).double()
        reference = copy.deepcopy(model)
        for index in (1, 4):
            reference[index] = nn.BatchNorm2d(4).double()
            reference[index].load_state_dict(model[index].state_dict())
        wrapped = MMDistributedDataParallel(module=model)
        _check_against_global_batch(rank, world_size, wrapped, model, reference, seed=4)
        assert norm.last_transport == "distributed"
        reverted = revert_sync_batchnorm(model)
        assert type(reverted[1]).__name__ == "_BatchNormXd" and reverted[1].weight is norm.weight
        done.append("mmengine")

    # A subclass defined after the patch whose forward never reaches it: refused where DDP used to refuse CPU.
    class LocalOnly(nn.SyncBatchNorm):
        def forward(self, x: Tensor) -> Tensor:
            return F.batch_norm(x, None, None, self.weight, self.bias, True)

    try:
        DistributedDataParallel(nn.Sequential(nn.Conv2d(3, 3, 1), LocalOnly(3)))
    except TypeError as error:
        assert "LocalOnly.forward does not call super().forward" in str(error), error
        done.append("refused")
    return {"done": done}


@pytest.mark.distributed
@pytest.mark.slow
def test_model_zoo_paths_under_ddp_on_cpu_give_global_batch_statistics() -> None:
    results = run_distributed(_worker, len(ROWS), timeout=240)
    expected = ["timm-before", "timm-after", "torch-convert", "compiled", "process-group"]
    if importlib.util.find_spec("mmcv") is not None and importlib.util.find_spec("mmengine") is not None:
        expected.append("mmengine")
    assert [r["done"] for r in results] == [[*expected, "refused"]] * len(ROWS)
