"""Texturing a given mesh (issue 45 item 1: ``--mesh``, ``Pixal3D.run(image, mesh=...)``) on the tiny demo weights:
the kind's cascade, the user's mesh kept, a shape-only output textured as the full run would have, bad meshes
refused in one line before any weight is read."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import trimesh

from pipelines import Pixal3D
from pipelines.build import SHAPE_ONLY
from pipelines.inputs.mesh import read_run_mesh
from pixal3d.memory_budget import GIB, PROCESS_BYTES
from pixal3d.mesh.user_mesh import MeshError, read_mesh
from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG, tiny_cache  # noqa: F401
from tests.support.cli import one_error_line, run_cli
from tests.support.header_hub import REAL, hub  # noqa: F401

SEED = 5


def _glb_mesh(path) -> trimesh.Trimesh:
    scene = trimesh.load(path, process=False)
    [mesh] = scene.geometry.values()
    return mesh


@pytest.fixture(scope="module")
def shape_and_full(tiny_cache, tmp_path_factory):  # noqa: F811
    """A shape-only run's GLB and a full run's texture latent, same image and seed."""
    folder = tmp_path_factory.mktemp("mesh_input")
    with Pixal3D.from_config(TINY_CONFIG, device="cpu", until=SHAPE_ONLY) as pipe:
        shape = pipe.run(EXAMPLE, seed=SEED)
        shape.save(folder / "shape.glb")
    with Pixal3D.from_config(TINY_CONFIG, device="cpu") as pipe:
        full = pipe.run(EXAMPLE, seed=SEED)
    return folder / "shape.glb", full.state.tex_latent


def test_the_mesh_cascade_encodes_the_mesh_in_place_of_the_shape_flows(tiny_cache):  # noqa: F811
    plan = Pixal3D.plan(TINY_CONFIG, device="cpu", input_kind="mesh")
    assert [s.name for s in plan.stages] == ["preprocess", "camera", "features", "mesh_encode", "texture",
                                             "mesh_decode", "mesh_export"]
    assert plan.stages[3].needs == ("shape_encoder",) and plan.stages[5].needs == ("tex_slat_decoder",)
    assert "scene_points" in plan.stages[1].outputs


def test_a_shape_only_output_textured_aligned_has_the_full_runs_texture_latent_bit_for_bit(shape_and_full, tmp_path):
    glb, full_latent = shape_and_full
    with Pixal3D.from_config(TINY_CONFIG, device="cpu", input_kind="mesh") as pipe:
        result = pipe.run(EXAMPLE, mesh=glb, seed=SEED)
        assert torch.equal(result.state.tex_latent.coords, full_latent.coords)
        assert torch.equal(result.state.tex_latent.feats, full_latent.feats)
        # control: the same mesh with one vertex moved is no longer the file's own: it is encoded, and the texture
        # latent is another
        mesh = _glb_mesh(glb)
        moved = mesh.vertices.copy()
        moved[0] += 1e-3
        trimesh.Trimesh(moved, mesh.faces, process=False).export(tmp_path / "moved.glb")
        other = pipe.run(EXAMPLE, mesh=tmp_path / "moved.glb", seed=SEED)
    assert read_mesh(glb).extras["note"].matches and not read_mesh(tmp_path / "moved.glb").extras
    assert not torch.equal(other.state.tex_latent.feats[:len(full_latent.feats)], full_latent.feats) \
        or other.state.tex_latent.feats.shape != full_latent.feats.shape


def _uv_sheet(tmp_path):
    """A wavy sheet with its own UVs, written as OBJ."""
    n = 12
    u, v = np.meshgrid(np.linspace(0, 1, n), np.linspace(0, 1, n), indexing="ij")
    vertices = np.stack([u - 0.5, 0.1 * np.sin(6 * u) * np.cos(4 * v), v - 0.5], axis=-1).reshape(-1, 3) * 0.8
    quads = [(i * n + j, (i + 1) * n + j, (i + 1) * n + j + 1, i * n + j + 1) for i in range(n - 1) for j in range(n - 1)]
    faces = np.array([f for a, b, c, d in quads for f in ((a, b, c), (a, c, d))])
    uvs = np.stack([u, v], axis=-1).reshape(-1, 2)
    mesh = trimesh.Trimesh(vertices, faces, process=False, visual=trimesh.visual.TextureVisuals(uv=uvs))
    path = tmp_path / "sheet.obj"
    mesh.export(path)
    return path


def test_the_users_mesh_comes_back_with_its_vertices_faces_and_uvs(tiny_cache, tmp_path):  # noqa: F811
    path = _uv_sheet(tmp_path)
    given = read_mesh(path)
    with Pixal3D.from_config(TINY_CONFIG, device="cpu", input_kind="mesh") as pipe:
        result = pipe.run(EXAMPLE, mesh=path, seed=SEED)
    result.save(tmp_path / "out.glb")
    out = _glb_mesh(tmp_path / "out.glb")
    source = trimesh.load(path, process=False)
    assert np.allclose(out.vertices, source.vertices, atol=1e-6) and np.array_equal(out.faces, source.faces)
    assert np.allclose(out.visual.uv, source.visual.uv, atol=1e-6)  # as trimesh reads both files
    assert np.allclose(given.uvs[:, 1], 1 - source.visual.uv[:, 1])  # the baker's v is glTF's
    image = np.asarray(out.visual.material.baseColorTexture)
    assert result.mesh.report.coverage > 0.5 and image[..., :3].std() > 1  # a texture, not one flat colour


def test_a_mesh_without_uvs_gets_an_atlas_and_keeps_its_positions(shape_and_full, tmp_path):
    ball = trimesh.creation.icosphere(subdivisions=2, radius=0.3)
    ball.export(tmp_path / "ball.ply")
    with Pixal3D.from_config(TINY_CONFIG, device="cpu", input_kind="mesh") as pipe:
        result = pipe.run(EXAMPLE, mesh=tmp_path / "ball.ply", seed=SEED)
    out = result.mesh.mesh
    assert out.visual.uv is not None and len(out.faces) == len(ball.faces)
    # each output vertex is one of the input's (split only at the atlas's seams), as the glTF frame stores it
    glb_frame = np.stack([ball.vertices[:, 0], ball.vertices[:, 1], ball.vertices[:, 2]], axis=1)
    nearest = np.abs(out.vertices[:, None, :] - glb_frame[None]).max(axis=2).min(axis=1)
    assert nearest.max() < 1e-6


BAD = {
    "empty.ply": ((b"ply\nformat ascii 1.0\nelement vertex 0\nelement face 0\nproperty list uchar int vertex_indices\n"
                   b"end_header\n"), "no faces|point cloud|no mesh|cannot be read"),
    "cloud.ply": ((b"ply\nformat ascii 1.0\nelement vertex 3\nproperty float x\nproperty float y\nproperty float z\n"
                   b"end_header\n0 0 0\n0.1 0 0\n0 0.1 0\n"), "point cloud|no faces"),
    "nan.obj": (b"v 0 0 0\nv nan 0 0\nv 0 0.1 0\nf 1 2 3\n", "NaN or infinite"),
    "fin.obj": (b"v 0 0 0\nv 0.1 0 0\nv 0 0.1 0\nv 0 0 0.1\nv 0 0 -0.1\nf 1 2 3\nf 1 2 4\nf 1 2 5\n",
                "edges are non-manifold"),
    "huge.obj": (b"v -2 0 0\nv 2 0 0\nv 0 1 0\nf 1 2 3\n", "outside the \\[-0.5, 0.5\\] cube"),
    "mesh.txt": (b"hello", "not a mesh file"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_mesh_is_refused_in_one_line_before_any_weight_is_read(name, tmp_path, capsys, monkeypatch):
    data, words = BAD[name]
    (tmp_path / name).write_bytes(data)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the released config's weights are not here: a weight read would fail
    code, _, err = run_cli(capsys, EXAMPLE, "--mesh", tmp_path / name, "-o", tmp_path / "out.glb", "--plan")
    line = one_error_line(err)
    assert code != 0 and name in line, line
    assert re.search(words, line), line


def test_a_mesh_with_more_faces_than_the_limit_is_refused(tmp_path, monkeypatch):
    from pixal3d.mesh import user_mesh

    trimesh.creation.icosphere(subdivisions=2, radius=0.3).export(tmp_path / "ball.ply")
    monkeypatch.setattr(user_mesh, "MAX_FACES", 100)
    with pytest.raises(MeshError, match="320 faces, more than 100"):
        read_mesh(tmp_path / "ball.ply")


def test_estimate_with_a_field_of_view_and_a_pose_without_a_mesh_are_refused(tiny_cache, tmp_path, capsys):  # noqa: F811
    trimesh.creation.icosphere(subdivisions=1, radius=0.3).export(tmp_path / "ball.glb")
    code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "--mesh", tmp_path / "ball.glb", "--mesh-pose",
                           "estimate", "--fov", "40", "-o", tmp_path / "o.glb")
    assert code != 0 and "MoGe-2" in one_error_line(err)
    code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "--mesh-pose", "estimate", "-o",
                           tmp_path / "o.glb")
    assert code != 0 and "--mesh" in one_error_line(err)


def test_the_real_mesh_cascade_plans_within_four_gib_from_headers(hub):  # noqa: F811
    plan = Pixal3D.plan(REAL, device="cpu", memory_budget="4G", input_kind="mesh")
    assert [r.name for r in plan.memory.stages] == ["preprocess", "camera", "features", "mesh_encode", "texture",
                                                    "mesh_decode", "mesh_export"]
    assert ("header", "microsoft/TRELLIS.2-4B", "ckpts/shape_enc_next_dc_f16c32_fp16.safetensors") in hub.calls
    for row in plan.memory.stages:
        assert row.total_bytes + PROCESS_BYTES <= 4 * GIB, row
    from math import prod

    from tests.support.header_hub import shape_encoder_entry

    released = sum(2 * prod(shape) for shape in shape_encoder_entry()["tensors"].values())  # F16, from its header
    assert plan.memory.model_bytes["shape_encoder"] == released
    assert plan.choices()["mesh_encode"]["tiles"]["levels"] >= 2  # the encoder over tiles within the budget
    assert "tiles" in plan.choices()["mesh_decode"]
    assert not any(m in plan.memory.model_bytes for m in ("shape_slat_flow_model_1024", "shape_slat_decoder"))


def test_a_batch_on_one_mesh_resumes_from_its_work_dir_with_the_same_fingerprints(shape_and_full, tmp_path):
    from tests.support.batch_fixtures import write_images

    images = write_images(tmp_path / "images")[:2]
    ball = tmp_path / "ball.glb"
    trimesh.creation.icosphere(subdivisions=2, radius=0.3).export(ball)
    with Pixal3D.from_config(TINY_CONFIG, device="cpu", input_kind="mesh", policy="staged") as pipe:
        first = list(pipe.run_batch(images, mesh=ball, work_dir=tmp_path / "work", order="stage"))
        again = list(pipe.run_batch(images, mesh=ball, work_dir=tmp_path / "work", order="stage"))
        other = list(pipe.run_batch(images[:1], mesh=ball, mesh_pose="aligned", seed=SEED + 1,
                                    work_dir=tmp_path / "work"))
    for a, b in zip(first, again):
        assert a.error is None and b.error is None
        assert a.result.fingerprints() == b.result.fingerprints()
        assert all(r.reused for r in b.result.stages) and not any(r.reused for r in a.result.stages)
    assert first[0].result.fingerprints() != first[1].result.fingerprints()  # two images, two textures
    reused = {r.stage for r in other[0].result.stages if r.reused}
    # another seed: the image's stages come back; mesh_encode runs again (it may set the generator: a shape-only note)
    assert reused == {"preprocess", "camera", "features"}


@pytest.fixture(scope="module")
def mesh_eager(tiny_cache):  # noqa: F811
    """The golden's run: eager, up to mesh_decode, on assets/example_mesh.ply (scripts/write_golden.py)."""
    with Pixal3D.from_config(TINY_CONFIG, policy="eager", device="cpu", until="mesh_decode",
                             input_kind="mesh") as pipe:
        return pipe.run(EXAMPLE, mesh=EXAMPLE.parent / "example_mesh.ply").fingerprints()


@pytest.mark.golden
def test_the_mesh_run_gives_this_platforms_golden_fingerprints(mesh_eager):
    from tests.support.cascade_fixtures import golden_or_skip

    assert mesh_eager == golden_or_skip("tiny_mesh")


def test_staged_and_eager_mesh_runs_give_the_same_bits(mesh_eager, tiny_cache):  # noqa: F811
    """The relative check, on every machine: the staged policy's run is the eager one bit for bit."""
    with Pixal3D.from_config(TINY_CONFIG, policy="staged", device="cpu", until="mesh_decode",
                             input_kind="mesh") as pipe:
        staged = pipe.run(EXAMPLE, mesh=EXAMPLE.parent / "example_mesh.ply").fingerprints()
    assert staged == mesh_eager
    assert {"camera", "mesh_encode", "texture", "mesh_decode"} <= set(staged)


def test_normalize_places_a_mesh_outside_the_cube_as_trellis2_does(tiny_cache, tmp_path):  # noqa: F811
    big = trimesh.creation.box((3.0, 1.0, 2.0))
    big.apply_translation((5.0, 1.0, -2.0))
    big.export(tmp_path / "big.obj")
    with pytest.raises(MeshError, match="outside the"):
        read_run_mesh(tmp_path / "big.obj", "aligned")
    with Pixal3D.from_config(TINY_CONFIG, device="cpu", input_kind="mesh") as pipe:
        result = pipe.run(EXAMPLE, mesh=tmp_path / "big.obj", mesh_pose="normalize", seed=SEED)
    pose = result.state.mesh_pose
    placed = pose.apply(result.state.input_mesh.vertices)
    assert np.allclose((placed.max(axis=0) - placed.min(axis=0)).max(), 0.99999)
    assert np.allclose(placed.max(axis=0) + placed.min(axis=0), 0, atol=1e-9)  # centred
    out = result.mesh.mesh  # the file keeps the user's coordinates
    assert np.allclose(out.vertices.min(axis=0), big.vertices.min(axis=0)) and result.mesh.report.coverage > 0.5


def test_estimate_places_the_mesh_by_the_cameras_points_end_to_end(tiny_cache, tmp_path):  # noqa: F811
    """``--mesh-pose estimate`` through the cascade: a camera stage standing in for MoGe-2 gives the points a depth
    camera sees of the mesh in a known pose; mesh_encode recovers it (residual < 2 voxels) and textures the mesh."""
    from pipelines.camera import CameraStage
    from pixal3d.models.camera import camera_from_degrees
    from tests.support.meshes import lamp, rotation, scene_points

    mesh = lamp()
    mesh.apply_translation(-mesh.bounds.mean(axis=0))  # centred, as the preprocessed image centres the object
    mesh.export(tmp_path / "lamp.glb")
    given = read_mesh(tmp_path / "lamp.glb")  # the grid frame the stage sees
    camera = camera_from_degrees(49.1)
    scene = scene_points(trimesh.Trimesh(given.vertices, given.faces, process=False), rotation(0.5, 0.2), 0.9,
                   np.array([0.02, 0.0, -0.01]))

    class SeenCamera(CameraStage):
        outputs = ("camera", "scene_points")

        def run(self, state, models):
            state.camera, state.scene_points = camera, torch.from_numpy(scene.points)

    stand_in = SeenCamera(None, use_moge=False)
    with Pixal3D.from_config(TINY_CONFIG, device="cpu", input_kind="mesh", replace={"camera": stand_in}) as pipe:
        result = pipe.run(EXAMPLE, mesh=tmp_path / "lamp.glb", mesh_pose="estimate", seed=SEED)
    assert result.state.mesh_pose.kind == "estimate" and result.state.mesh_pose.residual < 2.0
    assert result.mesh.report.coverage > 0.5 and result.record()["mesh"]["pose"] == "estimate"


def test_estimate_on_points_that_are_not_the_mesh_is_one_line(tiny_cache, tmp_path, capsys):  # noqa: F811
    """The tiny MoGe-2's random points look like no mesh: the command stops with the residual, in one line."""
    code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "--mesh", EXAMPLE.parent / "example_mesh.ply",
                           "--mesh-pose", "estimate", "-o", tmp_path / "o.glb", "--quiet")
    assert code == 1 and re.search(r"residual \d+\.\d voxels, more than 24", one_error_line(err))
    assert not (tmp_path / "o.glb").exists()
