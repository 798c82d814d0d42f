"""End to end: a textured cube through export_glb and back through trimesh."""
import json
import struct

import numpy as np
import pytest
import trimesh

from pixal3d.mesh.export import STEPS, ExportSettings, export_glb
from pixal3d.mesh.synthetic import box_sdf, pbr_from_function, sdf_dual_grid

RES = 48
HALF = 0.3
FACE_COLOURS = {  # (axis, sign) → base colour
    (0, 1): (0.9, 0.1, 0.1), (0, -1): (0.1, 0.9, 0.1), (1, 1): (0.1, 0.1, 0.9),
    (1, -1): (0.9, 0.9, 0.1), (2, 1): (0.1, 0.9, 0.9), (2, -1): (0.9, 0.1, 0.9),
}
INTERNAL_TO_GLB = np.diag([-1.0, 1.0, -1.0])


def _cube_colour(p):
    axis = np.abs(p).argmax(1)
    sign = np.sign(p[np.arange(len(p)), axis]).astype(int)
    out = np.empty((len(p), 6))
    for (a, s), rgb in FACE_COLOURS.items():
        out[(axis == a) & (sign == s), :3] = rgb
    out[:, 3], out[:, 4], out[:, 5] = 0.25, 0.75, 1.0
    return out


@pytest.fixture(scope="module")
def cube_fields():
    fields = sdf_dual_grid(box_sdf(HALF), RES)
    return fields, pbr_from_function(fields, _cube_colour)


def _glb_json(path):
    data = path.read_bytes()
    length = struct.unpack("<I", data[12:16])[0]
    return json.loads(data[20 : 20 + length])


@pytest.fixture(scope="module")
def exported(cube_fields, tmp_path_factory):
    path = tmp_path_factory.mktemp("glb") / "cube.glb"
    steps = []
    settings = ExportSettings(decimation_target=3000, texture_size=256)
    report = export_glb(*cube_fields, path, settings=settings, progress=False, on_step=steps.append)
    return path, report, steps


def test_report_and_step_callback_cover_every_step(exported):
    path, report, steps = exported
    assert tuple(steps) == STEPS and [s.name for s in report.steps] == list(STEPS)
    assert report.peak_rss > 0 and all(s.seconds >= 0 for s in report.steps)
    assert abs(report.faces - 3000) <= 0.02 * 3000 and report.file_bytes == path.stat().st_size
    assert "total" in report.table()


def test_glb_material_packing_and_attributes(exported):
    path, _, _ = exported
    gltf = _glb_json(path)
    material = gltf["materials"][0]
    assert material.get("alphaMode", "OPAQUE") == "OPAQUE" and not material.get("doubleSided", False)
    pbr = material["pbrMetallicRoughness"]
    assert "baseColorTexture" in pbr and "metallicRoughnessTexture" in pbr
    assert {"POSITION", "NORMAL", "TEXCOORD_0"} <= set(gltf["meshes"][0]["primitives"][0]["attributes"])
    mesh = trimesh.load(path, force="mesh")
    base = np.asarray(mesh.visual.material.baseColorTexture)
    mr = np.asarray(mesh.visual.material.metallicRoughnessTexture)
    assert base.shape == (256, 256, 4) and mr.shape[:2] == (256, 256)
    assert np.abs(mr[..., 1].astype(int) - 191).max() <= 2  # roughness 0.75 in G
    assert np.abs(mr[..., 2].astype(int) - 64).max() <= 2  # metallic 0.25 in B
    assert base[..., 3].min() == 255


def test_positions_use_the_pixal3d_frame_and_normals_point_outward(exported):
    path, _, _ = exported
    mesh = trimesh.load(path, force="mesh")
    internal = mesh.vertices @ INTERNAL_TO_GLB  # the map is its own inverse
    assert np.abs(np.abs(internal).max(0) - HALF).max() < 1.5 / RES
    normals = mesh.face_normals
    outward = np.einsum("ij,ij->i", normals, mesh.triangles_center)
    assert (outward > 0).mean() > 0.99


def test_texture_colours_match_the_cube_face_colours(exported):
    path, _, _ = exported
    mesh = trimesh.load(path, force="mesh")
    image = np.asarray(mesh.visual.material.baseColorTexture)[..., :3].astype(int)
    centre = mesh.triangles_center @ INTERNAL_TO_GLB
    axis = np.abs(centre).argmax(1)
    others = np.sort(np.abs(centre), axis=1)[:, 1]
    interior = others < HALF - 4 / RES  # away from cube edges, where colours blend across voxels
    uv = mesh.visual.uv[mesh.faces].mean(1)
    # trimesh's loaded v has row 0 at v = 1 (it flipped the stored TEXCOORD_0 back)
    x = np.clip((uv[:, 0] * 256).astype(int), 0, 255)
    y = np.clip(((1 - uv[:, 1]) * 256).astype(int), 0, 255)
    sign = np.sign(centre[np.arange(len(centre)), axis]).astype(int)
    expected = np.array([FACE_COLOURS[(a, s)] for a, s in zip(axis, sign)]) * 255
    error = np.abs(image[y, x] - expected).max(1)
    assert interior.sum() > 500
    assert np.mean(error[interior] <= 3) > 0.98


def test_webp_option_embeds_webp_textures(cube_fields, tmp_path):
    path = tmp_path / "cube_webp.glb"
    export_glb(*cube_fields, path, settings=ExportSettings(decimation_target=800, texture_size=64, texture_format="webp"),
               progress=False)
    assert "EXT_texture_webp" in _glb_json(path).get("extensionsUsed", [])


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    from pixal3d.mesh import glb

    path = tmp_path / "out.glb"
    path.write_bytes(b"old")
    mesh = trimesh.creation.box()
    monkeypatch.setattr(glb.os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        glb.write_glb(mesh, path)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["out.glb"]
    monkeypatch.undo()
    assert glb.write_glb(mesh, path) == path.stat().st_size > 3  # control: the same call succeeds


@pytest.mark.parametrize(
    "kwargs, match",
    [({"exterior_only": True}, "exterior_only"), ({"remesh": True, "remesh_resolution": 8}, "remesh_resolution"),
     ({"remesh": True, "remesh_resolution": 66}, "halve evenly"),
     ({"remesh_band": 0}, "remesh_band"), ({"quality_samples": -1}, "quality_samples"),
     ({"texture_format": "jpg"}, "texture_format"),
     ({"decimation_target": 0}, "decimation_target"), ({"projection": "bvh"}, "projection")],
)
def test_settings_reject_bad_values_with_a_clear_message(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExportSettings(**kwargs)


def test_export_rejects_mismatched_or_empty_inputs(cube_fields, tmp_path):
    import dataclasses

    import torch

    fields, pbr = cube_fields
    with pytest.raises(ValueError, match="resolution"):
        export_glb(fields, dataclasses.replace(pbr, resolution=2 * RES), tmp_path / "a.glb", progress=False)
    empty = dataclasses.replace(
        fields, coords=torch.zeros((0, 3), dtype=torch.int32), dual_vertices=torch.zeros((0, 3)),
        intersected=torch.zeros((0, 3), dtype=torch.bool), split_weight=torch.zeros(0),
    )
    with pytest.raises(ValueError, match="no voxels"):
        export_glb(empty, pbr, tmp_path / "b.glb", progress=False)
    assert not any(tmp_path.iterdir())


def test_written_glb_has_an_ordinary_file_mode_not_the_temporary_files_0600(tmp_path):
    import os
    import stat

    from pixal3d.mesh import glb

    old = os.umask(0o022)
    try:
        path = tmp_path / "mode.glb"
        glb.write_glb(trimesh.creation.box(), path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


@pytest.fixture(scope="module")
def remeshed(cube_fields, tmp_path_factory):
    folder = tmp_path_factory.mktemp("remesh")
    out = {}
    for name, extra in (("both", {}), ("exterior", {"exterior_only": True})):
        settings = ExportSettings(decimation_target=3000, texture_size=256, remesh=True, remesh_resolution=RES,
                                  quality_samples=20_000, **extra)
        out[name] = (folder / f"{name}.glb", export_glb(*cube_fields, folder / f"{name}.glb", settings=settings,
                                                        progress=False))
    return out


def test_remesh_export_is_closed_and_reports_its_quality(remeshed):
    for name, shells in (("both", 2), ("exterior", 1)):
        path, report = remeshed[name]
        quality = report.to_dict()["quality"]  # what run.json receives
        assert quality["boundary_edges"] == 0 and quality["non_manifold_edges"] == 0
        assert quality["components"] == shells and quality["uv_charts"] >= 6
        assert 0.5 < quality["chamfer_vox"] < 1.5  # the contour sits one cell off the decoded surface
        assert [s.name for s in report.steps] == list(STEPS) and report.steps[2].detail["faces"] > 3000


def test_remesh_exterior_shell_faces_outward_and_keeps_the_cube_colours(remeshed):
    path, _ = remeshed["exterior"]
    mesh = trimesh.load(path, force="mesh")
    assert (np.einsum("ij,ij->i", mesh.face_normals, mesh.triangles_center) > 0).mean() > 0.99
    image = np.asarray(mesh.visual.material.baseColorTexture)[..., :3].astype(int)
    centre = mesh.triangles_center @ INTERNAL_TO_GLB
    axis = np.abs(centre).argmax(1)
    interior = np.sort(np.abs(centre), axis=1)[:, 1] < HALF - 4 / RES
    uv = mesh.visual.uv[mesh.faces].mean(1)
    x = np.clip((uv[:, 0] * 256).astype(int), 0, 255)
    y = np.clip(((1 - uv[:, 1]) * 256).astype(int), 0, 255)
    sign = np.sign(centre[np.arange(len(centre)), axis]).astype(int)
    expected = np.array([FACE_COLOURS[(a, s)] for a, s in zip(axis, sign)]) * 255
    assert interior.sum() > 500 and np.mean(np.abs(image[y, x] - expected).max(1)[interior] <= 3) > 0.98


def test_remesh_texels_are_projected_onto_the_pre_remesh_surface(cube_fields, tmp_path):
    """Two cells out (band 2), texels find the PBR voxels only through the projection onto the decoded
    surface: without it no texel has trilinear support."""
    settings = ExportSettings(decimation_target=1500, texture_size=128, remesh=True, remesh_resolution=RES,
                              remesh_band=2, exterior_only=True, quality_samples=0)
    projected = export_glb(*cube_fields, tmp_path / "p.glb", settings=settings, progress=False)
    assert projected.coverage > 0.5 and projected.quality == {}
    import dataclasses

    unprojected = export_glb(*cube_fields, tmp_path / "u.glb", settings=dataclasses.replace(settings, projection=None),
                             progress=False)
    assert unprojected.coverage == 0.0  # control
