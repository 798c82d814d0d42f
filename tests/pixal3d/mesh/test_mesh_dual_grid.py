"""Flexible dual grid → mesh: sphere topology/area/orientation and face-for-face parity with a dict reference."""
import numpy as np
import pytest
import torch

from pixal3d.mesh.cleanup import edge_statistics, face_areas, orient_faces
from pixal3d.mesh.dual_grid import dual_grid_to_mesh
from pixal3d.mesh.fields import DualGridFields
from pixal3d.mesh.sparse_index import SparseIndex
from pixal3d.mesh.synthetic import sdf_dual_grid, sphere_sdf

CENTRE = np.array([0.013, -0.021, 0.007])
RADIUS = 0.3


@pytest.fixture(scope="module")
def sphere_mesh():
    fields = sdf_dual_grid(sphere_sdf(CENTRE, RADIUS), 128, project=True)
    return dual_grid_to_mesh(fields)


def test_sphere_is_closed_two_manifold_with_euler_characteristic_two(sphere_mesh):
    v, f = sphere_mesh
    stats = edge_statistics(f)
    assert stats["boundary"] == 0 and stats["non_manifold"] == 0
    assert len(v) - stats["edges"] + len(f) == 2


def test_sphere_area_matches_analytic_within_1e_3(sphere_mesh):
    # Dual vertices projected onto the SDF's zero set (synthetic.sdf_dual_grid): the mesh is then
    # inscribed in the sphere and the deficit is ~1e-4 at R = 128 (mean-of-crossings gives ~4e-4).
    v, f = sphere_mesh
    area = face_areas(v, f).sum()
    assert abs(area / (4 * np.pi * RADIUS**2) - 1) < 1e-3


def test_raw_winding_is_inconsistent_and_orient_faces_makes_it_outward(sphere_mesh):
    v, f = sphere_mesh
    assert edge_statistics(f)["inconsistent"] > 0  # control: the raw per-axis winding is mixed
    oriented = orient_faces(v, f)
    assert edge_statistics(oriented)["inconsistent"] == 0
    p = v.astype(np.float64)[oriented]
    normal = np.cross(p[:, 1] - p[:, 0], p[:, 2] - p[:, 0])
    radial = p.mean(1) - CENTRE
    assert np.all(np.einsum("ij,ij->i", normal, radial) > 0)
    volume = np.einsum("ij,ij->i", p[:, 0] - CENTRE, np.cross(p[:, 1] - CENTRE, p[:, 2] - CENTRE)).sum() / 6
    assert volume == pytest.approx(4 / 3 * np.pi * RADIUS**3, rel=1e-2)


def test_orient_faces_handles_two_components_independently():
    parts = [sdf_dual_grid(sphere_sdf(c, 0.15), 48) for c in ((-0.22, 0, 0), (0.22, 0, 0))]
    meshes = [dual_grid_to_mesh(p) for p in parts]
    v = np.concatenate([meshes[0][0], meshes[1][0]])
    f = np.concatenate([meshes[0][1], meshes[1][1] + len(meshes[0][0])])
    f[: len(meshes[0][1])] = f[: len(meshes[0][1]), ::-1]  # scramble one component
    oriented = orient_faces(v, f)
    p = v.astype(np.float64)[oriented]
    normal = np.cross(p[:, 1] - p[:, 0], p[:, 2] - p[:, 0])
    centre = np.where(p.mean(1)[:, :1] < 0, [-0.22, 0, 0], [0.22, 0, 0])
    assert np.all(np.einsum("ij,ij->i", normal, p.mean(1) - centre) > 0)


# ---- parity with a plain dict implementation of the upstream algorithm ----------------------

OFFSETS = {
    0: [(0, 0, 0), (0, 0, 1), (0, 1, 1), (0, 1, 0)],
    1: [(0, 0, 0), (1, 0, 0), (1, 0, 1), (0, 0, 1)],
    2: [(0, 0, 0), (0, 1, 0), (1, 1, 0), (1, 0, 0)],
}


def reference_faces(coords, flags, weights, *, ties_to_02=False):
    """Dict-based transcription of the upstream quad/split rule, one Python loop per voxel and axis."""
    where = {tuple(c): i for i, c in enumerate(coords.tolist())}
    faces = []
    for axis in range(3):
        for i, c in enumerate(coords.tolist()):
            if not flags[i, axis]:
                continue
            quad = [where.get((c[0] + o[0], c[1] + o[1], c[2] + o[2])) for o in OFFSETS[axis]]
            if any(q is None for q in quad):
                continue
            w = [weights[q] for q in quad]
            use_02 = w[0] * w[2] >= w[1] * w[3] if ties_to_02 else w[0] * w[2] > w[1] * w[3]
            if use_02:
                faces += [[quad[0], quad[1], quad[2]], [quad[0], quad[2], quad[3]]]
            else:
                faces += [[quad[0], quad[1], quad[3]], [quad[3], quad[1], quad[2]]]
    return np.array(faces, dtype=np.int64).reshape(-1, 3)


@pytest.fixture(scope="module")
def random_fields():
    rng = np.random.default_rng(7)
    res = 10
    grid = np.stack(np.meshgrid(*[np.arange(res)] * 3, indexing="ij"), -1).reshape(-1, 3)
    coords = grid[rng.random(len(grid)) < 0.6]  # includes voxels on the grid border
    coords = coords[rng.permutation(len(coords))]
    flags = rng.random((len(coords), 3)) < 0.5
    weights = rng.choice([1.0, 2.0, 4.0], len(coords)).astype(np.float32)  # many exact ties
    fields = DualGridFields(
        coords=torch.from_numpy(coords.astype(np.int32)),
        dual_vertices=torch.from_numpy(rng.uniform(-0.5, 1.5, (len(coords), 3)).astype(np.float32)),
        intersected=torch.from_numpy(flags),
        split_weight=torch.from_numpy(weights),
        resolution=res,
    )
    return fields, coords, flags, weights


def test_vectorized_extraction_equals_dict_reference_face_for_face(random_fields):
    fields, coords, flags, weights = random_fields
    v, f = dual_grid_to_mesh(fields)
    expected = reference_faces(coords, flags, weights)
    assert len(expected) > 100
    np.testing.assert_array_equal(f, expected)
    np.testing.assert_allclose(v, (coords + fields.dual_vertices.numpy()) / 10 - 0.5, rtol=0, atol=1e-6)


def test_parity_control_a_different_tie_rule_is_detected(random_fields):
    fields, coords, flags, weights = random_fields
    _, f = dual_grid_to_mesh(fields)
    assert not np.array_equal(f, reference_faces(coords, flags, weights, ties_to_02=True))


def test_sparse_index_matches_dict_and_rejects_out_of_bounds_and_duplicates(random_fields):
    _, coords, _, _ = random_fields
    index = SparseIndex(coords, 10, brick=4)
    where = {tuple(c): i for i, c in enumerate(coords.tolist())}
    queries = np.random.default_rng(1).integers(-2, 12, (5000, 3))
    expected = [where.get(tuple(q), -1) for q in queries.tolist()]
    np.testing.assert_array_equal(index.lookup(queries), expected)
    with pytest.raises(ValueError, match="duplicate"):
        SparseIndex(np.concatenate([coords, coords[:1]]), 10)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        SparseIndex(coords + 1, 10)


# ---- vertex positions: the reference's float32 expression, bit for bit ----------------------

def _reference_vertices(coords: np.ndarray, offsets: np.ndarray, resolution: int) -> torch.Tensor:
    """TRELLIS.2's inference path in torch float32: voxel_size = (aabb_max − aabb_min) / grid_size,
    then ``(coords + dual) * voxel_size + aabb_min``."""
    aabb = torch.tensor([[-0.5] * 3, [0.5] * 3], dtype=torch.float32)
    voxel_size = (aabb[1] - aabb[0]) / torch.tensor([resolution] * 3, dtype=torch.int32).float()
    return (torch.from_numpy(coords).float() + torch.from_numpy(offsets)) * voxel_size + aabb[0]


@pytest.mark.parametrize("resolution", [48, 1536])
def test_vertices_equal_the_reference_float32_expression_bitwise(resolution):
    from pixal3d.mesh.dual_grid import dual_grid_vertices

    rng = np.random.default_rng(resolution)
    coords = rng.integers(0, resolution, (200_000, 3)).astype(np.int32)
    offsets = rng.uniform(-0.5, 1.5, (200_000, 3)).astype(np.float32)
    ours = dual_grid_vertices(coords, offsets, resolution)
    assert ours.dtype == np.float32
    assert np.array_equal(ours.view(np.int32), _reference_vertices(coords, offsets, resolution).numpy().view(np.int32))
    # control: dividing by R and subtracting 0.5 (the old formula) is off by an ulp somewhere
    divided = (coords.astype(np.float32) + offsets) / np.float32(resolution) - np.float32(0.5)
    assert not np.array_equal(divided, ours)
