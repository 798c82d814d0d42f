"""Pixel-aligned projection: where each latent voxel lands in the input image, and the features there.

Reference: Pixal3D ``ProjGrid`` / ``project_points_to_image_batch``. The grid is ``linspace(-1, 1, G)``
per axis (endpoints included, not voxel centres), rotated by ``R = [[1,0,0],[0,0,-1],[0,1,0]]`` (grid
``(x, y, z)`` -> world ``(x, -z, y)``) and divided by ``2 * mesh_scale``. A pinhole camera at world
``(0, -d, 0)`` looks along ``+y`` with ``+z`` up; ``f = S / (2 tan(fov/2))`` pixels; ``v`` is flipped. The
feature map is sampled with ``grid_sample(bilinear, border, align_corners=False)``; points outside the
view get border-clamped features (the reference discards its validity mask).

Vocabulary: a *sampling grid* is ``g [K, 2]`` in ``grid_sample``'s normalised ``(x, y)`` coordinates.

Several posed views (``project_posed``, reference ``ProjGridMV``): each view's camera-to-world matrix replaces the
front camera, computed with the reference's own batched operations (``bmm``, ``linalg.inv`` on ``[1, 4, 4]``).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .camera import Camera

_GRID_TO_WORLD = ((1.0, 0.0, 0.0), (0.0, 0.0, -1.0), (0.0, 1.0, 0.0))
_FRONT_VIEW = ((1.0, 0.0, 0.0, 0.0), (0.0, 0.0, -1.0, -2.0), (0.0, 1.0, 0.0, 0.0), (0.0, 0.0, 0.0, 1.0))


def grid_points(resolution: int, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """All ``G³`` grid points ``[G³, 3]`` f32 (rotated, before scaling), row ``i·G² + j·G + k`` for index (i, j, k)."""
    one = torch.linspace(-1, 1, resolution, device=device)
    x, y, z = torch.meshgrid(one, one, one, indexing="ij")
    points = torch.stack([x, y, z], dim=-1) @ torch.tensor(_GRID_TO_WORLD, device=device).T  # [G, G, G, 3]
    return points.reshape(-1, 3)


def coords_points(coords: torch.Tensor, resolution: int) -> torch.Tensor:
    """The grid points ``[N, 3]`` f32 of sparse ``coords [N, 4]`` ``(b, x, y, z)`` — the rows of ``grid_points``
    that a dense-then-gather would pick, in coords order."""
    if coords.dim() != 2 or coords.shape[1] != 4:
        raise ValueError(f"coords must be [N, 4] (batch, x, y, z); got shape {tuple(coords.shape)}")
    xyz = coords[:, 1:].long()
    if xyz.numel() and (int(xyz.min()) < 0 or int(xyz.max()) >= resolution):
        raise ValueError(f"coords lie outside the {resolution}³ grid (min {int(xyz.min())}, max {int(xyz.max())}); "
                         f"pass coords at this extractor's grid resolution")
    one = torch.linspace(-1, 1, resolution, device=coords.device)
    grid_xyz = one[xyz]  # [N, 3]
    return grid_xyz @ torch.tensor(_GRID_TO_WORLD, device=coords.device).T


def project(points: torch.Tensor, camera: Camera, image_size: int) -> torch.Tensor:
    """Sampling grid ``[K, 2]`` (x, y in [-1, 1] for the visible part) of grid ``points [K, 3]`` seen by ``camera``
    in an ``image_size``-pixel square image."""
    device = points.device
    world = points / camera.mesh_scale / 2
    homogeneous = torch.cat([world, torch.ones_like(world[:, :1])], dim=-1)  # [K, 4]
    cam_to_world = torch.tensor(_FRONT_VIEW, device=device)
    cam_to_world[1, 3] = -camera.distance
    cam_points = homogeneous @ torch.linalg.inv(cam_to_world).T  # [K, 4]: (x_c, y_c, z_c, 1)
    fov = torch.tensor(camera.fov, dtype=torch.float32, device=device)
    focal = (16 / torch.tan(fov / 2)) * image_size / 32  # 32 mm sensor: f = S / (2 tan(fov/2))
    depth = -cam_points[:, 2] + 1e-8
    u = focal * cam_points[:, 0] / depth + image_size / 2
    v = -focal * cam_points[:, 1] / depth + image_size / 2
    uv = torch.stack([u, v], dim=-1)
    return (uv + 0.5) / image_size * 2 - 1


def project_posed(points: torch.Tensor, cam_to_world: torch.Tensor, fov: torch.Tensor, image_size: int,
                  mesh_scale: torch.Tensor) -> torch.Tensor:
    """Sampling grid ``[K, 2]`` of grid ``points [K, 3]`` seen by a camera ``cam_to_world [4, 4]`` with horizontal
    fov ``fov`` (a float32 scalar tensor, radians), ``mesh_scale`` a float32 scalar tensor. The reference's
    operations in its order and shapes (``project_points_to_image_batch`` with a batch of one)."""
    world = points[None] / mesh_scale.reshape(1, 1, 1) / 2  # [1, K, 3]
    homogeneous = torch.cat([world, torch.ones(1, world.shape[1], 1, device=points.device, dtype=world.dtype)], -1)
    world_to_camera = torch.linalg.inv(cam_to_world[None].float())  # [1, 4, 4]
    cam_points = torch.bmm(homogeneous, world_to_camera.transpose(-2, -1))[..., :3]  # [1, K, 3]
    focal = (16.0 / torch.tan(fov.reshape(1) / 2.0)) * image_size / 32.0  # [1]: f = S / (2 tan(fov/2))
    focal = focal.unsqueeze(1)  # [1, 1]
    u = focal * cam_points[..., 0] / (-cam_points[..., 2] + 1e-8) + image_size / 2.0
    v = -(focal * cam_points[..., 1] / (-cam_points[..., 2] + 1e-8)) + image_size / 2.0
    uv = torch.stack([u, v], dim=-1)  # [1, K, 2]
    return ((uv + 0.5) / image_size * 2 - 1)[0]


def sample_map(feature_map: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Bilinear features ``[K, C]`` of ``feature_map [1, C, H, W]`` at ``grid [K, 2]`` (border padding)."""
    if feature_map.dim() != 4 or feature_map.shape[0] != 1:
        raise ValueError(f"feature_map must be [1, C, H, W]; got {tuple(feature_map.shape)}")
    sampled = F.grid_sample(feature_map, grid.to(feature_map.dtype).view(1, -1, 1, 2), mode="bilinear",
                            padding_mode="border", align_corners=False)  # [1, C, K, 1]
    return sampled[0, :, :, 0].T


def bilinear_taps(grid: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The four pixels ``[K, 4, 2]`` (row, col) and weights ``[K, 4]`` that ``sample_map`` blends for ``grid``
    on an ``height × width`` map (same unnormalise/clamp/floor rule as ``grid_sample``)."""
    gx, gy = grid[:, 0], grid[:, 1]
    ix = (((gx + 1) * width - 1) / 2).clamp(0, width - 1)
    iy = (((gy + 1) * height - 1) / 2).clamp(0, height - 1)
    x0, y0 = ix.floor(), iy.floor()
    x1, y1 = x0 + 1, y0 + 1
    weights = torch.stack([(x1 - ix) * (y1 - iy), (ix - x0) * (y1 - iy), (x1 - ix) * (iy - y0), (ix - x0) * (iy - y0)], -1)
    cols = torch.stack([x0, x1, x0, x1], dim=-1).long()
    rows = torch.stack([y0, y0, y1, y1], dim=-1).long()
    inside = (cols < width) & (rows < height)  # the +1 tap past the last pixel has weight 0
    weights = weights * inside
    pixels = torch.stack([rows.clamp(max=height - 1), cols.clamp(max=width - 1)], dim=-1)
    return pixels, weights


def read_pixels(grid: torch.Tensor, height: int, width: int, *, slack: float = 1e-3) -> torch.Tensor:
    """Every pixel ``[P, 2]`` (row, col), sorted and unique, that ``sample_map`` can read for ``grid``.

    The 2×2 taps of each point, plus the neighbouring row/column where the point is within ``slack``
    pixels of a pixel centre: grid_sample's own float32 unnormalisation (its formula differs between
    kernels) may floor to that neighbour there. Computed in float64 on the host (mps has no float64; these
    are indices, a few per point), so the set is a superset of the kernel's reads; returned on ``grid``'s device.
    """
    def span(coord: torch.Tensor, size: int) -> torch.Tensor:  # [K, 4] candidate indices, -1 where none
        index = (((coord.detach().cpu().double() + 1) * size - 1) / 2).clamp(0, size - 1)
        low = index.floor()
        frac = index - low
        cand = torch.stack([low - 1, low, low + 1, low + 2], dim=-1)
        cand[:, 0] = torch.where(frac < slack, cand[:, 0], -1)
        cand[:, 3] = torch.where(frac > 1 - slack, cand[:, 3], -1)
        return torch.where((cand >= 0) & (cand < size), cand, -1).long()

    cols, rows = span(grid[:, 0], width), span(grid[:, 1], height)
    flat = (rows[:, :, None] * width + cols[:, None, :]).reshape(-1)  # [K·16]
    valid = (rows[:, :, None] >= 0) & (cols[:, None, :] >= 0)
    unique = torch.unique(flat[valid.reshape(-1)])
    return torch.stack([unique // width, unique % width], dim=-1).to(grid.device)


def sample_pointwise(features_at: Callable[[torch.Tensor], torch.Tensor], grid: torch.Tensor,
                     height: int, width: int) -> torch.Tensor:
    """``sample_map`` without the map: ``features_at(pixels [P, 2] (row, col)) -> [P, C]`` is asked only for the
    distinct pixels the bilinear taps read; returns ``[K, C]``."""
    pixels, weights = bilinear_taps(grid, height, width)
    flat = pixels[..., 0] * width + pixels[..., 1]  # [K, 4]
    unique, inverse = torch.unique(flat.reshape(-1), return_inverse=True)
    values = features_at(torch.stack([unique // width, unique % width], dim=-1))  # [P, C]
    inverse = inverse.view(-1, 4)
    weights = weights.to(values.dtype)
    out = values[inverse[:, 0]] * weights[:, :1]  # [K, C], accumulated tap by tap (no [K, 4, C] tensor)
    for tap in range(1, 4):
        out.addcmul_(values[inverse[:, tap]], weights[:, tap:tap + 1])
    return out
