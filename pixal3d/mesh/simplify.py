"""Simplification to a face budget: vertex clustering for huge inputs, then quadric edge collapse.

The quadric-error pass is ``fast_simplification`` (Fast-Quadric-Mesh-Simplification); a
Lindstrom-style vertex-clustering pre-pass first brings a ~10–20 M-face dual-grid mesh (one vertex per
voxel) to a few times the target in O(F), which keeps the QEM's memory and time small.
"""
from __future__ import annotations

import logging
import math

import fast_simplification
import numpy as np

from .cleanup import remove_duplicate_faces, remove_unreferenced_vertices

log = logging.getLogger(__name__)


def cluster_decimate(vertices: np.ndarray, faces: np.ndarray, cell: float) -> tuple[np.ndarray, np.ndarray]:
    """Merge all vertices inside each ``cell``-sized cube into their mean; drop collapsed/duplicate faces."""
    if cell <= 0:
        raise ValueError(f"cell must be > 0, got {cell}")
    grid = np.floor((vertices - vertices.min(0)) / cell).astype(np.int64)
    n = grid.max(0) + 1
    key = (grid[:, 0] * n[1] + grid[:, 1]) * n[2] + grid[:, 2]
    del grid
    _, cluster = np.unique(key, return_inverse=True)
    del key
    count = np.bincount(cluster)
    mean = np.stack([np.bincount(cluster, weights=vertices[:, k]) for k in range(3)], 1) / count[:, None]
    f = cluster[faces].astype(np.int32)
    f = f[(f[:, 0] != f[:, 1]) & (f[:, 1] != f[:, 2]) & (f[:, 2] != f[:, 0])]
    v, f, _ = remove_unreferenced_vertices(mean.astype(np.float32), remove_duplicate_faces(f))
    return v, f


def quadric_simplify(
    vertices: np.ndarray, faces: np.ndarray, target: int, *, tolerance: float = 0.01, max_rounds: int = 4
) -> tuple[np.ndarray, np.ndarray]:
    """Quadric edge collapse to ``target`` faces (within ``tolerance``); retried more aggressively if it stalls."""
    v, f = vertices, faces
    agg = 7.0
    for _ in range(max_rounds):
        if len(f) <= target * (1 + tolerance):
            break
        v64, f64 = fast_simplification.simplify(
            v.astype(np.float64), f.astype(np.int32), target_count=int(target), agg=agg
        )
        v, f = v64.astype(np.float32), f64.astype(np.int32)
        agg += 3.0
    if len(f) > target * (1 + tolerance):
        log.warning("simplification stalled at %d faces (target %d): the mesh is likely non-manifold", len(f), target)
    return v, f


def simplify_mesh(
    vertices: np.ndarray, faces: np.ndarray, target: int, *, voxel_size: float, cluster_above: float = 3.0
) -> tuple[np.ndarray, np.ndarray]:
    """Reduce to ``target`` faces; vertex-cluster first (cells ≥ 1 voxel) when F > ``cluster_above``·target."""
    if target <= 0:
        raise ValueError(f"decimation target must be a positive face count, got {target}")
    if len(faces) > cluster_above * target:
        # A dual-grid mesh has ~2 faces per voxel² of area, so cells of c voxels leave about F/c² faces.
        cell_vox = max(1.0, math.sqrt(len(faces) / (0.8 * cluster_above * target)))
        vertices, faces = cluster_decimate(vertices, faces, cell_vox * voxel_size)
        log.info("vertex clustering at %.2f voxels → %d faces", cell_vox, len(faces))
    if len(faces) > target:
        vertices, faces = quadric_simplify(vertices, faces, target)
    return vertices, faces
