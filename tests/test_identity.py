"""A synchronized layer's identity comes from its model's structure (syncbn_dist.layer.identity).

Each rank builds its own model, so "the same on every rank" is tested here as "the same for two separately built
models of one structure"; distinct for two places of one model and for models of different structure; independent of
what else the process built; kept by DataParallel replicas and deep copies.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import syncbn_dist
from syncbn_dist.integrations.data_parallel import _replicate_on_cpu
from syncbn_dist.layer.identity import layer_identity

C = 4


class _TwoHeads(nn.Module):
    """Layers built directly in ``__init__``, the container assigned before its layers exist (top-down)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(C, C)
        self.heads = nn.ModuleList()
        for _ in range(2):
            self.heads.append(nn.Sequential(nn.Linear(C, C), syncbn_dist.SynchronizedBatchNorm1d(C)))


def _identities(model: nn.Module) -> dict[str, str]:
    return {name: layer_identity(m) for name, m in model.named_modules() if isinstance(m, syncbn_dist.SyncBatchNorm)}


def _gan() -> tuple[nn.Module, nn.Module]:
    generator = nn.Sequential(nn.Linear(C, C), nn.BatchNorm1d(C), nn.ReLU())
    discriminator = nn.Sequential(nn.Linear(C, C), nn.BatchNorm1d(C), nn.LeakyReLU(0.2), nn.Linear(C, 1))
    return syncbn_dist.convert_model(generator), syncbn_dist.convert_model(discriminator)


def test_two_places_of_one_model_differ_and_a_model_built_again_has_the_same_identities() -> None:
    first, second = _TwoHeads(), _TwoHeads()
    identities = _identities(first)
    assert list(identities) == ["heads.0.1", "heads.1.1"]
    assert len(set(identities.values())) == 2, identities
    assert _identities(second) == identities  # another rank's model
    assert all(identity.endswith(":" + name) for name, identity in identities.items()), identities


def test_models_of_different_structure_differ_where_their_names_agree() -> None:
    generator, discriminator = _gan()
    assert layer_identity(generator[1]) != layer_identity(discriminator[1])
    another_rank = _gan()
    assert layer_identity(generator[1]) == layer_identity(another_rank[0][1])


def test_what_else_the_process_built_changes_nothing() -> None:
    alone = _identities(_TwoHeads())
    extra = [_gan(), _TwoHeads(), nn.Sequential(_TwoHeads())]  # built first, one holding a model of this structure
    assert _identities(_TwoHeads()) == alone
    assert extra  # (kept alive while the model is built)


def test_torchs_wrappers_are_no_part_of_a_layers_place() -> None:
    """A rank may wrap the model where another does not (torch.compile for a validation on rank 0): DataParallel and
    torch.compile's module leave the identities as they are; another container does not."""
    alone = _identities(_TwoHeads())
    parallel = syncbn_dist.DataParallelWithCallback(_TwoHeads(), cpu_replicas=2)
    compiled = torch.compile(_TwoHeads())
    assert _identities(parallel.module) == alone
    assert _identities(compiled._orig_mod) == alone
    held = nn.Sequential(_TwoHeads())
    assert all(identity.endswith(":0." + name) for name, identity in _identities(held[0]).items())


def test_data_parallel_replicas_name_their_layers_as_the_original_does() -> None:
    model = syncbn_dist.DataParallelWithCallback(_TwoHeads(), cpu_replicas=2)
    original = _identities(model.module)
    for replica in _replicate_on_cpu(model.module, 2):
        assert _identities(replica) == original


def test_a_deep_copy_keeps_its_places_and_collides_with_its_original() -> None:
    """A model and its exact copy (an EMA teacher) name their layers alike: docs/design.md says why users will not
    meet it. Inside the copy, two places still differ."""
    model = _TwoHeads()
    teacher = copy.deepcopy(model)
    assert _identities(teacher) == _identities(model)
    assert len(set(_identities(teacher).values())) == 2
    alone = copy.deepcopy(model.heads[0][1])  # a layer copied alone has no parent
    assert layer_identity(alone).endswith(":")


def test_convert_model_links_a_model_whose_parents_were_never_recorded() -> None:
    """A model assembled without torch's registration hook (as one built before syncbn_dist was imported)."""
    model = nn.Module()
    for name in ("a", "b"):
        child = nn.Sequential(nn.Linear(C, C), nn.BatchNorm1d(C))
        model._modules[name] = child  # (bypasses the hook)
        child[1].__dict__.pop("_syncbn_dist_parents", None)
        child.__dict__.pop("_syncbn_dist_parents", None)
    syncbn_dist.convert_model(model)
    identities = _identities(model)
    assert list(identities) == ["a.1", "b.1"] and len(set(identities.values())) == 2, identities


@pytest.mark.parametrize("built", ["directly", "convert_model"])
def test_errors_name_a_layer_by_its_path(built: str) -> None:
    model = _TwoHeads() if built == "directly" else syncbn_dist.convert_model(nn.Sequential(nn.BatchNorm1d(C)))
    layer = next(m for m in model.modules() if isinstance(m, syncbn_dist.SyncBatchNorm))
    expected = "heads.0.1" if built == "directly" else "0"
    assert layer._describe() == f"layer '{expected}' (SynchronizedBatchNorm1d)"


def test_a_plain_model_pickled_whole_loads_without_syncbn_dist() -> None:
    """Every module built after the import holds its links; a pickle holds none of syncbn_dist's classes."""
    model = nn.Sequential(nn.Linear(C, C), nn.BatchNorm1d(C))
    data = pickle.dumps(model)
    assert b"syncbn_dist." not in data
    assert pickle.loads(data)[1].__dict__["_syncbn_dist_parents"] == []
