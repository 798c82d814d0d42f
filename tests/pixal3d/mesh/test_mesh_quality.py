"""Quality metrics and the surface distance they use: each count checked on a mesh where it is known."""
import numpy as np
import pytest
import trimesh

from pixal3d.mesh.bake import closest_point_on_triangles
from pixal3d.mesh.distance import SurfaceDistance, point_triangle_distance2
from pixal3d.mesh.quality import (
    count_components,
    count_uv_charts,
    edge_counts,
    surface_distances,
)

TETRA = np.array([[0, 2, 1], [0, 1, 3], [1, 2, 3], [0, 3, 2]])


def test_edge_counts_on_meshes_with_known_boundary_and_non_manifold_edges():
    assert edge_counts(np.array([[0, 1, 2]])) == (3, 0)  # one triangle: 3 boundary edges
    assert edge_counts(np.array([[0, 1, 2], [0, 2, 3]])) == (4, 0)  # a square
    assert edge_counts(TETRA) == (0, 0)  # closed
    assert edge_counts(TETRA[1:]) == (3, 0)  # one face removed: a triangular hole
    fan = np.array([[0, 1, 2], [1, 0, 3], [0, 1, 4]])  # three faces on edge (0, 1)
    assert edge_counts(fan) == (6, 1)


def test_components_count_vertex_connected_face_sets():
    two = np.concatenate([TETRA, TETRA + 4])
    assert count_components(8, two) == 2
    joined = np.concatenate([two, [[3, 4, 5]]])  # control: one face bridging them
    assert count_components(8, joined) == 1
    assert count_components(9, two) == 2  # an unreferenced vertex is not a component


def test_uv_charts_are_islands_of_the_seam_split_mesh():
    box = trimesh.creation.box()
    normal = box.face_normals
    axis = np.abs(normal).argmax(1)
    side_of = axis * 2 + (normal[np.arange(12), axis] > 0)
    split = np.zeros((12, 3), np.int64)
    for side in range(6):  # every side gets its own 4 UV vertices
        tris = np.flatnonzero(side_of == side)
        verts, local = np.unique(box.faces[tris], return_inverse=True)
        split[tris] = local.reshape(-1, 3) + 4 * side
        assert len(verts) == 4
    assert count_uv_charts(split, 24) == 6
    assert count_uv_charts(box.faces, 8) == 1  # control: shared UV vertices make one island


def _brute_force_distance(p, vertices, faces):
    tri = vertices[faces].astype(np.float64)
    out = np.empty(len(p))
    for s in range(0, len(p), 64):
        q = closest_point_on_triangles(p[s : s + 64, None], tri[None, :, 0], tri[None, :, 1], tri[None, :, 2])
        out[s : s + 64] = np.sqrt(((q - p[s : s + 64, None]) ** 2).sum(-1)).min(1)
    return out


def test_point_triangle_distance_matches_dense_sampling_including_degenerate_triangles():
    rng = np.random.default_rng(0)
    a, b, c, p = (rng.normal(size=(400, 3)) for _ in range(4))
    b[:20] = a[:20]  # a repeated vertex
    c[20:40] = a[20:40] + 2 * (b[20:40] - a[20:40])  # collinear
    uv = rng.uniform(size=(20000, 2))
    uv[uv.sum(1) > 1] = 1 - uv[uv.sum(1) > 1]
    t = np.linspace(0, 1, 2000)[:, None]
    expected = np.empty(400)
    for i in range(400):
        pts = [a[i] + uv[:, :1] * (b[i] - a[i]) + uv[:, 1:] * (c[i] - a[i])]
        pts += [s + t * (e - s) for s, e in ((a[i], b[i]), (b[i], c[i]), (c[i], a[i]))]  # the edges, densely
        expected[i] = np.sqrt(((np.concatenate(pts) - p[i]) ** 2).sum(1).min())
    got = np.sqrt(point_triangle_distance2(p.T.copy(), a.T.copy(), b.T.copy(), c.T.copy()))
    assert np.all(got <= expected + 1e-9)  # never more than a sampled point of the triangle
    assert np.abs(got - expected).max() < 0.03  # and close to the sampled minimum


@pytest.fixture(scope="module")
def sphere():
    mesh = trimesh.creation.icosphere(subdivisions=4, radius=0.3)
    return mesh.vertices.astype(np.float32), mesh.faces.astype(np.int32)


def test_surface_distance_equals_brute_force_near_the_surface_and_respects_the_upper_bound():
    mesh = trimesh.creation.icosphere(subdivisions=3, radius=0.3)
    v, f = mesh.vertices.astype(np.float32), mesh.faces.astype(np.int32)
    rng = np.random.default_rng(1)
    direction = rng.normal(size=(600, 3))
    p = direction / np.linalg.norm(direction, axis=1, keepdims=True) * rng.uniform(0.24, 0.36, (600, 1))
    exact = _brute_force_distance(p, v, f)
    dist = SurfaceDistance(v, f)
    np.testing.assert_allclose(dist.distance(p), exact, atol=1e-6)
    bounded = dist.distance(p, upper_bound=0.02)
    near = exact < 0.02
    np.testing.assert_allclose(bounded[near], exact[near], atol=1e-6)
    assert np.all(bounded[~near] >= 0.02) and near.any() and (~near).any()


def test_hausdorff_and_chamfer_between_concentric_spheres(sphere):
    v, f = sphere
    reference = SurfaceDistance(v, f)
    hausdorff, chamfer = surface_distances(v * np.float32(1.1), f, reference, samples=5000)
    # faceting: a flat face of the icosphere sits up to r(1 - cos θ) ≈ 2.5e-4·r inside the sphere
    assert hausdorff == pytest.approx(0.03, abs=0.002) and chamfer == pytest.approx(0.03, abs=0.002)
    same_h, same_c = surface_distances(v, f, reference, samples=5000)
    assert same_h < 1e-6 and same_c < 1e-6  # control: identical surfaces


def test_hausdorff_is_two_sided_a_missing_patch_counts(sphere):
    v, f = sphere
    centroid = v[f].mean(1)
    keep = centroid[:, 2] < 0.3 * np.cos(np.radians(30))  # a cap of half-angle 30° cut off
    reference = SurfaceDistance(v, f)
    hausdorff, _ = surface_distances(v, f[keep], reference, samples=20000)
    one_sided = reference.distance(v[f[keep]].mean(1))
    assert one_sided.max() < 1e-6  # what the output alone sees: every point lies on the reference
    assert hausdorff > 0.3 * np.sin(np.radians(30)) * 0.8  # the cap's centre is far from the cut mesh
