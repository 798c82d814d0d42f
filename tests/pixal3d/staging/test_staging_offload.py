"""Offload: idle models parked in host memory and brought back, instead of released."""
import pytest
import torch

from pixal3d.staging import EventLog, StagedModels
from pixal3d.staging.offload import model_device, park, unpark
from pixal3d.staging.release import is_released
from tests.support.substitute_pipeline import STAGES, build, make_loaders, run

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_parking_a_cpu_module_moves_nothing():
    encoder = build("encoder")
    weight = encoder.proj.weight
    assert park(encoder, pin_memory=False) == (torch.device("cpu"), 0)
    assert encoder.proj.weight is weight and unpark(encoder, "cpu") == 0


def test_offload_registry_parks_instead_of_releasing_and_brings_back_the_same_module():
    log = EventLog()
    models = StagedModels(make_loaders(), STAGES, events=log, idle="park")
    models.enter("encode")
    encoder = models["encoder"]
    models.enter("decode")
    assert not is_released(encoder) and models.loaded() == ["encoder"]
    [parked] = log.of_kind("release")
    assert (parked.model, parked.stage, parked.note) == ("encoder", "decode", "parked in host memory")
    models.enter("denoise")
    assert models["encoder"] is encoder
    [back] = log.of_kind("reload")
    assert (back.model, back.note) == ("encoder", "from host memory")
    models.close()
    assert is_released(encoder) and models.loaded() == []


def test_offload_run_matches_staged_run():
    staged = StagedModels(make_loaders(), STAGES)
    offload = StagedModels(make_loaders(), STAGES, idle="park")
    assert run(offload, enter=offload.enter) == run(staged, enter=staged.enter)


@cuda
def test_park_moves_weights_to_pinned_host_memory_and_back_to_the_gpu():
    denoiser = build("denoiser").to("cuda")
    nbytes_on_gpu = torch.cuda.memory_allocated()
    origin, moved = park(denoiser)
    assert origin.type == "cuda" and moved > 0
    assert denoiser.inner.weight.device.type == "cpu" and denoiser.inner.weight.is_pinned()
    assert denoiser.outer.weight is denoiser.inner.weight  # ties survive
    assert torch.cuda.memory_allocated() < nbytes_on_gpu
    assert unpark(denoiser, origin) == moved and model_device(denoiser) == origin
