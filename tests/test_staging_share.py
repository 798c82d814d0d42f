"""Sharing: identical loads give one instance, loaded once and released once."""
import pytest
import torch
from torch import nn

from pixal3d.staging import EventLog, SharedInstances, StagedModels
from pixal3d.staging.release import is_released, module_nbytes

USERS = ["extractor_a", "extractor_b", "extractor_c", "extractor_d"]


def backbone(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))


def shared_registry():
    shared, log = SharedInstances(), EventLog()
    loaders = {name: shared.loader(backbone, 16) for name in USERS}
    stages = {
        "structure": ["extractor_a", "extractor_b"],
        "shape": ["extractor_c", "extractor_d"],
        "decode": [],
    }
    return StagedModels(loaders, stages, events=log), shared, log


def test_four_users_one_load_one_release():
    models, shared, log = shared_registry()
    models.enter("structure")
    first = models["extractor_a"]
    assert models["extractor_b"] is first
    models.enter("shape")  # a and b are not needed, but c and d share their instance
    assert not is_released(first)
    assert models["extractor_c"] is first and models["extractor_d"] is first
    nbytes = module_nbytes(first)
    models.enter("decode")
    assert is_released(first) and models.loaded() == []
    assert list(shared.builds.values()) == [1]
    loads = log.of_kind("load")
    assert [e.model for e in loads] == USERS and sum(e.bytes for e in loads) == nbytes
    assert all("shared with" in e.note for e in loads[1:])
    [release] = log.of_kind("release")
    assert (release.bytes, release.stage) == (nbytes, "decode")


def test_a_released_shared_instance_is_rebuilt_on_next_use():
    models, shared, log = shared_registry()
    models.enter("structure")
    old = models["extractor_a"]
    models.enter("decode")
    models.enter("shape")
    new = models["extractor_c"]
    assert new is not old and not is_released(new)
    assert list(shared.builds.values()) == [2]
    assert new(torch.ones(16)).shape == (16,)


def test_different_arguments_are_different_instances():
    shared = SharedInstances()
    make = shared.wrap(backbone)
    assert make(8) is make(8) and make(8) is not make(4)
    assert len(shared) == 2


class Extractor(nn.Module):
    """A user outside the registry: its own head on a shared backbone."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(16, 2)


def test_users_outside_the_registry_get_one_backbone():
    shared = SharedInstances()
    make = shared.wrap(backbone)
    extractors = [Extractor(make(16)) for _ in range(4)]
    assert len({id(e.backbone) for e in extractors}) == 1
    assert list(shared.builds.values()) == [1]


def test_unhashable_arguments_are_refused_instead_of_silently_copied():
    make = SharedInstances().wrap(lambda cfg: backbone(cfg["width"]))
    with pytest.raises(TypeError, match="unhashable"):
        make({"width": 4})
