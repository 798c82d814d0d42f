"""What peers bake beside the PBR colours: a tangent-space normal map and an ambient-occlusion map, in torch.

Both run on whatever device their tensors are on (CUDA, MPS or the CPU: the tests run them on CPU tensors).

* Normal map: the simplified mesh carries a tangent frame per vertex (``vertex_tangents``: Lengyel's per-face
  dP/du, dP/dv summed per vertex, Gram-Schmidt against the vertex normal, handedness in w; written to the GLB as
  TANGENT, so a viewer decodes in the very frame the map was baked in). At each texel the decoded surface's normal
  (``VoxelNormals``: one normal per decoded voxel, the area-weighted normal of its dual vertex, sampled trilinearly
  like the PBR voxels) is expressed in the texel's interpolated frame and stored as ``0.5·n + 0.5``. The decoded
  surface is not consistently wound, so every voxel normal is sign-aligned to the low-poly normal before blending.
* Occlusion: per vertex of the simplified mesh, ``rays`` fixed cosine-weighted directions around its normal are
  marched through an occupancy grid of the decoded voxels (at most 256³ cells, a bool each) up to ``distance``;
  AO = the share of rays that escape. The texture interpolates it per texel (``interpolate``).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .sparse_index import SparseIndex

OCCUPANCY_CELLS = 256  # the occlusion grid's cells per axis at most (16 MiB of bools)


def as_tensor(array, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
    """A numpy array or tensor as a tensor on ``device`` (no copy where it already is one there)."""
    t = array if isinstance(array, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(array))
    return t.to(device=device, dtype=dtype or t.dtype)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-20)


def vertex_tangents(positions: torch.Tensor, normals: torch.Tensor, uvs: torch.Tensor,
                    faces: torch.Tensor) -> torch.Tensor:
    """``[V, 4]`` float32 unit tangents (xyz along +u, orthogonal to the normal) and handedness w = ±1 such that
    ``cross(normal, tangent) · w`` points along +v (the bitangent glTF readers rebuild)."""
    p = positions.to(torch.float32)
    f = faces.long()
    e1, e2 = p[f[:, 1]] - p[f[:, 0]], p[f[:, 2]] - p[f[:, 0]]  # [F, 3]
    d1, d2 = uvs[f[:, 1]] - uvs[f[:, 0]], uvs[f[:, 2]] - uvs[f[:, 0]]  # [F, 2]
    det = d1[:, 0] * d2[:, 1] - d2[:, 0] * d1[:, 1]
    r = torch.where(det.abs() > 1e-20, 1.0 / torch.where(det == 0, torch.ones_like(det), det), torch.zeros_like(det))
    sdir = (e1 * d2[:, 1:2] - e2 * d1[:, 1:2]) * r[:, None]  # dP/du
    tdir = (e2 * d1[:, 0:1] - e1 * d2[:, 0:1]) * r[:, None]  # dP/dv
    tan = torch.zeros_like(p)
    bit = torch.zeros_like(p)
    for k in range(3):
        tan.index_add_(0, f[:, k], sdir)
        bit.index_add_(0, f[:, k], tdir)
    n = _unit(normals.to(torch.float32))
    t = tan - n * (n * tan).sum(-1, keepdim=True)
    # a vertex whose faces give no u direction (degenerate UVs): any unit vector orthogonal to n
    fallback = torch.where(n[:, :1].abs() < 0.9, torch.tensor([1.0, 0.0, 0.0], device=p.device),
                           torch.tensor([0.0, 1.0, 0.0], device=p.device))
    fallback = fallback - n * (n * fallback).sum(-1, keepdim=True)
    t = torch.where(t.norm(dim=-1, keepdim=True) > 1e-12, t, fallback)
    t = _unit(t)
    w = torch.where((torch.cross(n, t, dim=-1) * bit).sum(-1) < 0, -1.0, 1.0)
    return torch.cat([t, w[:, None]], dim=1)


def interpolate(values: torch.Tensor, faces: torch.Tensor, face_id: torch.Tensor, bary: torch.Tensor) -> torch.Tensor:
    """Per-vertex ``values [V, C]`` at texels of faces ``face_id [n]`` with barycentrics ``bary [n, 2]`` (weights of
    the face's vertices 1 and 2): ``[n, C]``."""
    corners = faces[face_id].long()  # [n, 3]
    b1, b2 = bary[:, :1], bary[:, 1:]
    return values[corners[:, 0]] * (1 - b1 - b2) + values[corners[:, 1]] * b1 + values[corners[:, 2]] * b2


class VoxelNormals:
    """The decoded surface's normal field: one unit normal per decoded voxel (its dual vertex's area-weighted
    normal, sign-aligned to one of its faces); the bake samples it trilinearly at voxel centres with each corner's
    sign aligned to the low-poly normal first (the decoded surface has no consistent winding)."""

    def __init__(self, vertices: np.ndarray, faces: np.ndarray, coords: np.ndarray, resolution: int,
                 *, device: torch.device | str = "cpu") -> None:
        n_voxels = len(coords)
        v = as_tensor(vertices, device, torch.float32)
        f = as_tensor(np.asarray(faces, np.int32), device)  # int32 whole, int64 a chunk at a time (memory)
        normal = torch.zeros((len(v), 3), device=device)
        chunk = 1 << 21
        # each vertex aligns its faces' normals to the normal of its first face (deterministic, unlike a scatter)
        first = torch.full((len(v),), len(f), dtype=torch.long, device=device)
        for s in range(0, len(f), chunk):
            ff = f[s : s + chunk].long()
            order = torch.arange(s, s + len(ff), device=device)
            for k in range(3):
                first.scatter_reduce_(0, ff[:, k], order, reduce="amin")
        first = first.clamp_max(max(len(f) - 1, 0))
        ref = torch.empty((len(v), 3), device=device)
        for s in range(0, len(v), chunk):
            ff = f[first[s : s + chunk]].long()
            ref[s : s + chunk] = torch.cross(v[ff[:, 1]] - v[ff[:, 0]], v[ff[:, 2]] - v[ff[:, 0]], dim=-1)
        del first
        for s in range(0, len(f), chunk):
            ff = f[s : s + chunk].long()
            fn = torch.cross(v[ff[:, 1]] - v[ff[:, 0]], v[ff[:, 2]] - v[ff[:, 0]], dim=-1)
            for k in range(3):
                sign = torch.where((fn * ref[ff[:, k]]).sum(-1, keepdim=True) < 0, -1.0, 1.0)
                normal.index_add_(0, ff[:, k], sign * fn)
        del ref
        normal = normal[:n_voxels]  # the dual vertices come first, one per voxel
        normal /= normal.norm(dim=-1, keepdim=True).clamp_min(1e-20)  # _unit's values, in place (no second field)
        self.normals = normal.cpu().numpy()
        self.coords = np.asarray(coords)

    def on(self, index: SparseIndex) -> np.ndarray:
        """``[M, 3]`` float32: the normal of each voxel of ``index`` (the PBR voxels' rows: the bake samples
        both with the same corner lookups), zero where the decoded surface has no vertex in that voxel."""
        out = np.zeros((int(index.table.max(initial=-1)) + 1, 3), np.float32)
        chunk = 1 << 20  # the lookup's int64 temporaries a chunk at a time (whole: ~0.7 GB at 9M voxels)
        for s in range(0, len(self.coords), chunk):
            rows = index.lookup(self.coords[s : s + chunk])
            found = rows >= 0
            out[rows[found]] = self.normals[s : s + chunk][found]
        return out

    def take(self, index: SparseIndex) -> np.ndarray:
        """``on(index)``, releasing this field's own arrays (two per voxel) before the caller's work goes on:
        the bake's, which needs only the normals on the PBR voxels' rows. Reading the field again is an error."""
        out = self.on(index)
        self.normals = self.coords = None
        return out


def encode_normals(world: torch.Tensor, normal: torch.Tensor, tangent: torch.Tensor) -> torch.Tensor:
    """Tangent-space ``[n, 3]`` uint8 texels of world normals in the interpolated frame (normal, tangent xyzw)."""
    n = _unit(normal.to(torch.float32))
    t = tangent[:, :3].to(torch.float32)
    t = _unit(t - n * (n * t).sum(-1, keepdim=True))
    b = torch.cross(n, t, dim=-1) * tangent[:, 3:4]
    local = torch.stack([(world * t).sum(-1), (world * b).sum(-1), (world * n).sum(-1)], dim=-1)
    return torch.round((_unit(local) * 0.5 + 0.5) * 255).clamp(0, 255).to(torch.uint8)


def decode_normals(texels: torch.Tensor, normal: torch.Tensor, tangent: torch.Tensor) -> torch.Tensor:
    """World unit normals from tangent-space uint8 texels (what a glTF viewer computes); the tests' inverse."""
    n = _unit(normal.to(torch.float32))
    t = tangent[:, :3].to(torch.float32)
    t = _unit(t - n * (n * t).sum(-1, keepdim=True))
    b = torch.cross(n, t, dim=-1) * tangent[:, 3:4]
    local = texels.to(torch.float32) / 255 * 2 - 1
    return _unit(local[:, :1] * t + local[:, 1:2] * b + local[:, 2:3] * n)


def hemisphere_directions(count: int) -> torch.Tensor:
    """``[count, 3]`` fixed cosine-weighted directions about +z (a Fibonacci spiral on the disc, lifted)."""
    k = torch.arange(count, dtype=torch.float64) + 0.5
    r = torch.sqrt(k / count)
    phi = k * math.pi * (3 - math.sqrt(5))
    d = torch.stack([r * torch.cos(phi), r * torch.sin(phi), torch.sqrt(1 - r * r)], dim=-1)
    return d.to(torch.float32)


def occupancy_grid(coords: np.ndarray, resolution: int, *, device: torch.device | str = "cpu",
                   cells: int = OCCUPANCY_CELLS, chunk: int = 1 << 20) -> tuple[torch.Tensor, int]:
    """A dense bool grid ``[G, G, G]`` (G ≤ ``cells``) marking cells holding a decoded voxel, and its G."""
    factor = max(1, -(-resolution // cells))
    size = -(-resolution // factor)
    grid = torch.zeros((size, size, size), dtype=torch.bool, device=device)
    for s in range(0, len(coords), chunk):  # int64 indices a chunk at a time (all at once: 0.4 GB at 9M voxels)
        c = as_tensor(coords[s : s + chunk], device).long() // factor
        grid[c[:, 0], c[:, 1], c[:, 2]] = True
    return grid, size


def vertex_occlusion(positions: torch.Tensor, normals: torch.Tensor, grid: torch.Tensor, *, rays: int,
                     distance: float, chunk: int = 1 << 15) -> torch.Tensor:
    """``[V]`` float32 in [0, 1]: the share of ``rays`` cosine-weighted rays from each vertex (world positions in
    [-0.5, 0.5]³) that cross no occupied cell within ``distance``; 1 = open sky."""
    size = grid.shape[0]
    cell = 1.0 / size
    steps = max(1, math.ceil(distance / cell))
    local = hemisphere_directions(rays).to(positions.device)  # [K, 3]
    out = torch.empty(len(positions), dtype=torch.float32, device=positions.device)
    along = (torch.arange(steps, device=positions.device, dtype=torch.float32) + 1.0) * cell  # [S]
    for s in range(0, len(positions), chunk):
        p = positions[s : s + chunk].to(torch.float32)
        n = _unit(normals[s : s + chunk].to(torch.float32))
        helper = torch.where(n[:, :1].abs() < 0.9, torch.tensor([1.0, 0.0, 0.0], device=p.device),
                             torch.tensor([0.0, 1.0, 0.0], device=p.device))
        t = _unit(torch.cross(n, helper, dim=-1))
        b = torch.cross(n, t, dim=-1)
        d = local[None, :, :1] * t[:, None] + local[None, :, 1:2] * b[:, None] + local[None, :, 2:] * n[:, None]
        # start 1.5 cells out along the normal: the vertex's own shell cell is occupied
        start = p + 1.5 * cell * n  # [n, 3]
        points = start[:, None, None] + d[:, :, None] * along[None, None, :, None]  # [n, K, S, 3]
        g = torch.floor((points + 0.5) * size).long()
        inside = ((g >= 0) & (g < size)).all(-1)
        g = g.clamp(0, size - 1)
        hit = grid[g[..., 0], g[..., 1], g[..., 2]] & inside
        out[s : s + chunk] = 1.0 - hit.any(-1).float().mean(-1)
    return out
