"""The export's lighter steps (issue 48, item 3) give what their whole-array forms gave, with less memory.

Each rewritten helper is checked against the whole-array rule it replaces (restated here) on meshes with
duplicate faces, both windings and boundaries, at chunk sizes that split faces' corners across chunks; and its
peak allocation (numpy reports its buffers to ``tracemalloc``) against that rule's.
"""
import tracemalloc

import numpy as np
import pytest

from pixal3d.mesh.cleanup import (
    EdgeTable,
    boundary_half_edges,
    fill_small_holes,
    remove_duplicate_faces,
)
from pixal3d.mesh.distance import SurfaceDistance, incident_faces


def _soup(vertices: int, faces: int, seed: int) -> np.ndarray:
    """Random faces plus re-wound and rotated copies of some of them (duplicates either way)."""
    rng = np.random.default_rng(seed)
    f = rng.integers(0, vertices, (faces, 3)).astype(np.int32)
    f = f[(f[:, 0] != f[:, 1]) & (f[:, 1] != f[:, 2]) & (f[:, 2] != f[:, 0])]
    return np.concatenate([f, f[: len(f) // 5][:, [1, 2, 0]], f[: len(f) // 7][:, [0, 2, 1]]])


def _grid_mesh(n: int) -> tuple[np.ndarray, np.ndarray]:
    """An n×n grid of quads (two triangles each) with one quad in 16 left out: boundaries inside and around."""
    y, x = np.mgrid[0 : n + 1, 0 : n + 1]
    v = np.stack([x.ravel(), y.ravel(), np.zeros(x.size)], 1).astype(np.float32) / n
    row, col = np.mgrid[0:n, 0:n]
    i = (row * (n + 1) + col)[(row % 4 != 1) | (col % 4 != 1)]  # holes one quad wide, none touching another
    f = np.concatenate([np.stack([i, i + 1, i + n + 2], 1), np.stack([i, i + n + 2, i + n + 1], 1)])
    return v, f.astype(np.int32)


def _table_boundary(faces: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    table = EdgeTable.build(faces)
    h = table.half_edges_of(1)[:, 0]
    return table.u[h].astype(np.int64), table.v[h].astype(np.int64)


def _whole_duplicates(faces: np.ndarray) -> np.ndarray:
    s = np.sort(faces, axis=1)
    order = np.lexsort((s[:, 2], s[:, 1], s[:, 0]))
    s = s[order]
    dup = np.zeros(len(faces), bool)
    dup[order[1:]] = np.all(s[1:] == s[:-1], axis=1)
    return faces[~dup]


def _peak(fn, *args, **kwargs) -> int:
    tracemalloc.start()
    try:
        fn(*args, **kwargs)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(("vertices", "faces", "chunk"), [(30, 200, 21), (400, 3000, 3 << 21), (2000, 500, 9)])
def test_boundary_half_edges_are_the_edge_tables_single_edges_in_its_order(vertices, faces, chunk):
    f = _soup(vertices, faces, seed=vertices)
    u, v = boundary_half_edges(f, chunk=chunk)
    want_u, want_v = _table_boundary(f)
    assert len(u) > 0 and len(u) < 3 * len(f)  # control: neither none nor every half-edge
    np.testing.assert_array_equal(u, want_u)
    np.testing.assert_array_equal(v, want_v)


def test_boundary_half_edges_of_a_closed_mesh_are_none():
    _, f = _grid_mesh(4)
    closed = np.concatenate([f, f[:, [0, 2, 1]]])  # both sides: every edge used twice or more
    assert len(boundary_half_edges(closed)[0]) == 0
    assert len(boundary_half_edges(f)[0]) == len(_table_boundary(f)[0]) > 0


def test_hole_filling_is_unchanged_and_its_edge_search_holds_less_memory():
    v, f = _grid_mesh(300)
    _, filled_f = fill_small_holes(v, f, max_perimeter=0.05)
    assert len(filled_f) > len(f)  # the missing quads were closed
    # the same fans as through the edge table: the boundary half-edges come in the same order
    u, w = boundary_half_edges(f)
    np.testing.assert_array_equal(np.stack([u, w]), np.stack(_table_boundary(f)))
    assert _peak(boundary_half_edges, f, chunk=3 << 12) < 0.5 * _peak(EdgeTable.build, f)


@pytest.mark.parametrize("chunk", [1, 2, 7, 1 << 20])
def test_duplicate_removal_in_chunks_is_the_whole_array_rule(chunk):
    f = _soup(300, 4000, seed=chunk)
    kept = remove_duplicate_faces(f, chunk=chunk)
    assert len(kept) < len(f)  # control: the soup has duplicates
    np.testing.assert_array_equal(kept, _whole_duplicates(f))


def test_duplicate_removal_holds_less_than_the_whole_array_rule():
    f = _soup(100_000, 600_000, seed=3)
    assert _peak(remove_duplicate_faces, f, chunk=1 << 16) < 0.9 * _peak(_whole_duplicates, f)


@pytest.mark.parametrize("chunk", [1, 5, 64, 1 << 22])
def test_incident_faces_are_the_stable_argsort_of_the_corners(chunk):
    f = _soup(500, 3000, seed=chunk)
    owner = f.reshape(-1)
    start = np.zeros(501, np.int64)
    np.cumsum(np.bincount(owner, minlength=500), out=start[1:])
    want = (np.argsort(owner, kind="stable") // 3).astype(np.int32)
    np.testing.assert_array_equal(incident_faces(owner, start, chunk=chunk), want)
    shuffled = incident_faces(owner[::-1].copy(), start, chunk=chunk)
    assert not np.array_equal(shuffled, want)  # control: the order of the corners matters


def test_surface_distance_builds_its_incidence_without_a_corner_permutation():
    v, f = _grid_mesh(300)
    owner = f.reshape(-1)

    def argsort_incidence():  # the rule it replaces: a stable argsort of every corner, divided in chunks
        order = np.argsort(owner, kind="stable")
        out = np.empty(len(order), np.int32)
        for s in range(0, len(order), 1 << 14):
            out[s : s + (1 << 14)] = order[s : s + (1 << 14)] // 3
        return out

    dist = SurfaceDistance(v, f)
    np.testing.assert_array_equal(dist.incident, argsort_incidence())
    assert _peak(incident_faces, owner, dist.start, chunk=1 << 14) < 0.6 * _peak(argsort_incidence)


def test_voxel_normals_take_gives_on_and_releases_the_field():
    from pixal3d.mesh.maps import VoxelNormals
    from pixal3d.mesh.sparse_index import SparseIndex

    v, f = _grid_mesh(8)
    coords = np.stack([np.arange(len(v)) % 9, np.arange(len(v)) // 9, np.zeros(len(v), int)], 1).astype(np.int32)
    field = VoxelNormals(v, f, coords, resolution=16)
    index = SparseIndex(coords[::-1].copy(), 16)
    want = field.on(index)
    np.testing.assert_array_equal(field.take(index), want)
    assert field.normals is None and field.coords is None
    with pytest.raises(TypeError):
        field.on(index)



def test_vertices_of_no_face_stay_out_of_the_distance_index():
    """Where every vertex has a face the index keeps no vertex list (the tree's rows are the vertices); where some
    have none (here placed nearer the queries than the surface), they are left out of the tree, and the distances
    are those of the mesh without them."""
    from pixal3d.mesh.cleanup import clean_mesh
    from pixal3d.mesh.distance import SurfaceDistance
    from pixal3d.mesh.dual_grid import dual_grid_to_mesh
    from pixal3d.mesh.synthetic import sdf_dual_grid, sphere_sdf

    v, f = clean_mesh(*dual_grid_to_mesh(sdf_dual_grid(sphere_sdf((0, 0, 0), 0.3), 48)), max_hole_perimeter=3e-2,
                      min_component_area=1e-5)
    points = np.random.default_rng(2).uniform(-0.45, 0.45, (5000, 3))
    whole = SurfaceDistance(v, f)
    assert whole.tree_ids is None and whole.start.dtype == np.int32
    stray = points[:300].astype(np.float32) * 0.999  # no face: must not be found as anyone's nearest vertex
    with_stray = SurfaceDistance(np.concatenate([stray, v]), f + len(stray))
    assert len(with_stray.tree_ids) == len(v)
    assert np.array_equal(with_stray.distance(points), whole.distance(points))
    # control: a face on the stray vertices changes the distances near them, so the comparison can fail
    touched = SurfaceDistance(np.concatenate([stray, v]), np.r_[f + len(stray), [[0, 1, 2]]])
    assert not np.array_equal(touched.distance(points), whole.distance(points))


def _bumpy_mesh(seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """A random mesh over a jittered grid, with zero-area faces (a repeated vertex) among its faces."""
    rng = np.random.default_rng(seed)
    v, f = _grid_mesh(24)
    v = v + rng.normal(0, 0.01, v.shape).astype(np.float32)
    f = f.copy()
    f[::37, 2] = f[::37, 1]  # degenerate: zero area, a flat run in the CDF
    return v, f


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_surface_samples_walk_the_area_cdf_in_chunks_as_the_whole_cdf(chunk):
    from pixal3d.mesh.cleanup import face_areas
    from pixal3d.mesh.quality import sample_surface

    v, f = _bumpy_mesh()

    def whole(vertices, faces, count, rng):  # the rule it replaces: one face-sized CDF, searchsorted over it
        cdf = np.cumsum(face_areas(vertices, faces))
        face = np.minimum(np.searchsorted(cdf, rng.uniform(0, cdf[-1], count)), len(faces) - 1)
        u, w = rng.uniform(size=(2, count))
        flip = u + w > 1
        u, w = np.where(flip, 1 - u, u), np.where(flip, 1 - w, w)
        a, b, c = (vertices[faces[face, k]].astype(np.float64) for k in range(3))
        return a + u[:, None] * (b - a) + w[:, None] * (c - a)

    got = sample_surface(v, f, 5000, np.random.default_rng(0), chunk=chunk)
    assert np.array_equal(got, whole(v, f, 5000, np.random.default_rng(0)))
    # control: other faces (the same ones in another order) give other points, so the comparison can fail
    assert not np.array_equal(got, whole(v, f[::-1], 5000, np.random.default_rng(0)))


def test_the_projectors_vertex_normals_are_normalised_in_chunks_as_whole():
    from pixal3d.mesh.bake import SurfaceProjector

    v, f = _bumpy_mesh()
    f = np.concatenate([f, f[:50, [0, 2, 1]]])  # some faces both ways: the sign alignment matters
    got = SurfaceProjector._aligned_normals(v, f, chunk=100)
    whole = SurfaceProjector._aligned_normals(v, f, chunk=1 << 20)
    assert got.dtype == np.float32 and np.array_equal(got, whole)
    # the rule it replaces, on the sums: the quotient of every row at once, then float32
    sums = np.zeros((len(v), 3))
    ref = np.zeros(len(v), np.int64)
    ref[f.reshape(-1)] = np.repeat(np.arange(len(f)), 3)
    ref_normal = np.cross(v[f[ref, 1]] - v[f[ref, 0]], v[f[ref, 2]] - v[f[ref, 0]])
    n = np.cross(v[f[:, 1]] - v[f[:, 0]], v[f[:, 2]] - v[f[:, 0]])
    for k in range(3):
        sign = np.where(np.einsum("ij,ij->i", n, ref_normal[f[:, k]]) < 0, -1.0, 1.0)
        for c in range(3):
            sums[:, c] += np.bincount(f[:, k], weights=sign * n[:, c], minlength=len(v))
    rule = (sums / np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-30)).astype(np.float32)
    assert np.array_equal(got, rule)
    # control: without the sign alignment the normals differ, so the comparison can fail
    plain = np.zeros((len(v), 3))
    for k in range(3):
        for c in range(3):
            plain[:, c] += np.bincount(f[:, k], weights=n[:, c], minlength=len(v))
    plain = (plain / np.maximum(np.linalg.norm(plain, axis=1, keepdims=True), 1e-30)).astype(np.float32)
    assert not np.array_equal(got, plain)


def test_the_bakes_brick_size_does_not_change_a_lookup():
    from pixal3d.mesh.sparse_index import SparseIndex

    rng = np.random.default_rng(4)
    coords = np.unique(rng.integers(0, 64, (20_000, 3)), axis=0)
    query = rng.integers(-2, 66, (50_000, 3))
    small, large = SparseIndex(coords, 64, brick=4), SparseIndex(coords, 64, brick=8)
    found = small.lookup(query)
    assert np.array_equal(found, large.lookup(query)) and (found >= 0).any() and (found < 0).any()
    assert np.array_equal(coords[found[found >= 0]], query[found >= 0])


@pytest.mark.parametrize("chunk", [64, 1 << 20])
def test_the_band_search_measures_each_levels_children_a_chunk_at_a_time_as_whole(chunk):
    from pixal3d.mesh.dual_grid import dual_grid_to_mesh
    from pixal3d.mesh.narrow_band import RemeshGrid, band_parents, children
    from pixal3d.mesh.synthetic import blobby_sdf, sdf_dual_grid

    v, f = dual_grid_to_mesh(sdf_dual_grid(blobby_sdf(1.0, 0), 64, project=False))
    udf, grid = SurfaceDistance(v, f), RemeshGrid(64)

    def whole():  # the rule it replaces: every candidate of a level and its distance at once
        axis = np.arange(grid.levels()[0], dtype=np.int32)
        cells = np.stack(np.meshgrid(axis, axis, axis, indexing="ij"), -1).reshape(-1, 3)
        free = []
        for i, n in enumerate(grid.levels()):
            size, step = grid.scale / n, grid.resolution // n
            d = udf.distance(grid.to_world((cells + 0.5) * step), upper_bound=grid.eps + 0.87 * size, coherent=True)
            keep = np.abs(d - grid.eps) < 0.87 * size
            far = cells[~keep & (d > grid.eps)].astype(np.int64)
            free.append((n, np.sort((far[:, 0] * n + far[:, 1]) * n + far[:, 2])))
            cells = cells[keep]
            if i + 1 < len(grid.levels()):
                cells = children(cells)
        return cells[np.lexsort((cells[:, 2], cells[:, 1], cells[:, 0]))], free

    parents, free = band_parents(udf, grid, keep_free=True, chunk=chunk)
    want, want_free = whole()
    assert len(parents) > 1000 and np.array_equal(parents, want)
    assert [n for n, _ in free] == [n for n, _ in want_free]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(free, want_free, strict=True))
    assert np.array_equal(band_parents(udf, grid, chunk=chunk)[0], want)  # and without the free cells
    # control: a narrower band keeps fewer cells, so the comparison can fail
    assert len(band_parents(udf, RemeshGrid(64, 0.5), chunk=chunk)[0]) != len(want)
