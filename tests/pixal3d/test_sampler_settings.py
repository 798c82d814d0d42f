"""Sampler settings from pipeline.json (issue 15): the reference reads each sampler's guidance interval and
sigma_min from the checkpoint folder's pipeline.json; the config may override them, and a difference between
the two is logged once. The run then samples with what was resolved (the plan's config, run.json)."""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import pytest
import yaml

from pipelines import Pixal3D
from pixal3d import pipeline_json
from pixal3d.config import ConfigError
from pixal3d.pipeline_json import published_samplers, resolve_samplers
from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG, tiny, tiny_cache  # noqa: F401


def _no_interval(config):
    """``config`` as if its file set no guidance interval (1024_cascade.yaml's way)."""
    changes = {s: dataclasses.replace(getattr(config, s), sampler=dataclasses.replace(
        getattr(config, s).sampler, guidance_interval=None)) for s in ("structure", "shape_512", "shape_1024", "texture")}
    return dataclasses.replace(config, **changes)


def _pipeline(structure=(0.5, 0.95), shape=(0.55, 1.0), tex=(0.6, 0.8), sigma=2e-5):
    sections = published_samplers()
    for section, interval in (("sparse_structure_sampler", structure), ("shape_slat_sampler", shape),
                              ("tex_slat_sampler", tex)):
        sections[section]["params"]["guidance_interval"] = list(interval)
        sections[section]["args"]["sigma_min"] = sigma
    return {"args": sections}


@pytest.fixture(autouse=True)
def _fresh_reports(monkeypatch):
    monkeypatch.setattr(pipeline_json, "_reported", set())  # "once per process": each test starts afresh


def test_unset_values_come_from_pipeline_json_the_shape_stages_sharing_one_sampler(tiny):
    config = resolve_samplers(_no_interval(tiny), _pipeline())
    assert config.structure.sampler.guidance_interval == (0.5, 0.95)
    assert config.shape_512.sampler.guidance_interval == config.shape_1024.sampler.guidance_interval == (0.55, 1.0)
    assert config.texture.sampler.guidance_interval == (0.6, 0.8)
    assert {getattr(config, s).sampler.sigma_min for s in ("structure", "texture")} == {2e-5}
    assert config.structure.sampler.steps == tiny.structure.sampler.steps  # the explicit ones stay the config's


def test_the_config_overrides_pipeline_json_and_the_difference_is_logged_once(tiny, caplog):
    with caplog.at_level(logging.WARNING, logger="pixal3d.pipeline_json"):
        first = resolve_samplers(tiny, _pipeline())  # tiny.yaml sets every interval
        again = resolve_samplers(tiny, _pipeline())
    assert first == again and first.structure.sampler.guidance_interval == (0.6, 1.0)  # the config's
    lines = [r.getMessage() for r in caplog.records]
    assert sum("structure.sampler.guidance_interval: the config says [0.6, 1.0], pipeline.json's "
               "sparse_structure_sampler says [0.5, 0.95]; using the config's" in line for line in lines) == 1
    assert len(lines) == 8  # 4 intervals + 4 sigma_min, once each although resolved twice
    assert first.texture.sampler.sigma_min == 2e-5  # sigma_min left at the default: pipeline.json's
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pixal3d.pipeline_json"):
        same = resolve_samplers(tiny, {"args": published_samplers()})  # control: no difference, nothing said
    assert caplog.records == [] and same == tiny


def test_an_interval_set_by_neither_is_one_error_naming_the_key_and_the_section(tiny):
    pipeline = _pipeline()
    del pipeline["args"]["tex_slat_sampler"]["params"]["guidance_interval"]
    with pytest.raises(ConfigError, match=r"'texture\.sampler\.guidance_interval' is set neither there nor in "
                                          r"pipeline\.json \(args\.tex_slat_sampler\.params\.guidance_interval\)"):
        resolve_samplers(_no_interval(tiny), pipeline)
    with pytest.raises(ConfigError, match="set neither"):
        resolve_samplers(_no_interval(tiny), None)


def test_the_plan_reads_pipeline_json_and_the_run_samples_with_what_it_says(tiny, tiny_cache, tmp_path):
    """A local copy of the tiny weights whose pipeline.json carries sampler sections, and a config without
    intervals: the plan's config has pipeline.json's, and the run's structure noise is sampled with them (a
    different interval gives a different latent than the demo's)."""
    source = tiny_cache / "tiny"
    folder = next(p for p in source.iterdir() if p.is_dir())
    copy = tmp_path / "weights"
    shutil.copytree(folder, copy)
    pipe_json = copy / "pixal3d" / "pipeline.json"
    data = json.loads(pipe_json.read_text())
    data["args"].update(_pipeline(structure=(0.0, 1.0))["args"])
    pipe_json.write_text(json.dumps(data))
    raw = yaml.safe_load(TINY_CONFIG.read_text())
    for stage in ("structure", "shape_512", "shape_1024", "texture"):
        raw[stage]["sampler"].pop("guidance_interval")
    raw["weights"] = {"pixal3d": {"local": str(copy / "pixal3d")}, "dinov3": {"local": str(copy / "dinov3")},
                      "naf": {"local": str(copy / "naf"), "files": ["naf.safetensors"]}, "rembg": None, "moge": None}
    path = tmp_path / "from_pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    plan = Pixal3D.plan(path, device="cpu", policy="staged", until="structure")
    assert plan.config.structure.sampler.guidance_interval == (0.0, 1.0)
    # a stage passed in replace= is built from the file's config, before pipeline.json is read: filled in too
    from pipelines.structure import StructureStage
    from pixal3d.config import load_config

    early = StructureStage.from_config(load_config(path))
    assert early.config.sampler.guidance_interval is None
    replaced = Pixal3D.plan(path, device="cpu", policy="staged", until="structure", replace={"structure": early})
    assert next(s for s in replaced.stages if s.name == "structure").config.sampler.guidance_interval == (0.0, 1.0)
    with Pixal3D.from_plan(plan) as pipe:
        result = pipe.run(EXAMPLE)
    assert result.record()["config"]["structure"]["sampler"]["guidance_interval"] == [0.0, 1.0]
    with Pixal3D.from_config(tiny, device="cpu", policy="staged", until="structure") as pipe:
        demo = pipe.run(EXAMPLE)
    prints, demo_prints = result.fingerprints()["structure"], demo.fingerprints()["structure"]
    assert prints["ss_noise"] == demo_prints["ss_noise"] and prints["ss_latent"] != demo_prints["ss_latent"]
