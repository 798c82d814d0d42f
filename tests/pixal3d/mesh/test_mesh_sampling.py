"""Sparse trilinear sampling (flex_gemm semantics), UV rasterization and surface projection."""
import numpy as np
import pytest
import torch

from pixal3d.mesh.bake import (
    SurfaceProjector,
    closest_point_on_triangles,
    fill_gutters,
    rasterize_uv,
    sample_trilinear,
)
from pixal3d.mesh.dual_grid import dual_grid_to_mesh
from pixal3d.mesh.sparse_index import SparseIndex
from pixal3d.mesh.synthetic import sdf_dual_grid, sphere_sdf

R = 16


def _block(lo, hi):
    axis = np.arange(lo, hi)
    return np.stack(np.meshgrid(axis, axis, axis, indexing="ij"), -1).reshape(-1, 3)


def test_trilinear_reproduces_a_linear_field_inside_the_voxel_set():
    coords = _block(2, 10)
    a = np.random.default_rng(0).normal(size=(3, 6))
    b = np.arange(6.0)
    attrs = ((coords + 0.5) / R - 0.5) @ a + b  # value stored at the voxel centre
    g = np.random.default_rng(1).uniform(2.5, 9.5, (2000, 3))  # all 8 surrounding centres exist
    points = g / R - 0.5
    values, support = sample_trilinear(SparseIndex(coords, R), attrs, points, R)
    np.testing.assert_allclose(values, points @ a + b, atol=1e-5)
    np.testing.assert_allclose(support, 1.0, atol=1e-6)


def test_trilinear_matches_grid_sample_align_corners_false_on_a_dense_block():
    coords = _block(0, R)
    attrs = np.random.default_rng(2).random((len(coords), 6)).astype(np.float32)
    g = np.random.default_rng(3).uniform(0.5, R - 0.5, (500, 3))
    values, _ = sample_trilinear(SparseIndex(coords, R), attrs, g / R - 0.5, R)
    volume = torch.from_numpy(attrs.reshape(R, R, R, 6)).permute(3, 0, 1, 2)[None]  # [1, C, X, Y, Z]
    grid = torch.from_numpy(g[:, ::-1] / R * 2 - 1).float().view(1, 1, 1, -1, 3)  # (z, y, x) order
    expected = torch.nn.functional.grid_sample(volume, grid, align_corners=False)[0, :, 0, 0].T.numpy()
    np.testing.assert_allclose(values, expected, atol=1e-5)


def test_trilinear_renormalizes_over_existing_neighbours_and_is_zero_without_any():
    coords = np.array([[0, 0, 0], [1, 0, 0]])
    attrs = np.array([[1.0] * 6, [3.0] * 6])
    g = np.array([[1.25, 1.0, 1.0], [8.0, 8.0, 8.0]])
    values, support = sample_trilinear(SparseIndex(coords, R), attrs, g / R - 0.5, R)
    # corner weights 0.25·0.5·0.5 (value 1) and 0.75·0.5·0.5 (value 3) → (0.0625 + 0.5625) / 0.25
    np.testing.assert_allclose(values[0], 2.5, atol=1e-6)
    assert support[0] == pytest.approx(0.25)
    np.testing.assert_array_equal(values[1], 0.0)
    assert support[1] == 0.0


def test_rasterizer_covers_a_tiled_square_once_with_exact_barycentrics():
    n, size = 24, 128
    rng = np.random.default_rng(4)
    axis = np.linspace(0, 1, n + 1)
    uv = np.stack(np.meshgrid(axis, axis, indexing="xy"), -1).reshape(-1, 2)
    inner = (uv > 0) & (uv < 1)
    uv = uv + np.where(inner, rng.uniform(-0.3, 0.3, uv.shape) / n, 0)
    idx = np.arange((n + 1) ** 2).reshape(n + 1, n + 1)
    a, b, c, d = idx[:-1, :-1].ravel(), idx[:-1, 1:].ravel(), idx[1:, 1:].ravel(), idx[1:, :-1].ravel()
    faces = np.concatenate([np.stack([a, b, c], 1), np.stack([a, c, d], 1)])
    face_id, bary = rasterize_uv(uv.astype(np.float32), faces, size, size)
    assert (face_id >= 0).all()
    tri = uv[faces[face_id]]  # [H, W, 3, 2]
    rebuilt = tri[..., 0, :] * (1 - bary[..., :1] - bary[..., 1:]) + tri[..., 1, :] * bary[..., :1] + tri[..., 2, :] * bary[..., 1:]
    ys, xs = np.mgrid[0:size, 0:size]
    np.testing.assert_allclose(rebuilt[..., 0], (xs + 0.5) / size, atol=1e-4 / size)
    np.testing.assert_allclose(rebuilt[..., 1], (ys + 0.5) / size, atol=1e-4 / size)


def test_gutter_fill_copies_the_nearest_covered_texel():
    image = np.zeros((5, 5, 1), np.uint8)
    covered = np.zeros((5, 5), bool)
    image[0, 0], covered[0, 0] = 10, True
    image[4, 4], covered[4, 4] = 200, True
    out = fill_gutters(image, covered)
    assert out[1, 0, 0] == 10 and out[3, 4, 0] == 200 and out[0, 0, 0] == 10


def test_closest_point_on_triangles_agrees_with_dense_sampling():
    rng = np.random.default_rng(5)
    a, b, c = rng.normal(size=(3, 200, 3))
    p = rng.normal(size=(200, 3)) * 2
    q = closest_point_on_triangles(p, a, b, c)
    s, t = np.meshgrid(np.linspace(0, 1, 201), np.linspace(0, 1, 201))
    keep = s + t <= 1
    s, t = s[keep], t[keep]
    samples = a[:, None] + s[None, :, None] * (b - a)[:, None] + t[None, :, None] * (c - a)[:, None]
    brute = np.sqrt(((samples - p[:, None]) ** 2).sum(-1)).min(1)
    got = np.linalg.norm(q - p, axis=1)
    assert np.all(got <= brute + 1e-9)
    assert np.all(got >= brute - 0.02)


@pytest.mark.parametrize("mode", ["exact", "tangent"])
def test_projector_moves_points_onto_the_reference_sphere(mode):
    centre, radius = np.array([0.0, 0.0, 0.0]), 0.3
    v, f = dual_grid_to_mesh(sdf_dual_grid(sphere_sdf(centre, radius), 64))
    rng = np.random.default_rng(6)
    d = rng.normal(size=(3000, 3))
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    points = (d * (radius + rng.uniform(-1, 1, (3000, 1)) / 64)).astype(np.float32)  # ±1 voxel off
    moved = SurfaceProjector(v, f, mode=mode, max_shift=2 / 64).project(points)
    before = np.abs(np.linalg.norm(points, axis=1) - radius) * 64
    after = np.abs(np.linalg.norm(moved, axis=1) - radius) * 64
    assert before.mean() > 0.4 and after.max() < 0.1  # in voxels
