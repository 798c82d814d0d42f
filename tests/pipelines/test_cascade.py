"""Latent-hash regression of the tiny cascade: eager, staged and resident runs give the same fingerprints
(relative: on every machine), the eager one those of this platform's golden (where one is verified); the
controls show the comparisons catch RNG drift, a changed seed, another NAF mode and other kernels; the stage
plan is honest."""
from __future__ import annotations

import json

import pytest
import torch

from pipelines import Pixal3D, pipeline
from pixal3d import kernels
from pixal3d.staging.events import EventLog
from tests.support.cascade_fixtures import (  # noqa: F401
    EXAMPLE,
    GOLDEN_DIR,
    first_difference,
    golden_or_skip,
    golden_path,
    run_tiny,
    tiny,
    tiny_cache,
    tiny_reference,
)


class _GlobalGenerator:
    """Stands in for the run's ``torch.Generator``: seeds the global CPU generator and hands it out, so the
    noise is drawn the way the reference draws it (and a load that draws from it moves it)."""

    def manual_seed(self, seed):
        return torch.manual_seed(seed)


def _consuming(name, load):
    """A loader that draws from the global CPU generator before loading, like a model built with random init."""
    def loader():
        torch.randn(16)
        return load()
    return loader


@pytest.mark.golden
def test_the_eager_run_gives_this_platforms_golden_fingerprints(tiny_reference):
    expected = golden_or_skip()
    assert tiny_reference == expected, first_difference(tiny_reference, expected)


@pytest.mark.golden
def test_control_a_fixed_fov_run_leaves_preprocess_and_parts_from_the_golden_at_the_camera(tiny):
    """The golden's camera is MoGe-2's estimate (the tiny config gives no field of view): the same image with
    ``fov=49.1`` (the command's ``--fov``) uses no model there, keeps the golden's preprocess and differs from
    the camera stage on."""
    expected = golden_or_skip()
    with Pixal3D.from_config(tiny, policy="staged", device="cpu", until="structure") as pipe:
        fixed = pipe.run(EXAMPLE, fov=49.1)
    actual = fixed.fingerprints()
    assert [r.used for r in fixed.stages][:2] == [[], []]
    assert actual["preprocess"] == expected["preprocess"]
    assert first_difference(actual, expected).startswith("first differing stage 'camera'")
    assert actual["camera"]["camera.fov"] != expected["camera"]["camera.fov"]


@pytest.mark.golden
def test_a_resident_run_gives_the_eager_fingerprints(tiny, tiny_reference):
    actual = run_tiny(tiny, "resident").fingerprints()
    assert actual == tiny_reference, first_difference(actual, tiny_reference)


@pytest.mark.golden
def test_staged_strict_full_run_gives_the_eager_fingerprints_uses_exactly_its_needs_with_rng_drawing_loads(
        tiny, tiny_reference):
    """Staged + strict over the whole cascade (export included): no outside_stage event, each stage asked for
    exactly the models it declares, and the fingerprints are the eager run's although every load draws from
    the global generator (preserved_rng restores it)."""
    log = EventLog()
    result = run_tiny(tiny, "staged", export=True, strict=True, events=log, wrap_loader=_consuming)
    assert "outside_stage" not in log.kinds()
    from pipelines.build import build_stages
    assert {r.stage: r.used for r in result.stages} == {s.name: sorted(s.needs) for s in build_stages(tiny)}
    assert log.of_kind("release"), "a staged run releases models between stages"
    assert result.mesh is not None and result.mesh.glb[:4] == b"glTF"
    actual, expected = result.fingerprints(), tiny_reference
    assert set(actual) - set(expected) == {"export"}
    actual.pop("export")
    assert actual == expected, first_difference(actual, expected)


def test_control_without_rng_preservation_the_fingerprints_drift(tiny, tiny_reference, monkeypatch):
    """The control: the same loads with preserved_rng disabled shift whatever draws from the global generator
    (here: a run that seeds it and draws its noise from it, as the reference does), and the comparison sees it."""
    monkeypatch.setattr(pipeline.torch, "Generator", _GlobalGenerator)
    result = run_tiny(tiny, "staged", preserve_rng=False, until="shape_512", wrap_loader=_consuming)
    actual, expected = result.fingerprints(), tiny_reference
    assert actual["preprocess"] == expected["preprocess"]  # before any load: unaffected
    assert actual["structure"]["ss_noise"] != expected["structure"]["ss_noise"]
    assert first_difference(actual, {k: expected[k] for k in actual}).startswith("first differing stage 'structure'")


def test_control_another_seed_gives_other_fingerprints_from_the_first_noise_on(tiny, tiny_reference):
    """The relative checks can fail: seed 43 leaves the image and camera alone and changes the structure's
    noise and everything after it."""
    actual = run_tiny(tiny, "staged", seed=43, until="structure").fingerprints()
    assert {k: actual[k] for k in ("preprocess", "camera")} == {k: tiny_reference[k] for k in ("preprocess", "camera")}
    assert first_difference(actual, {k: tiny_reference[k] for k in actual}) == (
        "first differing stage 'structure': ['coords_lr', 'ss_latent', 'ss_noise']")


def test_the_four_noises_are_consecutive_cpu_draws_right_after_the_seed(tiny):
    """Reference §7.1: after the seed, nothing but the four noise draws consumes the CPU generator, in the
    order structure, shape 512, shape 1024, texture, with shapes [1, C, R, R, R], [N_lr, C], [N_hr, C] x 2;
    the reference draws them from the seeded global generator, the run from its own: the same bits."""
    config = tiny
    state = run_tiny(config, "staged").state
    r, n_lr, n_hr = config.structure.noise_resolution, len(state.coords_lr), len(state.coords_hr)
    torch.manual_seed(config.seed)
    expected = [torch.randn(1, config.structure.latent_channels, r, r, r),
                torch.randn(n_lr, config.shape_512.latent_channels),
                torch.randn(n_hr, config.shape_1024.latent_channels),
                torch.randn(n_hr, config.texture.latent_channels)]
    drawn = [state.ss_noise, state.lr_noise, state.hr_noise, state.tex_noise]
    for name, got, want in zip(("ss", "lr", "hr", "tex"), drawn, expected, strict=True):
        assert got.device.type == "cpu" and got.dtype == torch.float32, name
        assert torch.equal(got, want), f"{name} noise is not the expected draw"
    assert state.coords_lr.dtype == state.coords_hr.dtype == torch.int32
    assert (state.coords_lr[:, 0] == 0).all() and (state.coords_hr[:, 0] == 0).all()
    assert torch.equal(state.coords_hr, torch.unique(state.coords_hr, dim=0))  # sorted rows = noise row order
    torch.manual_seed(config.seed + 1)
    assert not torch.equal(torch.randn(1, config.structure.latent_channels, r, r, r), expected[0])  # control


def test_the_reference_holds_nafs_full_mode_and_frugal_is_a_visible_difference(tiny, tiny_reference):
    """The reference (and the golden) run NAF in full mode (the plan's auto choice here): a run forced to
    frugal differs from the first NAF stage on, in the conditioning and the latent (the control for the mode)."""
    import dataclasses

    frugal = {s: dataclasses.replace(getattr(tiny, s), condition=dataclasses.replace(getattr(tiny, s).condition,
                                                                                      naf_mode="frugal"))
              for s in ("shape_512", "shape_1024", "texture")}
    result = run_tiny(dataclasses.replace(tiny, **frugal), "staged", until="shape_512")
    actual, expected = result.fingerprints(), tiny_reference
    assert actual["structure"] == expected["structure"]  # no NAF before shape_512
    assert first_difference(actual, {k: expected[k] for k in actual}) == (
        "first differing stage 'shape_512': ['cond.proj.feats', 'lr_latent.feats']")
