"""StagedModels: lazy loading, release on enter, pins, close, errors and events."""
from collections import Counter

import pytest
import torch

from pixal3d.staging import (
    Event,
    EventLog,
    OutsideStageError,
    ReleasedModuleError,
    StagedModels,
)
from pixal3d.staging.release import module_nbytes
from tests.support.substitute_pipeline import STAGES, make_loaders


def registry(**kwargs):
    builds, log = Counter(), EventLog()
    return StagedModels(make_loaders(builds), STAGES, events=log, **kwargs), builds, log


def test_in_len_and_iteration_never_load():
    models, builds, log = registry()
    assert "encoder" in models and "nope" not in models
    assert len(models) == 4 and list(models) == ["encoder", "denoiser", "decoder", "refiner"]
    assert set(models.keys()) == {"encoder", "denoiser", "decoder", "refiner"}
    assert builds == Counter() and log.events == [] and models.loaded() == []


def test_first_access_loads_once_and_emits_a_load_event_with_bytes_and_seconds():
    models, builds, log = registry()
    models.enter("encode")
    encoder = models["encoder"]
    assert models["encoder"] is encoder and builds["encoder"] == 1
    [load] = log.of_kind("load")
    assert (load.model, load.stage, load.bytes) == ("encoder", "encode", module_nbytes(encoder))
    assert load.seconds > 0 and load.time > 0


def test_enter_releases_what_the_new_stage_does_not_need_before_the_stage_event():
    models, builds, log = registry()
    models.enter("denoise")
    encoder, denoiser = models["encoder"], models["denoiser"]
    encoder_bytes = module_nbytes(encoder)
    models.enter("decode")
    assert log.kinds() == ["stage", "load", "load", "release", "release", "stage"]
    release = log.of_kind("release")[0]
    assert (release.model, release.stage, release.bytes) == ("encoder", "decode", encoder_bytes)
    assert log.events[-1] == Event("stage", stage="decode", time=log.events[-1].time)
    assert models.loaded() == [] and models.stage == "decode"
    with pytest.raises(ReleasedModuleError, match="'denoiser'.*'decode'"):
        denoiser(torch.zeros(1, 32), torch.zeros(1, 32))


def test_enter_collects_garbage_once_for_all_the_models_it_releases(monkeypatch):
    import gc

    models, _, log = registry()
    models.enter("denoise")
    models["encoder"], models["denoiser"]
    calls = Counter()
    monkeypatch.setattr(gc, "collect", lambda: calls.update(["collect"]))  # every caller's gc.collect
    models.enter("decode")
    assert len(log.of_kind("release")) == 2 and calls["collect"] == 1


def test_a_model_the_new_stage_also_needs_stays_loaded():
    models, _, log = registry()
    models.enter("decode")
    decoder = models["decoder"]
    models.enter("refine")
    assert models["decoder"] is decoder and log.of_kind("release") == []


def test_access_after_release_reloads_a_fresh_module_and_emits_reload():
    models, builds, log = registry()
    models.enter("encode")
    old = models["encoder"]
    models.enter("decode")
    models.enter("denoise")
    new = models["encoder"]
    assert new is not old and builds["encoder"] == 2
    assert new(torch.zeros(1, 16)).shape == (1, 32)
    [reload] = log.of_kind("reload")
    assert (reload.model, reload.stage, reload.bytes) == ("encoder", "denoise", module_nbytes(new))


def test_pinned_models_survive_enter_but_not_close():
    models, _, log = registry(pinned=["encoder"])
    models.enter("encode")
    encoder = models["encoder"]
    models.enter("refine")
    assert models.loaded() == ["encoder"] and models["encoder"] is encoder


def test_close_releases_everything_pinned_included():
    models, _, log = registry(pinned=["refiner"])
    models.enter("refine")
    decoder, refiner = models["decoder"], models["refiner"]
    models.close()
    assert models.loaded() == [] and models.stage is None
    assert sorted(e.model for e in log.of_kind("release")) == ["decoder", "refiner"]
    assert all(p.device.type == "meta" for p in [*decoder.parameters(), *refiner.parameters()])


def test_context_manager_closes():
    with StagedModels(make_loaders(), STAGES) as models:
        encoder = models["encoder"]
    assert encoder.proj.weight.device.type == "meta"


def test_unknown_names_raise_key_error_listing_the_valid_ones():
    models, _, _ = registry()
    with pytest.raises(KeyError, match="unknown model 'vae'.*'decoder'"):
        models["vae"]
    with pytest.raises(KeyError, match="unknown stage 'upscale'.*'refine'"):
        models.enter("upscale")
    with pytest.raises(KeyError, match="unknown model"):
        models.pin("vae")
    with pytest.raises(KeyError, match=r"no loader: \['vae'\]"):
        StagedModels(make_loaders(), {**STAGES, "extra": ["vae"]})


def test_use_outside_the_stage_loads_with_an_outside_stage_event_once():
    models, builds, log = registry()
    models.enter("encode")
    models["decoder"]
    models["decoder"]
    assert builds["decoder"] == 1
    [outside] = log.of_kind("outside_stage")
    assert (outside.model, outside.stage) == ("decoder", "encode")


def test_strict_registry_refuses_use_outside_the_stage():
    models, builds, _ = registry(strict=True)
    models.enter("encode")
    with pytest.raises(OutsideStageError, match="'decoder'.*'encode'.*strict=False"):
        models["decoder"]
    assert builds["decoder"] == 0


def test_access_before_any_stage_is_not_outside_a_stage():
    models, _, log = registry(strict=True)
    models.load_all()
    assert len(models.loaded()) == 4 and log.kinds() == ["load"] * 4


def test_reentering_the_current_stage_emits_no_second_stage_event():
    models, _, log = registry()
    models.enter("encode")
    models.enter("encode")
    assert log.kinds() == ["stage"]


def test_loader_returning_a_non_module_is_an_error_naming_the_model():
    models = StagedModels({"bad": lambda: object()}, {"s": ["bad"]})
    with pytest.raises(TypeError, match="'bad'.*object"):
        models["bad"]


def test_loads_preserve_the_global_rng_state():
    models, _, _ = registry()
    torch.manual_seed(3)
    expected = torch.randn(4)
    torch.manual_seed(3)
    models["denoiser"]  # its construction draws random init
    assert torch.equal(torch.randn(4), expected)


def test_event_to_dict_and_kind_validation():
    event = Event("release", model="m", stage="s", bytes=5, seconds=0.5, time=1.0)
    assert event.to_dict() == {
        "kind": "release", "model": "m", "stage": "s", "bytes": 5, "seconds": 0.5, "time": 1.0, "note": "",
    }
    with pytest.raises(ValueError, match="unknown event kind 'mark'"):
        Event("mark")
