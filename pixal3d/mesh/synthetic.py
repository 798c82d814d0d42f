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


# -- shapes that look like real decodes: holes, thin walls, a handle, slits, several parts ------------

def torus_sdf(center: tuple[float, float, float], big: float, small: float, axis: int = 2) -> Sdf:
    """Signed distance to a torus of radii ``big`` (ring) and ``small`` (tube) around ``axis``."""
    c = np.asarray(center, np.float64)

    def sdf(p: np.ndarray) -> np.ndarray:
        q = p - c
        ring = np.linalg.norm(np.delete(q, axis, axis=-1), axis=-1) - big
        return np.hypot(ring, q[..., axis]) - small

    return sdf


def capped_cylinder_sdf(center: tuple[float, float, float], radius: float, half_height: float) -> Sdf:
    """Signed distance to a z-aligned cylinder with flat caps."""
    c = np.asarray(center, np.float64)

    def sdf(p: np.ndarray) -> np.ndarray:
        q = p - c
        d = np.stack([np.linalg.norm(q[..., :2], axis=-1) - radius, np.abs(q[..., 2]) - half_height], -1)
        return np.minimum(d.max(-1), 0.0) + np.linalg.norm(np.maximum(d, 0.0), axis=-1)

    return sdf


def union(*sdfs: Sdf) -> Sdf:
    """Sharp union (the minimum): the sum of several parts."""
    return lambda p: np.min(np.stack([s(p) for s in sdfs], -1), axis=-1)


def thin_wall_sdf(resolution: int, thickness_vox: tuple[float, float] = (1.0, 2.0)) -> Sdf:
    """An open bowl (sphere shell r = 0.3, cut above z = 0.12) whose wall is ``thickness_vox[0]`` voxels
    thick for x < 0 and ``thickness_vox[1]`` for x ≥ 0: both of its surfaces fall in the same voxels."""

    def sdf(p: np.ndarray) -> np.ndarray:
        half = np.where(p[..., 0] < 0, thickness_vox[0], thickness_vox[1]) / (2 * resolution)
        return np.maximum(np.abs(np.linalg.norm(p, axis=-1) - 0.3) - half, p[..., 2] - 0.12)

    return sdf


def slit_box_sdf(resolution: int, widths_vox: tuple[float, ...] = (0.8, 1.3, 1.8, 3.0)) -> Sdf:
    """A box (half side 0.28) with slots cut from the top down to its middle, ``widths_vox`` voxels wide,
    across the whole box in y: slits narrower than two voxels close in a one-voxel offset."""
    box = box_sdf(0.28)
    centres = np.linspace(-0.18, 0.18, len(widths_vox))

    def sdf(p: np.ndarray) -> np.ndarray:
        d = box(p)
        for x, w in zip(centres, widths_vox):
            slot = np.maximum(np.abs(p[..., 0] - x) - w / (2 * resolution), -p[..., 2])
            d = np.maximum(d, -slot)
        return d

    return sdf


def handle_sdf() -> Sdf:
    """A mug: a capped cylinder with a torus handle on its side (genus one)."""
    return union(capped_cylinder_sdf((-0.05, 0, 0), 0.2, 0.25), torus_sdf((0.2, 0, 0), 0.12, 0.035, axis=1))


def components_sdf(resolution: int) -> Sdf:
    """Seven separate spheres from r = 0.15 down to 1.5 voxels (a speck a decoder leaves behind)."""
    radii = [0.15, 0.1, 0.07, 0.045, 0.03, 0.02, 1.5 / resolution]
    centres = [(-0.25, -0.2, 0.0), (0.2, -0.2, 0.05), (0.25, 0.2, -0.1), (-0.2, 0.22, 0.15),
               (0.0, 0.05, -0.3), (0.0, 0.0, 0.3), (0.05, -0.3, 0.3)]
    return union(*[sphere_sdf(c, r) for c, r in zip(centres, radii)])


def drop_voxels(fields: DualGridFields, keep: np.ndarray) -> DualGridFields:
    """The fields without the voxels where ``keep`` is False: the quads through them disappear, which is
    how a decoder's missing voxels turn into holes."""
    keep_t = torch.from_numpy(np.asarray(keep, bool))
    return DualGridFields(coords=fields.coords[keep_t], dual_vertices=fields.dual_vertices[keep_t],
                          intersected=fields.intersected[keep_t], split_weight=fields.split_weight[keep_t],
                          resolution=fields.resolution)


def punch_holes(fields: DualGridFields, centres: np.ndarray, radii_vox: np.ndarray, *, dropout: float = 0.0,
                seed: int = 0) -> DualGridFields:
    """Drop the voxels within ``radii_vox`` voxels of each world ``centres [k, 3]``, and a random
    ``dropout`` fraction of all voxels (pinprick holes, as decoders leave)."""
    coords = fields.coords.numpy()
    centre_vox = (np.asarray(centres, np.float64) + 0.5) * fields.resolution
    keep = np.ones(len(coords), bool)
    for c, r in zip(centre_vox, radii_vox):
        keep &= np.linalg.norm(coords + 0.5 - c, axis=1) > r
    if dropout > 0:
        keep &= np.random.default_rng(seed).uniform(size=len(coords)) >= dropout
    return drop_voxels(fields, keep)


def holey_sphere_fields(resolution: int, *, radii_vox: tuple[float, ...] = (0.75, 1.5, 3.0, 6.0, 12.0),
                        dropout: float = 0.002, seed: int = 0) -> DualGridFields:
    """A sphere (r = 0.3) with holes of ``radii_vox`` voxels around it plus random pinpricks."""
    fields = sdf_dual_grid(sphere_sdf((0.0, 0.0, 0.0), 0.3), resolution, project=False, seed=seed)
    angles = np.linspace(0, 2 * np.pi, len(radii_vox), endpoint=False)
    centres = 0.3 * np.stack([np.cos(angles) * np.cos(0.4), np.sin(angles) * np.cos(0.4),
                              np.full_like(angles, np.sin(0.4))], -1)
    return punch_holes(fields, centres, np.asarray(radii_vox), dropout=dropout, seed=seed)


DECODE_LIKE_SHAPES: dict[str, Callable[[int], DualGridFields]] = {
    "holes": holey_sphere_fields,
    "thin_walls": lambda r: sdf_dual_grid(thin_wall_sdf(r), r, project=False),
    "handle": lambda r: sdf_dual_grid(handle_sdf(), r, project=False),
    "slits": lambda r: sdf_dual_grid(slit_box_sdf(r), r, project=False),
    "components": lambda r: sdf_dual_grid(components_sdf(r), r, project=False),
}
"""Decoded fields at resolution R that have what real decodes have and closed test shapes lack."""
