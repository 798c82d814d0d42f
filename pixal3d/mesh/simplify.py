"""Simplification to a face budget: a bounded-memory pre-pass for huge inputs, then quadric collapse.

The quadric-error pass is ``fast_simplification`` (Fast-Quadric-Mesh-Simplification, ~300 B of
working memory per face: 6 GB at 20 M faces). Two pre-passes bring a ~10–20 M-face dual-grid mesh to
a few times the target first:
* ``"tiles"`` (default): the same QEM on slabs of at most ``max_tile_faces`` faces with their cut
  borders frozen, stitched back through the unchanged border vertices. Keeps the mesh manifold.
* ``"cluster"``: Lindstrom-style vertex clustering, O(F) and fastest, but merging cells creates
  non-manifold edges (~1–2 % of edges on smooth shapes), which later show up as UV overlaps.
"""
from __future__ import annotations

import logging
import math

import fast_simplification
import numpy as np

from .cleanup import remove_duplicate_faces, remove_unreferenced_vertices
from .workers import ordered_map, resolve_workers

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


# Faces per slab of a tiled QEM: max_tile_faces // SLAB_SHARE. A constant, not the worker count, so that the cuts (and
# with them the pre-pass's mesh) are the same on every machine; 2 is what a 2-core machine used when it was the workers.
SLAB_SHARE = 2


def simplify_slab(job: tuple[np.ndarray, np.ndarray, int]) -> tuple[np.ndarray, np.ndarray]:
    """One slab's QEM ``(vertices, faces, target)`` with its cut border frozen, so that ``stitch_slabs`` can join it
    to its neighbours (a worker process's task: arguments and result are pickled)."""
    vertices, faces, target = job
    pv, pf = fast_simplification.simplify(vertices.astype(np.float64), faces, target_count=target,
                                          preserve_border=True)
    return pv.astype(np.float32), pf.astype(np.int32)


def stitch_slabs(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Join slab meshes whose shared border vertices are bit-identical in both slabs (frozen, or never simplified)
    by exact vertex value: float32 vertices (sorted), int32 faces."""
    v = np.concatenate([p[0] for p in parts])
    offsets = np.cumsum([0] + [len(p[0]) for p in parts[:-1]])
    f = np.concatenate([p[1].astype(np.int64) + o for p, o in zip(parts, offsets, strict=True)])
    merged, inverse = np.unique(v, axis=0, return_inverse=True)
    return merged, inverse.reshape(-1)[f].astype(np.int32)


def tiled_quadric_simplify(
    vertices: np.ndarray, faces: np.ndarray, target: int, *, max_tile_faces: int, workers: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """QEM slab by slab (cut borders frozen) so that no single QEM holds more than ``max_tile_faces``.

    Slabs of about ``max_tile_faces // SLAB_SHARE`` faces, a count that depends on the mesh alone (so the result is
    the same on every machine); ``workers`` forked processes (default one per core, at most 4) simplify them at
    once, and one worker simplifies them one at a time here. The result depends on the number of slabs, not on
    which process ran one.
    """
    n_tiles = -(-len(faces) // max(1, max_tile_faces // SLAB_SHARE))
    workers = min(resolve_workers(workers, processes=True), n_tiles)
    axis = int(np.argmax(vertices.max(0) - vertices.min(0)))
    centre = vertices[faces[:, 0], axis] + vertices[faces[:, 1], axis] + vertices[faces[:, 2], axis]
    cuts = np.quantile(centre, np.linspace(0, 1, n_tiles + 1)[1:-1])
    tile = np.searchsorted(cuts, centre)
    del centre
    ratio = target / len(faces)

    def jobs():
        for t in range(n_tiles):
            ids = np.flatnonzero(tile == t)
            verts, local = np.unique(faces[ids], return_inverse=True)
            yield vertices[verts], local.reshape(-1, 3).astype(np.int32), max(4, int(len(ids) * ratio))

    return stitch_slabs(list(ordered_map(simplify_slab, jobs(), workers, processes=True)))


PREPASSES = ("tiles", "cluster")


def simplify_mesh(
    vertices: np.ndarray,
    faces: np.ndarray,
    target: int,
    *,
    voxel_size: float,
    prepass: str = "tiles",
    prepass_above: float = 3.0,
    max_tile_faces: int = 2_000_000,
    workers: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Reduce to ``target`` faces; when F > ``prepass_above``·target, first run the bounded pre-pass
    (``"tiles"``: to ``prepass_above``·target, only if F exceeds ``max_tile_faces``, its slabs on ``workers``
    forked processes; ``"cluster"``)."""
    if target <= 0:
        raise ValueError(f"decimation target must be a positive face count, got {target}")
    if prepass not in PREPASSES:
        raise ValueError(f"prepass must be one of {PREPASSES}, got {prepass!r}")
    if prepass == "tiles" and len(faces) > max(prepass_above * target, max_tile_faces):
        vertices, faces = tiled_quadric_simplify(
            vertices, faces, int(prepass_above * target) // 2 * 2, max_tile_faces=max_tile_faces, workers=workers
        )
        log.info("tiled QEM pre-pass → %d faces", len(faces))
    elif prepass == "cluster" and len(faces) > prepass_above * target:
        # A dual-grid mesh has ~2 faces per voxel² of area, so cells of c voxels leave about F/c² faces.
        cell_vox = max(1.0, math.sqrt(len(faces) / (0.8 * prepass_above * target)))
        vertices, faces = cluster_decimate(vertices, faces, cell_vox * voxel_size)
        log.info("vertex clustering at %.2f voxels → %d faces", cell_vox, len(faces))
    if len(faces) > target:
        vertices, faces = quadric_simplify(vertices, faces, target)
    return vertices, faces
