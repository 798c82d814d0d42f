"""Synthetic decoder outputs from a signed distance function (tests and the export benchmark).

``sdf_dual_grid`` builds flexible-dual-grid fields the way the forward converter would on clean
data: voxels are those whose 8 corners do not all share the SDF's sign; the owned edge of each axis
(through the voxel's max corner in the other two axes) is flagged when its SDF changes sign; the
dual vertex is the mean of the linear crossings on the voxel's 12 edges, optionally projected onto
the zero level set by Newton steps. The search is coarse to fine (8³ bricks), never a dense R³ grid.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .fields import DualGridFields, PbrVoxels

Sdf = Callable[[np.ndarray], np.ndarray]

# The 12 voxel edges as (corner a, corner b); corner index = 4x + 2y + z.
_CORNERS = np.array([[x, y, z] for x in (0, 1) for y in (0, 1) for z in (0, 1)])
_EDGES = np.array([(a, b) for a in range(8) for b in range(a + 1, 8) if np.abs(_CORNERS[a] - _CORNERS[b]).sum() == 1])
# Owned edge per axis: along the axis, at +1 in the other two → corners (0,1,1)-(1,1,1), (1,0,1)-(1,1,1), (1,1,0)-(1,1,1).
_OWNED = np.array([[3, 7], [5, 7], [6, 7]])


def sphere_sdf(center: tuple[float, float, float], radius: float) -> Sdf:
    """Signed distance to a sphere (negative inside) in world units."""
    c = np.asarray(center, np.float64)
    return lambda p: np.linalg.norm(p - c, axis=-1) - radius


def box_sdf(half_size: float) -> Sdf:
    """Signed distance to an origin-centred cube of half side ``half_size``."""

    def sdf(p: np.ndarray) -> np.ndarray:
        q = np.abs(p) - half_size
        return np.linalg.norm(np.maximum(q, 0.0), axis=-1) + np.minimum(q.max(axis=-1), 0.0)

    return sdf


def blobby_sdf(scale: float = 1.0, seed: int = 0) -> Sdf:
    """A genus-rich "realistic" test shape: smooth union of spheres and tori with a surface ripple."""
    rng = np.random.default_rng(seed)
    centres = rng.uniform(-0.22, 0.22, (6, 3)) * scale
    radii = rng.uniform(0.08, 0.14, 6) * scale
    tori = [(rng.uniform(-0.15, 0.15, 3) * scale, 0.16 * scale, 0.035 * scale, i % 3) for i in range(3)]

    def sdf(p: np.ndarray) -> np.ndarray:
        d = np.linalg.norm(p[..., None, :] - centres, axis=-1) - radii
        for c, big, small, axis in tori:
            q = p - c
            planar = np.delete(q, axis, axis=-1)
            t = np.stack([np.linalg.norm(planar, axis=-1) - big, q[..., axis]], axis=-1)
            d = np.concatenate([d, (np.linalg.norm(t, axis=-1) - small)[..., None]], axis=-1)
        k = 0.03 * scale  # exponential smooth-min blend width
        m = d.min(axis=-1)
        smooth = m - k * np.log(np.exp(-(d - m[..., None]) / k).sum(axis=-1))
        ripple = 0.004 * scale * np.sin(40 * p[..., 0] / scale) * np.sin(40 * p[..., 1] / scale)
        return smooth + ripple

    return sdf


def repeated_sdf(sdf: Sdf, copies: int) -> Sdf:
    """``copies³`` copies of ``sdf`` (scaled by 1/copies) on a regular grid over [-0.5, 0.5]³.

    Domain repetition: each point is evaluated against the copy of its own cell, which is exact as
    long as every copy stays inside its cell (the scaled shape must fit in [-0.5, 0.5]³).
    """
    cell = 1.0 / copies

    def out(p: np.ndarray) -> np.ndarray:
        local = np.mod(p + 0.5, cell) - 0.5 * cell
        return sdf(local * copies) / copies

    return out


def _candidate_bricks(sdf: Sdf, resolution: int, brick: int) -> np.ndarray:
    nb = -(-resolution // brick)
    axis = np.arange(nb)
    grid = np.stack(np.meshgrid(axis, axis, axis, indexing="ij"), -1).reshape(-1, 3)
    keep = []
    for start in range(0, len(grid), 1 << 20):
        g = grid[start : start + (1 << 20)]
        centre = ((g + 0.5) * brick) / resolution - 0.5
        # Lipschitz-1 SDF: the surface can only cross a brick whose centre is within its half diagonal.
        keep.append(g[np.abs(sdf(centre)) <= (0.87 * brick + 1.0) / resolution])
    return np.concatenate(keep)


def sdf_dual_grid(
    sdf: Sdf, resolution: int, *, project: bool = True, seed: int = 0, brick: int = 8, chunk: int = 2048
) -> DualGridFields:
    """Flexible-dual-grid fields of ``sdf < 0`` at ``resolution`` (random positive split weights)."""
    bricks = _candidate_bricks(sdf, resolution, brick)
    lattice = np.stack(np.meshgrid(*[np.arange(brick + 1)] * 3, indexing="ij"), -1).reshape(-1, 3)
    local = np.stack(np.meshgrid(*[np.arange(brick)] * 3, indexing="ij"), -1).reshape(-1, 3)
    # lattice index of each voxel's 8 corners, [brick³, 8]
    corner_idx = ((local[:, None, :] + _CORNERS[None]) * np.array([(brick + 1) ** 2, brick + 1, 1])).sum(-1)
    coords_out, offsets_out, flags_out = [], [], []
    for start in range(0, len(bricks), chunk):
        b = bricks[start : start + chunk]
        points = (b[:, None, :] * brick + lattice[None]).reshape(-1, 3)
        values = sdf(points / resolution - 0.5).reshape(len(b), -1)
        corner_vals = values[:, corner_idx]  # [B, brick³, 8]
        inside = corner_vals < 0
        mixed = inside.any(-1) & ~inside.all(-1)
        voxel = (b[:, None, :] * brick + local[None])
        valid = mixed & np.all(voxel < resolution, axis=-1)
        vals = corner_vals[valid]  # [V, 8]
        vox = voxel[valid]
        ea, eb = vals[:, _EDGES[:, 0]], vals[:, _EDGES[:, 1]]
        crossing = (ea < 0) != (eb < 0)
        t = np.where(crossing, ea / np.where(crossing, ea - eb, 1.0), 0.0)
        pts = _CORNERS[_EDGES[:, 0]] + t[..., None] * (_CORNERS[_EDGES[:, 1]] - _CORNERS[_EDGES[:, 0]])
        offset = (pts * crossing[..., None]).sum(1) / crossing.sum(1, keepdims=True)
        flags = (vals[:, _OWNED[:, 0]] < 0) != (vals[:, _OWNED[:, 1]] < 0)
        coords_out.append(vox)
        offsets_out.append(offset)
        flags_out.append(flags)
    coords = np.concatenate(coords_out).astype(np.int32)
    offsets = np.concatenate(offsets_out)
    if project:
        offsets = _project_offsets(sdf, coords, offsets, resolution)
    weights = np.random.default_rng(seed).uniform(0.1, 2.0, len(coords)).astype(np.float32)
    return DualGridFields(
        coords=torch.from_numpy(coords),
        dual_vertices=torch.from_numpy(offsets.astype(np.float32)),
        intersected=torch.from_numpy(np.concatenate(flags_out)),
        split_weight=torch.from_numpy(weights),
        resolution=resolution,
    )


def _project_offsets(sdf: Sdf, coords: np.ndarray, offsets: np.ndarray, resolution: int) -> np.ndarray:
    """Move dual vertices onto the zero level set (two Newton steps along the numeric gradient)."""
    out = np.empty_like(offsets)
    h = 1e-3 / resolution
    eye = np.eye(3) * h
    for start in range(0, len(coords), 1 << 20):
        sl = slice(start, start + (1 << 20))
        p = (coords[sl] + offsets[sl]) / resolution - 0.5
        for _ in range(2):
            g = np.stack([(sdf(p + eye[k]) - sdf(p - eye[k])) / (2 * h) for k in range(3)], -1)
            p = p - (sdf(p) / np.maximum((g * g).sum(-1), 1e-12))[:, None] * g
        out[sl] = (p + 0.5) * resolution - coords[sl]
    return np.clip(out, -0.5, 1.5)


def pbr_from_function(fields: DualGridFields, color: Callable[[np.ndarray], np.ndarray]) -> PbrVoxels:
    """PBR voxels on the shape's voxels, ``attrs = color(voxel centre in world units)`` → [M, 6]."""
    coords = fields.coords.numpy()
    centre = (coords + 0.5) / fields.resolution - 0.5
    attrs = np.concatenate([color(centre[s : s + (1 << 20)]) for s in range(0, len(coords), 1 << 20)])
    return PbrVoxels(coords=fields.coords, attrs=torch.from_numpy(attrs.astype(np.float32)), resolution=fields.resolution)
