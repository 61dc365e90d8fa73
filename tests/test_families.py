"""Tests of syncbn_dist.families: model zoos' BatchNorm subclasses convert to synchronized layers computing the same.

The layers are the stand-ins of ``tests/zoo_layers.py`` (timm 1.0's ``BatchNormAct2d`` and ``SyncBatchNormAct``,
mmengine's ``_BatchNormXd``, detectron2's ``NaiveSyncBatchNorm``), matched by their import paths; the real timm
classes run too where ``import timm`` works. For each family:

- one process: train- and eval-mode outputs, input and parameter gradients and running statistics are identical,
  bit for bit, before and after convert_model, and again after revert_model (the original class, the same
  state_dict keys and values); converting twice is a no-op;
- DistributedDataParallel at world sizes 2 and 3 (one launch each), float64, uneven shards: a small network built
  from the family's layers trains like the original network in one process on the global batch for several
  SGD-with-momentum steps (parameters, running statistics, num_batches_tracked);
- DataParallelWithCallback with CPU thread replicas, and torch.compile, on the converted network.
"""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from zoo_layers import TIMM, BatchNormAct2d, NaiveSyncBatchNorm, SyncBatchNormAct, _BatchNormXd, norm_act_class

import syncbn_dist
from launch.common.spawn import run_distributed
from syncbn_dist import DataParallelWithCallback, SyncBatchNorm
from syncbn_dist.integrations.families import SynchronizedBatchNormAct, SynchronizedBatchNormAct2d


def _sync_bn_act(num_features: int, act: nn.Module, drop: bool = False) -> SyncBatchNormAct:
    """What ``timm.layers.convert_sync_batchnorm`` builds: ``act`` (and ``drop``) set as attributes."""
    layer = SyncBatchNormAct(num_features, momentum=0.2)
    layer.act = act
    if drop:
        layer.drop = nn.Identity()
    return layer


class _Net(nn.Module):
    """conv -> norm(4) -> conv -> norm(4) -> mean over H, W -> linear -> head(5) -> linear: the family's layers."""

    def __init__(self, norms: tuple[nn.Module, nn.Module], head: nn.Module) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.norm1, self.norm2 = norms
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.fc = nn.Linear(4, 5)
        self.head = head
        self.out = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        y = self.norm2(self.conv2(self.norm1(self.conv1(x))))
        return self.out(self.head(self.fc(y.mean(dim=(2, 3)))))


# Each family: its layers, with the constructor options that change the forward. The head takes (N, 5) input.
FAMILIES: dict[str, Callable[[], tuple[tuple[nn.Module, nn.Module], nn.Module]]] = {
    "timm BatchNormAct2d": lambda: (
        (
            BatchNormAct2d(4, act_layer=nn.SiLU, momentum=None),  # cumulative average; SiLU(inplace=True)
            BatchNormAct2d(4, act_layer=nn.PReLU, act_kwargs={"num_parameters": 4}),  # an activation with a weight
        ),
        nn.Identity(),
    ),
    "timm BatchNormAct2d options": lambda: (
        (
            BatchNormAct2d(4, act_layer=nn.LeakyReLU, act_kwargs={"negative_slope": 0.2}, inplace=False),
            BatchNormAct2d(4, apply_act=False, affine=False, eps=1e-3),
        ),
        nn.Identity(),
    ),
    "timm SyncBatchNormAct": lambda: (
        (_sync_bn_act(4, nn.Hardswish()), _sync_bn_act(4, nn.ELU(), drop=True)),
        _sync_bn_act(5, nn.Tanh()),
    ),
    "mmengine _BatchNormXd": lambda: ((_BatchNormXd(4), _BatchNormXd(4, momentum=0.3)), _BatchNormXd(5)),
    "detectron2 NaiveSyncBatchNorm": lambda: (
        (NaiveSyncBatchNorm(4, stats_mode="N"), NaiveSyncBatchNorm(4, momentum=None)),
        nn.Identity(),
    ),
}
SYNC_CLASS = {
    BatchNormAct2d: SynchronizedBatchNormAct2d,
    SyncBatchNormAct: SynchronizedBatchNormAct,
    _BatchNormXd: SyncBatchNorm,
    NaiveSyncBatchNorm: syncbn_dist.SynchronizedBatchNorm2d,
}


def _net(family: str, seed: int = 0) -> _Net:
    torch.manual_seed(seed)
    norms, head = FAMILIES[family]()
    net = _Net(norms, head)
    with torch.no_grad():  # non-trivial affine parameters and running statistics
        for layer in net.modules():
            if isinstance(layer, nn.modules.batchnorm._BatchNorm) and layer.affine:
                layer.weight.uniform_(0.5, 1.5)
                layer.bias.uniform_(-0.5, 0.5)
    return net


def _norms(net: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in net.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def _step_results(net: nn.Module, x: Tensor, seed: int) -> list[Tensor]:
    """Output, input gradient and parameter gradients of one forward/backward (dropout seeded by ``seed``)."""
    x = x.clone().requires_grad_(True)
    net.zero_grad()
    torch.manual_seed(seed)
    out = net(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return [out.detach(), x.grad, *(p.grad for p in net.parameters())]


def _assert_identical(actual: list[Tensor], expected: list[Tensor], what: str) -> None:
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, rtol=0, atol=0, msg=f"{what}: tensor {i}")  # the same kernels: bit for bit


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_converts_to_the_same_function_and_back(family: str) -> None:
    original = _net(family)
    model = copy.deepcopy(original)
    keys = list(original.state_dict())
    classes = {name: type(m) for name, m in _norms(original).items()}
    children = {name: dict(m.named_children()) for name, m in _norms(model).items()}

    assert syncbn_dist.convert_model(model) is model
    for name, layer in _norms(model).items():
        assert type(layer) is SYNC_CLASS[classes[name]], name
        assert dict(layer.named_children()) == children[name], name  # act and drop: the very same modules
    assert list(model.state_dict()) == keys
    layers = list(model.modules())
    assert syncbn_dist.convert_model(model) is model  # converting twice: a no-op, the very same layer objects
    assert all(a is b for a, b in zip(model.modules(), layers)) and len(list(model.modules())) == len(layers)

    x = torch.randn(6, 3, 5, 5) * 2 + 0.5
    for step in range(3):  # train: outputs, gradients and the running statistics they update
        _assert_identical(_step_results(model, x, step), _step_results(original, x, step), f"train step {step}")
    _assert_identical(list(model.state_dict().values()), list(original.state_dict().values()), "state after train")
    model.eval()
    original.eval()
    _assert_identical(_step_results(model, x, 0), _step_results(original, x, 0), "eval")

    assert syncbn_dist.revert_model(model) is model
    assert {name: type(m) for name, m in _norms(model).items()} == classes
    for name, layer in _norms(model).items():
        reference = _norms(original)[name]
        assert set(vars(layer)) == set(vars(reference)), name  # nothing of the synchronized layer is left over
        assert getattr(layer, "_stats_mode", None) == getattr(reference, "_stats_mode", None), name
    assert list(model.state_dict()) == keys
    _assert_identical(list(model.state_dict().values()), list(original.state_dict().values()), "state after revert")
    model.train()
    original.train()
    _assert_identical(_step_results(model, x, 7), _step_results(original, x, 7), "train after revert")


def test_dropout_child_is_kept() -> None:
    # timm's drop_layer: with nn.Dropout the training output depends on the RNG, the same before and after.
    original = nn.Sequential(BatchNormAct2d(3, drop_layer=lambda: nn.Dropout(0.5)))
    model = syncbn_dist.convert_model(copy.deepcopy(original))
    x = torch.randn(4, 3, 2, 2)
    _assert_identical(_step_results(model, x, 3), _step_results(original, x, 3), "dropout")
    assert (_step_results(model, x, 3)[0] == 0).any()  # the dropout did run


def test_subclass_of_a_family() -> None:
    class Quiet(BatchNormAct2d):  # another default, no forward of its own: converted as the family
        def __init__(self, num_features: int) -> None:
            super().__init__(num_features, act_layer=nn.GELU)

    class Doubled(BatchNormAct2d):  # its own forward: unknown, whatever its base
        def forward(self, x: Tensor) -> Tensor:
            return super().forward(x) * 2

    model = syncbn_dist.convert_model(nn.Sequential(Quiet(3)))
    assert type(model[0]) is SynchronizedBatchNormAct2d and isinstance(model[0].act, nn.GELU)
    assert type(syncbn_dist.revert_model(model)[0]) is Quiet
    with pytest.raises(TypeError, match="Doubled defines its own forward"):
        syncbn_dist.convert_model(nn.Sequential(Doubled(3)))


def test_real_timm_layers() -> None:
    try:
        from timm.layers import BatchNormAct2d as TimmBatchNormAct2d
        from timm.layers import convert_sync_batchnorm
    except Exception as error:  # ImportError, or torchvision's CUDA wheel failing to load with CPU torch
        pytest.skip(f"timm does not import here ({type(error).__name__}: {error})")
    original = nn.Sequential(nn.Conv2d(3, 4, 1), TimmBatchNormAct2d(4, act_layer="silu"))
    model = syncbn_dist.convert_model(copy.deepcopy(original))
    assert type(model[1]) is SynchronizedBatchNormAct2d
    x = torch.randn(5, 3, 2, 2)
    _assert_identical(_step_results(model, x, 0), _step_results(original, x, 0), "timm train")
    timm_sync = convert_sync_batchnorm(copy.deepcopy(original))
    assert type(syncbn_dist.convert_model(timm_sync)[1]) is SynchronizedBatchNormAct
    assert type(syncbn_dist.revert_model(model)[1]) is TimmBatchNormAct2d


def test_data_parallel_replicas() -> None:
    # CPU thread replicas split the batch; the family's forward (act after the synchronized normalization) runs in
    # each replica and the statistics cover the whole batch: the original network on the whole batch.
    for family in ["timm BatchNormAct2d", "timm SyncBatchNormAct"]:
        original = _net(family).double()
        x = torch.randn(7, 3, 4, 4, dtype=torch.float64)
        dp = DataParallelWithCallback(syncbn_dist.convert_model(copy.deepcopy(original)), cpu_replicas=2)
        # float64, the global statistics merged from two replicas' moments vs. one pass: rounding only.
        torch.testing.assert_close(dp(x), original(x), rtol=1e-10, atol=1e-12)
        for name, layer in _norms(dp.module).items():
            assert layer.last_transport == "dataparallel", name
            torch.testing.assert_close(layer.running_var, _norms(original)[name].running_var, rtol=1e-10, atol=1e-12)


STEPS = 4
LR, MOMENTUM = 0.1, 0.9
SPLITS = {2: [4, 7], 3: [2, 6, 3]}


def _data(step: int, batch: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    x = torch.randn(batch, 3, 5, 5, generator=gen, dtype=torch.float64) * 1.5 + 0.3
    return x, torch.randint(0, 3, (batch,), generator=gen)


def _train(net: nn.Module, world_size: int, rows: slice, batch: int) -> None:
    """STEPS of SGD with momentum; each rank's loss is its rows' summed cross-entropy × world_size / global batch."""
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        x, y = _data(step, batch)
        opt.zero_grad()
        loss = F.cross_entropy(net(x[rows]), y[rows], reduction="sum") * world_size / batch
        loss.backward()
        opt.step()


def _worker(rank: int, world_size: int) -> dict[str, dict[str, Tensor]]:
    splits = SPLITS[world_size]
    rows = slice(sum(splits[:rank]), sum(splits[: rank + 1]))
    states = {}
    for family in FAMILIES:
        net = syncbn_dist.convert_model(_net(family).double())
        ddp = nn.parallel.DistributedDataParallel(net)
        _train(ddp, world_size, rows, sum(splits))
        assert all(m.last_transport == "distributed" for m in _norms(net).values()), family
        states[family] = {k: v.detach().clone() for k, v in syncbn_dist.revert_model(net).state_dict().items()}
    if world_size == 2:
        states["compiled"] = _compiled_step(rank, rows, sum(splits))
    return states


def _compiled_step(rank: int, rows: slice, batch: int) -> dict[str, float]:
    """One training step of a norm+act network compiled whole (aot_eager) over the process group vs. eager."""
    nets = [
        syncbn_dist.convert_model(
            nn.Sequential(nn.Conv2d(3, 4, 1), BatchNormAct2d(4), BatchNormAct2d(4, act_layer=nn.SiLU))
        )
        for _ in range(2)
    ]
    nets[1].load_state_dict(nets[0].state_dict())
    x = _data(0, batch)[0][rows].float()
    compiled = torch.compile(nets[1], backend="aot_eager", fullgraph=True)
    outputs = [net(x) for net in (nets[0], compiled)]
    for out in outputs:
        out.square().sum().backward()
    return {
        "output": (outputs[0] - outputs[1]).abs().max().item(),
        "grad": (nets[0][0].weight.grad - nets[1][0].weight.grad).abs().max().item(),
        "running_var": (nets[0][2].running_var - nets[1][2].running_var).abs().max().item(),
        "transport": float(nets[1][1].last_transport == "distributed"),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_trains_like_the_original_family_on_the_global_batch(world_size: int) -> None:
    results = run_distributed(_worker, world_size, timeout=240)
    batch = sum(SPLITS[world_size])
    if world_size == 2:
        for rank, states in enumerate(results):
            compiled = states.pop("compiled")
            assert compiled["transport"] == 1.0, rank
            # aot_eager decomposes the ops of the local moments and the normalization: float32 rounding only.
            assert max(compiled["output"], compiled["grad"], compiled["running_var"]) < 1e-4, (rank, compiled)
    for family in FAMILIES:
        reference = _net(family).double()  # the original classes, in this process: no process group
        _train(reference, 1, slice(0, batch), batch)
        for rank, states in enumerate(results):
            state = states[family]
            assert list(state) == list(reference.state_dict()), family
            for key, value in reference.state_dict().items():
                # float64 over 4 steps; sums in another order (per-rank partial sums, then all_reduce): rounding.
                torch.testing.assert_close(state[key], value, rtol=1e-9, atol=1e-11, msg=f"{family} rank {rank} {key}")


def test_matching_is_by_import_path() -> None:
    # The same code under another import path is not timm's class: refused, and the stand-in is matched by path.
    assert BatchNormAct2d.__module__ == TIMM and BatchNormAct2d.__qualname__ == "BatchNormAct2d"
    look_alike = norm_act_class("mypackage.layers")
    with pytest.raises(TypeError, match=r"'0' \(mypackage\.layers\.BatchNormAct2d\)"):
        syncbn_dist.convert_model(nn.Sequential(look_alike(3)))


def test_patch_sync_batchnorm_does_not_reach_subclasses_defined_before() -> None:
    # What patch_sync_batchnorm's docstring warns about: timm's BatchNormAct2d keeps its nn.BatchNorm2d base.
    with syncbn_dist.patch_sync_batchnorm():
        layer = BatchNormAct2d(3)
        assert isinstance(nn.BatchNorm2d(3), SyncBatchNorm)
    assert not isinstance(layer, SyncBatchNorm)
    assert type(syncbn_dist.convert_model(nn.Sequential(layer))[0]) is SynchronizedBatchNormAct2d
