"""Projection: reference distance frames the cube, known gradients sample to known values, frugal == map."""
import math

import pytest
import torch

from pixal3d.models.camera import FALLBACK_FOV, Camera, camera_from_fov
from pixal3d.models.projection import (
    bilinear_taps,
    coords_points,
    grid_points,
    project,
    sample_map,
    sample_pointwise,
)


def test_grid_points_rotate_grid_axes_to_world():
    points = grid_points(3).reshape(3, 3, 3, 3)
    # grid (x, y, z) -> world (x, -z, y); index (i, j, k) <-> (x, y, z)
    torch.testing.assert_close(points[2, 0, 1], torch.tensor([1.0, -0.0, -1.0]))
    torch.testing.assert_close(points[0, 2, 2], torch.tensor([-1.0, -1.0, 1.0]))


@pytest.mark.parametrize("fov_deg", [30.0, math.degrees(FALLBACK_FOV), 70.0])
@pytest.mark.parametrize("size", [512, 1024])
def test_cube_x_extremes_land_on_image_borders(fov_deg, size):
    camera = camera_from_fov(math.radians(fov_deg))
    # grid (±1, 0, 0) -> world (±0.5, 0, 0): depth exactly d, u = 0 and u = S
    grid = project(torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]), camera, size)
    u = (grid[:, 0] + 1) / 2 * size - 0.5
    torch.testing.assert_close(u, torch.tensor([0.0, float(size), size / 2]), atol=2e-3 * size / 512, rtol=0)
    torch.testing.assert_close(grid[:, 1], torch.full((3,), 1 / size), atol=1e-6, rtol=0)  # v = S/2
    # control: a camera twice as far sees the cube half as wide
    far = project(torch.tensor([[1.0, 0.0, 0.0]]), Camera(camera.fov, 2 * camera.distance), size)
    assert abs(((far[0, 0] + 1) / 2 * size - 0.5) - 0.75 * size) < 1e-2 * size


def test_nearer_slices_appear_larger_and_up_is_up():
    camera = camera_from_fov(FALLBACK_FOV)
    # grid z is depth (z = +1 is nearest the camera), grid y is up (world z)
    grid = grid_points(3).reshape(3, 3, 3, 3)  # index (i, j, k) <-> grid (x, y, z) in {-1, 0, 1}
    g = project(torch.stack([grid[2, 1, 2], grid[2, 1, 0], grid[1, 2, 1], grid[1, 0, 1]]), camera, 512)
    assert g[0, 0] > g[1, 0] > 0
    assert g[2, 1] < 0 < g[3, 1]  # up is the top of the image (v flipped)


def test_gradient_map_samples_to_known_values():
    height, width = 8, 12
    ys, xs = torch.meshgrid(torch.arange(height, dtype=torch.float32), torch.arange(width, dtype=torch.float32),
                            indexing="ij")
    fmap = torch.stack([xs, ys, 2 * xs - 3 * ys])[None]  # [1, 3, H, W]: linear in pixel index
    pix = torch.tensor([[0.0, 0.0], [3.25, 5.5], [11.0, 7.0], [6.5, 2.75], [-4.0, 3.0], [20.0, 9.0]])  # (x, y)
    grid = torch.stack([(pix[:, 0] + 0.5) / width * 2 - 1, (pix[:, 1] + 0.5) / height * 2 - 1], -1)
    out = sample_map(fmap, grid)
    x = pix[:, 0].clamp(0, width - 1)
    y = pix[:, 1].clamp(0, height - 1)  # border padding clamps out-of-view points
    torch.testing.assert_close(out, torch.stack([x, y, 2 * x - 3 * y], -1), atol=1e-5, rtol=0)


def test_pointwise_sampling_equals_grid_sample():
    gen = torch.Generator().manual_seed(0)
    fmap = torch.randn(1, 5, 9, 13, generator=gen)
    grid = torch.rand(300, 2, generator=gen) * 2.4 - 1.2  # includes out-of-range points
    grid[:4] = torch.tensor([[-1.0, -1.0], [1.0, 1.0], [1 - 1 / 13, 0.0], [0.0, 1 - 1 / 9]])  # exact edges
    asked = []

    def features_at(pixels):
        asked.append(len(pixels))
        return fmap[0, :, pixels[:, 0], pixels[:, 1]].T

    torch.testing.assert_close(sample_pointwise(features_at, grid, 9, 13), sample_map(fmap, grid), atol=1e-5, rtol=1e-5)
    assert asked[0] <= 9 * 13
    pixels, weights = bilinear_taps(grid, 9, 13)
    torch.testing.assert_close(weights.sum(-1), torch.ones(300))
    assert int(pixels[..., 0].max()) < 9 and int(pixels[..., 1].max()) < 13


def test_coords_points_are_the_dense_rows():
    G = 8
    coords = torch.tensor([[0, 7, 0, 3], [0, 1, 2, 3], [0, 0, 0, 0], [0, 5, 6, 7]], dtype=torch.int32)
    dense = grid_points(G)
    rows = coords[:, 1].long() * G * G + coords[:, 2].long() * G + coords[:, 3].long()
    assert torch.equal(coords_points(coords, G), dense[rows])
    with pytest.raises(ValueError, match="outside the 8"):
        coords_points(coords + 1, G)
