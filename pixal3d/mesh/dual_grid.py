"""Flexible dual grid → triangle mesh (TRELLIS.2 ``flexible_dual_grid_to_mesh``, inference path).

One vertex per voxel at ``(coord + offset) · fl32(1/R) + aabb_min`` (aabb_min = −0.5), the reference's
float32 expression bit for bit. Voxel ``(i, j, k)`` owns, for each axis a,
the grid edge along a through its max corner in the other two axes; a set flag emits one quad
through the 4 voxels around that edge (owner + its +1 neighbours in the other two axes), kept only
when all 4 exist. The quad is split along diagonal 0–2 when ``w0·w2 > w1·w3``, else along 1–3.
Winding is fixed per axis, so the faces still need orienting (``cleanup.orient_faces``).
"""
from __future__ import annotations

import numpy as np

from .fields import DualGridFields
from .sparse_index import SparseIndex

# [axis, corner, xyz]: the 4 voxels around the edge owned by voxel (0, 0, 0), in cyclic order.
QUAD_OFFSETS = np.array(
    [
        [[0, 0, 0], [0, 0, 1], [0, 1, 1], [0, 1, 0]],
        [[0, 0, 0], [1, 0, 0], [1, 0, 1], [0, 0, 1]],
        [[0, 0, 0], [0, 1, 0], [1, 1, 0], [1, 0, 0]],
    ],
    dtype=np.int64,
)
AABB_MIN = np.float32(-0.5)  # the grid's corner in world units (the object spans [-0.5, 0.5]³)
SPLIT_02 = np.array([[0, 1, 2], [0, 2, 3]])
SPLIT_13 = np.array([[0, 1, 3], [3, 1, 2]])


def _as_numpy(t) -> np.ndarray:
    return t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t)


def dual_grid_vertices(coords: np.ndarray, offsets: np.ndarray, resolution: int) -> np.ndarray:
    """World positions in float32 (float16 is too coarse at R = 1024), as the reference computes them:
    ``(coord + offset) * voxel_size + aabb_min`` with ``voxel_size = float32(1) / float32(R)``.

    Multiplying by the rounded ``1/R`` is not the same as dividing by R where R is not a power of two
    (the 1536 cascade's sizes): the results differ by an ulp on some vertices.
    """
    voxel_size = np.float32(1.0) / np.float32(resolution)  # float32 division: the correctly rounded 1/R
    return (coords.astype(np.float32) + offsets.astype(np.float32)) * voxel_size + AABB_MIN


def quads_for_axis(
    coords: np.ndarray, flags: np.ndarray, index: SparseIndex, axis: int, *, chunk: int = 2_000_000
) -> np.ndarray:
    """``[Q, 4]`` int32 voxel indices of the complete quads emitted by flags on ``axis``."""
    rows = np.flatnonzero(flags[:, axis])
    out = []
    for start in range(0, len(rows), chunk):
        base = coords[rows[start : start + chunk]].astype(np.int64)
        quad = np.stack([index.lookup(base + QUAD_OFFSETS[axis, k]) for k in range(4)], axis=1)
        out.append(quad[np.all(quad >= 0, axis=1)])
    return np.concatenate(out) if out else np.zeros((0, 4), np.int32)


def split_quads(quads: np.ndarray, split_weight: np.ndarray) -> np.ndarray:
    """Two triangles per quad, ``[2Q, 3]`` int32; diagonal 0–2 iff ``w0·w2 > w1·w3`` (ties → 1–3)."""
    w = split_weight[quads]
    use_02 = w[:, 0] * w[:, 2] > w[:, 1] * w[:, 3]
    pattern = np.where(use_02[:, None, None], SPLIT_02, SPLIT_13)  # [Q, 2, 3]
    tris = np.take_along_axis(quads[:, None, :], pattern.reshape(len(quads), 1, 6), axis=2)
    return tris.reshape(-1, 3).astype(np.int32, copy=False)


def dual_grid_to_mesh(fields: DualGridFields) -> tuple[np.ndarray, np.ndarray]:
    """Vertices ``[M, 3]`` float32 (one per voxel) and faces ``[F, 3]`` int32 of the raw dual-grid mesh."""
    coords = _as_numpy(fields.coords).astype(np.int32, copy=False)
    offsets = _as_numpy(fields.dual_vertices)
    flags = _as_numpy(fields.intersected).astype(bool, copy=False)
    weights = _as_numpy(fields.split_weight).astype(np.float32, copy=False).reshape(-1)
    n = len(coords)
    if offsets.shape != (n, 3) or flags.shape != (n, 3) or weights.shape != (n,):
        raise ValueError(
            f"DualGridFields rows disagree: coords {coords.shape}, dual_vertices {offsets.shape}, "
            f"intersected {flags.shape}, split_weight {weights.shape}; all need the same M"
        )
    index = SparseIndex(coords, fields.resolution)
    faces = [split_quads(quads_for_axis(coords, flags, index, a), weights) for a in range(3)]
    del index
    return dual_grid_vertices(coords, offsets, fields.resolution), np.concatenate(faces)
