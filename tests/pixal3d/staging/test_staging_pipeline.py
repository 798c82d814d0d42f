"""Lazy mid-run loading gives the same outputs as loading everything first (the eager reference)."""
from collections import Counter

from pixal3d.staging import EventLog, StagedModels
from tests.support.substitute_pipeline import STAGES, build, make_loaders, run


def eager_fingerprints() -> dict[str, str]:
    models = {name: build(name) for name in make_loaders()}
    return run(models)


def test_staged_run_matches_eager_fingerprints_at_every_stage():
    registry = StagedModels(make_loaders(), STAGES)
    assert run(registry, enter=registry.enter) == eager_fingerprints()


def test_without_rng_preservation_fingerprints_differ_after_the_first_stage():
    # Control: the comparison above can fail. Each stage draws its noise before building its
    # models, so the first stage still matches and every later stage is shifted.
    registry = StagedModels(make_loaders(), STAGES, preserve_rng=False)
    staged, eager = run(registry, enter=registry.enter), eager_fingerprints()
    assert staged["encode"] == eager["encode"]
    assert all(staged[s] != eager[s] for s in ("denoise", "decode", "refine"))


def test_staged_run_releases_models_as_stages_pass_and_reloads_none():
    builds, log = Counter(), EventLog()
    registry = StagedModels(make_loaders(builds), STAGES, events=log)
    run(registry, enter=registry.enter)
    assert builds == Counter({"encoder": 1, "denoiser": 1, "decoder": 1, "refiner": 1})
    assert registry.loaded() == ["decoder", "refiner"]
    released = [(e.model, e.stage) for e in log.of_kind("release")]
    assert released == [("encoder", "decode"), ("denoiser", "decode")]
    assert log.of_kind("outside_stage") == [] and log.of_kind("reload") == []
