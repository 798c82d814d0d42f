"""Unsigned distance from points to a triangle mesh without a BVH: nearest vertices, then their faces.

A ``cKDTree`` over the mesh vertices finds the ``k`` nearest vertices of each query point; the exact
closest point is then taken over every face incident to those vertices (any valence: the incident
faces are kept as a CSR list, not a fixed-width table). On a dense mesh (the decoded surface has about
one vertex per voxel) the true closest face is incident to the nearest vertex except in rare
configurations, where the error is a fraction of an edge length. The remesh uses it as its UDF,
the quality metrics for point-to-surface distances. Chunks of queries run on a few threads (the
KD-tree and numpy release the GIL); the result does not depend on how many.
"""
from __future__ import annotations

import numpy as np

from .workers import default_workers, ordered_map


def point_triangle_distance2(p: np.ndarray | None, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Squared distance ``[n]`` from points ``p`` to triangles ``(a, b, c)``, all ``[3, n]`` (coordinate-major,
    so every product below runs over contiguous rows).

    Ericson, Real-Time Collision Detection §5.1.5: the closest point is ``a + s·ab + t·ac`` with (s, t)
    chosen by the Voronoi region of p (vertex, edge or face), tested in the book's order. Degenerate
    (zero-area) triangles are measured against their three edges instead. numpy, single-threaded on
    purpose: on a busy 2-core machine torch's threaded elementwise ops were 30× slower here.
    """
    ab, ac = b - a, c - a
    ap = -a if p is None else p - a  # None: the origin (the caller moved the triangles by -p)

    def dot(u: np.ndarray, v: np.ndarray) -> np.ndarray:
        return u[0] * v[0] + u[1] * v[1] + u[2] * v[2]

    def ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
        return num / np.where(den == 0, 1, den)

    d1, d2 = dot(ab, ap), dot(ac, ap)
    abab, acac, abac = dot(ab, ab), dot(ac, ac), dot(ab, ac)
    d3, d4 = d1 - abab, d2 - abac  # ab·(p − b), ac·(p − b)
    d5, d6 = d1 - abac, d2 - acac  # ab·(p − c), ac·(p − c)
    va, vb, vc = d3 * d6 - d5 * d4, d5 * d2 - d1 * d6, d1 * d4 - d3 * d2
    total = va + vb + vc
    s, t = ratio(vb, total), ratio(vc, total)  # inside the face; the regions below override it
    region = (  # lowest priority first: a later region wins, as the book's early returns do
        ((va <= 0) & (d4 >= d3) & (d5 >= d6), None, ratio(d4 - d3, (d4 - d3) + (d5 - d6))),  # edge bc
        ((vb <= 0) & (d2 >= 0) & (d6 <= 0), 0.0, ratio(d2, d2 - d6)),  # edge ac
        ((d6 >= 0) & (d5 <= d6), 0.0, 1.0),  # vertex c
        ((vc <= 0) & (d1 >= 0) & (d3 <= 0), ratio(d1, d1 - d3), 0.0),  # edge ab
        ((d3 >= 0) & (d4 <= d3), 1.0, 0.0),  # vertex b
        ((d1 <= 0) & (d2 <= 0), 0.0, 0.0),  # vertex a
    )
    for mask, s_new, t_new in region:
        if s_new is None:  # edge bc: b + w·(c − b) = a + (1 − w)·ab + w·ac
            s, t = np.where(mask, 1 - t_new, s), np.where(mask, t_new, t)
        else:
            s, t = np.where(mask, s_new, s), np.where(mask, t_new, t)
    diff = ap - s * ab - t * ac
    out = dot(diff, diff)
    degenerate = abab * acac - abac * abac <= 1e-12 * abab * acac
    if degenerate.any():
        q = np.zeros_like(a[:, degenerate]) if p is None else p[:, degenerate]
        out[degenerate] = _edge_distance2(q, a[:, degenerate], b[:, degenerate], c[:, degenerate])
    return out


def _edge_distance2(p: np.ndarray, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Squared distance to the three clamped edges of each triangle (``[3, n]`` inputs)."""
    best = None
    for s, e in ((a, b), (b, c), (c, a)):
        d = e - s
        t = ((p - s) * d).sum(0) / np.maximum((d * d).sum(0), 1e-30)
        diff = p - s - np.clip(t, 0, 1) * d
        dist = (diff * diff).sum(0)
        best = dist if best is None else np.minimum(best, dist)
    return best


def z_order(points: np.ndarray, bits: int = 10) -> np.ndarray:
    """The permutation that sorts ``points [N, 3]`` along a Z-order (Morton) curve over their bounding box, at
    ``2^bits`` cells per axis (stable: ties keep their order)."""
    if len(points) < 2:
        return np.arange(len(points))
    lo, hi = points.min(0), points.max(0)
    cells = np.clip(((points - lo) * ((1 << bits) / np.maximum(hi - lo, 1e-30))).astype(np.int64), 0, (1 << bits) - 1)
    key = np.zeros(len(points), np.int64)
    for b in range(bits):
        for a in range(3):
            key |= ((cells[:, a] >> b) & 1) << (3 * b + a)
    return np.argsort(key, kind="stable")


def incident_faces(corner_owner: np.ndarray, start: np.ndarray, *, chunk: int = 1 << 20) -> np.ndarray:
    """``[3F]`` int32 face of each corner, grouped by the corner's vertex (``corner_owner [3F]``; ``start [V + 1]``
    the groups' offsets), each group in corner order: what ``argsort(corner_owner, kind="stable") // 3`` gives,
    a chunk of corners at a time (each chunk's corners go after those of earlier chunks in their groups)."""
    out = np.empty(len(corner_owner), np.int32)
    filled = start[:-1].copy()  # [V] the next free slot of each group
    for s in range(0, len(corner_owner), chunk):
        owner = corner_owner[s : s + chunk]
        order = np.argsort(owner, kind="stable")
        grouped = owner[order]
        first = np.r_[0, np.flatnonzero(grouped[1:] != grouped[:-1]) + 1]  # start of each vertex's run
        rank = np.arange(len(order)) - np.repeat(first, np.diff(np.r_[first, len(order)]))
        out[filled[grouped] + rank] = (order + s) // 3
        filled[grouped[first]] += np.diff(np.r_[first, len(order)])
    return out


class SurfaceDistance:
    """Unsigned distance from query points to the surface ``(vertices, faces)``."""

    def __init__(self, vertices: np.ndarray, faces: np.ndarray, *, neighbours: int = 1,
                 threads: int | None = None) -> None:
        if len(faces) == 0:
            raise ValueError("SurfaceDistance needs a mesh with at least one face")
        if neighbours < 1:
            raise ValueError(f"neighbours must be >= 1, got {neighbours}")
        # [V, 3] float32, the caller's array where it is one (no copy: 108 MB at 9M vertices, which the reference
        # surface's holder already has); a face's corners are gathered as rows, then laid out coordinate-major
        self.vertices = np.ascontiguousarray(vertices, dtype=np.float32)
        self.faces = faces = np.ascontiguousarray(faces, dtype=np.int32)
        self.neighbours = int(neighbours)
        self.threads = threads if threads is not None else default_workers()
        used = np.zeros(len(self.vertices), bool)
        used[faces.reshape(-1)] = True
        # vertices of no face stay out of the tree; None: every vertex is in it, in order (a cleaned surface)
        self.tree_ids = None if used.all() else np.flatnonzero(used).astype(np.int32)
        del used
        # scipy.spatial: 0.4 s to import, only when a mesh is exported
        from scipy.spatial import cKDTree

        # leafsize 32: a third fewer node visits per query than the default 16 on these dense meshes (1.1 s against
        # 1.9 s per million near-surface queries in Z order, 3M vertices); the nearest vertex is the same
        tree_points = self.vertices if self.tree_ids is None else self.vertices[self.tree_ids]
        self.tree = cKDTree(tree_points, balanced_tree=False, compact_nodes=False, leafsize=32)
        del tree_points
        corner_owner = faces.reshape(-1)
        counts = np.bincount(corner_owner, minlength=len(self.vertices))
        # int32 offsets while the 3F corners fit (half the bytes of int64: 36 MB at 9M vertices)
        self.start = np.zeros(len(self.vertices) + 1, np.int32 if len(corner_owner) < 2**31 else np.int64)
        np.cumsum(counts, out=self.start[1:])
        del counts
        # [3F] the faces incident to each vertex, grouped by vertex (CSR with ``start``), in face order within a
        # vertex: a counting sort a chunk of corners at a time (a stable argsort of all 3F corners is a 0.4 GB int64
        # permutation at 18M faces)
        self.incident = incident_faces(corner_owner, self.start)
        self.longest_edge = max(
            float(np.sqrt(((self.vertices[f[:, [1, 2, 0]]] - self.vertices[f]).astype(np.float64) ** 2).sum(-1).max()))
            for f in (faces[s : s + (1 << 20)] for s in range(0, len(faces), 1 << 20))
        )

    def distance(self, points: np.ndarray, *, upper_bound: float = np.inf, chunk: int = 1 << 15,
                 coherent: bool = False) -> np.ndarray:
        """Unsigned distance ``[N]`` (float64) of ``points [N, 3]`` to the surface.

        With ``upper_bound``, points farther than it may come back as ``inf`` (never a wrong finite value):
        the vertex search stops at ``upper_bound`` plus the longest edge, which is much faster far away.
        Scattered points are queried in Z order (neighbouring queries walk the same tree nodes and faces: 2-4x
        faster than random order); ``coherent`` says they already come in runs of neighbours (a grid's rows, as
        the remesh's), which are as fast as that, and skips the sort. Chunks of 2^15 queries: the exact step's
        temporaries per pair of face and query (~40 arrays) are ~90 MiB for two threads against 2^16's ~160 MiB, in
        about the same time; the distances do not depend on it.
        """
        points = np.asarray(points, dtype=np.float64).reshape(-1, 3)
        order = None if coherent else z_order(points)
        points = points if coherent else points[order]
        out = np.empty(len(points))
        reach = upper_bound + self.longest_edge

        def one(s: int) -> None:
            d = self._distance(points[s : s + chunk], reach)
            if coherent:
                out[s : s + chunk] = d
            else:
                out[order[s : s + chunk]] = d

        for _ in ordered_map(one, range(0, len(points), chunk), self.threads if len(points) > chunk else 1):
            pass
        return out

    def _distance(self, p: np.ndarray, reach: float) -> np.ndarray:
        out = np.full(len(p), np.inf)
        _, nearest = self.tree.query(p, k=self.neighbours, distance_upper_bound=reach)
        nearest = np.asarray(nearest).reshape(len(p), -1)
        found = np.flatnonzero(nearest[:, 0] < self.tree.n)
        if len(found) == 0:
            return out
        p, nearest = p[found], nearest[found]
        nearest = np.where(nearest < self.tree.n, nearest, nearest[:, :1])  # fewer than k in reach
        vertex = nearest.reshape(-1) if self.tree_ids is None else self.tree_ids[nearest.reshape(-1)]  # [n·k]
        count = self.start[vertex + 1] - self.start[vertex]  # >= 1: every tree vertex has a face
        owner = np.repeat(np.arange(len(p)).repeat(self.neighbours), count)  # [pairs] query of each pair
        pos = np.arange(int(count.sum())) + np.repeat(self.start[vertex] - (np.cumsum(count) - count), count)
        corners = self.faces[self.incident[pos]].T  # [3, pairs]
        # Relative to the query point: small numbers, so float32 keeps ~1e-5 voxel of precision.
        query = np.ascontiguousarray(p.T.astype(np.float32))[:, owner]  # [3, pairs]
        a, b, c = (np.subtract(self.vertices[corners[k]].T, query, order="C") for k in range(3))
        d2 = point_triangle_distance2(None, a, b, c)
        group = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])  # pairs are grouped by query
        out[found] = np.sqrt(np.minimum.reduceat(d2, group).astype(np.float64))
        return out
