"""The remesh and the simplifier's pre-pass together, slab by slab: the full-resolution contour never exists whole.

At 9M decoded voxels the narrow-band contour has ~36M faces (0.9 GB with its vertices, cells and corner values),
and the tiled QEM pre-pass then cut it into slabs anyway. Here the band's kept parents (narrow_band steps 1-2, one
search over the whole domain) are cut into x-slabs of about equal size; each slab is contoured on its own (its
corners' UDF, its cells, the quads of the edges its cells own, reaching one parent plane into the next slab) and
simplified at once to its share of ``prepass_above · target`` with its cut border frozen, in forked workers
(``workers.ordered_map``) or, with one worker, each slab in a forked child of its own (``isolated.run_isolated``:
the quadric simplifier's buffers leave with the child, not under the next slab). The slabs meet at the cut: a dual vertex there is computed from the same corner values
in both, bit for bit, and frozen in both, so the slabs are stitched by exact vertex value, as the tiled pre-pass
stitches its tiles. What remains is ``simplify``'s final QEM.

Where the contour is small (at most ``max(prepass_above · target, max_tile_faces)`` faces, estimated from the band),
there is one slab and no pre-pass: exactly ``remesh.remesh``'s mesh. ``exterior_only`` (a flood fill over the whole
band) stays with ``remesh.remesh``.
"""
from __future__ import annotations

import logging

import numpy as np

from pixal3d.staging.stream import release_freed_heap

from .distance import SurfaceDistance
from .isolated import can_isolate, run_isolated
from .narrow_band import RemeshGrid, band_of, band_parents
from .remesh import contour_cells, dual_mesh
from .simplify import SLAB_SHARE, simplify_slab, stitch_slabs
from .workers import MAX_WORKERS, ordered_map, resolve_workers

log = logging.getLogger(__name__)

FACES_PER_PARENT = 8.7  # contour faces per kept R/2 cell: 8.65 at 3M and 9M voxels (blobby shape), 2 sheets

# The forked workers' view of the band: set before the workers fork, read there (not pickled per slab).
_BAND: tuple[SurfaceDistance, RemeshGrid, np.ndarray] | None = None


def slab_bounds(parents: np.ndarray, slabs: int) -> list[tuple[int, int]]:
    """Parent-plane ranges ``[x0, x1)`` covering every parent, about equal in parents, at least one plane each."""
    x = parents[:, 0]
    planes = np.unique(x)
    if slabs <= 1 or len(planes) <= 1:
        return [(int(planes[0]), int(planes[-1]) + 1)] if len(planes) else []
    cuts = np.unique(x[np.linspace(0, len(x), slabs + 1)[1:-1].astype(np.int64)])  # planes where a slab starts
    starts = np.unique(np.r_[planes[0], cuts[cuts > planes[0]]])
    ends = np.r_[starts[1:], planes[-1] + 1]
    return [(int(a), int(b)) for a, b in zip(starts, ends, strict=True)]


def slab_mesh(udf: SurfaceDistance, grid: RemeshGrid, parents: np.ndarray,
              bounds: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The contour's part owned by the parents with x in ``[x0, x1)``: float32 vertices, int32 faces."""
    x0, x1 = bounds
    lo, hi = np.searchsorted(parents[:, 0], [x0, x1 + 1])  # plus plane x1: the quads that reach into it
    band = band_of(udf, grid, parents[lo:hi])
    cells = contour_cells(band, band.values)
    del band
    return dual_mesh(cells, grid, owners=(2 * x0, 2 * x1))


def _slab_job(job: tuple[tuple[int, int], float | None, bool]) -> tuple[np.ndarray, np.ndarray]:
    bounds, ratio, serial_udf = job
    udf, grid, parents = _BAND
    if serial_udf:
        udf.threads = 1  # this worker's copy: the other workers have the other cores
    v, f = slab_mesh(udf, grid, parents, bounds)
    if ratio is None or len(f) == 0:
        return v, f
    return simplify_slab((v, f, max(4, int(len(f) * ratio))))


def remesh_presimplified(
    vertices: np.ndarray,
    faces: np.ndarray,
    *,
    resolution: int,
    band: float = 1.0,
    target: int,
    prepass_above: float = 3.0,
    max_tile_faces: int = 2_000_000,
    workers: int | None = None,
) -> tuple[tuple[np.ndarray, np.ndarray], dict]:
    """``remesh.remesh`` of ``(vertices, faces)`` and, where the contour is large, the simplifier's pre-pass to
    about ``prepass_above · target`` faces, slab by slab. Returns ``((vertices, faces), detail)``."""
    global _BAND
    grid = RemeshGrid(resolution, band)
    udf = SurfaceDistance(vertices, faces)
    parents, _ = band_parents(udf, grid)
    release_freed_heap()  # the search's levels (~0.3 GB at 9M voxels) back to the system, not under every slab
    estimate = FACES_PER_PARENT * len(parents)
    workers = resolve_workers(workers, processes=True)  # 1 where this process cannot fork: one slab at a time here
    large = estimate > max(prepass_above * target, max_tile_faces)
    # at least MAX_WORKERS slabs, each about max_tile_faces // SLAB_SHARE faces: neither depends on this machine
    slabs = max(MAX_WORKERS, int(np.ceil(estimate / max(1, max_tile_faces // SLAB_SHARE)))) if large else 1
    bounds = slab_bounds(parents, slabs)
    ratio = prepass_above * target / estimate if large else None
    _BAND = (udf, grid, parents)
    try:
        jobs = [(b, ratio, large and workers > 1) for b in bounds]
        if large and workers == 1 and can_isolate():
            # one slab at a time, each in a fresh child: the quadric simplifier keeps its buffers (~0.3 GB per slab)
            # until its process exits, and they would sit under every later slab's contour here
            parts = [run_isolated(_slab_job, job) for job in jobs]
        else:
            parts = list(ordered_map(_slab_job, jobs, workers if large else 1, processes=True))
    finally:
        _BAND = None
    del udf
    detail = {"parents": len(parents), "slabs": len(bounds), "presimplified": large}
    if not parts:
        return (np.zeros((0, 3), np.float32), np.zeros((0, 3), np.int32)), detail
    if len(parts) == 1:
        return parts[0], detail
    # Each slab's cut border was frozen (or never simplified): a vertex on a cut is bit-identical in both slabs.
    v, f = stitch_slabs(parts)
    log.info("remesh in %d slabs: %d parents, %d faces after the pre-pass", len(bounds), len(parents), len(f))
    return (v, f), detail
