"""Simplification hits its face budget; the UV atlas stays in [0, 1] with no overlapping charts."""
import numpy as np
import pytest

from pixal3d.mesh.cleanup import clean_mesh, edge_statistics, fill_small_holes
from pixal3d.mesh.dual_grid import dual_grid_to_mesh
from pixal3d.mesh.simplify import cluster_decimate, simplify_mesh
from pixal3d.mesh.synthetic import sdf_dual_grid, sphere_sdf
from pixal3d.mesh.uv import uv_unwrap

RES = 64


@pytest.fixture(scope="module")
def sphere():
    v, f = dual_grid_to_mesh(sdf_dual_grid(sphere_sdf((0, 0, 0), 0.3), RES))
    return clean_mesh(v, f, max_hole_perimeter=3e-2, min_component_area=1e-5)


@pytest.mark.parametrize("target", [5000, 1500])
def test_simplification_hits_the_target_within_one_percent(sphere, target):
    v, f = simplify_mesh(*sphere, target, voxel_size=1 / RES)
    assert abs(len(f) - target) <= 0.01 * target
    radius = np.linalg.norm(v, axis=1)
    assert np.abs(radius - 0.3).max() < 2 / RES


def test_clustering_prepass_reduces_a_large_input_before_qem(sphere):
    _, f = cluster_decimate(*sphere, 2 / RES)
    assert len(f) < len(sphere[1]) / 3
    _, f2 = simplify_mesh(*sphere, 2000, voxel_size=1 / RES, prepass="cluster", prepass_above=1.5)
    assert abs(len(f2) - 2000) <= 20


def test_fill_small_holes_closes_small_loops_only(sphere):
    v, f = sphere
    centroid = v[f].mean(1)
    near_pole = np.linalg.norm(centroid - [0, 0, 0.3], axis=1) < 0.02  # a small cap
    big_cap = np.linalg.norm(centroid - [0, 0, -0.3], axis=1) < 0.15  # a large one
    holed = f[~near_pole & ~big_cap]
    _, f2 = fill_small_holes(v, holed, 0.2)
    stats = edge_statistics(f2)
    assert 0 < stats["boundary"] == edge_statistics(f[~big_cap])["boundary"]


def _overlap_count(uvs, faces, size, shrink=1e-3):
    """Texels strictly inside more than one UV triangle (a plain per-face loop over bounding boxes)."""
    count = np.zeros((size, size), np.int32)
    tri = uvs[faces] * size - 0.5
    for t in tri:
        lo = np.maximum(np.ceil(t.min(0)).astype(int), 0)
        hi = np.minimum(np.floor(t.max(0)).astype(int), size - 1)
        if np.any(hi < lo):
            continue
        ys, xs = np.mgrid[lo[1] : hi[1] + 1, lo[0] : hi[0] + 1]
        q = np.stack([xs, ys], -1) - t[0]
        e1, e2 = t[1] - t[0], t[2] - t[0]
        det = e1[0] * e2[1] - e1[1] * e2[0]
        if abs(det) < 1e-12:
            continue
        b1 = (q[..., 0] * e2[1] - q[..., 1] * e2[0]) / det
        b2 = (e1[0] * q[..., 1] - e1[1] * q[..., 0]) / det
        inside = (b1 > shrink) & (b2 > shrink) & (b1 + b2 < 1 - shrink)
        count[ys[inside], xs[inside]] += 1
    return int((count > 1).sum()), count


def test_uv_atlas_is_in_unit_square_without_overlapping_charts(sphere):
    v, f = simplify_mesh(*sphere, 3000, voxel_size=1 / RES)
    uv = uv_unwrap(v, f, cell=8 * np.linalg.norm(v[f[:, 1]] - v[f[:, 0]], axis=1).mean())
    assert uv.uvs.min() >= 0 and uv.uvs.max() <= 1
    assert uv.chart_count > 1 and len(uv.faces) == len(f)
    np.testing.assert_array_equal(uv.vertex_map[uv.faces], f)  # same faces, split along seams
    overlaps, count = _overlap_count(uv.uvs, uv.faces, 512)
    assert overlaps == 0 and (count > 0).mean() > 0.3
    # control: move one triangle onto another one's place and the raster test must see it
    broken = uv.uvs.copy()
    broken[uv.faces[0]] = uv.uvs[uv.faces[len(f) // 2]]
    assert _overlap_count(broken, uv.faces, 512)[0] > 0


def test_tiled_prepass_keeps_a_closed_mesh_closed_and_manifold(sphere):
    v, f = simplify_mesh(*sphere, 1500, voxel_size=1 / RES, prepass_above=2.0, max_tile_faces=4000)
    stats = edge_statistics(f)
    assert abs(len(f) - 1500) <= 15
    assert stats["boundary"] == 0 and stats["non_manifold"] == 0
    assert len(v) - stats["edges"] + len(f) == 2


def test_xatlas_binding_maps_normals_and_uvs_keywords_to_the_right_slots():
    # An old xatlas-python bound the Python names of uvs/normals in the opposite order; uv.py passes
    # every argument by keyword, so pin that the names land where they say.
    import xatlas

    p = np.array([[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 1, 0]], np.float32)
    i = np.array([[0, 1, 2], [0, 2, 3]], np.uint32)
    n = np.tile(np.array([[0, 0, 1]], np.float32), (4, 1))
    uv = np.array([[0, 0], [0.5, 0], [0.5, 0.25], [0, 0.25]], np.float32)  # a 2:1 chart
    atlas = xatlas.Atlas()
    atlas.add_mesh(positions=p, indices=i, normals=n, uvs=uv)
    options = xatlas.ChartOptions()
    options.use_input_mesh_uvs = True
    atlas.generate(chart_options=options)
    assert atlas.atlas_count == 1 and atlas.width / atlas.height == pytest.approx(2, rel=0.05)
    with pytest.raises(ValueError, match="Nx3"):  # control: swapped arrays are rejected
        xatlas.Atlas().add_mesh(positions=p, indices=i, normals=uv, uvs=n)


def test_remove_face_pairs_drops_both_sides_of_a_flattened_bubble():
    from pixal3d.mesh.cleanup import edge_statistics, remove_duplicate_faces, remove_face_pairs

    tetra = np.array([[0, 2, 1], [0, 1, 3], [1, 2, 3], [0, 3, 2]])
    bubble = np.array([[4, 5, 6], [4, 6, 5]])  # a closed component squeezed to two opposite faces
    faces = np.concatenate([tetra, bubble])
    assert np.array_equal(remove_face_pairs(faces), tetra)
    assert edge_statistics(remove_duplicate_faces(faces))["boundary"] == 3  # control: one side left open
