"""Mesh → flexible dual grid (``pixal3d.mesh.voxelize``): against analytic SDFs always, against TRELLIS.2's own
C++ converter (compiled on the fly by ``tests/support/trellis2_voxelize.py``) when its source and Eigen are here."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import trimesh
from scipy.spatial import cKDTree

from pixal3d.mesh import voxelize as vz
from pixal3d.mesh.dual_grid import dual_grid_to_mesh
from pixal3d.mesh.fields import DualGridFields
from pixal3d.mesh.synthetic import sphere_sdf, torus_sdf
from tests.support import trellis2_voxelize as ref

CENTRE = (0.013, -0.021, 0.007)
ROTATION = trimesh.transformations.rotation_matrix(0.3, [1, 2, 3])[:3, :3]
HALF = np.array([0.25, 0.2, 0.3])


def rotated_box_sdf(p: np.ndarray) -> np.ndarray:
    q = np.abs(p @ ROTATION) - HALF  # the box's frame (ROTATION maps box → world)
    return np.linalg.norm(np.maximum(q, 0.0), axis=-1) + np.minimum(q.max(axis=-1), 0.0)


def sphere_mesh(subdivisions=5):
    m = trimesh.creation.icosphere(subdivisions=subdivisions, radius=0.3)
    return np.asarray(m.vertices) + CENTRE, np.asarray(m.faces)


def box_mesh():
    m = trimesh.creation.box(extents=2 * HALF)
    return np.asarray(m.vertices) @ ROTATION.T, np.asarray(m.faces)


def torus_mesh():
    m = trimesh.creation.torus(major_radius=0.28, minor_radius=0.1, major_sections=128, minor_sections=64)
    return np.asarray(m.vertices), np.asarray(m.faces)


def open_bowl_mesh():
    """A sphere cut below z = 0.1: a mesh with a boundary (the boundary term acts)."""
    m = trimesh.creation.icosphere(subdivisions=3, radius=0.35)
    m.update_faces(m.triangles_center[:, 2] < 0.1)
    m.remove_unreferenced_vertices()
    return np.asarray(m.vertices), np.asarray(m.faces)


def grid_aligned_open_box():
    """Corners on grid lines at R = 64 and 256, an open top (boundary edges along grid lines: the DDA's ties),
    and two degenerate faces."""
    m = trimesh.creation.box(extents=[0.5, 0.375, 0.25])
    m.update_faces(m.face_normals[:, 2] < 0.5)
    m.remove_unreferenced_vertices()
    return np.asarray(m.vertices), np.concatenate([np.asarray(m.faces), [[0, 0, 1], [1, 2, 1]]])


def soup_on_cube_faces(seed=0, n=300):
    """Random triangles in the cube: some with vertices on grid points, some on its faces (x = 0.5, y = -0.5),
    some duplicated with the other winding."""
    rng = np.random.default_rng(seed)
    v = np.clip(rng.uniform(-0.5, 0.5, (n, 1, 3)) + rng.normal(0, 0.08, (n, 3, 3)), -0.5, 0.5)
    v[:5] = np.round(v[:5] * 64) / 64
    v[5:10, :, 0] = 0.5
    v[10:15, :, 1] = -0.5
    f = np.arange(3 * n).reshape(-1, 3)
    return v.reshape(-1, 3), np.concatenate([f, f[:20, [0, 2, 1]]])


# (mesh, analytic SDF, resolution, band in world units where the mesh and the SDF may disagree: tessellation)
SHAPES = {
    "sphere": (sphere_mesh, sphere_sdf(CENTRE, 0.3), 128, 2e-4),
    "box": (box_mesh, rotated_box_sdf, 64, 1e-6),
    "torus": (torus_mesh, torus_sdf((0, 0, 0), 0.28, 0.1), 96, 3e-4),  # 96: a voxel size that is not 2^-k
}


@pytest.fixture(scope="module", params=list(SHAPES))
def shape(request):
    build, sdf, r, band = SHAPES[request.param]
    v, f = build()
    return SimpleNamespace(v=v, f=f, sdf=sdf, r=r, band=band, fields=vz.mesh_to_dual_grid(v, f, r, progress=False))


def corner_sdf(sdf, r):
    g = np.arange(r + 1) / r - 0.5
    return sdf(np.stack(np.meshgrid(g, g, g, indexing="ij"), axis=-1))  # [R+1]^3 at grid corners


def flag_mismatches(fields, sdf, r, band, owner_shift=0):
    """Grid edges where the flags and the SDF's sign changes disagree, away from tangencies.

    Voxel (i, j, k) owns, per axis, the edge through its max corner in the other two axes; a non-zero
    ``owner_shift`` moves the owner that many more voxels along the other two axes (a wrong convention)."""
    s = corner_sdf(sdf, r)
    coords = fields.coords.numpy().astype(np.int64)
    flags = fields.intersected.numpy()
    mismatches = 0
    for a in range(3):
        lo, hi = np.take(s, np.arange(r), axis=a), np.take(s, np.arange(1, r + 1), axis=a)  # edges along a
        change = np.sign(lo) != np.sign(hi)
        # Clear of tangencies: a sign change with both ends out of the band (one crossing), or no sign change
        # with |s(a)| + |s(b)| beyond the edge's length (a distance function cannot reach zero between them).
        clear = np.where(change, (np.abs(lo) > band) & (np.abs(hi) > band),
                         np.abs(lo) + np.abs(hi) > 1 / r + 2 * band)
        start = np.argwhere(clear & change)  # the crossing edges' start corners (x, y, z)
        others = np.arange(3) != a
        expected = set(map(tuple, start - others * (1 + owner_shift)))
        corner = coords[flags[:, a]] + others * (1 + owner_shift)  # each flag's edge under that convention
        inside = np.all((corner >= 0) & (corner < np.array(clear.shape)), axis=1)
        corner = corner[inside]
        away = clear[tuple(corner.T)]
        got = set(map(tuple, corner[away] - others * (1 + owner_shift)))
        mismatches += len(got ^ expected)
    return mismatches


def test_flags_are_the_sdf_sign_changes_on_owned_edges(shape):
    assert shape.fields.intersected.any()
    assert flag_mismatches(shape.fields, shape.sdf, shape.r, shape.band) == 0


def test_control_shifted_owner_breaks_the_flag_check(shape):
    assert flag_mismatches(shape.fields, shape.sdf, shape.r, shape.band, owner_shift=1) > 100


def test_dual_vertices_lie_in_their_voxels_and_near_the_surface(shape):
    fields, sdf, r = shape.fields, shape.sdf, shape.r
    offsets = fields.dual_vertices.numpy()
    assert fields.coords.dtype == torch.int32 and offsets.dtype == np.float32
    # The reference's voxel is [c·fl(1/R), (c+1)·fl(1/R)] in float32: [c, c+1] to ~R float32 ulps of 1.
    slack = r * 2.0**-23  # exact where R is a power of two; measured 3.8e-6 at R = 96
    assert offsets.min() >= -slack and offsets.max() <= 1 + slack
    world = (fields.coords.numpy() + offsets.astype(np.float64)) / r - 0.5
    dist = np.abs(sdf(world)) * r
    assert dist.max() < 0.1  # measured: sphere 0.011, box 0.048, torus 0.027 voxels


def test_dual_grid_mesh_of_the_result_is_close_to_the_input(shape):
    # Hausdorff distance in voxels between the input and our dual_grid.py mesh of the result, both ways on
    # samples: output → input by the analytic SDF at 400k points of the output (the mesh is within the
    # tessellation band of it), input → output by the nearest of those points (an upper bound, which adds the
    # samples' spacing, ~0.2 voxel). Measured: out → in 0.012 / 0.16 / 0.027, in → out 0.37 / 0.23 / 0.30
    # (sphere / box / torus).
    fields, sdf, r = shape.fields, shape.sdf, shape.r
    mv, mf = dual_grid_to_mesh(fields)
    out = trimesh.Trimesh(mv, mf, process=False).sample(400_000, seed=0).astype(np.float64)
    dense = trimesh.Trimesh(shape.v, shape.f, process=False).sample(20_000, seed=0)
    assert np.abs(sdf(out)).max() * r < 0.25
    assert cKDTree(out).query(dense)[0].max() * r < 0.5
    # Control: dual vertices at the voxels' min corners (offsets zero) fail the first bound.
    corners = DualGridFields(fields.coords, torch.zeros_like(fields.dual_vertices), fields.intersected,
                             fields.split_weight, r)
    cv, _ = dual_grid_to_mesh(corners)
    assert np.abs(sdf(cv.astype(np.float64))).max() * r > 0.5


def test_free_minima_are_the_float64_solution_rounded_to_float32():
    # Our solve: where the QEF's free minimum is inside the voxel, the vertex is that float64 minimum rounded to
    # float32 (the reference's float32 QR lands up to hundreds of ulps away: docs/testing.md).
    v, f = sphere_mesh(4)
    acc = vz.accumulate_qefs(v, f, 64)
    q = acc.matrices(1e-2).astype(np.float64)
    exact = np.linalg.solve(q[:, :3, :3], -q[:, :3, 3:])[:, :, 0]
    lo = acc.coords / 64
    free = np.all((exact > lo + 1e-6) & (exact < lo + 1 / 64 - 1e-6), axis=1)
    fields = vz.mesh_to_dual_grid(v, f, 64, progress=False)
    dual = (fields.dual_vertices.numpy() + acc.coords.astype(np.float32)) / np.float32(64)  # exact: R = 2^6
    assert free.mean() > 0.99
    assert np.array_equal(dual[free], exact[free].astype(np.float32))
    # Control: a float32 solve of the same systems (torch's LU in float32; numpy's solve works in float64 for
    # float32 input) gives other bits.
    q32 = torch.from_numpy(acc.matrices(1e-2))
    single = torch.linalg.solve(q32[:, :3, :3], -q32[:, :3, 3:])[:, :, 0].numpy()
    assert single.dtype == np.float32 and not np.array_equal(dual[free], single[free])


def test_split_weight_is_ones_and_fields_line_up(shape):
    fields = shape.fields
    n = len(fields.coords)
    assert fields.resolution == shape.r
    assert fields.split_weight.shape == (n,) and bool(torch.all(fields.split_weight == 1))
    assert fields.intersected.shape == (n, 3) and fields.intersected.dtype == torch.bool
    assert len(np.unique(fields.coords.numpy(), axis=0)) == n


def test_a_mesh_on_the_cube_faces_stays_in_the_grid():
    # Crossings at the grid's far planes fall outside [0, R) and are dropped, as in the reference.
    fields = vz.mesh_to_dual_grid(*soup_on_cube_faces(), 64, progress=False)
    coords, offsets = fields.coords.numpy(), fields.dual_vertices.numpy()
    assert coords.min() >= 0 and coords.max() < 64
    assert offsets.min() >= 0 and offsets.max() <= 1
    assert (coords[:, 0] == 63).any()  # the x = 0.5 face's voxels are there


def test_torch_and_numpy_inputs_agree():
    v, f = box_mesh()
    a = vz.mesh_to_dual_grid(v, f, 32, progress=False)
    b = vz.mesh_to_dual_grid(torch.from_numpy(v), torch.from_numpy(f), 32, progress=False)
    assert torch.equal(a.coords, b.coords) and torch.equal(a.dual_vertices, b.dual_vertices)


def test_chunked_passes_give_the_same_bits():
    v, f = torus_mesh()
    whole = vz.mesh_to_dual_grid(v, f, 64, progress=False)
    small = vz.mesh_to_dual_grid(v, f, 64, chunk=1024, progress=False)
    for name in ("coords", "dual_vertices", "intersected"):
        assert torch.equal(getattr(whole, name), getattr(small, name)), name
    # Control: the same faces in another order touch the voxels in another order (and add in another order).
    flipped = vz.mesh_to_dual_grid(v, f[::-1], 64, progress=False)
    assert not torch.equal(whole.coords, flipped.coords)
    assert {tuple(c) for c in whole.coords.tolist()} == {tuple(c) for c in flipped.coords.tolist()}


@pytest.mark.parametrize(
    "vertices, faces, message",
    [
        (np.zeros((0, 3)), np.zeros((0, 3), int), "non-empty"),
        (np.array([[0, 0, 0], [0.1, 0, 0], [np.nan, 0, 0]]), np.array([[0, 1, 2]]), "non-finite"),
        (np.array([[0, 0, 0], [0.7, 0, 0], [0, 0.1, 0]]), np.array([[0, 1, 2]]), "outside the cube"),
        (np.array([[0, 0, 0], [0.1, 0, 0], [0, 0.1, 0]]), np.array([[0, 1, 3]]), "outside \\[0, 2\\]"),
        (np.array([[0, 0, 0], [0.1, 0, 0], [0, 0.1, 0]]), np.array([[0.0, 1, 2]]), "integer"),
    ],
)
def test_bad_meshes_raise_one_line_value_errors(vertices, faces, message):
    with pytest.raises(ValueError, match=message) as err:
        vz.mesh_to_dual_grid(vertices, faces, 32, progress=False)
    assert "\n" not in str(err.value)


def test_bad_settings_raise_value_errors():
    v, f = box_mesh()
    with pytest.raises(ValueError, match="resolution"):
        vz.mesh_to_dual_grid(v, f, 0, progress=False)
    with pytest.raises(ValueError, match="boundary_weight"):
        vz.mesh_to_dual_grid(v, f, 32, boundary_weight=-1.0, progress=False)


# ---- parity with TRELLIS.2's C++ converter -----------------------------------------------------------

PARITY_MESHES = {"sphere": lambda: sphere_mesh(4), "box": box_mesh, "torus": torus_mesh,
                 "open_bowl": open_bowl_mesh, "grid_aligned_open_box": grid_aligned_open_box,
                 "soup_on_cube_faces": soup_on_cube_faces}
needs_reference = pytest.mark.skipif(ref.missing() is not None, reason=str(ref.missing()))


def _ours_state(v, f, r, face_weight=1.0, boundary_weight=0.2):
    return vz.accumulate_qefs(v, f, r, face_weight=face_weight, boundary_weight=boundary_weight)


@needs_reference
@pytest.mark.parametrize("r", [64, 96, 256])  # 96: a voxel size that is not a power of two
@pytest.mark.parametrize("name", list(PARITY_MESHES))
def test_voxels_flags_means_and_qefs_are_the_references_bits(name, r):
    v, f = PARITY_MESHES[name]()
    for faces_on, bw in ((False, 0.0), (True, 0.0), (True, 0.2)):  # after each of the three passes
        coords, means, counts, flags, qefs = ref.reference_qefs(v, f, r, faces_on=faces_on, boundary_weight=bw)
        ours = _ours_state(v, f, r, 1.0 if faces_on else 0.0, bw)
        assert {tuple(c) for c in ours.coords.tolist()} == {tuple(c) for c in coords.tolist()}
        assert np.array_equal(ours.coords, coords)  # the same order: first touched first
        assert np.array_equal(ours.intersected, flags)
        assert np.array_equal(ours.counts, counts) and np.array_equal(ours.mean_sums, means)
        assert np.array_equal(ours.matrices(), qefs), (faces_on, bw)


@needs_reference
def test_control_one_ulp_moves_the_qef_bits():
    v, f = sphere_mesh(4)
    coords, *_, qefs = ref.reference_qefs(v, f, 64)
    nudged = v.astype(np.float32).copy()
    nudged[0, 0] = np.nextafter(nudged[0, 0], np.float32(1))
    ours = _ours_state(nudged, f, 64)
    assert np.array_equal(ours.coords, coords)
    assert not np.array_equal(ours.matrices(), qefs)


@needs_reference
@pytest.mark.parametrize("r", [64, 256])
@pytest.mark.parametrize("name", list(PARITY_MESHES))
def test_dual_vertices_match_the_reference_to_its_float32_solve(name, r):
    # Not bitwise: the reference solves each voxel's 3×3 (and its faces' 2×2) QEF with Eigen's float32
    # column-pivoting QR and compares the constrained candidates' errors pᵀQp in float32, where those errors
    # (~1e-7) are below float32's rounding of their O(1) terms; we solve in float64. On the same QEF bits
    # (test above) our vertex is never worse, and where both solutions are inside the voxel they agree to
    # float32 solve noise; on the voxels' faces the reference's pick is noise along the surface.
    v, f = PARITY_MESHES[name]()
    coords, dual_ref, flags = ref.reference_dual_grid(v, f, r)
    fields = vz.mesh_to_dual_grid(v, f, r, progress=False)
    assert np.array_equal(fields.coords.numpy(), coords) and np.array_equal(fields.intersected.numpy(), flags)
    offsets_ref = dual_ref * np.float32(r) - coords.astype(np.float32)  # the texturing pipeline's feats
    ours = fields.dual_vertices.numpy()
    diff = np.abs(ours.astype(np.float64) - offsets_ref).max(axis=1)
    interior = np.all((ours > 1e-4) & (ours < 1 - 1e-4) & (offsets_ref > 1e-4) & (offsets_ref < 1 - 1e-4), axis=1)
    # Measured over these meshes: interior max 0.0036 at 64, 0.014 at 256; p99 ≤ 0.0074; more than 0.1 voxel
    # apart: at most 0.48 % of the voxels (the soup at 256), up to a whole voxel there.
    assert diff[interior].max() < {64: 0.005, 256: 0.02}[r]
    assert np.quantile(diff, 0.99) < 0.01
    assert np.mean(diff > 0.1) < 0.01
    q = _ours_state(v, f, r).matrices(1e-2).astype(np.float64)

    def err(offsets):
        p = (coords + offsets.astype(np.float64)) / r
        ph = np.concatenate([p, np.ones((len(p), 1))], axis=1)
        return np.einsum("ni,nij,nj->n", ph, q, ph)

    assert np.all(err(ours) <= err(offsets_ref) + 1e-13)
