"""Which corners of the remesh band the outside can reach: a flood fill from the grid border.

The d ≥ 0 region (farther than eps from the surface) is covered by two kinds of pieces: the corners
of the finest cells (``NarrowBand.corners``) and the *free* cells the coarse-to-fine search left out
at every level (d > 0 in the whole cell). One graph joins them:
* two finest corners along a grid edge, both d ≥ 0;
* a finest corner and the free cell (at whatever level) covering one of the 8 cells around it;
* a free cell and the free cell (same level or coarser) across each of its 6 faces;
* the border: any of these touching the outside of the grid joins one extra node.
Its connected component through that extra node is the exterior (scipy ``connected_components``).
Corners with d ≥ 0 outside it sit in pockets enclosed by the thickened shell: the object's interior.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components

from .narrow_band import CORNERS, NarrowBand

_STEPS = np.concatenate([np.eye(3, dtype=np.int64), -np.eye(3, dtype=np.int64)])  # the 6 face directions


class _FreeCells:
    """Node ids of the free cells of every level (after the C corner nodes), and ancestor lookup."""

    def __init__(self, band: NarrowBand, first_node: int) -> None:
        self.sizes = [n for n, _ in band.free]
        self.keys = [keys for _, keys in band.free]
        self.offsets = np.cumsum([first_node] + [len(k) for k in self.keys])
        self.outside = int(self.offsets[-1])  # the extra node for the outside of the grid

    def covering(self, cells: np.ndarray, level: int) -> np.ndarray:
        """Node of the free cell covering each ``cells [m, 3]`` of level ``level`` (an index into the
        levels, ``len(levels)`` for the finest cells), or -1. Ancestors are kept cells until the
        coarsest left-out one, so the first ancestor found in a free set is the covering one."""
        out = np.full(len(cells), -1, np.int64)
        pending = np.arange(len(cells))
        for j in range(min(level, len(self.sizes) - 1), -1, -1):
            if len(pending) == 0:
                break
            anc = cells[pending] >> (level - j)
            n = self.sizes[j]
            key = (anc[:, 0] * n + anc[:, 1]) * n + anc[:, 2]
            pos = np.minimum(np.searchsorted(self.keys[j], key), max(len(self.keys[j]) - 1, 0))
            hit = (self.keys[j][pos] == key) if len(self.keys[j]) else np.zeros(len(key), bool)
            out[pending[hit]] = self.offsets[j] + pos[hit]
            pending = pending[~hit]
        return out


def _corner_edges(band: NarrowBand, free: _FreeCells) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Edges of the finest corners with d ≥ 0, slab by slab: along grid edges, to free cells, to outside."""
    grid, h = band.grid, band.slab_planes()
    n, half = grid.corner_side, grid.resolution // 2
    rows, cols = [], []
    parent_x = band.parents[:, 0]
    for a, _ in band.slabs():
        first = 2 * a * n * n
        lo, hi = np.searchsorted(band.corners, [first, first + 2 * h * n * n])  # own planes 2a … 2a+2h−1
        own = np.arange(lo, hi)[band.values[lo:hi] >= 0]
        if len(own) == 0:
            continue
        g = grid.corner_coords(band.corners[own])  # [m, 3]
        index = band.corner_index(a)
        for k in range(3):  # along the +x, +y, +z grid edges
            nb = g.copy()
            nb[:, k] += 1
            ok = nb[:, k] <= grid.resolution
            target = np.full(len(g), -1, np.int64)
            target[ok] = index[nb[ok, 0] - 2 * a, nb[ok, 1], nb[ok, 2]]
            ok &= target >= 0
            ok[ok] &= band.values[target[ok]] >= 0
            rows.append(own[ok])
            cols.append(target[ok])
        # the 8 cells around each corner: outside the grid, a finest cell (child of a kept parent), or free
        lo_p, hi_p = np.searchsorted(parent_x, [a - 1, a + h])
        kept = np.zeros((h + 1, half, half), bool)  # parents with x in [a − 1, a + h)
        p = band.parents[lo_p:hi_p]
        kept[p[:, 0] - (a - 1), p[:, 1], p[:, 2]] = True
        for o in CORNERS:
            cell = g - o
            outside = np.any((cell < 0) | (cell >= grid.resolution), axis=1)
            rows.append(own[outside])
            cols.append(np.full(int(outside.sum()), free.outside, np.int64))
            inside = np.flatnonzero(~outside)
            parent = cell[inside] >> 1
            finest = kept[parent[:, 0] - (a - 1), parent[:, 1], parent[:, 2]]
            inside = inside[~finest]
            node = free.covering(cell[inside], len(free.sizes))
            rows.append(own[inside][node >= 0])
            cols.append(node[node >= 0])
    return rows, cols


def _free_edges(free: _FreeCells) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each free cell to the free cell across each face (same level or coarser) or to the outside."""
    rows, cols = [], []
    for j, (n, keys) in enumerate(zip(free.sizes, free.keys)):
        if len(keys) == 0:
            continue
        cells = np.stack([keys // (n * n), (keys // n) % n, keys % n], axis=1)
        node = free.offsets[j] + np.arange(len(keys))
        for step in _STEPS:
            nb = cells + step
            outside = np.any((nb < 0) | (nb >= n), axis=1)
            rows.append(node[outside])
            cols.append(np.full(int(outside.sum()), free.outside, np.int64))
            inside = np.flatnonzero(~outside)
            target = free.covering(nb[inside], j)
            rows.append(node[inside][target >= 0])
            cols.append(target[target >= 0])
    return rows, cols


def exterior_corners(band: NarrowBand) -> np.ndarray:
    """``[C]`` bool: the corner has d ≥ 0 and is connected to the outside of the grid through d ≥ 0."""
    if len(band.free) != len(band.grid.levels()):
        raise ValueError("the narrow band was built without free cells: call narrow_band(..., keep_free=True)")
    free = _FreeCells(band, len(band.corners))
    rows, cols = _corner_edges(band, free)
    more_rows, more_cols = _free_edges(free)
    nodes = free.outside + 1
    dtype = np.int32 if nodes < 2**31 else np.int64
    r = np.concatenate([x.astype(dtype) for x in rows + more_rows])
    c = np.concatenate([x.astype(dtype) for x in cols + more_cols])
    del rows, cols, more_rows, more_cols
    graph = sp.coo_matrix((np.ones(len(r), np.int8), (r, c)), shape=(nodes, nodes)).tocsr()
    del r, c
    _, label = connected_components(graph, directed=False)
    return (label[: len(band.corners)] == label[free.outside]) & (band.values >= 0)
