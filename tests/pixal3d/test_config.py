"""Cascade configs: the shipped files load; unknown keys, wrong types and missing keys are errors that
name the key and the file; ``base:`` inheritance; cross-key rules."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pixal3d.config import CascadeConfig, ConfigError, load_config, to_dict, with_sampler_steps
from pixal3d.pipeline_json import published_samplers, resolve_samplers

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

TINY_TEXT = (CONFIGS / "tiny.yaml").read_text()


def _write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", ["1024_cascade", "1536_cascade", "tiny"])
def test_shipped_configs_load(name):
    config = load_config(CONFIGS / f"{name}.yaml")
    assert isinstance(config, CascadeConfig) and config.name == name and config.seed == 42
    # the real cascades read the interval from pipeline.json, as the reference does; the demo sets it
    assert config.structure.sampler.guidance_interval == (None if name != "tiny" else (0.6, 1.0))


def test_1024_cascade_has_the_reference_sampler_parameters_and_pinned_revisions():
    config = resolve_samplers(load_config(CONFIGS / "1024_cascade.yaml"), {"args": published_samplers()})
    rows = {stage: getattr(config, stage).sampler for stage in ("structure", "shape_512", "shape_1024", "texture")}
    assert [(s.steps, s.guidance_strength, s.guidance_rescale, s.guidance_interval, s.rescale_t)
            for s in rows.values()] == [(12, 7.5, 0.7, (0.6, 1.0), 5.0), (12, 7.5, 0.5, (0.6, 1.0), 3.0),
                                         (12, 7.5, 0.5, (0.6, 1.0), 3.0), (12, 1.0, 0.0, (0.6, 0.9), 3.0)]
    assert len(config.weights.pixal3d.revision) == 40 and len(config.weights.dinov3.revision) == 40
    assert config.upsample.hr_resolution == 1024 and config.structure.coords_resolution == 32


def test_1536_inherits_everything_but_its_resolution():
    base, derived = load_config(CONFIGS / "1024_cascade.yaml"), load_config(CONFIGS / "1536_cascade.yaml")
    assert derived.upsample.hr_resolution == 1536 and derived.upsample.min_resolution == 1024
    assert to_dict(derived.shape_1024) == to_dict(base.shape_1024) and derived.weights == base.weights


def test_unknown_key_names_the_dotted_key_and_the_file(tmp_path):
    path = _write(tmp_path, TINY_TEXT.replace("rescale_t: 5.0", "rescale_t: 5.0, stepz: 3"))
    with pytest.raises(ConfigError, match=r"c\.yaml: unknown key 'structure\.sampler\.stepz'"):
        load_config(path)


def test_unknown_top_level_key(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'sead'"):
        load_config(_write(tmp_path, TINY_TEXT + "sead: 3\n"))


@pytest.mark.parametrize("old, new, key", [
    ("steps: 2, guidance_strength: 7.5, guidance_rescale: 0.7",
     "steps: two, guidance_strength: 7.5, guidance_rescale: 0.7", "structure.sampler.steps"),
    ("seed: 42", "seed: true", "seed"),
    ("texture_size: 256", "texture_size: 2.5", "export.texture_size"),
    ("guidance_interval: [0.6, 0.9]", "guidance_interval: [0.6]", "texture.sampler.guidance_interval"),
    ("image_size: 64, grid_resolution: 4", "image_size: '64', grid_resolution: 4", "structure.condition.image_size"),
])
def test_wrong_type_names_the_key_and_the_file(tmp_path, old, new, key):
    assert old in TINY_TEXT
    path = _write(tmp_path, TINY_TEXT.replace(old, new))
    with pytest.raises(ConfigError, match=rf"c\.yaml: key '{key}'"):
        load_config(path)


def test_missing_required_key(tmp_path):
    text = TINY_TEXT.replace("  latent_channels: 8\n  coords_resolution: 8", "  coords_resolution: 8")
    with pytest.raises(ConfigError, match=r"missing required key 'structure\.latent_channels'"):
        load_config(_write(tmp_path, text))


def test_a_weight_source_needs_exactly_one_origin(tmp_path):
    text = TINY_TEXT.replace("dinov3: {generate: tiny}", "dinov3: {generate: tiny, repo: a/b}")
    with pytest.raises(ConfigError, match=r"'weights\.dinov3' needs exactly one of"):
        load_config(_write(tmp_path, text))


def test_export_values_are_checked_by_the_exporter(tmp_path):
    text = TINY_TEXT.replace("texture_size: 256", "texture_size: 256\n  texture_format: gif")
    with pytest.raises(ConfigError, match=r"key 'export' is invalid: texture_format"):
        load_config(_write(tmp_path, text))


def test_resolutions_must_divide_by_the_upsampling_factor(tmp_path):
    text = TINY_TEXT.replace("hr_resolution: 48", "hr_resolution: 50")
    with pytest.raises(ConfigError, match=r"multiples of 2\*\*upsample\.times = 4"):
        load_config(_write(tmp_path, text))


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "a: [1, 2\n"))


def test_base_chain_merges_mappings_and_resolves_relative_local_paths(tmp_path):
    (tmp_path / "sub").mkdir()
    _write(tmp_path, TINY_TEXT.replace("pixal3d: {generate: tiny}", "pixal3d: {local: weights/p}"), "base.yaml")
    child = _write(tmp_path / "sub", "base: ../base.yaml\nupsample: {hr_resolution: 64}\n"
                   "weights: {dinov3: {local: d}}\n", "child.yaml")
    config = load_config(child)
    assert config.upsample.hr_resolution == 64 and config.upsample.times == 2
    assert config.weights.pixal3d.local == str((tmp_path / "weights" / "p").resolve())
    # a weight source is replaced whole (no mix of the base's generate with the child's local)
    assert config.weights.dinov3.local == str((tmp_path / "sub" / "d").resolve())
    assert config.weights.dinov3.generate is None
    assert config.source == str(child)


def test_with_sampler_steps_changes_every_flow_stage_only():
    config = with_sampler_steps(load_config(CONFIGS / "tiny.yaml"), 1)
    assert {getattr(config, s).sampler.steps for s in ("structure", "shape_512", "shape_1024", "texture")} == {1}
    assert config.texture.sampler.guidance_strength == 1.0


# -- declared ranges, file encodings (issue 16) ----------------------------------------------------------

def _override(tmp_path: Path, dotted: str, value) -> Path:
    data: dict = {"base": str(CONFIGS / "tiny.yaml")}
    node = data
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("key, value", [
    ("seed", 2**70), ("seed", -1), ("structure.noise_resolution", 0), ("structure.noise_resolution", -3),
    ("structure.latent_channels", 0), ("structure.coords_resolution", 0), ("structure.sampler.steps", 0),
    ("structure.sampler.guidance_strength", -1.0), ("shape_512.sampler.guidance_rescale", 1.5),
    ("shape_512.sampler.rescale_t", 0.0), ("texture.sampler.sigma_min", 1.0),
    ("shape_1024.condition.image_size", 0), ("shape_1024.condition.naf_size", -64),
    ("upsample.times", -1), ("upsample.max_tokens", 0), ("upsample.resolution_step", 0),
    ("camera.fov_deg", 180.0), ("camera.fov_deg", 0.0),
])
def test_a_value_outside_its_declared_range_names_the_key_the_range_and_the_file(tmp_path, key, value):
    with pytest.raises(ConfigError) as info:
        load_config(_override(tmp_path, key, value))
    message = str(info.value)
    assert f"key '{key}'" in message and "c.yaml" in message and "must be" in message, message


def test_every_range_is_declared_on_the_dataclass_field():
    from pixal3d.config import Range, declared_ranges

    ranges = declared_ranges(CascadeConfig)
    assert isinstance(ranges["seed"], Range) and ranges["seed"].describe() == "an integer in [0, 2**64 - 1]"
    assert {"structure.noise_resolution", "structure.sampler.steps", "camera.fov_deg"} <= set(ranges)


def test_overrides_are_checked_against_the_same_ranges():
    config = load_config(CONFIGS / "tiny.yaml")
    with pytest.raises(ConfigError, match=r"key 'seed' must be an integer in \[0, 2\*\*64 - 1\], got -5"):
        config.with_overrides(seed=-5)
    assert config.with_overrides(seed=2**64 - 1).seed == 2**64 - 1


@pytest.mark.parametrize("encoding", ["utf-16", "binary"])
def test_a_utf16_or_binary_config_file_is_one_clear_error(tmp_path, encoding):
    path = tmp_path / "c.yaml"
    if encoding == "utf-16":
        path.write_bytes(TINY_TEXT.encode("utf-16"))
    else:
        path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "c.yaml" in message and "UTF-8" in message and "\n" not in message
    if encoding == "utf-16":
        assert "UTF-16" in message
