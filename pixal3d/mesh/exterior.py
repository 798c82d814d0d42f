"""Which corners of the remesh band the outside can reach: a flood fill from the grid border.

The d ≥ 0 region (farther than eps from the surface) is covered by two kinds of pieces: the corners
of the finest cells (``NarrowBand.corners``) and the *free* cells the coarse-to-fine search left out
at every level (d > 0 in the whole cell). They connect:
* two finest corners along a grid edge, both d ≥ 0;
* a finest corner and the free cell (at whatever level) covering one of the 8 cells around it;
* a free cell and the free cell (same level or coarser) across each of its 6 faces;
* the border: any of these touching the outside of the grid joins one extra node.
The component of that extra node is the exterior; corners with d ≥ 0 outside it sit in pockets
enclosed by the thickened shell: the object's interior.

Memory: tens of millions of corners at R = 1024 would make a graph of GBs, so the corners are first
grouped into their connected components slab by slab (scipy ``connected_components`` on each slab's
corners), and only those slab components, the free cells and the outside node form the global graph.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components

from .narrow_band import CORNERS, NarrowBand

_STEPS = np.concatenate([np.eye(3, dtype=np.int64), -np.eye(3, dtype=np.int64)])  # the 6 face directions


def _components(nodes: int, rows: np.ndarray, cols: np.ndarray) -> tuple[int, np.ndarray]:
    graph = sp.coo_matrix((np.ones(len(rows), np.int8), (rows, cols)), shape=(nodes, nodes)).tocsr()
    return connected_components(graph, directed=False)


class _FreeCells:
    """Node ids of the free cells of every level (after ``first_node``), and ancestor lookup."""

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


def _slab_components(band: NarrowBand) -> tuple[np.ndarray, int, list[np.ndarray], list[np.ndarray]]:
    """Component id ``[C]`` (int32, -1 for d < 0) of every corner, from slab-local flood fills, and the
    edges that join components across slab boundaries (``(component, component)`` pairs)."""
    grid, h = band.grid, band.slab_planes()
    n = grid.corner_side
    comp = np.full(len(band.corners), -1, np.int32)
    count, rows, cols = 0, [], []
    for a, _ in band.slabs():
        first = 2 * a * n * n
        lo, hi = np.searchsorted(band.corners, [first, first + 2 * h * n * n])  # own planes 2a … 2a+2h−1
        own = lo + np.flatnonzero(band.values[lo:hi] >= 0)
        if len(own) == 0:
            continue
        local = np.full(hi - lo, -1, np.int64)
        local[own - lo] = np.arange(len(own))
        g = grid.corner_coords(band.corners[own])  # [m, 3]
        index = band.corner_index(a)
        edge_a, edge_b = [], []
        for k in range(3):  # +x, +y, +z grid edges inside the slab's own planes
            nb = g.copy()
            nb[:, k] += 1
            ok = (nb[:, k] <= grid.resolution) & (nb[:, 0] < 2 * a + 2 * h)
            target = np.full(len(g), -1, np.int64)
            target[ok] = index[nb[ok, 0] - 2 * a, nb[ok, 1], nb[ok, 2]]
            ok &= target >= 0
            target_local = np.full(len(g), -1, np.int64)
            target_local[ok] = local[target[ok] - lo]
            ok &= target_local >= 0  # d ≥ 0 at the other end too
            edge_a.append(np.flatnonzero(ok))
            edge_b.append(target_local[ok])
        del index
        found, label = _components(len(own), np.concatenate(edge_a), np.concatenate(edge_b))
        comp[own] = count + label
        count += found
        if a > 0:  # −x edges from this slab's first plane into the previous slab's last one
            at_first = np.flatnonzero(g[:, 0] == 2 * a)
            back = g[at_first].copy()
            back[:, 0] -= 1
            key = (back[:, 0] * n + back[:, 1]) * n + back[:, 2]
            pos = np.minimum(np.searchsorted(band.corners, key), len(band.corners) - 1)
            hit = (band.corners[pos] == key) & (comp[pos] >= 0)
            rows.append(comp[own[at_first[hit]]])
            cols.append(comp[pos[hit]])
    return comp, count, rows, cols


def _corner_links(band: NarrowBand, comp: np.ndarray, free: _FreeCells) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``(component, free cell or outside)`` pairs, deduplicated per slab: a corner with d ≥ 0 joins the
    free cell covering each of the 8 cells around it that is not a finest cell, or the outside."""
    grid, h = band.grid, band.slab_planes()
    n, half = grid.corner_side, grid.resolution // 2
    rows, cols = [], []
    parent_x = band.parents[:, 0]
    for a, _ in band.slabs():
        first = 2 * a * n * n
        lo, hi = np.searchsorted(band.corners, [first, first + 2 * h * n * n])
        own = lo + np.flatnonzero(band.values[lo:hi] >= 0)
        if len(own) == 0:
            continue
        g = grid.corner_coords(band.corners[own])
        lo_p, hi_p = np.searchsorted(parent_x, [a - 1, a + h])
        kept = np.zeros((h + 1, half, half), bool)  # parents with x in [a − 1, a + h)
        p = band.parents[lo_p:hi_p]
        kept[p[:, 0] - (a - 1), p[:, 1], p[:, 2]] = True
        pair_a, pair_b = [], []
        for o in CORNERS:
            cell = g - o
            outside = np.any((cell < 0) | (cell >= grid.resolution), axis=1)
            pair_a.append(comp[own[outside]])
            pair_b.append(np.full(int(outside.sum()), free.outside, np.int64))
            inside = np.flatnonzero(~outside)
            parent = cell[inside] >> 1
            inside = inside[~kept[parent[:, 0] - (a - 1), parent[:, 1], parent[:, 2]]]
            node = free.covering(cell[inside], len(free.sizes))
            pair_a.append(comp[own[inside][node >= 0]])
            pair_b.append(node[node >= 0])
        pairs = np.unique(np.stack([np.concatenate(pair_a).astype(np.int64), np.concatenate(pair_b)], 1), axis=0)
        rows.append(pairs[:, 0])
        cols.append(pairs[:, 1])
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
    comp, count, rows, cols = _slab_components(band)
    free = _FreeCells(band, count)  # global nodes: slab components, then free cells, then the outside
    more_rows, more_cols = _corner_links(band, comp, free)
    free_rows, free_cols = _free_edges(free)
    nodes = free.outside + 1
    dtype = np.int32 if nodes < 2**31 else np.int64
    r = np.concatenate([x.astype(dtype) for x in rows + more_rows + free_rows] or [np.zeros(0, dtype)])
    c = np.concatenate([x.astype(dtype) for x in cols + more_cols + free_cols] or [np.zeros(0, dtype)])
    _, label = _components(nodes, r, c)
    exterior = label[: max(count, 1)] == label[free.outside]  # per slab component
    return (comp >= 0) & exterior[np.maximum(comp, 0)]
