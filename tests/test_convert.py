"""Tests of syncbn_dist.integrations.convert: convert_model / revert_model keep tensors, settings and state_dict, at
any depth.

Single process (torch.distributed not initialized, so every synchronized layer runs locally), except the
DistributedDataParallel check, which needs a real one-rank gloo group from ``launch/common/spawn.py``.
"""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize, prune
from torch.utils.hooks import RemovableHandle

from launch.common.spawn import run_distributed
from syncbn_dist import (
    DataParallelWithCallback,
    SyncBatchNorm,
    SynchronizedBatchNorm1d,
    SynchronizedBatchNorm2d,
    SynchronizedBatchNorm3d,
    convert_model,
    revert_model,
)

_SYNC_OF = {
    nn.BatchNorm1d: SynchronizedBatchNorm1d,
    nn.BatchNorm2d: SynchronizedBatchNorm2d,
    nn.BatchNorm3d: SynchronizedBatchNorm3d,
    nn.SyncBatchNorm: SyncBatchNorm,
}


class _Block(nn.Module):
    """Layers as plain attributes, plus a nested container."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.norm = nn.BatchNorm2d(4, eps=1e-3, momentum=None)
        self.inner = nn.Sequential(nn.ReLU(), nn.BatchNorm2d(4, affine=False))

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(self.norm(self.conv(x)))


class _Net(nn.Module):
    """BatchNorm layers at every kind of position: Sequential, ModuleList, ModuleDict, attribute, nested."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(_Block(), nn.Sequential(nn.BatchNorm2d(4, track_running_stats=False)))
        self.heads = nn.ModuleList([nn.BatchNorm1d(4), nn.ModuleList([nn.BatchNorm1d(4, momentum=0.3)])])
        self.volumes = nn.ModuleDict({"bn": nn.BatchNorm3d(2, dtype=torch.float64), "sync": nn.SyncBatchNorm(2)})
        self.untouched = nn.ModuleList(
            [nn.InstanceNorm2d(4, affine=True, track_running_stats=True), nn.LazyBatchNorm2d(), nn.GroupNorm(2, 4)]
        )
        self.stem[0].norm.weight.requires_grad_(False)
        self.stem[0].inner[1].eval()
        self.heads[0].qconfig = "a qconfig"

    def forward(self, x: Tensor) -> Tensor:
        y = self.stem(x)
        v = self.heads[1][0](self.heads[0](y.mean(dim=(2, 3))))
        return v


def _bn_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def _settings(m: nn.Module) -> tuple:
    return (m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats, m.training, getattr(m, "qconfig", 0))


@pytest.mark.filterwarnings("ignore:convert_model leaves 1 uninitialized LazyBatchNorm")  # its own test below
def test_convert_replaces_every_batchnorm_keeping_tensors_and_settings() -> None:
    model = _Net()
    before = {
        name: (type(m), _settings(m), dict(m.named_parameters()), dict(m.named_buffers()))
        for name, m in _bn_layers(model).items()
        if not isinstance(m, nn.LazyBatchNorm2d)
    }
    untouched = list(model.untouched)
    assert len(before) == 7

    assert convert_model(model) is model
    after = _bn_layers(model)
    for name, (cls, settings, params, buffers) in before.items():
        layer = after[name]
        assert type(layer) is _SYNC_OF[cls], name
        assert _settings(layer) == settings, name
        assert layer.process_group is None, name
        for key, tensor in {**params, **buffers}.items():
            new = getattr(layer, key)
            # The very same tensor objects: values, dtype, requires_grad and the optimizer's references survive.
            assert new is tensor, (name, key)
            assert new.data_ptr() == tensor.data_ptr(), (name, key)
        assert dict(layer.named_parameters()).keys() == params.keys(), name
        assert dict(layer.named_buffers()).keys() == buffers.keys(), name
    assert not model.stem[0].norm.weight.requires_grad and model.stem[0].norm.bias.requires_grad
    assert model.volumes["bn"].weight.dtype == torch.float64 and model.volumes["bn"].running_var.dtype == torch.float64
    assert model.stem[0].norm.momentum is None
    assert model.stem[0].inner[1].weight is None and not model.stem[0].inner[1].affine
    assert model.stem[1][0].running_mean is None and not model.stem[1][0].track_running_stats
    assert not model.stem[0].inner[1].training and model.stem[0].norm.training
    assert model.heads[0].qconfig == "a qconfig"
    # InstanceNorm, LazyBatchNorm and GroupNorm are left exactly as they were.
    assert all(a is b for a, b in zip(model.untouched, untouched))
    assert type(model.untouched[1]) is nn.LazyBatchNorm2d


def test_lazy_batch_norm_is_named_until_its_first_forward() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.LazyBatchNorm2d(), nn.Sequential(nn.LazyBatchNorm1d()))
    with pytest.warns(UserWarning, match=r"2 uninitialized LazyBatchNorm layer\(s\) unsynchronized: \['1', '2.0'\]"):
        convert_model(model)
    assert type(model[1]) is nn.LazyBatchNorm2d and type(model[2][0]) is nn.LazyBatchNorm1d
    model[1](torch.randn(2, 4, 3, 3))  # the first forward makes it an nn.BatchNorm2d, which then converts
    del model[2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_model(model)
    assert isinstance(model[1], SynchronizedBatchNorm2d)


def test_convert_process_group() -> None:
    given, own = object(), object()  # stand-ins: the group is only stored until a forward in training mode
    model = nn.Sequential(nn.BatchNorm2d(3), nn.SyncBatchNorm(3, process_group=own))
    convert_model(model)
    assert model[0].process_group is None and model[1].process_group is own  # nn.SyncBatchNorm keeps its group
    model = nn.Sequential(nn.BatchNorm2d(3), nn.SyncBatchNorm(3, process_group=own), SynchronizedBatchNorm1d(3))
    convert_model(model, process_group=given)
    assert all(layer.process_group is given for layer in model)


@pytest.mark.parametrize("cls", [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm])
def test_convert_single_layer_returns_converted_layer(cls: type[nn.Module]) -> None:
    layer = cls(5, momentum=None)
    converted = convert_model(layer)
    assert type(converted) is _SYNC_OF[cls]
    assert converted.weight is layer.weight and converted.running_var is layer.running_var
    assert converted.momentum is None


def test_convert_sync_batchnorm_classmethod_is_convert_model() -> None:
    # The spelling of torch.nn.SyncBatchNorm.convert_sync_batchnorm, for code written against it.
    group = object()
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm1d(4)))
    weight = model[1].weight
    converted = SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
    assert converted is model
    assert type(model[1]) is SynchronizedBatchNorm2d and model[1].weight is weight
    assert type(model[2][0]) is _SYNC_OF[nn.BatchNorm1d]
    assert model[1].process_group is group and model[2][0].process_group is group
    assert type(SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm3d(2))) is _SYNC_OF[nn.BatchNorm3d]


@pytest.mark.filterwarnings("ignore:convert_model leaves 1 uninitialized LazyBatchNorm")  # its own test below
def test_convert_leaves_relatives_alone() -> None:
    for layer in [
        nn.InstanceNorm1d(3, track_running_stats=True),
        nn.LazyBatchNorm1d(),
        nn.LayerNorm(3),
        nn.Linear(3, 3),
    ]:
        assert convert_model(layer) is layer


def test_revert_round_trip() -> None:
    model = _Net()
    del model.untouched[1]  # an uninitialized LazyBatchNorm has no state_dict values to compare
    model(torch.randn(4, 3, 5, 5))  # non-trivial running statistics and num_batches_tracked
    state = {key: value.clone() for key, value in model.state_dict().items()}
    types = {name: type(m) for name, m in _bn_layers(model).items()}

    reverted = revert_model(convert_model(model))
    assert reverted is model
    assert {name: type(m) for name, m in _bn_layers(model).items()} == types
    new_state = model.state_dict()
    assert list(new_state.keys()) == list(state.keys())
    for key, value in state.items():
        assert new_state[key].dtype == value.dtype, key
        torch.testing.assert_close(new_state[key], value, rtol=0, atol=0)  # same tensors: bit for bit


@pytest.mark.parametrize("cls", [SynchronizedBatchNorm1d, SynchronizedBatchNorm2d, SynchronizedBatchNorm3d])
def test_revert_single_layer(cls: type[SyncBatchNorm]) -> None:
    layer = cls(4, eps=1e-4, momentum=None, affine=False)
    plain = revert_model(layer)
    assert type(plain) is {v: k for k, v in _SYNC_OF.items()}[cls]
    assert plain.running_mean is layer.running_mean and plain.eps == 1e-4 and plain.momentum is None
    assert not plain.affine


def test_state_dict_loads_both_ways() -> None:
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(3)
    plain(torch.randn(6, 3, 2, 2) * 3 + 1)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        plain.bias.uniform_(-1, 1)
    sync = SynchronizedBatchNorm2d(3)
    sync.load_state_dict(plain.state_dict())  # strict: same keys
    back = nn.BatchNorm2d(3)
    back.load_state_dict(sync.state_dict())
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(sync.state_dict()[key], value, rtol=0, atol=0)  # copies of the same values
        torch.testing.assert_close(back.state_dict()[key], value, rtol=0, atol=0)


def test_convert_data_parallel() -> None:
    module = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    dp = nn.DataParallel(module)
    dp.dim = 1  # on a CPU-only machine nn.DataParallel sets no dim; a CUDA one would have it
    if torch.cuda.is_available():
        converted = convert_model(dp)
    else:  # one replica, nothing to synchronize with: the warning points to cpu_replicas
        with pytest.warns(UserWarning, match=r"found no GPU.*cpu_replicas=N"):
            converted = convert_model(dp)
    assert type(converted) is DataParallelWithCallback
    assert converted.module is module and type(module[1]) is SynchronizedBatchNorm2d
    assert converted.dim == 1
    assert list(converted.device_ids) == list(dp.device_ids)
    if not torch.cuda.is_available():
        assert converted.device_ids == []

    threaded = DataParallelWithCallback(nn.Sequential(nn.BatchNorm1d(2)), cpu_replicas=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # replicas in threads: nothing to warn about
        again = convert_model(threaded)
    assert type(again) is DataParallelWithCallback and again.cpu_replicas == 2
    assert type(again.module[0]) is SynchronizedBatchNorm1d

    reverted = revert_model(converted)
    assert reverted is converted and type(module[1]) is nn.BatchNorm2d


def _worker_ddp_rejected(rank: int, world_size: int) -> str:
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)))
    with pytest.raises(TypeError, match="DistributedDataParallel") as info:
        convert_model(ddp)
    assert type(ddp.module[1]) is nn.BatchNorm1d  # nothing was converted behind DDP's back
    return str(info.value)


@pytest.mark.distributed
def test_convert_rejects_ddp() -> None:
    (message,) = run_distributed(_worker_ddp_rejected, 1, timeout=60)
    assert "convert the model first" in message


SHARED_ROWS = [3, 5]  # rows of the global batch per rank (uneven)
SHARED_LR = 0.1


def _shared_layer_net() -> nn.Sequential:
    """A network that applies one BatchNorm layer twice, in two slots of the same Sequential and in a nested one."""
    torch.manual_seed(5)
    bn = nn.BatchNorm2d(3)
    return nn.Sequential(
        nn.Conv2d(2, 3, 1), bn, nn.ReLU(), nn.Sequential(nn.Conv2d(3, 3, 1), bn), bn, nn.Flatten(), nn.Linear(12, 2)
    ).double()


def _shared_layer_step(model: nn.Module, rows: slice, world_size: int) -> None:
    """One SGD step on ``rows`` of the global batch; the loss is scaled so that DDP's average is the global mean."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(sum(SHARED_ROWS), 2, 2, 2, generator=gen, dtype=torch.float64) * 2 + 1
    y = torch.randn(sum(SHARED_ROWS), 2, generator=gen, dtype=torch.float64)
    loss = F.mse_loss(model(x[rows]), y[rows], reduction="sum") * world_size / sum(SHARED_ROWS)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= SHARED_LR * p.grad


def test_a_layer_registered_twice_becomes_one_synchronized_layer() -> None:
    # nn.Module.named_children yields a module once per parent, so the second slot of the same Sequential was left
    # an unsynchronized nn.BatchNorm2d (torch's convert_sync_batchnorm does the same).
    model = _shared_layer_net()
    convert_model(model)
    assert type(model[1]) is SynchronizedBatchNorm2d and model[1] is model[3][1] is model[4]
    revert_model(model)
    assert type(model[1]) is nn.BatchNorm2d and model[1] is model[3][1] is model[4]


def _worker_shared_layer(rank: int, world_size: int) -> dict[str, Tensor]:
    model = nn.parallel.DistributedDataParallel(convert_model(_shared_layer_net()))
    _shared_layer_step(model, slice(sum(SHARED_ROWS[:rank]), sum(SHARED_ROWS[: rank + 1])), world_size)
    assert model.module[4].last_transport == "distributed"
    return {key: value.clone() for key, value in model.module.state_dict().items()}


@pytest.mark.distributed
def test_a_layer_registered_twice_trains_on_the_global_batch_under_ddp() -> None:
    results = run_distributed(_worker_shared_layer, len(SHARED_ROWS), timeout=120)
    reference = _shared_layer_net()  # nn.BatchNorm in one process on the global batch
    _shared_layer_step(reference, slice(0, sum(SHARED_ROWS)), 1)
    for rank, state in enumerate(results):
        assert list(state) == list(reference.state_dict()), rank
        for key, value in reference.state_dict().items():
            # float64; per-rank partial sums merged by all_reduce: rounding only.
            torch.testing.assert_close(state[key], value, rtol=1e-10, atol=1e-12, msg=f"rank {rank} {key}")


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv3d(2, 3, 1),
        nn.BatchNorm3d(3),
        nn.Flatten(2),
        nn.BatchNorm1d(3, momentum=None),
        nn.Flatten(1),
        nn.Linear(3 * 8, 4),
        nn.BatchNorm1d(4, affine=False),
    )


def test_converted_model_equals_batchnorm_exactly() -> None:
    torch.manual_seed(1)
    plain = _cnn()
    converted = convert_model(copy.deepcopy(plain))
    x = torch.randn(5, 2, 2, 2, 2) * 2 + 1
    # Training mode without torch.distributed: the local path, which is nn.BatchNorm itself (same kernels).
    for _ in range(3):
        torch.testing.assert_close(converted(x), plain(x), rtol=0, atol=0)
    assert all(m.last_transport == "local" for m in converted.modules() if isinstance(m, SyncBatchNorm))
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(converted.state_dict()[key], value, rtol=0, atol=0)
    plain.eval()
    converted.eval()
    y = torch.randn(3, 2, 2, 2, 2)
    torch.testing.assert_close(converted(y), plain(y), rtol=0, atol=0)  # eval: the same running-stat kernel


def _hooked_model(hooks: bool = True) -> tuple[nn.Sequential, list[RemovableHandle]]:
    """A conv-BN network whose BatchNorm layer's hooks change its input, output, gradient and state_dict."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3), nn.ReLU()).double()
    if not hooks:
        return model, []
    bn = model[1]
    handles = [
        bn.register_forward_pre_hook(lambda module, args: (args[0] + 1.5,)),
        bn.register_forward_hook(lambda module, args, output: output * 2),
        bn.register_full_backward_hook(lambda module, grad_input, grad_output: (grad_input[0] * 0.25,)),
        bn.register_state_dict_post_hook(lambda module, state, prefix, local: state.update({prefix + "tag": 1})),
    ]
    return model, handles


def _forward_backward(model: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    x = x.clone().requires_grad_()
    out = model(x)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape))
    return out.detach(), x.grad


def test_hooks_move_with_the_layer() -> None:
    original, _ = _hooked_model()
    model, handles = _hooked_model()
    x = torch.randn(4, 2, 3, 3, dtype=torch.float64)
    expected = _forward_backward(original, x)
    convert_model(model)
    assert type(model[1]) is SynchronizedBatchNorm2d
    for got, want in zip(_forward_backward(model, x), expected):  # the local path: nn.BatchNorm's kernels
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert "1.tag" in model.state_dict()
    revert_model(model)
    assert type(model[1]) is nn.BatchNorm2d
    for got, want in zip(_forward_backward(model, x), _forward_backward(original, x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # The handles taken on the original layer still remove its hooks after a convert/revert round trip.
    convert_model(model)
    for handle in handles:
        handle.remove()
    plain, _ = _hooked_model(hooks=False)
    plain.load_state_dict(original.state_dict(), strict=False)  # the running statistics of the steps above
    for got, want in zip(_forward_backward(model, x), _forward_backward(plain, x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert "1.tag" not in model.state_dict()


class _PositiveScale(nn.Module):
    def forward(self, weight: Tensor) -> Tensor:
        return weight.abs() + 0.5


def _reparametrized_net(how: str) -> nn.Sequential:
    torch.manual_seed(6)
    model = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3)).double()
    if how == "parametrize":
        parametrize.register_parametrization(model[1], "weight", _PositiveScale())
    else:
        prune.l1_unstructured(model[1], "weight", amount=0.5)  # weight_orig, weight_mask and a forward pre-hook
    return model


@pytest.mark.parametrize("how", ["parametrize", "prune"])
def test_parametrized_and_pruned_layers_keep_their_function(how: str) -> None:
    original, model = _reparametrized_net(how), _reparametrized_net(how)
    original_class = type(model[1])
    x = torch.randn(4, 2, 3, 3, dtype=torch.float64)
    expected = _forward_backward(original, x)
    convert_model(model)
    assert isinstance(model[1], SynchronizedBatchNorm2d)
    assert list(model.state_dict()) == list(original.state_dict())
    for got, want in zip(_forward_backward(model, x), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for p, q in zip(model.parameters(), original.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    revert_model(model)
    assert type(model[1]) is original_class
    for got, want in zip(_forward_backward(model, x), _forward_backward(original, x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_optimizer_built_before_convert_updates_converted_layers() -> None:
    torch.manual_seed(2)
    model = _cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    reference = copy.deepcopy(model)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    convert_model(model)
    layer = model[1]
    assert any(p is layer.weight for p in optimizer.param_groups[0]["params"])
    weight_before = layer.weight.detach().clone()
    x, target = torch.randn(6, 2, 2, 2, 2), torch.randn(6, 4)
    for net, opt in [(model, optimizer), (reference, ref_optimizer)]:
        opt.zero_grad()
        F.mse_loss(net(x), target).backward()
        opt.step()
    assert not torch.equal(layer.weight, weight_before)
    # The converted model's step is the plain model's step: same kernels in local mode.
    for (key, value), ref_value in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(value, ref_value, rtol=0, atol=0, msg=key)


class _Doubled(nn.BatchNorm2d):
    """An unknown subclass: its own forward."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * 2


class _WithAux(nn.BatchNorm2d):
    """An unknown subclass: no forward of its own, but a child module (timm's SplitBatchNorm2d has both)."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        self.aux_bn = nn.ModuleList([nn.BatchNorm2d(num_features)])


class _Renamed(nn.BatchNorm2d):
    """A plain subclass: neither a forward nor children of its own."""

    def _check_input_dim(self, input: Tensor) -> None:
        super()._check_input_dim(input)


def _mixed() -> nn.Module:
    return nn.Sequential(
        nn.BatchNorm2d(3), nn.Sequential(_Doubled(3), nn.ModuleDict({"split": _WithAux(3)})), _Renamed(3)
    )


def test_unknown_subclasses_are_refused_naming_each_and_the_ways_out() -> None:
    model = _mixed()
    layers = list(model.modules())
    with pytest.raises(TypeError) as info:
        convert_model(model)
    message = str(info.value)
    assert "cannot swap 2 BatchNorm layer(s)" in message and "swapped none" in message
    assert f"'1.0' ({__name__}._Doubled): {__name__}._Doubled defines its own forward" in message
    assert f"'1.1.split' ({__name__}._WithAux): owns child modules ['aux_bn']" in message
    assert "syncbn_dist.register_conversion(" in message and "strict=False" in message
    assert all(a is b for a, b in zip(model.modules(), layers))  # nothing converted, not even model[0]
    assert type(model[0]) is nn.BatchNorm2d
    with pytest.raises(TypeError, match="_Doubled defines its own forward"):
        convert_model(_Doubled(3))  # a single layer too
    with pytest.raises(TypeError, match="_Doubled"):
        SyncBatchNorm.convert_sync_batchnorm(_mixed())


def test_strict_false_leaves_unknown_subclasses_with_a_warning() -> None:
    model = _mixed()
    doubled, split = model[1][0], model[1][1]["split"]
    with pytest.warns(UserWarning, match=r"leaves 2 layer\(s\) as they are") as record:
        assert convert_model(model, strict=False) is model
    assert "'1.0'" in str(record[0].message) and "'1.1.split'" in str(record[0].message)
    assert model[1][0] is doubled and model[1][1]["split"] is split
    assert type(split.aux_bn[0]) is nn.BatchNorm2d  # an unknown layer's children are left with it
    assert type(model[0]) is SynchronizedBatchNorm2d and type(model[2]) is SynchronizedBatchNorm2d
    x = torch.randn(4, 3, 2, 2)
    torch.testing.assert_close(model[1][0](x), _Doubled(3)(x), rtol=0, atol=0)  # its function untouched


def test_plain_subclass_converts_and_reverts_to_its_class() -> None:
    model = nn.Sequential(_Renamed(3, momentum=None))
    model[0].custom = "kept"
    weight = model[0].weight
    convert_model(model)
    assert type(model[0]) is SynchronizedBatchNorm2d and model[0].weight is weight
    revert_model(model)
    assert type(model[0]) is _Renamed and model[0].custom == "kept" and model[0].momentum is None
    assert model[0].weight is weight and not hasattr(model[0], "process_group")


def test_revert_refuses_synchronized_subclasses_it_cannot_undo() -> None:
    class Halved(SynchronizedBatchNorm2d):  # built synchronized: no record of an original class to return to
        def forward(self, x: Tensor) -> Tensor:
            return super().forward(x) / 2

    model = nn.Sequential(SynchronizedBatchNorm2d(3), Halved(3))
    with pytest.raises(TypeError, match=r"'1' \(.*Halved\): .*Halved defines its own forward and the layer has no"):
        revert_model(model)
    with pytest.raises(TypeError, match="Revert only layers that convert_model built, or pass strict=False"):
        revert_model(model)
    assert type(model[0]) is SynchronizedBatchNorm2d  # nothing reverted
    with pytest.warns(UserWarning, match="Halved"):
        revert_model(model, strict=False)
    assert type(model[0]) is nn.BatchNorm2d and type(model[1]) is Halved
    assert convert_model(model)[1] is model[1]  # already synchronized: kept as it is


def test_convert_model_leaves_no_reference_cycle() -> None:
    """A converted model is freed as soon as it is dropped, without a gc pass: a cycle (a nested recursive walk) would
    keep it, and the process group its layers reach, alive past destroy_process_group, into the interpreter's exit,
    where a gloo group can abort the process (docs/troubleshooting.md)."""
    gc.collect()
    gc.disable()
    try:
        model = convert_model(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm2d(4))))
        layer = weakref.ref(model[1])
        reverted = weakref.ref(revert_model(convert_model(nn.BatchNorm1d(3))))
        del model
        assert layer() is None and reverted() is None
    finally:
        gc.enable()
