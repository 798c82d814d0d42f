"""release(): weights to meta, each storage counted once, keep honoured, released modules refuse to run."""
import gc
import weakref

import psutil
import pytest
import torch
from torch import nn

from pixal3d.staging import ReleasedModuleError, release
from pixal3d.staging.release import is_released, module_nbytes
from tests.support.substitute_pipeline import Denoiser, Encoder, build


def tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def test_bytes_freed_equal_parameter_and_buffer_bytes():
    encoder = build("encoder")
    expected = sum(t.numel() * t.element_size() for t in tensors(encoder))
    assert module_nbytes(encoder) == expected
    assert release(encoder, name="encoder", stage="decode") == expected
    assert all(t.device.type == "meta" for t in tensors(encoder))
    # Structure survives: names and shapes are still there for a rebuild or a repr.
    assert encoder.proj.weight.shape == (32, 16) and "scale" in dict(encoder.named_buffers())


def test_tied_weights_are_counted_once():
    denoiser = build("denoiser")
    assert denoiser.outer.weight is denoiser.inner.weight
    untied = 2 * 32 * 4 + 32 * 32 * 4  # two biases, one shared weight
    assert module_nbytes(denoiser) == untied
    assert release(denoiser) == untied


def test_views_of_one_storage_count_the_storage_once():
    module = nn.Module()
    base = torch.zeros(100)
    module.register_buffer("a", base[:50])
    module.register_buffer("b", base[50:])
    assert release(module) == 400


def test_releasing_twice_frees_nothing_the_second_time():
    encoder = build("encoder")
    assert release(encoder) > 0
    assert release(encoder) == 0


def test_storage_shared_with_a_kept_module_is_left_alone():
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    second.weight = first.weight  # shared across two models; bias is first's own
    assert release(first, name="first", keep=[second]) == 8 * 4
    assert second.weight.device.type == "cpu" and first.bias.device.type == "meta"
    assert torch.isfinite(second(torch.ones(8))).all()


def test_submodule_shared_with_a_kept_module_keeps_working():
    backbone = nn.Linear(4, 4)
    user_a, user_b = nn.Sequential(backbone, nn.Linear(4, 2)), nn.Sequential(backbone, nn.Linear(4, 3))
    freed = release(user_a, name="user_a", keep=[user_b])
    assert freed == (4 * 2 + 2) * 4  # only user_a's own head
    assert not is_released(backbone) and is_released(user_a)
    assert user_b(torch.ones(4)).shape == (3,)


def test_calling_a_released_module_names_model_stage_and_the_way_back():
    denoiser = build("denoiser")
    release(denoiser, name="denoiser", stage="decode")
    x = torch.zeros(1, 32)
    with pytest.raises(ReleasedModuleError) as err:
        denoiser(x, x)
    message = str(err.value)
    assert "'denoiser'" in message and "'decode'" in message and "StagedModels registry" in message
    assert err.value.name == "denoiser" and err.value.stage == "decode"
    with pytest.raises(ReleasedModuleError, match="velocity_scale"):
        denoiser.velocity_scale()
    with pytest.raises(ReleasedModuleError):
        denoiser.inner(x)  # a reference to a submodule is no way around it
    assert "Denoiser" in repr(denoiser)


def test_plain_tensor_attributes_are_released_too():
    module = Encoder()
    module.freqs = torch.ones(1000)  # e.g. a rotary table kept as a plain attribute
    nbytes = module_nbytes(module)
    assert release(module) == nbytes and module.freqs.device.type == "meta"


def test_old_parameters_die_even_if_referenced_by_the_module_tree_only():
    encoder = Encoder()
    ref = weakref.ref(encoder.proj.weight)
    release(encoder)
    gc.collect()
    assert ref() is None


def test_a_200mb_module_really_gives_its_memory_back():
    size = 56 * 2**20  # float32 elements: 224 MiB
    module = nn.Module()
    module.weight = nn.Parameter(torch.ones(size))  # ones: every page touched, so RSS holds it
    process = psutil.Process()
    before = process.memory_info().rss
    assert release(module, name="big") == size * 4
    after = process.memory_info().rss
    assert module.weight.device.type == "meta"
    assert before - after > 0.9 * size * 4, (before, after)
