"""Normal and occlusion maps: a sphere's baked normals decode to its analytic normals; occlusion sees a roof."""
import numpy as np
import pytest
import torch

from pixal3d.mesh.export import ExportSettings, export_mesh
from pixal3d.mesh.maps import (
    decode_normals,
    hemisphere_directions,
    occupancy_grid,
    vertex_occlusion,
)
from pixal3d.mesh.synthetic import pbr_from_function, sdf_dual_grid, sphere_sdf

RES, SIZE = 64, 256


def _grey(p):
    out = np.full((len(p), 6), 0.5)
    out[:, 5] = 1.0
    return out


@pytest.fixture(scope="module")
def coarse_sphere():
    """A sphere simplified to 400 faces (its interpolated normals are visibly off) with a normal map."""
    fields = sdf_dual_grid(sphere_sdf((0.0, 0.0, 0.0), 0.35), RES)
    settings = ExportSettings(decimation_target=400, texture_size=SIZE, quality_samples=0, occlusion_map=False)
    return export_mesh(fields, pbr_from_function(fields, _grey), settings=settings, progress=False)


def _texel_normals(exported, use_map=True):
    """At each face's centroid: (the analytic normal, the normal a viewer shades with) in the GLB frame."""
    mesh = exported.mesh
    faces = np.asarray(mesh.faces)
    p = np.asarray(mesh.vertices)[faces].mean(1)
    n = np.asarray(mesh.vertex_normals)[faces].mean(1)
    t = np.asarray(mesh.vertex_attributes["TANGENT"])[faces].mean(1)
    t[:, 3] = np.sign(t[:, 3])
    uv = np.asarray(mesh.visual.uv)[faces].mean(1)  # trimesh's v: row 0 of the image at v = 1
    x = np.clip((uv[:, 0] * SIZE).astype(int), 0, SIZE - 1)
    y = np.clip(((1 - uv[:, 1]) * SIZE).astype(int), 0, SIZE - 1)
    image = np.asarray(mesh.visual.material.normalTexture)[..., :3]
    texels = image[y, x] if use_map else np.tile(np.array([128, 128, 255], np.uint8), (len(faces), 1))
    shaded = decode_normals(torch.from_numpy(texels), torch.from_numpy(n), torch.from_numpy(t)).numpy()
    return p / np.linalg.norm(p, axis=1, keepdims=True), shaded


def _angles(a, b):
    return np.degrees(np.arccos(np.clip((a * b).sum(1), -1, 1)))


def test_baked_normals_match_the_spheres_analytic_normals(coarse_sphere):
    analytic, shaded = _texel_normals(coarse_sphere)
    error = _angles(analytic, shaded)
    assert np.median(error) < 1.5 and np.percentile(error, 95) < 4.0, (np.median(error), np.percentile(error, 95))


def test_control_a_flat_normal_map_leaves_the_low_poly_error(coarse_sphere):
    analytic, flat = _texel_normals(coarse_sphere, use_map=False)
    _, shaded = _texel_normals(coarse_sphere)
    assert np.median(_angles(analytic, flat)) > 2 * max(np.median(_angles(analytic, shaded)), 0.5)


def test_glb_has_normal_texture_and_tangents(coarse_sphere):
    from pixal3d.mesh.glb_container import Glb

    gltf = Glb.parse(coarse_sphere.glb).gltf
    assert "normalTexture" in gltf["materials"][0]
    attributes = gltf["meshes"][0]["primitives"][0]["attributes"]
    assert "TANGENT" in attributes and "_TANGENT" not in attributes
    assert gltf["accessors"][attributes["TANGENT"]]["type"] == "VEC4"


def test_occlusion_is_dark_under_a_roof_and_open_elsewhere():
    coords = np.array([[x, y, 40] for x in range(64) for y in range(64)])  # a slab of voxels at z = 40 of 64
    grid, size = occupancy_grid(coords, 64)
    assert size == 64
    below = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.3]])
    normal = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, -1.0], [0.0, 0.0, 1.0]])  # up at the roof, down, above it
    ao = vertex_occlusion(below, normal, grid, rays=32, distance=0.3)
    assert ao[0] < 0.2 and ao[1] == 1.0 and ao[2] == 1.0


def test_occlusion_rays_are_a_cosine_weighted_hemisphere():
    d = hemisphere_directions(256)
    assert torch.allclose(d.norm(dim=1), torch.ones(256), atol=1e-5) and (d[:, 2] > 0).all()
    assert abs(float(d[:, 2].mean()) - 2 / 3) < 0.01  # E[cos θ] of a cosine-weighted hemisphere


def test_occlusion_map_is_the_red_channel_of_the_metallic_roughness_texture():
    fields = sdf_dual_grid(sphere_sdf((0.0, 0.0, 0.0), 0.3), 48)
    exported = export_mesh(fields, pbr_from_function(fields, _grey), progress=False,
                           settings=ExportSettings(decimation_target=600, texture_size=128, quality_samples=0))
    from pixal3d.mesh.glb_container import Glb

    material = Glb.parse(exported.glb).gltf["materials"][0]
    assert material["occlusionTexture"]["index"] == material["pbrMetallicRoughness"]["metallicRoughnessTexture"]["index"]
    red = np.asarray(exported.mesh.visual.material.metallicRoughnessTexture)[..., 0]
    assert red.mean() > 0.9 * 255  # a sphere is open sky everywhere


def test_the_plan_counts_the_maps_where_the_bake_is_the_exports_peak():
    from pipelines.working_set import export_bytes

    small_mesh_big_atlas = {"hr_resolution": 512, "times": 1, "decimation_target": 20_000, "texture_size": 8192}
    plain = export_bytes(**small_mesh_big_atlas)
    assert export_bytes(**small_mesh_big_atlas, normal_map=True, occlusion_map=True) > plain
    release = {"hr_resolution": 1024, "times": 4, "decimation_target": 1_000_000, "texture_size": 4096}
    assert export_bytes(**release, normal_map=True, occlusion_map=True) >= export_bytes(**release)
