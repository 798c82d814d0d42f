"""A shape-only run (issue 45 item 2: ``--shape-only``, ``until=SHAPE_ONLY``): the cascade up to ``shape_1024``,
then the shape decoder alone and an untextured GLB; its shared stages are the full cascade's, keyed alike, so the
same run without it resumes from a work directory at ``texture`` and equals a fresh full run bit for bit."""
from __future__ import annotations

import json
import struct

import pytest
import trimesh

from pipelines import Pixal3D
from pipelines.build import SHAPE_ONLY, build_stages
from pipelines.job import Job, SettingsError
from pipelines.session import same_plan
from pixal3d.config import load_config
from pixal3d.memory_budget import GIB, PROCESS_BYTES
from tests.support.batch_fixtures import batch_images, fast_config, singles  # noqa: F401
from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG, tiny_cache  # noqa: F401
from tests.support.cli import one_error_line, run_cli
from tests.support.header_hub import REAL, hub  # noqa: F401

SHARED = ("preprocess", "camera", "features", "structure", "shape_512", "upsample", "shape_1024")


def _gltf_json(glb: bytes) -> dict:
    """The JSON chunk of a GLB (header 12 bytes, then the chunk's length and type)."""
    length, kind = struct.unpack_from("<II", glb, 12)
    assert kind == 0x4E4F534A  # "JSON"
    return json.loads(glb[20:20 + length])


def test_the_shape_only_cascade_is_the_full_one_up_to_shape_1024_then_the_shape_decode_and_export():
    config = load_config(TINY_CONFIG)
    full, shape = build_stages(config), build_stages(config, until=SHAPE_ONLY)
    assert [s.name for s in shape] == [*SHARED, "shape_decode", "shape_export"]
    assert [s.name for s in full][:len(SHARED)] == list(SHARED)
    assert shape[-2].needs == ("shape_slat_decoder",)  # no texture decoder, no texture flow
    assert not any(m.startswith("tex_") for s in shape for m in s.needs)


def test_a_shape_only_run_then_the_full_run_resumes_at_texture_and_equals_a_fresh_full_run(
        fast_config, batch_images, singles, tmp_path):
    work = tmp_path / "work"
    with Pixal3D.from_config(fast_config, policy="staged", device="cpu", until=SHAPE_ONLY) as pipe:
        [shaped] = list(pipe.run_batch(batch_images[:1], work_dir=work))
    fresh = singles["prints"]["a"]  # a fresh full run of the same image and seed
    shape_prints = shaped.result.fingerprints()
    assert {s: shape_prints.get(s) for s in SHARED} == {s: fresh.get(s) for s in SHARED}
    assert {"structure", "shape_512", "shape_1024"} <= set(shape_prints)  # the latents' stages are compared
    fields = {k: v for k, v in fresh["decode"].items() if k.startswith("fields.")}
    assert len(fields) == 5 and shape_prints["shape_decode"] == fields  # the full decode's shape half, bit for bit
    assert shaped.result.shape_only and shaped.result.record()["shape_only"] is True
    with Pixal3D.from_config(fast_config, policy="staged", device="cpu") as pipe:
        [resumed] = list(pipe.run_batch(batch_images[:1], work_dir=work))
        whole = pipe.run(batch_images[0])
    assert resumed.resumed == SHARED
    assert resumed.result.fingerprints() == fresh
    assert resumed.result.mesh.glb == whole.mesh.glb
    assert resumed.result.record()["shape_only"] is False


def test_a_stage_ordered_shape_only_batch_gives_each_images_shared_fingerprints_of_a_full_single_run(
        fast_config, batch_images, singles):
    with Pixal3D.from_config(fast_config, policy="staged", device="cpu", until=SHAPE_ONLY) as pipe:
        items = list(pipe.run_batch(batch_images[:2], order="stage"))
    assert [item.failure for item in items] == [None, None]
    for item, path in zip(items, batch_images[:2]):
        prints, full = item.result.fingerprints(), singles["prints"][path.stem]
        assert {s: prints.get(s) for s in SHARED} == {s: full.get(s) for s in SHARED}
        assert prints["shape_decode"] == {k: v for k, v in full["decode"].items() if k.startswith("fields.")}
    assert items[0].result.mesh.glb != items[1].result.mesh.glb  # two images, two shapes


def test_control_a_changed_seed_does_not_resume_a_shape_only_run_past_the_features(
        fast_config, batch_images, singles, tmp_path):
    work = tmp_path / "work"
    with Pixal3D.from_config(fast_config, policy="staged", device="cpu", until=SHAPE_ONLY) as pipe:
        list(pipe.run_batch(batch_images[:1], work_dir=work))
    with Pixal3D.from_config(fast_config, policy="staged", device="cpu") as pipe:
        [reseeded] = list(pipe.run_batch(batch_images[:1], work_dir=work, seed=7))
    assert reseeded.resumed == ("preprocess", "camera", "features")  # they do not read the generator
    assert reseeded.result.fingerprints()["structure"] != singles["prints"]["a"]["structure"]


def test_the_shape_only_glb_is_an_untextured_mesh_that_trimesh_loads(fast_config, tmp_path):
    with Pixal3D.from_config(fast_config, device="cpu", until=SHAPE_ONLY) as pipe:
        result = pipe.run(EXAMPLE)
    path = result.save(tmp_path / "shape.glb")
    scene = trimesh.load(path)
    [mesh] = scene.geometry.values()
    assert len(mesh.faces) > 0 and len(mesh.vertices) > 0
    material = mesh.visual.material
    assert material.baseColorTexture is None and material.metallicRoughnessTexture is None
    assert getattr(mesh.visual, "uv", None) is None
    document = _gltf_json(path.read_bytes())
    assert "textures" not in document and "images" not in document
    assert "TEXCOORD_0" not in document["meshes"][0]["primitives"][0]["attributes"]
    assert result.mesh.report.texture_size == 0 and [s.name for s in result.mesh.report.steps][-2:] == ["normals",
                                                                                                         "glb"]


def test_a_shape_only_plan_is_not_the_full_plan_for_a_kept_pipeline(tiny_cache):
    config = load_config(TINY_CONFIG)
    full = Pixal3D.plan(config, device="cpu")
    shape = Pixal3D.plan(config, device="cpu", until=SHAPE_ONLY)
    assert shape.shape_only and not full.shape_only
    assert not same_plan(full, shape) and same_plan(shape, Pixal3D.plan(config, device="cpu", until=SHAPE_ONLY))
    assert "tex_slat_decoder" not in shape.model_names() and "tex_slat_flow_model_1024" not in shape.model_names()


def test_the_real_shape_only_cascade_plans_within_four_gib_from_headers(hub):
    plan = Pixal3D.plan(REAL, device="cpu", memory_budget="4G", until=SHAPE_ONLY)
    assert [r.name for r in plan.memory.stages] == [*SHARED, "shape_decode", "shape_export"]
    for row in plan.memory.stages:
        assert row.total_bytes + PROCESS_BYTES <= 4 * GIB, row
    assert "tex_slat_flow_model_1024" not in plan.memory.model_bytes
    assert plan.choices()["shape_decode"]["tiles"]["start_level"] >= 1  # tiled within the budget


def test_the_command_plans_only_the_stages_that_run_and_refuses_a_texture_setting(tiny_cache, capsys, tmp_path):
    code, out, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", tmp_path / "o.glb", "--plan",
                             "--shape-only")
    assert code == 0, err
    stages = [line.split()[0] for line in out.splitlines() if line.split()[:1] and line.split()[0] in
              {*SHARED, "texture", "decode", "export", "shape_decode", "shape_export"}]
    assert stages == [*SHARED, "shape_decode", "shape_export"]
    for flag, value, label in (("--texture-size", "512", "texture size"), ("--texture-format", "webp", "texture format")):
        code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", tmp_path / "o.glb", "--shape-only",
                               flag, value)
        assert code == 2
        assert one_error_line(err).endswith(f"error: {flag}: {label} sets the texture, and a shape-only job makes "
                                            f"none: drop one of them")
    assert not (tmp_path / "o.glb").exists()


@pytest.mark.parametrize("shape_only", [True, False])
def test_the_command_says_shape_only_in_run_json(fast_config, capsys, tmp_path, shape_only):
    out = tmp_path / "o.glb"
    code, _, err = run_cli(capsys, EXAMPLE, "--config", fast_config, "-o", out, "--quiet",
                           *(["--shape-only"] if shape_only else []))
    assert code == 0, err
    record = json.loads((tmp_path / "o.run.json").read_text())
    assert record["shape_only"] is shape_only
    assert [s["stage"] for s in record["stages"]][-2:] == (["shape_decode", "shape_export"] if shape_only else
                                                          ["decode", "export"])


def test_shape_only_is_one_setting_row_the_server_and_the_app_take_as_the_command_does(tiny_cache):
    config = load_config(TINY_CONFIG)
    assert Job.from_request({"shape_only": True}, config).shape_only is True
    assert Job.from_request({}, config).settings()["shape_only"] is False  # unset: the full run
    assert Job.from_form({"shape_only": True}, config).shape_only is True
    assert Job.from_form({"shape_only": False}, config).shape_only is False
    for value in ("yes", 1):
        with pytest.raises(SettingsError, match="settings.shape_only must be bool"):
            Job.from_request({"shape_only": value}, config)
    with pytest.raises(SettingsError, match="settings.seed must be int"):
        Job.from_request({"seed": True}, config)  # control: a bool is still no number
    with pytest.raises(SettingsError, match="texture size sets the texture, and a shape-only job makes none"):
        Job.from_request({"shape_only": True, "texture_size": 512}, config)
    assert Job.from_request({"shape_only": True}, config).plan_key() != Job.from_request({}, config).plan_key()
